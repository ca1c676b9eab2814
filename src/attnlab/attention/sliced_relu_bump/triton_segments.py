"""ReLU-bump on packed rows with the Triton walks: `SegmentedSlicedReLUBump`'s math on the tile
walks of ``sliced_relu_bump/triton.py``, one program's rows per segment.

Keys and queries sorted by (segment, score) (`segments.sort_keys`: integer codes) hold each
segment's sorted keys and queries on the positions its tokens hold in the row, so a segment is a
row of its own to every kernel (``_sorted_run``): its sorted run starts at ``row · L + start`` and
holds ``size`` entries, its prefix tables, plans, bandwidth and key count are its own, and no
window reads past its run. The launch grid needs the number of segments and the longest: one read
from the device per call.
"""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.sliced_common.rows import first_order_only
from attnlab.attention.sliced_common.segments import Runs, segment_table, sort_keys
from attnlab.attention.sliced_relu_bump.triton import (
    BUMP,
    block_carries,
    check_tuning,
    column_blocks,
    key_table,
    plan_keys,
    plan_queries,
    table_buffers,
    walk,
)

OP = "sliced_relu_bump_attention_segments"


class SegmentedSlicedReLUBumpTriton(torch.autograd.Function):
    """`SegmentedSlicedReLUBump` on the Triton walks: centred rows ``s, t (N, L)`` in the
    accumulation dtype, ``v (N, L, D)``, the per-row bandwidth ``b (N, 1)`` and the `Runs` (as
    tensors) of the segments."""

    @staticmethod
    def forward(ctx, s, t, v, b, local, start, size):
        check_tuning()
        with no_autocast(v.device):
            runs = Runs(local, start, size)
            codes = sort_keys(t, [s], runs)
            _, q_order = torch.sort(codes.probe(0), dim=1)
            t_search, s_search = torch.gather(t, 1, codes.order), torch.gather(s, 1, q_order)
            q_order, k_order = q_order.to(torch.int32), codes.order.to(torch.int32)
            segments = segment_table(runs)
            row = segments.table[:, 0]
            real = segments.table[:, 2].to(torch.int32)  # every token of a segment is real
            count = real.to(s.dtype)
            width = b.reshape(-1)[row].to(s.dtype).contiguous()
            bad = torch.zeros(row.shape[0], dtype=torch.bool, device=v.device)  # on_packed_rows has them
            table = key_table(k_order, t_search, v, real, segments)
            plan = plan_queries(s_search, t_search, width, real, BUMP.sinks, segments)
            out = torch.empty_like(v)
            queries, keys = (s_search, q_order, real), (t_search, k_order, real)
            walk(0, queries, keys, v, table, plan, width, count, bad, out=out, segments=segments)
        ctx.save_for_backward(v, s_search, q_order, t_search, k_order, width, count, real, bad, *table)
        ctx.segments = segments
        return out

    @staticmethod
    @first_order_only(OP)
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return SegmentedSlicedReLUBumpTriton._backward(ctx, grad_out.contiguous())

    @staticmethod
    def _backward(ctx, g):
        v, s_search, q_order, t_search, k_order, width, count, real, bad, local, carry = ctx.saved_tensors
        segments = ctx.segments
        rows, length, dim = v.shape
        acc = width.dtype
        _, d_blocks = column_blocks(dim)
        programs = segments.table.shape[0]
        queries, keys = (s_search, q_order, real), (t_search, k_order, real)

        # Queries: dL/ds and dL/db from one walk over v, which also writes the prefix table of g
        # over each segment's sorted queries (as the padded op's backward, per segment).
        plan = plan_queries(s_search, t_search, width, real, BUMP.query_sinks, segments)
        grad_s = torch.zeros(d_blocks, rows, length, dtype=acc, device=v.device)
        grad_b = torch.empty(programs, plan.shape[1], d_blocks, dtype=torch.float64, device=v.device)
        g_local, g_totals = table_buffers(g, plan.shape[1], BUMP.query_sinks, programs)
        walk(1, queries, keys, v, (local, carry), plan, width, count, bad, y=g, scal=grad_s,
              part=grad_b, write=(g_local, g_totals), segments=segments)  # fmt: skip

        # Keys: dL/dv and dL/dt from one walk over g, keys as sinks.
        grad_v = torch.empty_like(v)
        grad_t = torch.zeros(d_blocks, rows, length, dtype=acc, device=v.device)
        key_plan = plan_keys(t_search, s_search, width, real, segments)
        walk(2, keys, queries, g, (g_local, block_carries(g_totals)), key_plan, width, count, bad, y=v,
              out=grad_v, scal=grad_t, segments=segments)  # fmt: skip

        grad_s, grad_t = (x.sum(dim=0) if d_blocks > 1 else x[0] for x in (grad_s, grad_t))
        per_segment = grad_b.sum(dim=(1, 2))
        grad_width = torch.zeros(rows, dtype=torch.float64, device=v.device)
        grad_width.index_add_(0, segments.table[:, 0], per_segment)
        return grad_s, grad_t, grad_v, grad_width[:, None].to(acc), None, None, None
