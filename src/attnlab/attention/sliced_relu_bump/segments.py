"""Sliced ReLU-bump attention on packed rows: each query's hat window reads the keys of its own
segment only, one sort by (segment, score) per row (``attnlab.attention.sliced_common.segments``
has the method)."""

from __future__ import annotations

import torch

from attnlab.attention.common import compiler
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced_common.rows import (
    cumsum_rows_,
    exclusive_cumsum,
    first_order_only,
    hat_terms,
    key_windows,
    rowdot,
    sorted_rows,
    times_scores,
)
from attnlab.attention.sliced_common.segments import (
    Runs,
    check_segment_inputs,
    on_finite_segments,
    segment_mean,
    segment_runs,
    sort_keys,
)
from attnlab.attention.sliced_relu_bump.ops import check_bandwidth
from attnlab.attention.sliced_relu_bump.sorted import gather_combine

__all__ = ["sliced_relu_bump_attention_segments"]

OP = "sliced_relu_bump_attention_segments"


def sliced_relu_bump_attention_segments(
    s: torch.Tensor, t: torch.Tensor, v: torch.Tensor, bandwidth: torch.Tensor, segments: torch.Tensor
) -> torch.Tensor:
    """Bidirectional `sliced_relu_bump_attention` (count normaliser) inside segments:
    ``o_i = (1/n) Σ_j max(0, 1 − |s_i − t_j| / b_h) v_j`` over the n keys of the query's own segment
    (``segments`` (B, L), contiguous runs, `PackedLayout.segments`); s, t (B, H, L), v (B, H, L, D),
    ``bandwidth`` (H,). O(L log L) per row, torch code on every device; differentiable in s, t, v
    and the bandwidth (first order: the backward pass is hand-written)."""
    check_segment_inputs(OP, s, t, v, segments)
    batch, heads, length, dim = v.shape
    check_bandwidth(OP, bandwidth, heads)
    if compiler.compiling():  # its hand-written backward pass: called, not traced
        return _OPAQUE(s, t, v, bandwidth, segments)
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    with no_autocast(v.device):
        s, t = (x.reshape(-1, length).to(acc) for x in (s, t))
        v_rows = v.reshape(-1, length, dim).to(acc)
        width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]  # row (b, h) → b_h
        op = lambda s, t, v, r: SegmentedSlicedReLUBump.apply(s, t, v, width, r.local, r.start, r.size)  # noqa: E731
        out = on_finite_segments(op, s, t, v_rows, segment_runs(segments, heads))
    return out.view(batch, heads, length, dim).to(v.dtype)


def _windows(search, centres, width):
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
        lo, below, mid, hi = _windows(keys, s, b)
        rows, scored = hat_terms(lo, mid, hi, s, b, coef)
        out, _, buffer = gather_combine(p_v, rows)
        out, _, _ = gather_combine(p_tv, scored, out=out, buffer=buffer)
        left_n, right_n, left_t, right_t = key_windows(p_t, lo, mid, hi, s.dtype)
        mass = coef * ((b - s) * left_n + left_t + (b + s) * right_n - right_t)
        out.addcmul_(mass[..., None], vbar)
        ctx.save_for_backward(s, t, v, b, p_v, p_tv, p_t, vbar, lo, below, mid, hi, coef)
        ctx.keys = keys
        return out

    @staticmethod
    @first_order_only(OP, "each sequence laid out alone with sliced_relu_bump_attention(..., path='dense')")
    def backward(ctx, grad_out):
        s, t, v, b, p_v, p_tv, p_t, vbar, lo, below, mid, hi, coef = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # Queries (as `SlicedReLUBump`): dL/ds_i = c_i g_i · (Σ_{(s, s+b)} v − Σ_{(s−b, s)} v), tied keys
        # out; dL/db = Σ_i c_i/b · g_i · Σ_{|r|<b} |r| v_j. Window sums of v add g·vbar times counts.
        _, (g_lo, g_mid, g_hi, g_below), buffer = gather_combine(
            p_v, [(lo, None), (mid, None), (hi, None), (below, None)], dots_with=grad_out
        )
        _, (gx_lo, gx_mid, gx_hi), buffer = gather_combine(
            p_tv, [(lo, None), (mid, None), (hi, None)], dots_with=grad_out, buffer=buffer
        )
        g_vbar = rowdot(grad_out, vbar)
        left_n, right_n, left_t, right_t = key_windows(p_t, lo, mid, hi, s.dtype)
        tied = (mid - below).to(s.dtype)
        grad_s = coef * (g_hi - g_mid + g_lo - g_below + g_vbar * (right_n - left_n + tied))
        left, right = g_mid - g_lo + g_vbar * left_n, g_hi - g_mid + g_vbar * right_n
        left_x, right_x = gx_mid - gx_lo + g_vbar * left_t, gx_hi - gx_mid + g_vbar * right_t
        grad_b = (coef / b * (s * (left - right) + right_x - left_x)).sum(dim=1, keepdim=True)

        # Keys: the same windows with queries and keys exchanged, over each segment's queries sorted
        # by score: dL/dv_j = Σ_i c_i hat(s_i − t_j) g_i,
        # dL/dt_j = v_j · (Σ_{s∈(t, t+b)} c g − Σ_{s∈(t−b, t)} c g).
        queries = ctx.keys.among(1, [3, 4, 5])  # by (segment, s), with t − b, t, t + b to search
        q_g = sorted_rows(grad_out, queries.order, None, torch.gather(coef, 1, queries.order))
        q_sg = times_scores(q_g, torch.gather(s, 1, queries.order))
        cumsum_rows_(q_g)
        cumsum_rows_(q_sg)
        k_lo, k_below, k_mid, k_hi = _windows(queries, t, b)
        rows, scored = hat_terms(k_lo, k_mid, k_hi, t, b, torch.ones_like(coef))
        grad_v, (v_lo, v_mid, v_hi), buffer = gather_combine(q_g, rows, dots_with=v, buffer=buffer)
        _, (v_below,), buffer = gather_combine(q_g, [(k_below, None)], dots_with=v, buffer=buffer)
        grad_v, _, _ = gather_combine(q_sg, scored, out=grad_v, buffer=buffer)
        grad_t = v_hi - v_mid + v_lo - v_below
        return grad_s, grad_t, grad_v, grad_b, None, None, None


#: the op as ``torch.compile`` calls it (``attnlab.attention.common.compiler``)
_OPAQUE = compiler.opaque_op(
    OP,
    sliced_relu_bump_attention_segments,
    "Tensor s, Tensor t, Tensor v, Tensor bandwidth, Tensor segments",
    differentiable=4,
)
