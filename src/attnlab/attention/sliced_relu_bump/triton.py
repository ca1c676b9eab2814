"""Sliced ReLU-bump attention on Triton: ``o_i = (1/(n b)) Σ_j max(0, b - |s_i - t_j|) v_j`` with
the torch op's exactness rules (``attnlab.attention.sliced_common``), forward + backward moving 3.46 /
3.76 times the least bytes an op must move at T = 1,024 / 4,096 (``attnlab bench bytes``).

The window of query i is the run of sorted keys between its ranks ``#{t <= s - b}`` and
``#{t < s + b}``; since b is one number per row, these ranks (and ``#{t < s}``, ``#{t <= s}``) are
monotone in the sorted order of s. Forward (``bump_walk_kernel``, mode 0): one program per block of
sorted queries keeps their outputs in registers and walks the key tiles from its first query's
lowest edge to its last query's highest (``bump_plan_kernel``), with the exact weights
``b - |s - t|`` summed by ``tl.dot``: nothing cancels (on tensor cores for half values from
sm_80 on, the weights cut into exact parts: ``dot_format``). Where a run of keys holds no edge
of any query of the block, every key of it lies on one side of each query (below it, tied, or
above; inside its window or outside), which its first and last key tell; there the weights are
linear, ``b ∓ ((s - τ) - (t - τ))``, and the sum over the run is ``(b ∓ (s - τ)) Σ v ± Σ (t - τ) v``
for the queries whose window holds it: two rows of a float64 prefix table over the sorted keys
(one pass over v, ``bump_table_kernel``; rows every ``table`` keys, runs of whole rows, their
ends found by bisection), differenced in float64 with τ = the run's first key's score, so the
terms are of the window's own size. A block costs about as many tiles as hold its edges, however
far apart they lie: a block of queries straddling two clusters of scores walks about as far as
any other, not the whole cluster between its first and last edges. Reads: about three passes
over v, the table pass, one write of o.

Backward: the same walk gives at each query ``Σ_j π v_j`` (π = +1 below s, -1 above, 0 tied: dL/ds)
and ``Σ_j |s - t| v_j`` (dL/db), reading g once, and writes the prefix table of g over the sorted
queries as it goes (mode 1); the same kernel with keys as sinks and queries as sources (mode 2)
gives ``Σ_i W g_i`` (dL/dv) and ``Σ_i π g_i`` (dL/dt, dotted with v_j). The forward's two sorts
serve both passes. Sums run in the accumulation dtype (float32 for half inputs; float64 inputs in
float64), the tables in float64, and dL/db's per-query sums too: dL/db adds every query's term, and
they cancel, so a float32 ``tl.dot``'s rounding inside a tile showed (3 times the float64 error
in ``tests/attention/sliced_relu_bump/test_triton_precision.py``), so mode 1 adds the tile as BK
float64 rank-1 updates (more arithmetic, no more bytes) on blocks of 128 queries (at 256 the float64
accumulator spills).
float64 *inputs* never reach these kernels on CUDA (``sliced_common.dispatch.triton`` declares it):
the key walk spills kilobytes of stack per thread in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.common.triton.runtime import kernels
from attnlab.attention.sliced_common.rows import first_order_only, nan_rows
from attnlab.attention.sliced_common.segments import SegmentTable, table_or
from attnlab.attention.sliced_common.triton_scores import sort_scores


@dataclass
class BumpTuning:
    """Launch shape of the bump's kernels: ``sinks`` sorted positions per program in the forward
    (``query_sinks`` on the backward's query side, whose float64 accumulator would spill at 256;
    ``key_sinks`` on its key side, whose two accumulators spilled 570-1,020 B a thread at 256 on
    sm_80/90, at most 480 B at 128; all multiples of ``table``), ``sources`` per tile (16: ``tl.dot``'s
    least), a prefix-table row every ``table`` sources (a multiple of ``sources``), D in blocks of
    ``block_d``."""

    sinks: int = 256
    sources: int = 16
    table: int = 32
    block_d: int = 64
    num_warps: int = 8
    query_sinks: int = 128
    key_sinks: int = 128


BUMP = BumpTuning()
PLAN_BLOCK = 64  # sink blocks per program of the plan kernel
# A list: each walk appends ``(mode, stats (N, blocks, 2))``, the tiles it walked and the table rows
# it jumped over per block of sinks (``bump_walk_kernel``'s ``STATS``; tests and benchmarks).
WALK_STATS: list | None = None


def check_tuning() -> None:
    tiles, table = BUMP.sources, BUMP.table
    if tiles < 16 or table % tiles or any(n % table for n in (BUMP.sinks, BUMP.query_sinks, BUMP.key_sinks)):
        raise ValueError(f"BumpTuning: sources >= 16, dividing table, dividing every sinks; got {BUMP}")


def _real(mask: torch.Tensor | None, rows: int, length: int, device) -> torch.Tensor:
    """How many positions of each row are real ``(N,)`` int32 (they sort first)."""
    if mask is None:
        return torch.full((rows,), length, dtype=torch.int32, device=device)
    return mask.sum(dim=1, dtype=torch.int32)


def column_blocks(dim: int) -> tuple[int, int]:
    block = min(BUMP.block_d, max(16, 1 << (dim - 1).bit_length()))
    return block, -(-dim // block)


def _programs(rows: int, length: int, segments: SegmentTable | None) -> tuple[int, int]:
    """``(programs, positions)``: one per row of ``length`` sorted positions, or one per segment,
    the longest deciding the blocks."""
    return (rows, length) if segments is None else (segments.table.shape[0], segments.longest)


def _plan(sinks_sorted, sources_sorted, width, n_sink, sinks, key_sinks, segments=None):
    """Where each block of ``sinks`` sorted sinks walks over the sorted sources ``(programs, blocks,
    2)`` int32: its lowest and highest window edge (``bump_plan_kernel``); queries over keys, or keys
    over queries (``key_sinks``)."""
    rows, length = sinks_sorted.shape
    programs, positions = _programs(rows, length, segments)
    blocks = -(-positions // sinks)
    plan = torch.empty(programs, blocks, 2, dtype=torch.int32, device=sinks_sorted.device)
    kernels().bump_plan_kernel[(programs, -(-blocks // PLAN_BLOCK))](
        sinks_sorted, sources_sorted, n_sink, width, plan,
        table_or(segments, plan), length, blocks,
        KEY_SINKS=key_sinks, SINKS=sinks, HAS_SEGMENTS=segments is not None, BLOCK=PLAN_BLOCK,
    )  # fmt: skip
    return plan


def plan_queries(s_search, t_search, width, n_query, sinks, segments=None):
    """The walk of each block of ``sinks`` sorted queries over the sorted keys."""
    return _plan(s_search, t_search, width, n_query, sinks, False, segments)


def plan_keys(t_search, s_search, width, n_key, segments=None):
    """The walk of each block of sorted keys over the sorted queries (the same pairs)."""
    return _plan(t_search, s_search, width, n_key, BUMP.key_sinks, True, segments)


def table_buffers(x: torch.Tensor, blocks: int, sinks: int, programs: int | None = None):
    """Empty prefix-table rows ``(programs, blocks · rows per block + 1, 2, D)`` float64 (the last,
    past every block, zero) and block totals ``(programs, blocks, 2, D)``; a program per row of
    ``x`` unless ``programs`` says."""
    rows, _, dim = x.shape
    rows = rows if programs is None else programs
    local = torch.empty(
        rows, blocks * (sinks // BUMP.table) + 1, 2, dim, dtype=torch.float64, device=x.device
    )
    local[:, -1].zero_()
    return local, torch.empty(rows, blocks, 2, dim, dtype=torch.float64, device=x.device)


def block_carries(totals: torch.Tensor) -> torch.Tensor:
    """Each block's carry ``(N, blocks + 1, 2, D)``: the sums over the blocks before it."""
    carry = torch.zeros(
        totals.shape[0], totals.shape[1] + 1, *totals.shape[2:], dtype=totals.dtype, device=totals.device
    )
    torch.cumsum(totals, dim=1, out=carry[:, 1:])
    return carry


def key_table(k_order, t_search, v, n_key, segments=None):
    """The prefix table of v over the sorted keys (``bump_table_kernel``): ``(local, carry)``, per
    row or per segment."""
    rows, length, dim = v.shape
    programs, positions = _programs(rows, length, segments)
    blocks = -(-positions // BUMP.sinks)
    local, totals = table_buffers(v, blocks, BUMP.sinks, programs)
    block_d, d_blocks = column_blocks(dim)
    kernels().bump_table_kernel[(programs, blocks, d_blocks)](
        k_order, t_search, v, n_key, local, totals, table_or(segments, n_key),
        length, dim, local.shape[1], blocks,
        HAS_SEGMENTS=segments is not None, BS=BUMP.sinks, TB=BUMP.table, BD=block_d, num_warps=BUMP.num_warps,
    )  # fmt: skip
    return local, block_carries(totals)


def dot_format(values: torch.dtype, acc: torch.dtype, capability: tuple[int, int] | None) -> dict:
    """The walk's dot constants (``DOT``, ``OPERAND``, ``PRECISION``: see ``_dot_parts``) for values
    of dtype ``values`` summed in ``acc`` on a GPU of ``capability`` (None: the interpreter).

    Tensor cores from sm_80 on, for half values summed in float32: bf16 values are exact in bf16,
    fp16 values in tf32 (bf16 would round them), so only the weights are cut into parts, and each
    product is exact as on CUDA cores. float32 values would need parts of their own as well (six
    tf32 dots for exact products, no faster than the one float32 dot): they stay on CUDA cores,
    as does everything on sm_70 (no bf16 or tf32 tensor cores)."""
    import triton.language as tl

    half = values in (torch.bfloat16, torch.float16) and acc == torch.float32
    if not half or (capability is not None and capability < (8, 0)):
        return {"DOT": 0, "OPERAND": tl.float64 if acc == torch.float64 else tl.float32, "PRECISION": "ieee"}
    if values == torch.bfloat16:
        return {"DOT": 1, "OPERAND": tl.float32 if capability is None else tl.bfloat16, "PRECISION": "ieee"}
    return {"DOT": 2, "OPERAND": tl.float32, "PRECISION": "tf32"}


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def walk(
    mode, sinks, sources, x, table, plan, width, count, bad, *, y=None, out=None, scal=None, part=None,
    write=None, segments=None,
):  # fmt: skip
    """``bump_walk_kernel`` in ``mode``: ``sinks``/``sources`` are ``(sorted scores, order, real
    count)``; ``table`` the sources' ``(local, carry)``; ``write`` the sinks' table buffers; ``count``
    the rows' real keys (n in the factor 1 / (n b)); ``bad``
    the rows whose ``out`` is NaN at the real sinks; with ``segments``, every per-row array is per
    segment."""
    rows, length, dim = x.shape
    block_d, d_blocks = column_blocks(dim)
    programs, blocks = plan.shape[:2]
    (sink_score, sink_order, n_sink), (src_score, src_order, n_src) = sinks, sources
    local, carry = table
    dummy = width
    tloc, ttot = write if write is not None else (dummy, dummy)
    stats = None
    if WALK_STATS is not None:
        stats = torch.zeros(programs, blocks, 2, dtype=torch.int32, device=x.device)
        WALK_STATS.append((mode, stats))
    kernels().bump_walk_kernel[(programs, blocks, d_blocks)](
        sink_score, sink_order, src_score, src_order, x, y if y is not None else x,
        local, carry, plan, width, count, n_sink, n_src,
        out if out is not None else dummy, scal if scal is not None else dummy,
        part if part is not None else dummy, tloc, ttot, bad, stats if stats is not None else plan,
        table_or(segments, plan),
        rows, length, dim, blocks, local.shape[1], carry.shape[1], tloc.shape[1] if write is not None else 0,
        MODE=mode, KEY_SINKS=mode == 2, RPB=(BUMP.query_sinks if mode == 2 else BUMP.sinks) // BUMP.table,
        HAS_SEGMENTS=segments is not None,
        BS=(BUMP.sinks, BUMP.query_sinks, BUMP.key_sinks)[mode], BK=BUMP.sources,
        TB=BUMP.table, BD=block_d, STATS=stats is not None, num_warps=BUMP.num_warps,
        **dot_format(x.dtype, width.dtype, _capability(x.device)),
    )  # fmt: skip


class SlicedReLUBumpTriton(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)``, per-row bandwidth ``b (N, 1)``; ``valid`` (real keys)
    and ``queries`` (the queries whose output is kept) or None, as in ``SlicedReLUTriton``."""

    @staticmethod
    def forward(ctx, s, t, v, b, valid, queries):
        check_tuning()
        with no_autocast(v.device):
            rows, length, _ = v.shape
            count, s, t, bad, (t_search, _, k_order), (s_search, q_order) = sort_scores(
                s, t, v, valid, queries
            )
            # int32 orders: every walked tile reads them (the conversion costs less than it saves)
            q_order, k_order = q_order.to(torch.int32), k_order.to(torch.int32)
            width = b.to(s.dtype).contiguous()
            n_key = _real(valid, rows, length, v.device)
            n_query = _real(queries, rows, length, v.device)
            table = key_table(k_order, t_search, v, n_key)
            plan = plan_queries(s_search, t_search, width, n_query, BUMP.sinks)
            out = torch.empty_like(v)
            queries_, keys = (s_search, q_order, n_query), (t_search, k_order, n_key)
            walk(0, queries_, keys, v, table, plan, width, count, bad, out=out)  # NaN rows included
        ctx.save_for_backward(v, s_search, q_order, t_search, k_order, width, count, n_query, n_key, *table)
        ctx.valid, ctx.queries, ctx.bad = valid, queries, bad
        return out

    @staticmethod
    @first_order_only("sliced_relu_bump_attention")
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return SlicedReLUBumpTriton._backward(ctx, grad_out.contiguous())

    @staticmethod
    def _backward(ctx, g):
        v, s_search, q_order, t_search, k_order, width, count, n_query, n_key, local, carry = (
            ctx.saved_tensors
        )
        rows, length, dim = v.shape
        acc = width.dtype
        _, d_blocks = column_blocks(dim)
        queries, keys = (s_search, q_order, n_query), (t_search, k_order, n_key)

        # Queries: dL/ds and dL/db from one walk over v (the forward's table; blocks of
        # ``query_sinks``), which also writes the prefix table of g over the sorted queries.
        plan = plan_queries(s_search, t_search, width, n_query, BUMP.query_sinks)
        grad_s = torch.empty(d_blocks, rows, length, dtype=acc, device=v.device)
        grad_b = torch.empty(rows, plan.shape[1], d_blocks, dtype=torch.float64, device=v.device)
        g_local, g_totals = table_buffers(g, plan.shape[1], BUMP.query_sinks)
        walk(1, queries, keys, v, (local, carry), plan, width, count, ctx.bad, y=g, scal=grad_s,
              part=grad_b, write=(g_local, g_totals))  # fmt: skip

        # Keys: dL/dv and dL/dt from one walk over g, keys as sinks.
        grad_v = torch.empty_like(v)
        grad_t = torch.empty(d_blocks, rows, length, dtype=acc, device=v.device)
        key_plan = plan_keys(t_search, s_search, width, n_key)
        walk(
            2,
            keys,
            queries,
            g,
            (g_local, block_carries(g_totals)),
            key_plan,
            width,
            count,
            ctx.bad,
            y=v,
            out=grad_v,
            scal=grad_t,
        )

        grad_s, grad_t = (x.sum(dim=0) if d_blocks > 1 else x[0] for x in (grad_s, grad_t))
        grad_b = grad_b.sum(dim=(1, 2))[:, None].to(acc)
        return (
            grad_s,
            grad_t,
            grad_v,
            nan_rows(grad_b, ctx.bad),
            None,
            None,
        )  # the rest: NaN rows from the walks


def _rows(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    x = x.reshape(-1, *x.shape[2:])
    return (x if dtype is None else x.to(dtype)).contiguous()


def sliced_relu_bump(s, t, v, width, valid, queries, acc):
    batch, heads, length, dim = v.shape
    out = SlicedReLUBumpTriton.apply(_rows(s, acc), _rows(t, acc), _rows(v), width, valid, queries)
    return out.view(batch, heads, length, dim)


__all__ = ["BUMP", "BumpTuning", "SlicedReLUBumpTriton", "dot_format", "sliced_relu_bump"]
