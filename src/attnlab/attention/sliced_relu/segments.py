"""Sliced ReLU attention on packed rows: each query sums the keys of its own segment only, one sort
by (segment, score) per row (``attnlab.attention.sliced_common.segments`` has the method). The
torch code is here; the Triton walks of the bidirectional op are in ``triton_segments``."""

from __future__ import annotations

import torch

from attnlab.attention.common import compiler
from attnlab.attention.common.dispatch import check_choice
from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.common.triton import runtime
from attnlab.attention.sliced_common.rows import (
    count_greater,
    cumsum_rows_,
    exclusive_cumsum,
    first_order_only,
    rowdot,
    sorted_rows,
    take_difference,
    take_scalar,
    times_scores,
)
from attnlab.attention.sliced_common.segments import (
    Runs,
    add_back_totals_,
    check_segment_inputs,
    on_packed_rows,
    restart_at_segment_ends_,
    segment_mean,
    sort_keys,
    triton_takes,
)
from attnlab.attention.sliced_relu.causal import causal_sliced_relu_rows

__all__ = ["sliced_relu_attention_segments"]

OP = "sliced_relu_attention_segments"


def sliced_relu_attention_segments(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    eps: float = 1e-4,
    causal: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """`sliced_relu_attention` inside segments: s, t (B, H, L), v (B, H, L, D) hold several
    sequences end to end in each row, ``segments`` (B, L) says which each position belongs to
    (contiguous runs, `PackedLayout.segments`), and every sum and mean runs over the query's own
    segment: each sequence gets what it gets alone. O(L log L) per row; ``causal=True``: keys
    ``j ≤ i`` of the segment only, every statistic over that prefix, O(L log² L)
    (`causal_sliced_relu_rows`). ``impl``: ``"auto"`` (the Triton walks for CUDA tensors,
    bidirectional: ``sliced_relu.triton_segments``; torch code otherwise), ``"triton"`` or
    ``"torch"``. Differentiable in s, t and v (first order: the backward passes are hand-written)."""
    check_segment_inputs(OP, s, t, v, segments)
    if not eps > 0:
        raise ValueError(f"{OP}: eps must be > 0, got {eps}")
    if type(causal) is not bool:
        raise TypeError(f"{OP}: causal must be True or False, got {causal!r}")
    check_choice(OP, impl)
    if compiler.compiling():  # its hand-written backward pass: called, not traced
        return _OPAQUE(s, t, v, segments, float(eps), causal, impl)
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    if triton_takes(OP, impl, causal, s, t, v):
        from attnlab.attention.sliced_relu.triton_segments import SegmentedSlicedReLUTriton  # loads triton

        def walks(s, t, v, r):
            return SegmentedSlicedReLUTriton.apply(s, t, v, r.local, r.start, r.size, float(eps))

        out = runtime.launch(OP, impl, v.device, lambda: on_packed_rows(walks, s, t, v, segments, acc))
        if out is not None:
            return out
    if causal:
        op = lambda s, t, v, r: causal_sliced_relu_rows(s, t, v, r, eps)  # noqa: E731
        return on_packed_rows(op, s, t, v, segments, acc, centre=False)
    op = lambda s, t, v, r: SegmentedSlicedReLU.apply(s, t, v, r.local, r.start, r.size, float(eps))  # noqa: E731
    return on_packed_rows(op, s, t, v, segments, acc)


class SegmentedSlicedReLU(torch.autograd.Function):
    """`SlicedReLU` on packed rows: centred rows ``s, t (N, L)``, ``v (N, L, D)`` in the accumulation
    dtype and the `Runs` (as tensors) of their segments. The same prefix-table algebra with every
    table read as a difference from its segment's start, and the same hand-written backward pass
    (queries sorted by segment and descending score), so nothing of autograd's intermediates is kept."""

    @staticmethod
    def forward(ctx, s, t, v, local, start, size, eps):
        runs = Runs(local, start, size)
        w = v - segment_mean(v, runs)  # centred per segment: each segment's totals of its own order
        keys = sort_keys(t, [s], runs)
        t_sorted = torch.gather(t, 1, keys.order)
        p_w = sorted_rows(w, keys.order, None, None)
        p_tw = times_scores(p_w, t_sorted)
        cumsum_rows_(p_w)
        cumsum_rows_(p_tw)
        p_t = exclusive_cumsum(t_sorted.to(torch.float64))
        below, at_or_below = keys.rank(0, "left"), keys.rank(0, "right")  # global sorted positions
        end = start + size

        below_w = take_difference(p_w, below, start)  # Σ_{seg, t_j<s_i} w_j
        below_tw = take_difference(p_tw, below, start)
        del p_w, p_tw
        # Σ_j |s_i − t_j| = s_i (#below − #above) + Σ_{above} t − Σ_{below} t (ties add 0)
        counts = (below + at_or_below - 2 * start - size).to(s.dtype)
        ends = [take_scalar(p_t, k) for k in (end, start, below, at_or_below)]
        den = s * counts + (ends[0] + ends[1] - ends[2] - ends[3]).to(s.dtype)
        scale = 2.0 / den.clamp_min(eps)
        out = below_tw.mul_(-scale[..., None]).addcmul_(below_w, (s * scale)[..., None])

        ctx.save_for_backward(s, t, w, below, at_or_below, counts, den, out, below_w, local, start, size)
        ctx.eps, ctx.keys = eps, keys
        return out

    @staticmethod
    @first_order_only(
        OP,
        "each sequence laid out alone with sliced_relu_attention(..., path='dense') "
        "(a packed layer: path='dense')",
    )
    def backward(ctx, grad_out):
        s, t, w, below, at_or_below, counts, den, out, below_w, local, start, size = ctx.saved_tensors
        runs, length, order = Runs(local, start, size), s.shape[1], ctx.keys.order
        grad_out = grad_out.contiguous()
        # o_i = 2 N_i / d_i, d_i = max(den_i, eps): dL/dN_i = a_i g_i, dL/dden_i = -(g_i · o_i) / d_i
        inv_d = 1.0 / den.clamp_min(ctx.eps)
        a_scale = 2.0 * inv_d
        grad_den = -rowdot(grad_out, out) * inv_d * (den >= ctx.eps)
        grad_s = a_scale * rowdot(grad_out, below_w) + grad_den * counts

        # Keys: each segment's queries by descending score, so that a prefix of its run is the set
        # {i : s_i > t_j}. A key at sorted position p has #{i : below_i > p} queries above it, less
        # the queries of the later segments (whose ranks all lie past p); earlier segments' lie before.
        _, q_order = torch.sort(ctx.keys.descending(0, runs), dim=1)
        q_a = sorted_rows(grad_out, q_order, None, torch.gather(a_scale, 1, q_order))
        q_sa = times_scores(q_a, torch.gather(s, 1, q_order))
        totals = restart_at_segment_ends_([q_a, q_sa], runs)
        cumsum_rows_(q_a)
        cumsum_rows_(q_sa)
        q_den = exclusive_cumsum(torch.gather(grad_den, 1, q_order).to(torch.float64))
        later = length - runs.end
        above = start + count_greater(below, order) - later  # start + #{i in segment : s_i > t_j}
        at_or_above = start + count_greater(at_or_below, order) - later
        sum_a, grad_w = (
            add_back_totals_(take_difference(table, above, start), total, above == runs.end, runs)
            for table, total in zip((q_a, q_sa), totals, strict=True)
        )
        del q_a, q_sa
        grad_w.addcmul_(sum_a, t[..., None], value=-1.0)  # Σ_{s_i>t_j} (s_i − t_j) a_i
        den_above = take_scalar(q_den, above) - take_scalar(q_den, start)
        den_below = take_scalar(q_den, runs.end) - take_scalar(q_den, at_or_above)
        grad_t = (den_below - den_above).to(s.dtype) - rowdot(w, sum_a)
        grad_v = grad_w.sub_(segment_mean(grad_w, runs))  # w = v − its segment's mean
        return grad_s, grad_t, grad_v, None, None, None, None


#: the op as ``torch.compile`` calls it (``attnlab.attention.common.compiler``)
_OPAQUE = compiler.opaque_op(
    OP,
    sliced_relu_attention_segments,
    "Tensor s, Tensor t, Tensor v, Tensor segments, float eps, bool causal, str impl",
    differentiable=3,
)
