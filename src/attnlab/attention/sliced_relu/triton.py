"""Sliced ReLU and ReLU-bump attention on Triton: the same math and exactness rules as
``attnlab.attention.sliced_common`` (its docstring has the derivation), without prefix tables.

The torch op sorts the keys, builds (T+1)×D prefix tables of the centred values (and of score ·
value) in memory, and gathers them at each query's ``searchsorted`` rank. Here the sorts and ranks
stay in torch ((B·H, T) tensors, 1/D of the data; two sorts per forward, which the backward reuses),
the per-query scalars are one elementwise kernel (``kernels.relu_scalars_kernel`` for sliced ReLU)
and the D-wide work is one *merged stream* per row and per rank rule: keys and queries in one
ascending order, walked by ``kernels.stream_kernel`` with running sums, so that each query reads the
sums over exactly the keys before it. The merged order comes from the two sorted lists and two
``searchsorted`` calls (a merge, not a sort: ``kernels.merge_kernel`` places the slots, and each
slot's score, which the walks then read in order rather than gather), and ties go
to the side the torch op's ``searchsorted`` puts them. Each stream reads the value rows once and
writes the output rows once; rows split into chunks start from carried totals (a pass over the
sources first, ``stream_totals_kernel``, which for sliced ReLU's forward also gives the mean).

Sliced ReLU's backward is one walk of the forward's stream (``kernels.relu_backward_kernel``): the key
sums below each query as in the forward, and the query sums above each key (``{i : s_i > t_j}``) as
the queries' total minus their running sum; the mean subtraction of dL/dw is analytic
(``Σ_j dL/dw_j = Σ_i a_i R_i g_i`` with ``R_i = Σ_{t_j<s_i} (s_i - t_j)``), from the same pass over g
that gives the queries' totals. So v and g are read once each and dv written once.

Values, outputs and gradients keep the input dtype in memory; every sum runs in the accumulation
dtype (float32, float64 for float64 inputs), loaded and converted inside the kernels, with
compensated carries (TwoSum: the running sum's rounding errors are kept and added back).
ReLU-bump's kernels are of another shape (tile walks over the sorted keys,
``attnlab.attention.sliced_relu_bump.triton``); both start with ``sliced_common.triton_scores``.

Rows with a NaN or inf score are handled as by the torch op (``rows.finite_rows``): their scores
are zeroed before any sort (``score_prologue_kernel``), so every merged order is a permutation, and
the kernels that write the outputs and dv write NaN there themselves.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.common.triton.occupancy import compiled_blocks_per_sm
from attnlab.attention.common.triton.runtime import interpret_mode, kernels
from attnlab.attention.sliced_common.rows import exclusive_cumsum, first_order_only
from attnlab.attention.sliced_common.segments import SegmentTable, table_or
from attnlab.attention.sliced_common.triton_scores import scalar_block, sort_scores


@dataclass
class StreamTuning:
    """Launch shape of the stream kernels. ``chunk``: entries per program (None: enough chunks for
    ``waves`` full waves of the programs the GPU runs at once, ``_chunk_len``, at least
    ``min_chunk`` entries each)."""

    block: int = 32  # 32 × 64 tiles at 8 warps: no register spills on sm_90 (64 spills)
    block_d: int = 64
    min_chunk: int = 2048
    chunk: int | None = None
    waves: int = 2
    num_warps: int = 8
    # the backward walk's register cap: uncapped it takes 188-197 registers a thread at 8 warps (one
    # block of 256 threads per SM, 12.5 % occupancy); at 128 two blocks fit, for at most 8 bytes of
    # spills (sm_80 bf16): `tests/attention/sliced_relu/test_triton_occupancy.py` reads the registers,
    # `tests/attention/common/triton/test_compile.py` the spills
    backward_max_registers: int = 128


TUNING = StreamTuning()
# programs per SM assumed where the compiled walks cannot say (off CUDA, or a failed probe): what the
# backward walk fits under its register cap
DEFAULT_PER_SM = 2
_PER_SM: dict[tuple, int] = {}  # (device, values dtype, accumulation dtype, D) -> programs per SM


def _chunk_len(rows: int, length: int, d_blocks: int, x: torch.Tensor, acc: torch.dtype) -> int:
    """Entries per program of a walk over ``length`` entries of each of ``rows`` rows of ``x``: the
    rows' ``rows · d_blocks`` programs split into chunks until they make ``TUNING.waves`` full waves
    of what the GPU runs at once (its SMs times the programs per SM of the walks, as compiled:
    ``walk_programs_per_sm``), each chunk at least ``TUNING.min_chunk`` long."""
    if TUNING.chunk is not None:
        return max(TUNING.block, -(-TUNING.chunk // TUNING.block) * TUNING.block)
    if x.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = TUNING.waves * sms * walk_programs_per_sm(x.dtype, acc, x.shape[-1], x.device)
    else:
        programs = TUNING.waves * DEFAULT_PER_SM
    chunks = max(1, -(-programs // (rows * d_blocks)))
    chunk = max(TUNING.min_chunk, -(-length // chunks))
    return -(-chunk // TUNING.block) * TUNING.block


def walk_programs_per_sm(values: torch.dtype, acc: torch.dtype, dim: int, device: torch.device) -> int:
    """Programs per SM of the two walks that share a chunk layout (``stream_kernel`` and the
    backward's ``relu_backward_kernel``: the fewer), compiled for ``values`` summed in ``acc`` with
    every option on, by the compiler's registers (``occupancy.compiled_blocks_per_sm``); once per
    (device, dtypes, D), so every call of a run splits its rows alike. If the kernels cannot be
    compiled here, ``DEFAULT_PER_SM`` with a warning (the launch itself will then say why)."""
    key = (str(device), values, acc, dim)
    if key not in _PER_SM:
        try:
            _PER_SM[key] = min(
                compiled_blocks_per_sm(getattr(kernels(), name).warmup(*args, grid=(1,), **options), device)
                for name, args, options in _walk_signatures(values, acc, dim)
            )
        except Exception as error:  # noqa: BLE001 - any failure to compile only costs the tuning
            warnings.warn(
                f"sliced ReLU's Triton walks: no register count on {device} "
                f"({type(error).__name__}: {error}); chunks assume {DEFAULT_PER_SM} programs per SM",
                stacklevel=2,
            )
            _PER_SM[key] = DEFAULT_PER_SM
    return _PER_SM[key]


def _walk_signatures(values: torch.dtype, acc: torch.dtype, dim: int) -> list[tuple[str, list, dict]]:
    """``(kernel, arguments, options)`` of ``stream_kernel`` and ``relu_backward_kernel`` as
    ``stream`` and ``relu_backward`` launch them, every option on; tensors by their dtypes (what
    ``warmup`` compiles from), sizes as small placeholders that no size check specializes on."""
    sizes = [3, 48, dim, 96, 48, 3]  # rows, T, D, 2T, chunk, chunks
    tiles = {"BLOCK": TUNING.block, "BD": _block_d(dim), "num_warps": TUNING.num_warps}
    index = torch.int32
    stream_args = [index, values, acc, acc, acc, acc, acc, values, acc, torch.int64, *sizes]
    scalars = [acc, acc, acc]  # vbar, w, the slots' scores
    backward_args = [
        index,
        values,
        *scalars,
        values,
        acc,
        acc,
        values,
        acc,
        acc,
        acc,
        torch.bool,
        torch.int64,
        *sizes,
    ]
    return [
        (
            "stream_kernel",
            stream_args,
            {"HAS_XSHIFT": True, "HAS_W": True, "HAS_CARRY": True, "HAS_SEGMENTS": True, **tiles},
        ),
        (
            "relu_backward_kernel",
            backward_args,
            {
                "HAS_W": True,
                "HAS_KCARRY": True,
                "HAS_SEGMENTS": True,
                "maxnreg": TUNING.backward_max_registers,
                **tiles,
            },
        ),
    ]


def _block_d(dim: int) -> int:
    """Columns per program of the D-wide kernels: D up to a power of two, 16 to ``TUNING.block_d``."""
    return min(TUNING.block_d, max(16, 1 << (dim - 1).bit_length()))


def _layout(
    x: torch.Tensor, total: int, acc: torch.dtype, walks: int | None = None
) -> tuple[int, int, int, int]:
    """``(block_d, d_blocks, chunk, n_chunks)``: ``walks`` walks (the rows of ``x``, or the
    segments of its packed rows) over at most ``total`` entries each, summed in ``acc``."""
    rows, _, dim = x.shape
    block_d = _block_d(dim)
    d_blocks = -(-dim // block_d)
    chunk = _chunk_len(rows if walks is None else walks, total, d_blocks, x, acc)
    return block_d, d_blocks, chunk, -(-total // chunk)


def _walks(x: torch.Tensor, order: torch.Tensor, segments: SegmentTable | None) -> tuple[int, int]:
    """``(walks, entries)``: one walk per row of ``x`` over its stream ``order`` (N, 2T), or one
    per segment of packed rows (`segment_table`) over its ``2 · size`` slots, the longest deciding."""
    if segments is None:
        return x.shape[0], order.shape[1]
    return segments.table.shape[0], 2 * segments.longest


def _totals(
    order, x, score, xshift, weight, layout, *, sinks_as_sources=False, c4=None, scalars=None, segments=None
):
    """Each chunk's sums ``(walks, chunks, 4, D)`` (``stream_totals_kernel``; 5 planes with ``c4``;
    with ``scalars``, a ``(walks, chunks, 4)`` tensor, the chunks' ``Σ w``, ``Σ u w`` go there)."""
    block_d, d_blocks, chunk, n_chunks = layout
    _, length, dim = x.shape
    walks, _ = _walks(x, order, segments)
    totals = torch.empty(walks, n_chunks, 4 if c4 is None else 5, dim, dtype=score.dtype, device=x.device)
    kernels().stream_totals_kernel[(walks, n_chunks, d_blocks)](
        order, x, xshift if xshift is not None else score, weight if weight is not None else score,
        score, c4 if c4 is not None else score, totals, scalars if scalars is not None else score,
        table_or(segments, order), length, dim, order.shape[1], chunk, n_chunks,
        HAS_XSHIFT=xshift is not None, HAS_W=weight is not None, SINKS_AS_SOURCES=sinks_as_sources,
        HAS_C4=c4 is not None, SCALARS=scalars is not None, HAS_SEGMENTS=segments is not None,
        BLOCK=TUNING.block, BD=block_d, num_warps=TUNING.num_warps,
    )  # fmt: skip
    return totals


def centred_carry(order, v, score, weight, count, first, segments=None):
    """The mean ``vbar (N, 2, D)`` (nearest value and rest) of the sources of ``stream(order, v,
    score, xshift=vbar, weight=weight)`` (over ``count`` real ones) and that stream's chunk carry
    (None: one chunk), from one pass over ``v - p``: the chunks' sums (compensated) and their
    ``Σ w``, ``Σ w u`` give both, ``Σ w (v - vbar) = Σ w (v - p) - (vbar - p) Σ w``, in float64,
    with the very ``vbar`` the kernels will subtract (padded keys weigh 0: no masked copy of v).
    ``p``: the row of v at ``first (N,)`` (a real key): the sums inside a block of the walk are
    rounded, and of values near one of them far less than of values with a common offset (1e4:
    the outputs were 3e-3 off in float32). ``segments``: one walk per segment of packed rows
    (``_walks``; ``count``, ``first`` per segment, ``first`` as a flat index into the rows'
    tokens)."""
    order, v, score, weight = (None if a is None else a.contiguous() for a in (order, v, score, weight))
    acc = score.dtype
    rows, length, dim = v.shape
    walks, entries = _walks(v, order, segments)
    pivot = torch.zeros(walks, 2, dim, dtype=acc, device=v.device)
    if segments is None:
        pivot[:, 0] = v[torch.arange(rows, device=v.device), first]
    else:
        pivot[:, 0] = v.reshape(rows * length, dim)[first]
    layout = _layout(v, entries, acc, walks)
    scalars = torch.empty(walks, layout[3], 4, dtype=acc, device=v.device)
    totals = _totals(order, v, score, pivot, weight, layout, scalars=scalars, segments=segments)
    carry, vbar = _chunk_carry(totals, 1, count, scalars, pivot)
    return vbar, carry if layout[3] > 1 else None  # one chunk starts at zero


def stream(
    order: torch.Tensor,
    x: torch.Tensor,
    score: torch.Tensor,
    *,
    c1: torch.Tensor,
    c2: torch.Tensor,
    out: torch.Tensor,
    xshift: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    carry: torch.Tensor | None = None,
    segments: SegmentTable | None = None,
) -> None:
    """Walk the merged stream ``order (N, 2T)`` (see ``kernels.stream_kernel``).

    Sources: rows of ``x (N, T, D)``, minus ``xshift (N, 2, D)`` (a shift in two parts: its
    nearest value in the accumulation dtype and the rest, as ``centred_carry`` gives it), times
    ``weight (N, T)``; ``score (N, 2T)``, each slot's score (``merge``, accumulation dtype), scales
    the second running sum. At each sink ``out`` gets ``c1 P + c2 Px``. ``carry``: the chunks'
    starting sums (computed here when the row has several chunks and it is None; ``centred_carry``
    gives them with the mean). ``segments``: one walk per segment of packed rows (``_walks``; the
    shift and carry per segment).
    """
    order, x, score, xshift, weight, c1, c2 = (
        None if a is None else a.contiguous() for a in (order, x, score, xshift, weight, c1, c2)
    )
    rows, length, dim = x.shape
    walks, entries = _walks(x, order, segments)
    layout = _layout(x, entries, score.dtype, walks)
    block_d, d_blocks, chunk, n_chunks = layout
    dummy = score
    if n_chunks > 1 and carry is None:
        carry, _ = _chunk_carry(_totals(order, x, score, xshift, weight, layout, segments=segments), 0)
    kernels().stream_kernel[(walks, n_chunks, d_blocks)](
        order, x, xshift if xshift is not None else dummy, weight if weight is not None else dummy, score,
        c1, c2, out, carry if carry is not None else dummy, table_or(segments, order),
        rows, length, dim, order.shape[1], chunk, n_chunks,
        HAS_XSHIFT=xshift is not None, HAS_W=weight is not None, HAS_CARRY=carry is not None,
        HAS_SEGMENTS=segments is not None, BLOCK=TUNING.block, BD=block_d, num_warps=TUNING.num_warps,
    )  # fmt: skip


def relu_backward(order, v, vbar, weight, score, g, a_scale, c4, count, kcarry, bad, segments=None):
    """Sliced ReLU's backward walk (``kernels.relu_backward_kernel``) over the forward's ``order``:
    returns dv ``(N, T, D)`` and the dots ``(3, N, T)``: g·P and g·P_t at the queries, (v - vbar)·Q
    at the keys. ``score (N, 2T)``: each slot's score (``merge``). One pass over g first
    (``stream_totals_kernel``) sums the queries ``a g`` and ``s a g`` per chunk (the walk starts
    each chunk at minus the sum above it) and ``Σ c4 a g``, the mean of dL/dw times ``count``
    (``c4``: R, ``a``: the scale). ``kcarry``: the forward's ``centred_carry`` (the key sums);
    ``bad (N,)``: the rows whose dv is NaN at the real keys. ``segments``: one walk per segment of
    packed rows (``_walks``: ``vbar``, ``count``, ``kcarry``, ``bad`` per segment)."""
    order, v, vbar, weight, score, g, a_scale, c4 = (
        None if x is None else x.contiguous() for x in (order, v, vbar, weight, score, g, a_scale, c4)
    )
    rows, length, dim = v.shape
    walks, entries = _walks(v, order, segments)
    layout = _layout(v, entries, score.dtype, walks)
    block_d, d_blocks, chunk, n_chunks = layout
    totals = _totals(order, g, score, None, a_scale, layout, sinks_as_sources=True, c4=c4, segments=segments)
    qcarry, mean = _chunk_carry(totals, 2, count)  # minus the sums above each chunk; dL/dw's mean
    dots = torch.empty(d_blocks, 3, rows, length, dtype=score.dtype, device=v.device)
    grad_v = torch.empty_like(v)
    kernels().relu_backward_kernel[(walks, n_chunks, d_blocks)](
        order, v, vbar, weight if weight is not None else score, score, g, a_scale, mean,
        grad_v, dots, kcarry if kcarry is not None else score, qcarry, bad,
        table_or(segments, order), rows, length, dim, order.shape[1], chunk, n_chunks,
        HAS_W=weight is not None, HAS_KCARRY=kcarry is not None, HAS_SEGMENTS=segments is not None,
        BLOCK=TUNING.block, BD=block_d, num_warps=TUNING.num_warps, maxnreg=TUNING.backward_max_registers,
    )  # fmt: skip
    return grad_v, dots.sum(dim=0) if d_blocks > 1 else dots[0]


def _chunk_carry(totals, mode, count=None, scalars=None, pivot=None):
    """``kernels.chunk_carry_kernel`` in ``mode`` over the chunks' totals ``(rows, chunks, planes,
    D)``: each chunk's starting sums ``(rows, chunks, 4, D)`` (the accumulation dtype's nearest
    values of float64 sums, then their remainders, so the kernels start exact) and, in modes 1
    and 2, the mean: ``(rows, 2, D)`` in mode 1 (the value shift: nearest value and remainder;
    the totals are of ``x - pivot[:, 0]``), ``(rows, D)`` in mode 2 (None in mode 0)."""
    rows, chunks, planes, dim = totals.shape
    carry = torch.empty(rows, chunks, 4, dim, dtype=totals.dtype, device=totals.device)
    shape = (rows, 2, dim) if mode == 1 else (rows, dim)  # mode 1: the value shift in two parts
    mean = torch.empty(shape, dtype=totals.dtype, device=totals.device) if mode else None
    block_d = _block_d(dim)
    kernels().chunk_carry_kernel[(rows, -(-dim // block_d))](
        totals, scalars if scalars is not None else totals, count if count is not None else totals,
        pivot if pivot is not None else totals, carry, mean if mean is not None else totals,
        chunks, dim, planes, MODE=mode, BD=block_d,
    )  # fmt: skip
    return carry, mean


def merge(sink_sorted, sink_order, src_sorted, src_order, sinks_first: bool, finite: bool = False):
    """The merged ascending order of sinks and sources of one row, and each sink's source count.

    ``*_sorted`` are ascending ``(N, T)`` values, ``*_order`` their original indices. On ties,
    ``sinks_first`` puts a sink before equal sources (it counts ``#{src < x}``, ``searchsorted``
    side left), else after them (``#{src <= x}``, side right). Returns ``order (N, 2T)`` int32
    (sink ``i`` as ``i``, source ``j`` as ``T + j``), the counts ``(N, T)`` by original sink index
    and each slot's score ``(N, 2T)`` (+inf as 0: the walks read the scores by slot).

    The positions form a permutation only if both lists are ordered by one total order: NaN
    (which ``torch.sort`` puts last but compares false with everything) is read as +inf, last
    too, so that ``searchsorted`` agrees with the sort. The callers never pass NaN
    (``finite_rows``); this keeps the merge sound if one ever does (``finite=True``: the caller
    vouches that there is none, and the pass is skipped). ``order`` starts at -1, which the
    kernels skip: no slot can hold an index that was never written.
    """
    rows, length = sink_sorted.shape
    if not finite:
        sink_sorted, src_sorted = (torch.nan_to_num(x, nan=float("inf")) for x in (sink_sorted, src_sorted))
    device = sink_sorted.device
    if device.type == "cuda" or interpret_mode():  # the slots and counts in one kernel
        before_sink, before_src = (
            torch.searchsorted(a, b, side=side, out_int32=True)
            for a, b, side in _merge_sides(sink_sorted, src_sorted, sinks_first)
        )
        return place(before_sink, sink_order, sink_sorted, before_src, src_order, src_sorted)
    order = torch.full((rows, 2 * length), -1, dtype=torch.int32, device=device)
    slot_score = torch.empty(rows, 2 * length, dtype=sink_sorted.dtype, device=device)  # every slot written
    before_sink, before_src = (
        torch.searchsorted(a, b, side=side)
        for a, b, side in _merge_sides(sink_sorted, src_sorted, sinks_first)
    )
    arange = torch.arange(length, device=device)
    order.scatter_(1, arange + before_sink, sink_order.to(torch.int32))
    order.scatter_(1, arange + before_src, (src_order + length).to(torch.int32))
    slot_score.scatter_(1, arange + before_sink, sink_sorted.nan_to_num(posinf=0.0))
    slot_score.scatter_(1, arange + before_src, src_sorted.nan_to_num(posinf=0.0))
    counts = torch.empty_like(before_sink).scatter_(1, sink_order, before_sink)
    return order, counts, slot_score


def place(before_sink, sink_order, sink_sorted, before_src, src_order, src_sorted):
    """``merge_kernel``: the merged order of the sorted sinks and sources ``(N, 2T)`` int32 from
    each one's count of the other kind before it, each sink's source count ``(N, T)`` by original
    index, and each slot's score ``(N, 2T)`` (see ``merge``)."""
    rows, length = sink_sorted.shape
    device = sink_sorted.device
    order = torch.full((rows, 2 * length), -1, dtype=torch.int32, device=device)
    slot_score = torch.empty(rows, 2 * length, dtype=sink_sorted.dtype, device=device)  # every slot written
    counts = torch.empty(rows, length, dtype=torch.int64, device=device)
    block = scalar_block(length)
    kernels().merge_kernel[(rows, -(-length // block))](
        before_sink, sink_order, sink_sorted, before_src, src_order, src_sorted,
        order, counts, slot_score, length, BLOCK=block,
    )  # fmt: skip
    return order, counts, slot_score


def _merge_sides(sink_sorted, src_sorted, sinks_first):
    """``(sorted, values, side)`` of merge's two ``searchsorted`` calls: sinks among the sources,
    sources among the sinks, ties on the side ``sinks_first`` says."""
    return (
        (src_sorted, sink_sorted, "left" if sinks_first else "right"),
        (sink_sorted, src_sorted, "right" if sinks_first else "left"),
    )


def _relu_scalars(s, rank, rank_le, t_sorted, count, eps, queries, bad):
    """``kernels.relu_scalars_kernel``: ``(c1, scale, dden, balance, R)``, each ``(N, T)``; c1 NaN
    at the kept queries of the ``bad`` rows."""
    rows, length = s.shape
    outs = [torch.empty_like(s) for _ in range(5)]
    block = scalar_block(length)
    eps = torch.full((1,), eps, dtype=s.dtype, device=s.device)
    kernels().relu_scalars_kernel[(rows, -(-length // block))](
        s, rank, rank_le, exclusive_cumsum(t_sorted), count, eps, queries if queries is not None else s,
        bad, *outs, length, HAS_QUERIES=queries is not None, BLOCK=block,
    )  # fmt: skip
    return outs


# --------------------------------------------------------------------------------------------
# Sliced ReLU
# --------------------------------------------------------------------------------------------


class SlicedReLUTriton(torch.autograd.Function):
    """Rows ``s, t (N, T)`` in the accumulation dtype, ``v (N, T, D)`` in its own; ``valid`` (real keys)
    and ``queries`` (the queries whose output is kept) or None, as in the torch op."""

    @staticmethod
    def forward(ctx, s, t, v, valid, queries, eps):
        with no_autocast(v.device):
            acc = s.dtype
            count, s, t, bad, (t_search, t_sorted, k_order), (s_sorted, q_order) = sort_scores(
                s, t, v, valid, queries
            )
            order, rank, slot_score = merge(
                s_sorted, q_order, t_search, k_order, sinks_first=True, finite=True
            )
            rank_le = torch.searchsorted(t_search, s, side="right", out_int32=True)  # #{t <= s}
            c1, scale, dden, balance, relu_mass = _relu_scalars(
                s, rank, rank_le, t_sorted, count, eps, queries, bad
            )
            weight = None if valid is None else valid.to(acc)
            # carry: reused by the backward walk; k_order[:, 0]: the row's lowest real key
            vbar, carry = centred_carry(order, v, slot_score, weight, count, k_order[:, 0])
            out = torch.empty_like(v)
            # NaN at the kept queries of the bad rows through c1 (``relu_scalars_kernel``)
            stream(order, v, slot_score, xshift=vbar, weight=weight, c1=c1, c2=-scale, out=out, carry=carry)
            # for the backward pass: each key's #{s < t_j}, #{s <= t_j} among the sorted queries
            q_lt = torch.searchsorted(s_sorted, t, side="left")
            q_le = torch.searchsorted(s_sorted, t, side="right")
        ctx.save_for_backward(
            s, t, v, vbar, scale, dden, count, order, slot_score, balance, relu_mass,
            q_order, q_lt, q_le, carry,
        )  # fmt: skip
        ctx.valid, ctx.queries, ctx.eps, ctx.bad = valid, queries, eps, bad
        return out

    @staticmethod
    @first_order_only("sliced_relu_attention")
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return SlicedReLUTriton._backward(ctx, grad_out.contiguous())

    @staticmethod
    def _backward(ctx, g):
        (s, t, v, vbar, scale, dden, count, order, slot_score, balance, relu_mass,
         q_order, q_lt, q_le, carry) = ctx.saved_tensors  # fmt: skip
        valid, queries = ctx.valid, ctx.queries
        weight = None if valid is None else valid.to(s.dtype)

        # One walk (``relu_backward``): at the queries g·P_w and g·P_tw, hence g·o and dL/ds; at
        # the keys dL/dv_j = Σ_{s_i>t_j} (s_i - t_j) a_i g_i minus its mean over the real keys
        # (Σ_i a_i R_i g_i / n) and w_j · Σ_{s_i>t_j} a_i g_i (w_j = v_j - vbar), for dL/dt.
        grad_v, dots = relu_backward(
            order, v, vbar, weight, slot_score, g, scale, relu_mass, count, carry, ctx.bad
        )
        # dL/ds at the queries and dL/dden_i in the queries' sorted order, then
        # dL/dt_j = Σ_{s_i<t_j} dL/dden_i - Σ_{s_i>t_j} dL/dden_i - w_j · Σ_{s_i>t_j} a_i g_i
        rows, length = s.shape
        block = scalar_block(length)
        grid = (rows, -(-length // block))
        grad_s, den_sorted, grad_t = (torch.empty_like(s) for _ in range(3))
        kernels().relu_query_grads_kernel[grid](
            q_order, dots, dden, s, scale, balance, queries if queries is not None else s, ctx.bad,
            grad_s, den_sorted, rows, length, HAS_QUERIES=queries is not None, BLOCK=block,
        )  # fmt: skip
        kernels().relu_key_grads_kernel[grid](
            exclusive_cumsum(den_sorted), q_lt, q_le, dots, valid if valid is not None else s, ctx.bad,
            grad_t, rows, length, HAS_VALID=valid is not None, BLOCK=block,
        )  # fmt: skip
        return grad_s, grad_t, grad_v, None, None, None  # NaN rows from the kernels


# --------------------------------------------------------------------------------------------
# Entry points (inputs already checked by the public ops)
# --------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    x = x.reshape(-1, *x.shape[2:])
    return (x if dtype is None else x.to(dtype)).contiguous()


def sliced_relu(s, t, v, valid, queries, eps, acc):
    batch, heads, length, dim = v.shape
    out = SlicedReLUTriton.apply(_rows(s, acc), _rows(t, acc), _rows(v), valid, queries, float(eps))
    return out.view(batch, heads, length, dim)


__all__ = ["StreamTuning", "TUNING", "merge", "place", "sliced_relu", "stream"]
