"""NaN and inf scores: the Triton path gives exactly what the torch path gives.

A row (batch, head) holding a non-finite score at a real position outputs NaN at its kept queries
and gets NaN gradients; every other row is exact, and non-finite scores in padded slots change
nothing. Before the fix the centring turned such a row into NaN scores, the merged stream's
positions collided, and the stream kernel read and wrote through unwritten int32 indices (under
the interpreter: unwritten output rows, and a segmentation fault with a NaN score).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention import reference as ref  # noqa: E402
from attnlab.attention.ops import sliced_relu_attention, sliced_relu_bump_attention  # noqa: E402
from attnlab.attention.sliced_relu import triton as triton_sliced  # noqa: E402

# inf - inf in the scores' statistics: the interpreter's numpy warns where a GPU makes its NaN silently
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")

F64 = torch.float64
OPS = {
    "relu": (sliced_relu_attention, ref.sliced_relu_attention),
    "bump": (sliced_relu_bump_attention, ref.sliced_relu_bump_attention),
}
BAD = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
LENGTH = 13


def inputs(value, masked, dtype=F64):
    """Rows (b, h): (0, 1) has a bad key score, (1, 0) a bad query score; (0, 0) and (1, 1) are
    clean, and with ``masked`` batch 1 is padded from position 9 with bad scores there."""
    gen = torch.Generator().manual_seed(4)
    s, t = (torch.randn(2, 2, LENGTH, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(2, 2, LENGTH, 3, generator=gen, dtype=F64)
    bandwidth = torch.tensor([0.7, 1.3], dtype=F64)
    t[0, 1, 4] = value
    s[1, 0, 2] = value
    mask = None
    if masked:
        mask = torch.arange(LENGTH)[None, :] < torch.tensor([[LENGTH], [9]])
        s[1, 1, 10], t[1, 1, 11] = value, value  # padded slots: must not make row (1, 1) bad
    return [x.to(dtype) for x in (s, t, v, bandwidth)], mask


def run(kind, args, mask, impl, at=None, **kw):
    """Output and gradients (s, t, v [, bandwidth]) for a fixed output gradient (its row ``at``
    for one-row inputs)."""
    op = OPS[kind][1] if impl == "reference" else OPS[kind][0]
    leaves = [x.detach().clone().requires_grad_() for x in (args if kind == "bump" else args[:3])]
    extra = {} if impl == "reference" else {"impl": impl}
    out = op(*leaves, key_padding_mask=mask, **extra, **kw)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(2, 2, LENGTH, 3, generator=gen, dtype=F64)
    if at is not None:
        grad_out = grad_out[at[0] : at[0] + 1, at[1] : at[1] + 1]
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def same(got, want, tol):
    """Equal NaN pattern, equal values elsewhere (up to ``tol`` of the scale)."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN in different places"
    scale = max(1.0, want.nan_to_num(0.0).abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=tol * scale, equal_nan=True)


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("value", sorted(BAD))
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_triton_equals_torch_with_nonfinite_scores(interpret, kind, value, masked):
    args, mask = inputs(BAD[value], masked)
    names = ["out", "s", "t", "v", "bandwidth"]
    torch_path, triton_path = run(kind, args, mask, "torch"), run(kind, args, mask, "triton")
    for name, got, want in zip(names, triton_path, torch_path, strict=False):
        assert torch.isnan(want).any(), f"{name}: the bad rows must show"
        same(got, want, 1e-12)

    # what the torch path gives: NaN exactly at the bad rows' kept queries / real keys, the clean
    # rows equal to the float64 reference (the reference sees only those rows: they are independent)
    out, grad_s, grad_t, grad_v = torch_path[:4]
    keep = torch.ones(2, 2, LENGTH, dtype=torch.bool) if mask is None else mask[:, None, :].expand(2, 2, -1)
    bad_rows = torch.tensor([[False, True], [True, False]])
    for got in (out, grad_v):
        assert torch.equal(torch.isnan(got).any(-1), bad_rows[..., None] & keep)
    for got in (grad_s, grad_t):
        assert torch.equal(torch.isnan(got), bad_rows[..., None] & keep)
    for b, h in ((0, 0), (1, 1)):
        row = [x[b : b + 1, h : h + 1] for x in args[:3]] + [args[3][h : h + 1]]
        row[:2] = [x.nan_to_num(0.0, 0.0, 0.0) for x in row[:2]]  # padded slots: the reference's inf · 0
        row_mask = None if mask is None else mask[b : b + 1]
        expected = run(kind, row, row_mask, "reference", at=(b, h))
        for got, want in zip(torch_path[:4], expected[:4], strict=True):
            same(got[b : b + 1, h : h + 1], want, 1e-10)


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_float32_and_padded_queries_attend(interpret, kind):
    """float32, and padded queries that attend (their scores count, so a bad one makes its row bad)."""
    args, mask = inputs(float("nan"), True, dtype=torch.float32)
    torch_path = run(kind, args, mask, "torch", padded_queries="attend")
    triton_path = run(kind, args, mask, "triton", padded_queries="attend")
    assert torch.isnan(torch_path[0][1, 1]).all()  # row (1, 1): its padded query s[10] attends
    for got, want in zip(triton_path, torch_path, strict=True):
        same(got, want, 1e-5)


@pytest.mark.parametrize("chunk", [None, 16], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_padded_keys_values_reach_nothing_even_nan(interpret, monkeypatch, kind, chunk):
    """NaN in the values of padded keys, and a row with no real key at all: the Triton ops and the
    dense evaluation give what the torch ops give with those values zeroed, outputs and gradients.
    Before, sliced ReLU's walks and both dense evaluations multiplied those rows by a weight of 0:
    NaN everywhere in the row."""
    if chunk is not None:
        monkeypatch.setattr(triton_sliced.TUNING, "chunk", chunk)
        monkeypatch.setattr(triton_sliced.TUNING, "block", 16)
    args, _ = inputs(0.0, False)
    mask = torch.arange(LENGTH)[None, :] < torch.tensor([[LENGTH - 4], [0]])
    zeroed = [x.clone() for x in args]
    zeroed[2][~mask[:, None, :, None].expand_as(zeroed[2])] = 0.0
    args[2][~mask[:, None, :, None].expand_as(args[2])] = float("nan")
    expected = run(kind, zeroed, mask, "torch")
    for impl in ("triton", "torch"):  # the torch op at this length: its dense evaluation
        for got, want in zip(run(kind, args, mask, impl), expected, strict=True):
            same(got, want, 1e-9)


def test_merge_is_a_permutation_even_with_nan():
    """Sorted lists with NaN (last, as torch.sort puts it): every slot of the merged order is
    written exactly once; before, NaN made the two searchsorted calls disagree."""
    gen = torch.Generator().manual_seed(0)
    sinks, srcs = torch.randn(3, 10, generator=gen), torch.randn(3, 10, generator=gen)
    sinks[0, 3], srcs[1, 7], sinks[2, 1], srcs[2, 2] = (float("nan"),) * 4
    srcs[0, 5] = float("inf")
    for sinks_first in (True, False):
        sink_sorted, sink_order = torch.sort(sinks, dim=1)
        src_sorted, src_order = torch.sort(srcs, dim=1)
        order, counts, _ = triton_sliced.merge(sink_sorted, sink_order, src_sorted, src_order, sinks_first)
        assert torch.equal(order.sort(dim=1).values, torch.arange(20, dtype=torch.int32).expand(3, -1))
        assert counts.min() >= 0 and counts.max() <= 10


def test_stream_skips_slots_that_were_never_written(interpret):
    """Defence in depth: an order slot left at -1 (never written) is neither a sink nor a source,
    so the kernel neither reads nor writes through it (before, -1 counted as sink -1: a write one
    row before ``out``)."""
    gen = torch.Generator().manual_seed(0)
    length, dim = 5, 3
    x, score = torch.randn(1, length, dim, generator=gen), torch.randn(1, length, generator=gen)
    order = torch.full((1, 2 * length), -1, dtype=torch.int32)
    order[0, [0, 2, 3, 6]] = torch.tensor([length + 0, 1, length + 2, 3], dtype=torch.int32)
    out = torch.full((1, length, dim), 7.0)
    ones, zeros = torch.ones(1, length), torch.zeros(1, length)
    triton_sliced.stream(order, x, score, c1=ones, c2=zeros, out=out)
    assert torch.equal(out[0, 1], x[0, 0]) and torch.allclose(out[0, 3], x[0, 0] + x[0, 2])
    assert (out[0, [0, 2, 4]] == 7.0).all()


def test_merge_kernel_equals_the_torch_merge_with_ties(interpret, monkeypatch):
    """Under the interpreter (as on CUDA) merge places the slots with ``merge_kernel``; it must give
    the order, counts and slots' scores of the torch scatters, ties on either side included."""
    gen = torch.Generator().manual_seed(3)
    sinks = torch.randint(0, 6, (3, 40), generator=gen).double()  # many ties
    srcs = torch.randint(0, 6, (3, 40), generator=gen).double()
    sink_sorted, sink_order = torch.sort(sinks, dim=1)
    src_sorted, src_order = torch.sort(srcs, dim=1)
    for sinks_first in (True, False):
        args = (sink_sorted, sink_order, src_sorted, src_order, sinks_first)
        kernel = triton_sliced.merge(*args)
        monkeypatch.setattr(triton_sliced, "interpret_mode", lambda: False)
        scattered = triton_sliced.merge(*args)
        monkeypatch.undo()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert all(torch.equal(a, b) for a, b in zip(kernel, scattered, strict=True))  # order, counts, scores
