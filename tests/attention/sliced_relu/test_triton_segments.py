"""Sliced ReLU's Triton walks on packed rows (``sliced_relu.triton_segments``), under Triton's
interpreter: every sequence of a packed row gets what the float64 reference gives it alone, outputs
and gradients, in one chunk per segment and in many (segments that start and end inside a chunk)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention.common.triton.runtime import TritonUnavailableError  # noqa: E402
from attnlab.attention.sliced_relu import reference  # noqa: E402
from attnlab.attention.sliced_relu import triton as triton_sliced  # noqa: E402
from attnlab.attention.sliced_relu.segments import sliced_relu_attention_segments  # noqa: E402
from packed_rows import LONG, SHORT, packed_inputs  # noqa: E402

F64 = torch.float64


# the short rows in every form in the fast suite (their segments cross chunks of 16 too); the long
# ones, 5-8 s each interpreted, slow
CASES = [
    *(
        pytest.param(SHORT, grid, chunk, id=f"short-{'ties' if grid else 'random'}-{chunk or 'one'}")
        for grid in (False, True)
        for chunk in (None, 16)
    ),
    pytest.param(LONG, False, 16, id="long-random-16", marks=pytest.mark.slow),
    pytest.param(LONG, True, 16, id="long-ties-16", marks=pytest.mark.slow),
    pytest.param(LONG, False, None, id="long-random-one", marks=pytest.mark.slow),
    pytest.param(LONG, True, None, id="long-ties-one", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("case", "grid", "chunk"), CASES)
def test_each_sequence_gets_what_the_reference_gives_it_alone(interpret, monkeypatch, case, grid, chunk):
    if chunk is not None:
        monkeypatch.setattr(triton_sliced.TUNING, "chunk", chunk)
        monkeypatch.setattr(triton_sliced.TUNING, "block", 16)
    lengths, rows = case
    layout, *inputs = packed_inputs(lengths, rows, grid)
    s, t, v = (x.requires_grad_(True) for x in inputs)
    out = sliced_relu_attention_segments(s, t, v, layout.segments, impl="triton")
    grad = torch.randn_like(out) * layout.row_mask[:, None, :, None]  # empty slots read by no loss
    out.backward(grad)
    got = [layout.unpack_heads(x) for x in (out, s.grad, t.grad, v.grad)]
    for n, length in enumerate(lengths):
        alone = [
            layout.unpack_heads(x.detach())[n : n + 1, :, :length].requires_grad_(True) for x in (s, t, v)
        ]
        want = reference.sliced_relu_attention(*alone)
        want.backward(layout.unpack_heads(grad)[n : n + 1, :, :length])
        for name, mine, theirs in zip(
            ["out", "ds", "dt", "dv"], got, [want, *(x.grad for x in alone)], strict=True
        ):
            torch.testing.assert_close(mine[n : n + 1, :, :length], theirs, rtol=1e-10, atol=1e-12, msg=name)


def test_float32_keeps_float32_precision(interpret):
    """float32 packed rows within float32's rounding of the float64 results: each segment's walk
    starts from its own carries, so no earlier sequence's sums reach its outputs or gradients."""
    layout, *inputs = packed_inputs(*LONG, grid=False, seed=1)
    results = []
    for dtype, impl in ((torch.float32, "triton"), (F64, "torch")):
        s, t, v = (x.to(dtype).requires_grad_(True) for x in inputs)
        out = sliced_relu_attention_segments(s, t, v, layout.segments, impl=impl)
        out.backward(torch.ones_like(out) * layout.row_mask[:, None, :, None])
        results.append([x.double() for x in (out, s.grad, t.grad, v.grad)])
    for name, got, want in zip(["out", "ds", "dt", "dv"], *results, strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * scale, msg=name)


def test_triton_is_refused_by_name_for_the_causal_op():
    layout, s, t, v = packed_inputs(*SHORT, grid=False)
    with pytest.raises(TritonUnavailableError, match="causal op on packed rows"):
        sliced_relu_attention_segments(s, t, v, layout.segments, causal=True, impl="triton")


def test_triton_is_refused_by_name_for_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layout, s, t, v = packed_inputs(*SHORT, grid=False)
    with pytest.raises(TritonUnavailableError, match="take CUDA tensors"):
        sliced_relu_attention_segments(s, t, v, layout.segments, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernels_keep_float32_precision_on_cuda():
    """float32 on the GPU against the torch code in float64 on it."""
    layout, *inputs = packed_inputs(*LONG, grid=False, seed=2)
    segments = layout.segments.cuda()
    results = []
    for dtype, impl in ((torch.float32, "triton"), (F64, "torch")):
        leaves = [x.to("cuda", dtype).requires_grad_(True) for x in inputs]
        out = sliced_relu_attention_segments(*leaves, segments, impl=impl)
        out.backward(torch.ones_like(out) * layout.row_mask.cuda()[:, None, :, None])
        results.append([x.double() for x in (out, *(x.grad for x in leaves))])
    for name, got, want in zip(["out", "ds", "dt", "dv"], *results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item(), msg=name)
