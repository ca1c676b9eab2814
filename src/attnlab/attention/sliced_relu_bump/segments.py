"""Sliced ReLU-bump attention on packed rows: each query's hat window reads the keys of its own
segment only, one sort by (segment, score) per row (``attnlab.attention.sliced_common.segments``
has the method)."""

from __future__ import annotations

import torch

from attnlab.attention.common import compiler
from attnlab.attention.common.dispatch import check_choice
from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.common.triton import runtime
from attnlab.attention.sliced_common.rows import (
    cumsum_rows_,
    exclusive_cumsum,
    first_order_only,
    rowdot,
    sorted_rows,
    times_scores,
)
from attnlab.attention.sliced_common.segments import (
    Runs,
    check_segment_inputs,
    on_packed_rows,
    segment_mean,
    sort_keys,
    triton_takes,
)
from attnlab.attention.sliced_relu_bump.causal import causal_sliced_relu_bump_rows
from attnlab.attention.sliced_relu_bump.normaliser import check_bump_normaliser
from attnlab.attention.sliced_relu_bump.ops import check_bandwidth
from attnlab.attention.sliced_relu_bump.sorted import hat_output, key_gradients, query_gradients

__all__ = ["sliced_relu_bump_attention_segments"]

OP = "sliced_relu_bump_attention_segments"


def sliced_relu_bump_attention_segments(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    bandwidth: torch.Tensor,
    segments: torch.Tensor,
    causal: bool = False,
    normaliser: str = "count",
    mass_eps: float = 1e-2,
    impl: str = "auto",
) -> torch.Tensor:
    """`sliced_relu_bump_attention` inside segments:
    ``o_i = (1/n) Σ_j max(0, 1 − |s_i − t_j| / b_h) v_j`` over the n keys of the query's own segment
    (``segments`` (B, L), contiguous runs, `PackedLayout.segments`); s, t (B, H, L), v (B, H, L, D),
    ``bandwidth`` (H,). O(L log L) per row; ``causal=True``: keys ``j ≤ i`` of the segment only,
    ``normaliser`` and ``mass_eps`` as in `sliced_relu_bump_attention`, O(L log² L)
    (`causal_sliced_relu_bump_rows`). ``impl``: ``"auto"`` (the Triton walks for CUDA tensors,
    bidirectional: ``sliced_relu_bump.triton_segments``; torch code otherwise), ``"triton"`` or
    ``"torch"``. Differentiable in s, t, v and the bandwidth (first order: the backward passes are
    hand-written)."""
    check_segment_inputs(OP, s, t, v, segments)
    check_bandwidth(OP, bandwidth, v.shape[1])
    if type(causal) is not bool:
        raise TypeError(f"{OP}: causal must be True or False, got {causal!r}")
    check_bump_normaliser(OP, normaliser, mass_eps, causal)
    check_choice(OP, impl)
    if compiler.compiling():  # its hand-written backward pass: called, not traced
        return _OPAQUE(s, t, v, bandwidth, segments, causal, normaliser, float(mass_eps), impl)
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(v.shape[0])[:, None]  # row (b, h) → b_h
    if triton_takes(OP, impl, causal, s, t, v):
        # imported here: it loads triton
        from attnlab.attention.sliced_relu_bump.triton_segments import SegmentedSlicedReLUBumpTriton

        def walks(s, t, v, r):
            return SegmentedSlicedReLUBumpTriton.apply(s, t, v, width, r.local, r.start, r.size)

        out = runtime.launch(OP, impl, v.device, lambda: on_packed_rows(walks, s, t, v, segments, acc))
        if out is not None:
            return out
    if causal:
        eps = None if normaliser == "count" else float(mass_eps)
        op = lambda s, t, v, r: causal_sliced_relu_bump_rows(s, t, v, width, r, mass_eps=eps)  # noqa: E731
        return on_packed_rows(op, s, t, v, segments, acc, centre=False)
    op = lambda s, t, v, r: SegmentedSlicedReLUBump.apply(s, t, v, width, r.local, r.start, r.size)  # noqa: E731
    return on_packed_rows(op, s, t, v, segments, acc)


def _windows(search):
    """Global sorted positions bounding each centre's windows among its own segment's sorted keys
    (probes 0, 1, 2 of ``search`` are c − b, c, c + b): #{x <= c − b}, #{x < c}, #{x <= c}, #{x < c + b}."""
    return search.rank(0, "right"), search.rank(1, "left"), search.rank(1, "right"), search.rank(2, "left")


class SegmentedSlicedReLUBump(torch.autograd.Function):
    """`SlicedReLUBump` on packed rows: centred rows ``s, t (N, L)``, ``v (N, L, D)``, the per-row
    bandwidth ``b (N, 1)`` and the `Runs` (as tensors) of the segments. Window sums are differences
    inside one segment's run of the sorted keys, so nothing is read from a segment's start; the
    backward pass exchanges queries and keys as the padded op's does, on a second sort by
    (segment, query score)."""

    @staticmethod
    def forward(ctx, s, t, v, b, local, start, size):
        runs = Runs(local, start, size)
        coef = 1.0 / (size.to(s.dtype) * b)  # 1 / (n b), n the query's segment's keys
        vbar = segment_mean(v, runs)
        # the probes of both passes ranked at once: the queries' windows now, the keys' in backward
        keys = sort_keys(t, [s - b, s, s + b, t - b, t, t + b], runs)
        t_sorted = torch.gather(t, 1, keys.order)
        # tables of w = v − vbar (totals of each segment's own order); vbar returns times the hat mass
        p_v = sorted_rows(v - vbar, keys.order, None, None)
        p_tv = times_scores(p_v, t_sorted)
        cumsum_rows_(p_v)
        cumsum_rows_(p_tv)
        p_t = exclusive_cumsum(t_sorted.to(torch.float64))
        lo, below, mid, hi = _windows(keys)
        out = hat_output(p_v, p_tv, p_t, (lo, mid, hi), s, b, coef, vbar)
        ctx.save_for_backward(s, t, v, b, p_v, p_tv, p_t, vbar, lo, below, mid, hi, coef)
        ctx.keys, ctx.runs = keys, runs
        return out

    @staticmethod
    @first_order_only(OP, "each sequence laid out alone with sliced_relu_bump_attention(..., path='dense')")
    def backward(ctx, grad_out):
        s, t, v, b, p_v, p_tv, p_t, vbar, lo, below, mid, hi, coef = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # the padded op's algebra (`SlicedReLUBump`), with windows inside each segment's sorted run
        grad_s, grad_b, buffer = query_gradients(
            p_v, p_tv, p_t, (lo, below, mid, hi), grad_out, rowdot(grad_out, vbar), s, b, coef
        )
        queries = ctx.keys.among(1, [3, 4, 5])  # by (segment, s), with t − b, t, t + b to search
        s_sorted = torch.gather(s, 1, queries.order)
        grad_v, grad_t = key_gradients(
            grad_out, queries.order, s_sorted, _windows(queries), t, v, b, coef, buffer, ctx.runs
        )
        return grad_s, grad_t, grad_v, grad_b, None, None, None


#: the op as ``torch.compile`` calls it (``attnlab.attention.common.compiler``)
_OPAQUE = compiler.opaque_op(
    OP,
    sliced_relu_bump_attention_segments,
    "Tensor s, Tensor t, Tensor v, Tensor bandwidth, Tensor segments, bool causal, str normaliser, "
    "float mass_eps, str impl",
    differentiable=4,
)
