"""ReLU-bump's walk on tensor cores: half values dotted with weights cut into exact parts
(``_dot_parts``), so every product is exact, as on CUDA cores.

The parts and the dots run in the interpreter (float32 operands holding the parts' values: its bf16
dot is not a product of values); Triton's compiler shows the tensor-core instructions in the PTX
it builds for sm_80 and sm_90 on this CPU.
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from attnlab.attention.common.triton import runtime  # noqa: E402
from attnlab.attention.ops import sliced_relu_bump_attention  # noqa: E402
from attnlab.attention.sliced_relu_bump.triton import dot_format  # noqa: E402
from triton_builds import build  # noqa: E402

ROWS, K, COLS = 32, 16, 32
PARTS_SOURCE = """
@triton.jit
def parts_kernel(w_ptr, x_ptr, parts_ptr, out_ptr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    r = tl.arange(0, ROWS)
    k = tl.arange(0, K)
    c = tl.arange(0, COLS)
    w = tl.load(w_ptr + r[:, None] * K + k[None, :])
    x = tl.load(x_ptr + k[:, None] * COLS + c[None, :])
    rest = w
    for p in tl.static_range(3):
        head = _head(rest, DOT)
        tl.store(parts_ptr + p * ROWS * K + r[:, None] * K + k[None, :], head)
        rest = rest - head
    acc = tl.full([ROWS, COLS], 0.0, tl.float32)  # not tl.zeros: see kernels.py
    acc = _dot_parts(acc, w, x, 3, DOT, tl.float32, PRECISION)
    tl.store(out_ptr + r[:, None] * COLS + c[None, :], acc)
"""


@pytest.fixture
def parts_kernel(monkeypatch):
    """A kernel that writes the three parts of ``w`` and ``_dot_parts(w, x)``, interpreted."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    scope = runtime.kernels().__dict__  # as the kernel files are loaded: beside ``_dot_parts``
    scope.update(ROWS=ROWS, K=K, COLS=COLS)
    exec(PARTS_SOURCE, scope)
    return scope["parts_kernel"]


def weights(seed: int) -> torch.Tensor:
    """Weights as the walk makes them, ``b - |s - t|`` in float32, with a few extremes."""
    gen = torch.Generator().manual_seed(seed)
    s, t = (torch.randn(ROWS, K, generator=gen) for _ in range(2))
    w = (1.7 - (s - t).abs()).clamp_min(0)
    w[0, :4] = torch.tensor([1e-30, 3e38, -1.0, 0.0])
    return w


def run_parts(kernel, w, x, dot):
    parts = torch.empty(3, ROWS, K)
    out = torch.empty(ROWS, COLS)
    kernel[(1,)](w, x.float(), parts, out, DOT=dot, PRECISION="tf32" if dot == 2 else "ieee")
    return parts, out


@pytest.mark.filterwarnings("ignore:overflow encountered in matmul")  # 3e38 · x: not checked here
@pytest.mark.parametrize(("dot", "values"), [(1, torch.bfloat16), (2, torch.float16)], ids=["bf16", "tf32"])
def test_the_parts_are_exact_in_their_format_and_sum_to_the_weight(parts_kernel, dot, values):
    w = weights(1)
    x = torch.randn(K, COLS, generator=torch.Generator().manual_seed(2)).to(values)
    parts, _ = run_parts(parts_kernel, w, x, dot)
    assert torch.equal(parts.double().sum(0), w.double())
    if dot == 1:
        assert torch.equal(parts.bfloat16().float(), parts)
    else:  # tf32: 10 fraction bits, the low 13 of float32's 23 clear
        assert not (parts.view(torch.int32) & 0x1FFF).any()
    assert torch.equal(x.float().to(values).float(), x.float())  # x exact in the dot's format


@pytest.mark.parametrize(("dot", "values"), [(1, torch.bfloat16), (2, torch.float16)], ids=["bf16", "tf32"])
def test_the_split_dot_is_as_exact_as_one_float32_dot(parts_kernel, dot, values):
    """Against float64: the split dot's error is float32's summation error, no more; with a part
    left out it would be 2^-9 (bf16) or 2^-12 (tf32) of the weights."""
    w = weights(3)
    w[0] = 1.0  # no extremes: an error relative to the largest output
    x = torch.randn(K, COLS, generator=torch.Generator().manual_seed(4)).to(values)
    _, out = run_parts(parts_kernel, w, x, dot)
    exact = w.double() @ x.double()
    one_dot = (w @ x.float()).double()
    scale = exact.abs().max()
    assert (out.double() - exact).abs().max() / scale <= max(2e-7, 2 * (one_dot - exact).abs().max() / scale)


def test_bf16_op_matches_the_torch_op_bit_for_bit_almost_everywhere(monkeypatch):
    """The whole op on bf16 inputs: the outputs, rounded to bf16 from float32 sums of exact products,
    are the torch op's (float32 all through) but for the rare sum that float32's summation order
    puts on the other side of a bf16 rounding boundary (1 in 10,240 here)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dot_format(torch.bfloat16, torch.float32, None)["DOT"] == 1
    gen = torch.Generator().manual_seed(5)
    s, t = (torch.randn(2, 2, 160, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(2, 2, 160, 16, generator=gen).bfloat16()
    bandwidth = torch.tensor([0.7, 1.9])
    triton_out = sliced_relu_bump_attention(s, t, v, bandwidth, impl="triton")
    torch_out = sliced_relu_bump_attention(s, t, v, bandwidth, impl="torch")
    same = (triton_out == torch_out).float().mean().item()
    assert same >= 0.999, f"{same:.2%} of the outputs equal"
    ulp = torch_out.float().abs().clamp_min(1e-3) * 2**-7
    assert ((triton_out.float() - torch_out.float()).abs() <= ulp).all()


def test_the_interpreter_rounds_bf16_as_a_gpu_does(monkeypatch):
    """float32 -> bf16 to nearest even (``runtime``'s patch of Triton's interpreter, which truncates)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    scope = runtime.kernels().__dict__
    exec(ROUND_SOURCE, scope)
    x = torch.randn(64, generator=torch.Generator().manual_seed(6)) * 1e3
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 1e-40, -0.0])
    out = torch.empty(64, dtype=torch.bfloat16)
    scope["round_kernel"][(1,)](x, out)
    assert torch.equal(out.view(torch.int16)[1:], x.bfloat16().view(torch.int16)[1:])
    assert out[0].isnan()


ROUND_SOURCE = """
@triton.jit
def round_kernel(x_ptr, out_ptr):
    i = tl.arange(0, 64)
    tl.store(out_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))
"""


def test_dot_format_by_device_and_dtype():
    """Tensor cores for half values from sm_80 on; float32 values and sm_70 on CUDA cores."""
    f32 = torch.float32
    assert dot_format(torch.bfloat16, f32, (9, 0))["DOT"] == 1
    assert dot_format(torch.float16, f32, (8, 0)) == {
        "DOT": 2,
        "OPERAND": triton.language.float32,
        "PRECISION": "tf32",
    }
    assert dot_format(torch.bfloat16, f32, (7, 0))["DOT"] == 0
    assert dot_format(f32, f32, (9, 0))["DOT"] == 0
    assert dot_format(torch.bfloat16, torch.float64, None)["DOT"] == 0


FAST = {("fwd", "sm_80", "bf16"), ("fwd", "sm_90", "bf16")}  # the rest: make test-all
CASES = [
    pytest.param(mode, target, dtype, marks=() if (mode, target, dtype) in FAST else pytest.mark.slow)
    for mode in ("fwd", "query", "key")
    for target in ("sm_80", "sm_90")
    for dtype in ("bf16", "fp16")
]


@pytest.mark.parametrize(("mode", "target", "dtype"), CASES)
def test_ptx_holds_tensor_core_instructions(mode, target, dtype):
    try:
        ptx = build(f"bump_walk_kernel[{mode}]", target, dtype).asm["ptx"]
    except RuntimeError as err:  # no ptxas in this triton build
        if "ptxas" in str(err).lower():
            pytest.skip(f"cannot build for {target} here: {err}")
        raise
    operand = "bf16" if dtype == "bf16" else "tf32"
    instruction = "wgmma.mma_async" if target == "sm_90" else "mma.sync"
    assert re.search(rf"{re.escape(instruction)}\.[\w.]*\.{operand}\b", ptx), f"no {instruction} on {operand}"
