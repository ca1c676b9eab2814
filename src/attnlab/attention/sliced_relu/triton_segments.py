"""Sliced ReLU on packed rows with the Triton walks: `SegmentedSlicedReLU`'s math, with the D-wide
prefix tables and their gathers replaced by the merged-stream walks of ``sliced_relu/triton.py``.

Keys and queries sorted by (segment, score) (`segments.sort_keys`: integer codes, so ties compare
exactly as the floats do) lay each segment's keys and queries on the positions its tokens hold in
the row, so the merged stream of the whole row (``merge``) holds segment ``[start, start + size)``
on slots ``[2·start, 2·(start + size))``: one walk per segment (``_stream_range``) restarts its
sums there, with the segment's own value mean, carries and count. What is per token and per
query ((N, L) scalars: ranks, denominators, dL/ds, dL/dt) stays in torch, summed in float64 where a
row's running total is differenced at a segment's start. The launch grid needs the number of
segments and the longest: one read from the device per call.
"""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.common.triton.runtime import kernels
from attnlab.attention.sliced_common.rows import exclusive_cumsum, first_order_only, take_scalar
from attnlab.attention.sliced_common.segments import Runs, segment_table, sort_keys
from attnlab.attention.sliced_common.triton_scores import scalar_block
from attnlab.attention.sliced_relu.triton import centred_carry, relu_backward, stream

OP = "sliced_relu_attention_segments"


class SegmentedSlicedReLUTriton(torch.autograd.Function):
    """`SegmentedSlicedReLU` on the Triton walks: centred rows ``s, t (N, L)`` in the accumulation
    dtype, ``v (N, L, D)`` and the `Runs` (as tensors) of their segments."""

    @staticmethod
    def forward(ctx, s, t, v, local, start, size, eps):
        with no_autocast(v.device):
            runs = Runs(local, start, size)
            keys = sort_keys(t, [s], runs)
            q_codes = keys.probe(0).contiguous()
            s_codes, q_order = torch.sort(q_codes, dim=1)
            t_sorted, s_sorted = torch.gather(t, 1, keys.order), torch.gather(s, 1, q_order)
            order, below, slot_score = _merge(keys.codes, keys.order, t_sorted, s_codes, q_order, s_sorted)
            at_or_below = keys.rank(0, "right")
            end = start + size
            p_t = exclusive_cumsum(t_sorted.to(torch.float64))
            balance = (below + at_or_below - 2 * start - size).to(s.dtype)  # #below − #above
            ends = [take_scalar(p_t, k) for k in (end, start, below, at_or_below)]
            den = s * balance + (ends[0] + ends[1] - ends[2] - ends[3]).to(s.dtype)
            scale = 2.0 / den.clamp_min(eps)
            relu_mass = (s.double() * (below - start) - (ends[2] - ends[1])).to(s.dtype)  # Σ ReLU(s_i − t_j)

            table, longest = segment_table(runs)
            count = table[:, 2].to(s.dtype)
            # each segment's lowest key, as a flat index into the rows' tokens
            first_key = table[:, 0] * s.shape[1] + keys.order[table[:, 0], table[:, 1]]
            span = 2 * longest
            vbar, carry = centred_carry(order, v, slot_score, None, count, first_key, table, span)
            out = torch.empty_like(v)
            stream(
                order, v, slot_score, xshift=vbar, c1=scale * s, c2=-scale, out=out, carry=carry,
                segments=table, span=span,
            )  # fmt: skip
        ctx.save_for_backward(s, v, vbar, scale, den, balance, relu_mass, count, order, slot_score, carry)
        ctx.others = (table, span, keys, s_codes, q_order, runs, eps)
        return out

    @staticmethod
    @first_order_only(OP)
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return SegmentedSlicedReLUTriton._backward(ctx, grad_out.contiguous())

    @staticmethod
    def _backward(ctx, g):
        s, v, vbar, scale, den, balance, relu_mass, count, order, slot_score, carry = ctx.saved_tensors
        table, span, keys, s_codes, q_order, runs, eps = ctx.others
        bad = torch.zeros(table.shape[0], dtype=torch.bool, device=s.device)  # on_packed_rows has them
        grad_v, dots = relu_backward(
            order, v, vbar, None, slot_score, g, scale, relu_mass, count, carry, bad, table, span
        )
        g_below, g_scored, key_dots = dots.unbind(0)  # g·P, g·P_t at queries; (v − vbar)·Q at keys
        grad_den = torch.where(den >= eps, -0.5 * scale * scale, 0.0) * (s * g_below - g_scored)
        grad_s = scale * g_below + grad_den * balance
        # dL/dt_j = Σ_{s_i<t_j} dL/dden_i − Σ_{s_i>t_j} dL/dden_i − (v_j − vbar)·Q_j over j's segment:
        # the queries sorted by code, a float64 running sum differenced at the segment's bounds
        q_den = exclusive_cumsum(torch.gather(grad_den, 1, q_order).to(torch.float64))
        t_codes = torch.empty_like(keys.codes).scatter_(1, keys.order, keys.codes)
        q_lt, q_le = (torch.searchsorted(s_codes, t_codes, side=side) for side in ("left", "right"))
        start, end = runs.start, runs.end
        den_below = take_scalar(q_den, q_lt) - take_scalar(q_den, start)
        den_above = take_scalar(q_den, end) - take_scalar(q_den, q_le)
        grad_t = (den_below - den_above).to(s.dtype) - key_dots
        return grad_s, grad_t, grad_v, None, None, None, None


def _merge(key_codes, k_order, t_sorted, s_codes, q_order, s_sorted):
    """``merge``'s stream of a packed row (``merge_kernel``), placed by the codes: a query before the
    keys of equal code (``#{t < s}``), each segment's entries on its own slots. Returns the order,
    each query's count of keys before it (the segments before its own included) and the slots'
    scores."""
    rows, length = key_codes.shape
    before_sink = torch.searchsorted(key_codes, s_codes, side="left", out_int32=True)
    before_src = torch.searchsorted(s_codes, key_codes, side="right", out_int32=True)
    order = torch.full((rows, 2 * length), -1, dtype=torch.int32, device=key_codes.device)
    counts = torch.empty(rows, length, dtype=torch.int64, device=key_codes.device)
    slot_score = torch.empty(rows, 2 * length, dtype=t_sorted.dtype, device=key_codes.device)
    block = scalar_block(length)
    kernels().merge_kernel[(rows, -(-length // block))](
        before_sink, q_order, s_sorted, before_src, k_order, t_sorted, order, counts, slot_score, length,
        BLOCK=block,
    )  # fmt: skip
    return order, counts, slot_score
