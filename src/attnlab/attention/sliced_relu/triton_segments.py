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
from attnlab.attention.sliced_common.rows import exclusive_cumsum, first_order_only, take_scalar
from attnlab.attention.sliced_common.segments import Runs, segment_table, sort_keys
from attnlab.attention.sliced_relu.triton import centred_carry, place, relu_backward, stream

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
            # the row's merged stream, placed by the codes: a query before the keys of equal code
            # (#{t < s}); each query's count of keys before it takes the earlier segments' in too
            before_sink = torch.searchsorted(keys.codes, s_codes, side="left", out_int32=True)
            before_src = torch.searchsorted(s_codes, keys.codes, side="right", out_int32=True)
            order, below, slot_score = place(before_sink, q_order, s_sorted, before_src, keys.order, t_sorted)
            at_or_below = keys.rank(0, "right")
            end = start + size
            p_t = exclusive_cumsum(t_sorted.to(torch.float64))
            balance = (below + at_or_below - 2 * start - size).to(s.dtype)  # #below − #above
            ends = [take_scalar(p_t, k) for k in (end, start, below, at_or_below)]
            den = s * balance + (ends[0] + ends[1] - ends[2] - ends[3]).to(s.dtype)
            scale = 2.0 / den.clamp_min(eps)
            relu_mass = (s.double() * (below - start) - (ends[2] - ends[1])).to(s.dtype)  # Σ ReLU(s_i − t_j)

            segments = segment_table(runs)
            seg_row, seg_start, seg_size = segments.table.unbind(1)
            count = seg_size.to(s.dtype)
            first_key = seg_row * s.shape[1] + keys.order[seg_row, seg_start]  # its lowest key, flat
            vbar, carry = centred_carry(order, v, slot_score, None, count, first_key, segments)
            out = torch.empty_like(v)
            stream(
                order, v, slot_score, xshift=vbar, c1=scale * s, c2=-scale, out=out, carry=carry,
                segments=segments,
            )  # fmt: skip
        ctx.save_for_backward(s, v, vbar, scale, den, balance, relu_mass, count, order, slot_score, carry)
        ctx.others = (segments, keys, s_codes, q_order, runs, eps)
        return out

    @staticmethod
    @first_order_only(OP)
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return SegmentedSlicedReLUTriton._backward(ctx, grad_out.contiguous())

    @staticmethod
    def _backward(ctx, g):
        s, v, vbar, scale, den, balance, relu_mass, count, order, slot_score, carry = ctx.saved_tensors
        segments, keys, s_codes, q_order, runs, eps = ctx.others
        bad = torch.zeros(count.shape[0], dtype=torch.bool, device=s.device)  # on_packed_rows has them
        grad_v, dots = relu_backward(
            order, v, vbar, None, slot_score, g, scale, relu_mass, count, carry, bad, segments
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
