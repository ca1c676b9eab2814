"""Triton ops checked against the torch ops on the device itself, once, before they are trusted.

A kernel can build and launch yet compute wrong values on a GPU generation, driver or Triton
release nobody ran it on. Under ``impl="auto"`` the first call of each Triton op per (device,
dtype) therefore runs a small random case through both implementations, forward and backward, and
compares them with the torch op in float64; on a mismatch (or an error) the op runs the torch code
for the rest of the process, with one warning naming the op, the device and the error.
``impl="triton"`` skips the check: the caller asked for the kernels by name.
``compare`` is also what `make bench-gpu`'s correctness pass measures with.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.common.triton.runtime import TritonUnavailableError

#: relative error (‖x − ref‖ / ‖ref‖) always accepted, by input dtype: a few units of the format's
#: rounding (bf16 2⁻⁹ ≈ 2e-3, fp16 2⁻¹² ≈ 2.4e-4), which storing inputs and outputs costs alone
FLOOR = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 8e-3, torch.float16: 1e-3}
#: how much worse than the torch op's own error the Triton op may be
SLACK = 4.0

Fn = Callable[..., torch.Tensor]


@dataclass
class Comparison:
    """Relative errors against the float64 torch op, worst over the output and every gradient."""

    triton_err: float
    torch_err: float
    ok: bool
    what: str  # the worst quantity: "output" or "d<input index>"

    def describe(self) -> str:
        return (
            f"relative error {self.triton_err:.2e} in the {self.what} "
            f"(the torch op: {self.torch_err:.2e}; accepted up to {SLACK:g}x that or the dtype's floor)"
        )


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double()
    if not torch.isfinite(x).all():
        return math.inf
    norm = ref.norm().item()
    return (x - ref).norm().item() / norm if norm > 0 else (x - ref).norm().item()


def _forward_backward(fn: Fn, inputs: Sequence[torch.Tensor], grad_out: torch.Tensor, **kw):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    with torch.enable_grad():
        out = fn(*leaves, **kw)
        wanted = [x for x in leaves if x.requires_grad]
        grads = torch.autograd.grad(out, wanted, grad_out.to(out.dtype), allow_unused=True)
    zeros = [torch.zeros_like(x) for x in wanted]  # an input the op does not use: gradient 0
    return [out.detach(), *(g if g is not None else z for g, z in zip(grads, zeros, strict=True))]


def compare(triton_fn: Fn, torch_fn: Fn, inputs: Sequence[torch.Tensor], seed: int = 0, **kw) -> Comparison:
    """Output and gradients of ``triton_fn`` and ``torch_fn`` on ``inputs`` (float inputs receive
    gradients), each against ``torch_fn`` on the inputs in float64. ``ok``: every quantity finite
    and within ``SLACK`` times the torch op's error or the dtype's ``FLOOR``."""
    device = inputs[0].device
    dtype = next(x.dtype for x in inputs if x.is_floating_point())
    with no_autocast(device):
        wide = [x.double() if x.is_floating_point() else x for x in inputs]
        shape = torch_fn(*[x.detach() for x in wide], **kw).shape
        gen = torch.Generator().manual_seed(seed)
        grad_out = torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
        reference = _forward_backward(torch_fn, wide, grad_out, **kw)
        fast = _forward_backward(triton_fn, inputs, grad_out, **kw)
        plain = _forward_backward(torch_fn, inputs, grad_out, **kw)
    floor = FLOOR.get(dtype, 1e-4)
    results = []
    for index, (got, base, ref) in enumerate(zip(fast, plain, reference, strict=True)):
        got_err, base_err = _relative(got, ref), _relative(base, ref)
        what = "output" if index == 0 else f"gradient of input {index - 1}"
        results.append(Comparison(got_err, base_err, got_err <= max(SLACK * base_err, floor), what))
    failing = [r for r in results if not r.ok]
    return max(failing or results, key=lambda r: r.triton_err)


def random_case(kind: str, batch: int, heads: int, length: int, dim: int, dtype, device, padded=True, seed=0):
    """Random inputs of an op and its key padding mask: ``kind`` "scores" gives ``s, t (B, H, T)`` and
    ``v (B, H, T, D)``, "bump" those and a bandwidth per head in float32, "qkv" ``q, k, v``; with
    ``padded`` the second row's last quarter is padding. For the first-use check and `make bench-gpu`'s
    correctness pass."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "qkv":
        tensors = [torch.randn(batch, heads, length, dim, generator=gen) for _ in range(3)]
    else:
        tensors = [torch.randn(batch, heads, length, generator=gen) for _ in range(2)]
        tensors.append(torch.randn(batch, heads, length, dim, generator=gen))
    inputs = [x.to(device, dtype) for x in tensors]
    if kind == "bump":
        inputs.append((torch.rand(heads, generator=gen) + 0.3).to(device))
    mask = None
    if padded:
        lengths = torch.tensor([[length], [3 * length // 4]] + [[length]] * (batch - 2))
        mask = (torch.arange(length)[None, :] < lengths[:batch]).to(device)
    return inputs, mask


#: (op, device, input dtype) -> None when the Triton op agreed, else why not
_VERDICTS: dict[tuple[str, str, torch.dtype], str | None] = {}
Case = Callable[[], tuple[Fn, Fn, list[torch.Tensor], dict]]


def trusted(op: str, device: torch.device, dtype: torch.dtype, case: Case) -> bool:
    """Whether ``op``'s Triton kernels agree with its torch code on ``device`` in ``dtype``: the first
    call runs ``case()`` = ``(triton_fn, torch_fn, inputs, keywords)`` through ``compare``; a
    mismatch or an error warns once and is remembered. Inside a CUDA graph capture nothing can be
    checked (a new allocation or sync would break the capture): the kernels are trusted there and
    checked at the next call outside one."""
    key = (op, str(device), dtype)
    if key not in _VERDICTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return True
        from triton.errors import TritonError

        failed = False
        try:
            # the first call can come under inference mode (Lightning's sanity check, trainer.test):
            # the check needs autograd, which enable_grad alone does not give back there
            with torch.inference_mode(False), torch.enable_grad():
                triton_fn, torch_fn, inputs, keywords = case()
                result = compare(triton_fn, torch_fn, inputs, **keywords)
            _VERDICTS[key] = None if result.ok else result.describe()
        except (TritonUnavailableError, TritonError):  # a kernel that does not build: `launch` says so
            raise
        except Exception as err:  # noqa: BLE001 - any failure means "do not trust the kernels here"
            first = (str(err).strip().splitlines() or [""])[0][:300]
            _VERDICTS[key] = f"{type(err).__name__}: {first}"
            failed = True
        if _VERDICTS[key] is not None:
            what = "failed" if failed else "disagree with the torch code"
            warnings.warn(
                f"{op}: the Triton kernels {what} on {device} ({dtype}) in the "
                f"first-use check: {_VERDICTS[key]}; running the torch code for the rest of this run",
                RuntimeWarning,
                stacklevel=4,
            )
    return _VERDICTS[key] is None


def forget() -> None:
    """Drop every verdict (tests; a process that changed devices' kernels)."""
    _VERDICTS.clear()
