"""ReLU-bump's Triton walks on packed rows (``sliced_relu_bump.triton_segments``), under Triton's
interpreter: every sequence of a packed row gets what the float64 reference gives it alone, outputs
and gradients (the bandwidth's summed over the sequences), with one block of sinks per sequence and
with many (sequences longer than a block, windows reaching to a sequence's ends)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention.common.triton.runtime import TritonUnavailableError  # noqa: E402
from attnlab.attention.sliced_relu_bump import reference  # noqa: E402
from attnlab.attention.sliced_relu_bump import triton as triton_bump  # noqa: E402
from attnlab.attention.sliced_relu_bump.segments import sliced_relu_bump_attention_segments  # noqa: E402
from packed_rows import LONG, SHORT, packed_inputs  # noqa: E402

F64 = torch.float64
HEADS = 2  # packed_inputs' heads
SMALL_BLOCKS = {"sinks": 32, "query_sinks": 32, "key_sinks": 32, "sources": 16, "table": 32, "block_d": 16}


# the short rows in every form; the long ones (4-5 s each interpreted) in small blocks in the fast suite
CASES = [
    *(
        pytest.param(SHORT, grid, blocks, id=f"short-{'ties-and-edges' if grid else 'random'}-{blocks}")
        for grid in (False, True)
        for blocks in ("one", "small")
    ),
    pytest.param(LONG, False, "small", id="long-random-small"),
    pytest.param(LONG, True, "small", id="long-ties-and-edges-small", marks=pytest.mark.slow),
    pytest.param(LONG, False, "one", id="long-random-one", marks=pytest.mark.slow),
    pytest.param(LONG, True, "one", id="long-ties-and-edges-one", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("case", "grid", "blocks"), CASES)
def test_each_sequence_gets_what_the_reference_gives_it_alone(interpret, monkeypatch, case, grid, blocks):
    if blocks == "small":
        for name, value in SMALL_BLOCKS.items():
            monkeypatch.setattr(triton_bump.BUMP, name, value)
    lengths, rows = case
    layout, *inputs = packed_inputs(lengths, rows, grid)
    s, t, v = (x.requires_grad_(True) for x in inputs)
    bandwidth = torch.tensor([0.5, 1.25], dtype=F64, requires_grad=True)
    out = sliced_relu_bump_attention_segments(s, t, v, bandwidth, layout.segments, impl="triton")
    grad = torch.randn_like(out) * layout.row_mask[:, None, :, None]  # empty slots read by no loss
    out.backward(grad)
    got = [layout.unpack_heads(x) for x in (out, s.grad, t.grad, v.grad)]
    grad_b = torch.zeros_like(bandwidth)
    for n, length in enumerate(lengths):
        alone = [
            layout.unpack_heads(x.detach())[n : n + 1, :, :length].requires_grad_(True) for x in (s, t, v)
        ]
        b_alone = bandwidth.detach().clone().requires_grad_(True)
        want = reference.sliced_relu_bump_attention(*alone, b_alone)
        want.backward(layout.unpack_heads(grad)[n : n + 1, :, :length])
        theirs = [want, *(x.grad for x in alone)]
        for name, mine, their in zip(["out", "ds", "dt", "dv"], got, theirs, strict=True):
            torch.testing.assert_close(mine[n : n + 1, :, :length], their, rtol=1e-10, atol=1e-12, msg=name)
        grad_b += b_alone.grad
    torch.testing.assert_close(bandwidth.grad, grad_b, rtol=1e-10, atol=1e-12)


def test_float32_keeps_float32_precision(interpret):
    """float32 packed rows within float32's rounding of the float64 results."""
    layout, *inputs = packed_inputs(*LONG, grid=False, seed=1)
    results = []
    for dtype, impl in ((torch.float32, "triton"), (F64, "torch")):
        s, t, v = (x.to(dtype).requires_grad_(True) for x in inputs)
        bandwidth = torch.tensor([0.5, 1.25], dtype=dtype, requires_grad=True)
        out = sliced_relu_bump_attention_segments(s, t, v, bandwidth, layout.segments, impl=impl)
        out.backward(torch.ones_like(out) * layout.row_mask[:, None, :, None])
        results.append([x.double() for x in (out, s.grad, t.grad, v.grad, bandwidth.grad)])
    for name, got, want in zip(["out", "ds", "dt", "dv", "db"], *results, strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * scale, msg=name)


def test_triton_is_refused_by_name_for_the_causal_op(interpret):
    layout, s, t, v = packed_inputs(*SHORT, grid=False)
    bandwidth = torch.ones(HEADS, dtype=F64)
    with pytest.raises(TritonUnavailableError, match="causal op on packed rows"):
        sliced_relu_bump_attention_segments(s, t, v, bandwidth, layout.segments, causal=True, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernels_keep_float32_precision_on_cuda():
    """float32 on the GPU against the torch code in float64 on it."""
    layout, *inputs = packed_inputs(*LONG, grid=False, seed=2)
    segments = layout.segments.cuda()
    results = []
    for dtype, impl in ((torch.float32, "triton"), (F64, "torch")):
        leaves = [x.to("cuda", dtype).requires_grad_(True) for x in inputs]
        out = sliced_relu_bump_attention_segments(
            *leaves, torch.tensor([0.5, 1.25], device="cuda", dtype=dtype), segments, impl=impl
        )
        out.backward(torch.ones_like(out) * layout.row_mask.cuda()[:, None, :, None])
        results.append([x.double() for x in (out, *(x.grad for x in leaves))])
    for name, got, want in zip(["out", "ds", "dt", "dv"], *results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item(), msg=name)
