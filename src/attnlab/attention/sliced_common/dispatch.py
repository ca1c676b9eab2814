"""What the two public sliced ops share around their implementations: results back in v's layout,
empty batches, the Triton path with its first-use check, and the refusals of what has no kernel."""

from __future__ import annotations

import torch

from attnlab.attention.common.triton import selfcheck
from attnlab.attention.common.triton.runtime import IMPLS, launch, resolve_impl


def like_v(rows: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An op's (B·H, T, D) rows back in v's layout and dtype."""
    return rows.view(v.shape).to(v.dtype)


def empty_batch(v: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """B, H or D = 0 (nothing to sort or reduce over, which the ops' reshapes cannot take): the
    empty output, still in the graph of every input, whose gradients come back empty (or zero)."""
    return v * 0 + sum(x.sum() for x in inputs) * 0


def run_triton(op: str, impl: str, s, t, v, acc: torch.dtype, call, case) -> torch.Tensor | None:
    """``call(kernels)`` on the Triton kernels when ``impl`` picks them for these tensors; None when
    the torch code is to run (not CUDA, ``impl="torch"``, float64 on CUDA under ``auto``, or ``auto``
    and either Triton could not build a kernel here, which `launch` has warned about, or the kernels
    failed their first-use check against the torch code, which `selfcheck` has warned about)."""
    if resolve_impl(op, impl, s, t, v) != "triton" or not triton_takes_dtype(op, impl, v.device, acc):
        return None
    check = lambda: selfcheck.trusted(op, v.device, v.dtype, lambda: case(v))  # noqa: E731
    return launch(op, impl, v.device, call, check=check)


def triton_takes_dtype(op: str, impl: str, device: torch.device, acc: torch.dtype) -> bool:
    """Whether the sliced Triton kernels run in the accumulation dtype ``acc`` on ``device``.

    float64 on CUDA does not: the compiled ReLU-bump key walk spills 4-13 KB of stack per thread in
    float64 (sm_70-90), and fp64 units are a fraction of the GPU, so the torch op is the better
    float64 path; ``auto`` takes it, ``triton`` is refused by name. The interpreter (CPU tensors)
    runs float64, which the exactness tests use.
    """
    if acc != torch.float64 or device.type != "cuda":
        return True
    if impl == "triton":
        raise TypeError(
            f"{op}: impl='triton' has no float64 kernel on CUDA; use impl='auto' or impl='torch' "
            "for float64 inputs (the torch op runs them on the GPU)"
        )
    return False


def torch_only_causal(op: str, impl: str) -> None:
    """The causal ops have no Triton kernel yet: ``auto`` runs the torch code, ``triton`` is refused."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "triton":
        raise ValueError(f"{op}: causal=True has no Triton kernel yet; use impl='auto' or impl='torch'")
