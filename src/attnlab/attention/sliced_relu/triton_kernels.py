"""Sliced ReLU's Triton kernels, executed into the module of ``attnlab.attention.common.triton.kernels``
by ``runtime.kernels()`` (never imported directly; they use its ``_add``, ``_two_sum`` and
``_program_block``).

``stream_kernel`` / ``stream_totals_kernel``: one *merged stream* per row, the core of sliced
ReLU. A row's ``order`` (length L = 2T) lists entries in ascending score order: ``e >= T`` is a
*source* (row ``e - T`` of X, weighted), ``e < T`` a *sink* (position ``e``). Walking the stream
with running sums of the source rows ``P = Σ w (x - shift)`` and ``Px = Σ u w (x - shift)`` gives,
at each sink, the prefix sums over exactly the sources sorted before it: what the torch op gets
by building (T+1)×D prefix tables and gathering them at ``searchsorted`` ranks, here without any
table in memory. At a sink the kernel writes ``c1 P + c2 Px``. Rows are split into chunks scanned
in parallel: ``stream_totals_kernel`` sums each chunk's sources, and each chunk starts from the
carried total.
``relu_backward_kernel`` walks sliced ReLU's stream once for its whole backward pass (both kinds
of entry as sources); ``merge_kernel`` builds the streams, ``relu_scalars_kernel`` the per-query
scalars (elementwise, (N, T)), ``chunk_carry_kernel`` each chunk's starting sums from the chunks'
totals, and ``relu_query_grads_kernel`` / ``relu_key_grads_kernel`` dL/ds and dL/dt from the
backward walk's dot products.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Only triton's builtins are used, plus the jit functions of this file: triton.language's own jit
# helpers (tl.sum, tl.cumsum, tl.cdiv, tl.zeros) are decorated when triton is first imported, for
# the mode then in force, and would break the interpreter if triton was imported without it.
# Sums go through tl.reduce / tl.associative_scan with triton's own sum combiner, which the
# interpreter recognises by identity and runs as one numpy call (any other combiner is called
# element by element in Python: minutes instead of seconds).


_add = globals()["_add"]  # from common/triton/kernels.py, executed into the same module first
_two_sum = globals()["_two_sum"]
_program_block = globals()["_program_block"]
_packed_segment = globals()["_packed_segment"]


@triton.jit
def _shift(shift_ptr, row, d, dmask, D, acc_dtype, HAS_SHIFT: tl.constexpr):
    """A row's value shift ``(N, 2, D)`` as two parts, the nearest value in the accumulation dtype
    and the rest (``chunk_carry_kernel`` writes them): values far from 0 (a common offset of 1e4)
    lose their last digits to a shift rounded once, and ``(x - high) - low`` keeps them. Zeros
    without ``HAS_SHIFT``."""
    high = tl.full(d.shape, 0.0, acc_dtype)
    low = tl.full(d.shape, 0.0, acc_dtype)
    if HAS_SHIFT:
        high = tl.load(shift_ptr + (row * 2) * D + d, mask=dmask, other=0.0).to(acc_dtype)
        low = tl.load(shift_ptr + (row * 2 + 1) * D + d, mask=dmask, other=0.0).to(acc_dtype)
    return high, low


@triton.jit
def _weighted_rows(
    x_ptr, xshift, xlow, w_ptr, u_ptr, row, j, p, is_src, d, dmask, T, L, D, acc_dtype,
    HAS_XSHIFT: tl.constexpr, HAS_W: tl.constexpr,
):  # fmt: skip
    """Source rows ``w_j (x_j - shift)`` and ``u_j w_j (x_j - shift)`` (zero rows off the sources),
    and the weights ``w_j`` and ``u_j w_j``; the shift in two parts (``_shift``), ``u`` the scores
    by slot of the stream (``merge_kernel``: read in order, not gathered). A row of weight 0 (a
    padded key) is never read: whatever it holds, NaN included, reaches no sum."""
    if HAS_W:
        weight = tl.load(w_ptr + row * T + j, mask=is_src, other=0.0).to(acc_dtype)
    else:
        weight = tl.full(j.shape, 1.0, acc_dtype)
    weight = tl.where(is_src, weight, 0.0)
    used = weight != 0
    rows = tl.load(
        x_ptr + (row * T + j)[:, None] * D + d[None, :],
        mask=used[:, None] & dmask[None, :],
        other=0.0,
    ).to(acc_dtype)
    if HAS_XSHIFT:
        rows = tl.where(used[:, None], (rows - xshift[None, :]) - xlow[None, :], 0.0)
    rows = rows * weight[:, None]
    score = tl.load(u_ptr + row * L + p, mask=is_src, other=0.0).to(acc_dtype)
    return rows, rows * score[:, None], weight, weight * score


@triton.jit
def _merged_entries(order_ptr, row, L, T, first, stop, BLOCK: tl.constexpr):
    """One block of a row's merged order from ``first``: which entries are sources (``T + j``) and
    which sinks (``i``), their indices (0 where they are not) and their slots ``p``. -1, an
    unwritten slot, and the positions past ``stop`` are neither: skipped."""
    p = first + tl.arange(0, BLOCK)
    pmask = p < stop
    e = tl.load(order_ptr + row * L + p, mask=pmask, other=-1)
    is_src = pmask & (e >= T) & (e < 2 * T)
    is_sink = pmask & (e >= 0) & (e < T)
    return is_src, is_sink, tl.where(is_src, e - T, 0), tl.where(is_sink, e, 0), p


@triton.jit
def _carried(
    carry_ptr, row, chunk, NCHUNK, d, dmask, D, acc_dtype, BD: tl.constexpr, HAS_CARRY: tl.constexpr
):
    """A chunk's starting sums and their compensations from a ``(rows, chunks, 4, D)`` carry; zeros
    without one (``HAS_CARRY`` False: the walk starts at the row's beginning)."""
    run_a = tl.full([BD], 0.0, acc_dtype)
    run_b = tl.full([BD], 0.0, acc_dtype)
    err_a = tl.full([BD], 0.0, acc_dtype)
    err_b = tl.full([BD], 0.0, acc_dtype)
    if HAS_CARRY:
        base = carry_ptr + ((row * NCHUNK + chunk) * 4) * D + d
        run_a = tl.load(base, mask=dmask, other=0.0).to(acc_dtype)
        run_b = tl.load(base + D, mask=dmask, other=0.0).to(acc_dtype)
        err_a = tl.load(base + 2 * D, mask=dmask, other=0.0).to(acc_dtype)
        err_b = tl.load(base + 3 * D, mask=dmask, other=0.0).to(acc_dtype)
    return run_a, run_b, err_a, err_b


@triton.jit
def _stream_range(seg_ptr, prog, T, HAS_SEGMENTS: tl.constexpr):
    """The row of the merged stream a program walks and its slots ``[begin, end)``: the whole row,
    or a segment of a packed row (``_packed_segment``), whose keys and queries hold slots
    ``2·start .. 2·(start + size)`` of the row's stream: its walk restarts there."""
    row, start, size = _packed_segment(seg_ptr, prog, T, HAS_SEGMENTS)
    return row, 2 * start, 2 * (start + size)


@triton.jit
def stream_totals_kernel(
    order_ptr, x_ptr, xshift_ptr, w_ptr, u_ptr, c4_ptr, totals_ptr, scalars_ptr, seg_ptr,
    T, D, L, CHUNK, NCHUNK,
    HAS_XSHIFT: tl.constexpr, HAS_W: tl.constexpr, SINKS_AS_SOURCES: tl.constexpr, HAS_C4: tl.constexpr,
    SCALARS: tl.constexpr, HAS_SEGMENTS: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """``totals[row, chunk, 0/1, :]``: the chunk's sums of the source rows and score-weighted rows,
    ``totals[row, chunk, 2/3, :]`` their compensations (the rounding errors of the block adds).

    ``SINKS_AS_SOURCES``: the entries ``e < T`` are the sources (sliced ReLU's backward walk sums the
    queries of the forward's stream). ``HAS_C4``: also ``totals[row, chunk, 4, :] = Σ c4_e w_e (x_e - shift)``
    over the chunk's sources (a plain reduction riding on the same read). ``SCALARS``:
    ``scalars[row, chunk, :] = Σ w, Σ u w`` and their compensations (one column of ones as source:
    what a caller needs to shift the sums afterwards, ``Σ w (x - c) = Σ w x - c Σ w``).
    """
    prog, chunk, dblk, d, dmask = _program_block(D, BD)
    row, begin, end = _stream_range(seg_ptr, prog, T, HAS_SEGMENTS)
    acc_dtype = u_ptr.dtype.element_ty
    xshift, xlow = _shift(xshift_ptr, prog, d, dmask, D, acc_dtype, HAS_XSHIFT)
    sum_w = tl.full([BD], 0.0, acc_dtype)
    sum_x = tl.full([BD], 0.0, acc_dtype)
    err_w = tl.full([BD], 0.0, acc_dtype)
    err_x = tl.full([BD], 0.0, acc_dtype)
    sum_c4 = tl.full([BD], 0.0, acc_dtype)
    one = tl.arange(0, 1)
    count = tl.full([1], 0.0, acc_dtype)
    count_u = tl.full([1], 0.0, acc_dtype)
    err_count = tl.full([1], 0.0, acc_dtype)
    err_count_u = tl.full([1], 0.0, acc_dtype)
    start = begin + chunk * CHUNK
    stop = tl.minimum(start + CHUNK, end)
    for it in range(0, (stop - start + BLOCK - 1) // BLOCK):
        p = start + it * BLOCK + tl.arange(0, BLOCK)
        pmask = p < stop
        e = tl.load(order_ptr + row * L + p, mask=pmask, other=-1)
        if SINKS_AS_SOURCES:
            is_src = pmask & (e >= 0) & (e < T)
            j = tl.where(is_src, e, 0)
        else:
            is_src = pmask & (e >= T) & (e < 2 * T)  # never an index outside the row, written or not
            j = tl.where(is_src, e - T, 0)
        rows, scored, weight, weight_u = _weighted_rows(
            x_ptr, xshift, xlow, w_ptr, u_ptr, row, j, p, is_src, d, dmask, T, L, D, acc_dtype,
            HAS_XSHIFT, HAS_W,
        )  # fmt: skip
        sum_w, err_w = _two_sum(sum_w, err_w, tl.reduce(rows, 0, _add))
        sum_x, err_x = _two_sum(sum_x, err_x, tl.reduce(scored, 0, _add))
        if HAS_C4:
            c4 = tl.load(c4_ptr + row * T + j, mask=is_src, other=0.0).to(acc_dtype)
            sum_c4 += tl.reduce(rows * c4[:, None], 0, _add)
        if SCALARS:
            count, err_count = _two_sum(count, err_count, tl.reduce(weight, 0, _add))
            count_u, err_count_u = _two_sum(count_u, err_count_u, tl.reduce(weight_u, 0, _add))
    if SCALARS:  # noqa: SIM102 - a constexpr, then a runtime test: two statements for triton
        if dblk == 0:
            at = scalars_ptr + (prog * NCHUNK + chunk) * 4 + one
            tl.store(at, count)
            tl.store(at + 1, count_u)
            tl.store(at + 2, err_count)
            tl.store(at + 3, err_count_u)
    planes = 5 if HAS_C4 else 4
    base = totals_ptr + ((prog * NCHUNK + chunk) * planes) * D + d
    tl.store(base, sum_w, mask=dmask)
    tl.store(base + D, sum_x, mask=dmask)
    tl.store(base + 2 * D, err_w, mask=dmask)
    tl.store(base + 3 * D, err_x, mask=dmask)
    if HAS_C4:
        tl.store(base + 4 * D, sum_c4, mask=dmask)


@triton.jit
def stream_kernel(
    order_ptr, x_ptr, xshift_ptr, w_ptr, u_ptr, c1_ptr, c2_ptr, out_ptr, carry_ptr, seg_ptr,
    N, T, D, L, CHUNK, NCHUNK,
    HAS_XSHIFT: tl.constexpr, HAS_W: tl.constexpr, HAS_CARRY: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    BLOCK: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """One chunk of one row's stream, one block of D columns (grid: rows, chunks, D blocks).

    At every sink i (with P, Px the sums over the sources before it): ``out[i] = c1 P + c2 Px``.
    Sums run in the accumulation dtype, ``u``'s, with compensated carries.
    """
    prog, chunk, dblk, d, dmask = _program_block(D, BD)
    row, begin, end = _stream_range(seg_ptr, prog, T, HAS_SEGMENTS)
    acc_dtype = u_ptr.dtype.element_ty
    # running sums of the sources so far, each with its compensation (the rounding errors of the
    # big adds, TwoSum): the carry stays exact to about eps² of its size however long the row
    run_w, run_x, err_w, err_x = _carried(
        carry_ptr, prog, chunk, NCHUNK, d, dmask, D, acc_dtype, BD, HAS_CARRY
    )
    xshift, xlow = _shift(xshift_ptr, prog, d, dmask, D, acc_dtype, HAS_XSHIFT)
    start = begin + chunk * CHUNK
    stop = tl.minimum(start + CHUNK, end)
    for it in range(0, (stop - start + BLOCK - 1) // BLOCK):
        is_src, is_sink, j, i, p = _merged_entries(order_ptr, row, L, T, start + it * BLOCK, stop, BLOCK)
        rows, scored, _, _ = _weighted_rows(
            x_ptr, xshift, xlow, w_ptr, u_ptr, row, j, p, is_src, d, dmask, T, L, D, acc_dtype,
            HAS_XSHIFT, HAS_W,
        )  # fmt: skip
        # inclusive sums; a sink's own row is zero, so at a sink they are the sums strictly before it.
        # The small parts (the block's scan, the compensation) are added first: one rounding at
        # the size of the running sum, as when a float64 prefix table is rounded to float32.
        pre_w = (tl.associative_scan(rows, 0, _add) + err_w[None, :]) + run_w[None, :]
        pre_x = (tl.associative_scan(scored, 0, _add) + err_x[None, :]) + run_x[None, :]
        run_w, err_w = _two_sum(run_w, err_w, tl.reduce(rows, 0, _add))
        run_x, err_x = _two_sum(run_x, err_x, tl.reduce(scored, 0, _add))
        sink2 = is_sink[:, None] & dmask[None, :]
        c1 = tl.load(c1_ptr + row * T + i, mask=is_sink, other=0.0).to(acc_dtype)
        c2 = tl.load(c2_ptr + row * T + i, mask=is_sink, other=0.0).to(acc_dtype)
        value = c1[:, None] * pre_w + c2[:, None] * pre_x
        at = (row * T + i)[:, None] * D + d[None, :]
        tl.store(out_ptr + at, value.to(out_ptr.dtype.element_ty), mask=sink2)


@triton.jit
def relu_backward_kernel(
    order_ptr, v_ptr, vbar_ptr, w_ptr, u_ptr, g_ptr, a_ptr, mean_ptr,
    dv_ptr, dots_ptr, kcarry_ptr, qcarry_ptr, bad_ptr, seg_ptr,
    N, T, D, L, CHUNK, NCHUNK,
    HAS_W: tl.constexpr, HAS_KCARRY: tl.constexpr, HAS_SEGMENTS: tl.constexpr, BLOCK: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    """Sliced ReLU's backward pass in one walk of the forward's stream (grid: rows, chunks, D blocks).

    Two running sums in one ascending walk: of the keys ``w_j (v_j - vbar)`` (and times ``t_j``), which
    each query reads as the sums below it, as in the forward; and of the queries ``a_i g_i`` (and
    times ``s_i``), started at minus the queries' total above the chunk (``qcarry``), so that at a
    key it is minus the sum over the queries *above* it (``s_i > t_j``: the stream puts a query
    before equal keys). So each position is read once, v at keys and g at queries, and dv written
    once. Writes, per D block (the caller sums the blocks):
    ``dots[dblk, 0/1, row, i] = g_i · P, g_i · P_t`` at each query (P, P_t: the key sums below);
    ``dots[dblk, 2, row, j] = (v_j - vbar) · Q`` at each key (Q, Q_s: the query sums above);
    ``dv_j = w_j (Q_s - t_j Q - mean)`` (``mean``: the mean over the real keys of dL/dw, the
    backward's ``Σ_i a_i R_i g_i / n`` from ``stream_totals_kernel``'s ``c4`` plane); NaN at the
    real keys of a ``bad`` row (a non-finite score), written here rather than filled in afterwards.
    """
    prog, chunk, dblk, d, dmask = _program_block(D, BD)
    row, begin, end = _stream_range(seg_ptr, prog, T, HAS_SEGMENTS)
    acc_dtype = u_ptr.dtype.element_ty
    run_k, run_kt, err_k, err_kt = _carried(
        kcarry_ptr, prog, chunk, NCHUNK, d, dmask, D, acc_dtype, BD, HAS_KCARRY
    )
    run_q, run_qs, err_q, err_qs = _carried(qcarry_ptr, prog, chunk, NCHUNK, d, dmask, D, acc_dtype, BD, True)
    vbar, vbar_low = _shift(vbar_ptr, prog, d, dmask, D, acc_dtype, True)
    mean = tl.load(mean_ptr + prog * D + d, mask=dmask, other=0.0).to(acc_dtype)
    bad = tl.load(bad_ptr + prog) != 0
    plane = N.to(tl.int64) * T  # one (N, T) plane of ``dots``: its third starts past 2³¹ at B·H·T ≥ 2³⁰
    start = begin + chunk * CHUNK
    stop = tl.minimum(start + CHUNK, end)
    for it in range(0, (stop - start + BLOCK - 1) // BLOCK):
        is_key, is_query, j, i, p = _merged_entries(order_ptr, row, L, T, start + it * BLOCK, stop, BLOCK)
        u = tl.load(u_ptr + row * L + p, mask=is_key | is_query, other=0.0).to(acc_dtype)  # by slot
        if HAS_W:
            w = tl.load(w_ptr + row * T + j, mask=is_key, other=0.0).to(acc_dtype)
        else:
            w = tl.where(is_key, 1.0, 0.0)
        key2 = is_key[:, None] & dmask[None, :]
        query2 = is_query[:, None] & dmask[None, :]
        used = (w != 0)[:, None] & dmask[None, :]  # a padded key's row is never read (NaN or not)
        v = tl.load(v_ptr + (row * T + j)[:, None] * D + d[None, :], mask=used, other=0.0).to(acc_dtype)
        centred = tl.where(used, (v - vbar[None, :]) - vbar_low[None, :], 0.0)
        t = tl.where(is_key, u, 0.0)
        keys = centred * w[:, None]
        keys_t = keys * t[:, None]
        g = tl.load(g_ptr + (row * T + i)[:, None] * D + d[None, :], mask=query2, other=0.0).to(acc_dtype)
        a = tl.load(a_ptr + row * T + i, mask=is_query, other=0.0).to(acc_dtype)
        s = tl.where(is_query, u, 0.0)
        queries = g * a[:, None]
        queries_s = queries * s[:, None]
        # inclusive sums; a position's own row is zero in the other kind's sums (as in stream_kernel)
        pre_k = (tl.associative_scan(keys, 0, _add) + err_k[None, :]) + run_k[None, :]
        pre_kt = (tl.associative_scan(keys_t, 0, _add) + err_kt[None, :]) + run_kt[None, :]
        pre_q = (tl.associative_scan(queries, 0, _add) + err_q[None, :]) + run_q[None, :]
        pre_qs = (tl.associative_scan(queries_s, 0, _add) + err_qs[None, :]) + run_qs[None, :]
        run_k, err_k = _two_sum(run_k, err_k, tl.reduce(keys, 0, _add))
        run_kt, err_kt = _two_sum(run_kt, err_kt, tl.reduce(keys_t, 0, _add))
        run_q, err_q = _two_sum(run_q, err_q, tl.reduce(queries, 0, _add))
        run_qs, err_qs = _two_sum(run_qs, err_qs, tl.reduce(queries_s, 0, _add))
        at = dots_ptr + (dblk * 3) * plane + row * T
        tl.store(at + i, tl.reduce(g * pre_k, 1, _add), mask=is_query)
        tl.store(at + plane + i, tl.reduce(g * pre_kt, 1, _add), mask=is_query)
        # at a key, -pre_q and -pre_qs are the sums over the queries above it
        tl.store(at + 2 * plane + j, -tl.reduce(centred * pre_q, 1, _add), mask=is_key)
        grad = w[:, None] * ((t[:, None] * pre_q - pre_qs) - mean[None, :])
        grad = tl.where((bad & (w != 0))[:, None], float("nan"), grad)
        tl.store(
            dv_ptr + (row * T + j)[:, None] * D + d[None, :], grad.to(dv_ptr.dtype.element_ty), mask=key2
        )


@triton.jit
def merge_kernel(
    sink_before_ptr, sink_order_ptr, sink_sorted_ptr, src_before_ptr, src_order_ptr, src_sorted_ptr,
    order_ptr, counts_ptr, slot_score_ptr, T,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One merged stream per row from two sorted lists (grid: rows, blocks of T), and each sink's
    source count: the k-th sorted sink goes to slot ``k + sink_before[k]`` as entry ``sink_order[k]``,
    the k-th sorted source to ``k + src_before[k]`` as ``T + src_order[k]``;
    ``counts[sink_order[k]] = sink_before[k]`` (see ``sliced.merge``). Each slot's score goes to
    ``slot_score`` (+inf, what a padded key or dropped query sorts as, written as 0: its score),
    so that the walks read the scores in stream order instead of gathering 4-byte numbers."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = k < T
    before = tl.load(sink_before_ptr + row * T + k, mask=m, other=0)
    sink = tl.load(sink_order_ptr + row * T + k, mask=m, other=0)
    tl.store(order_ptr + row * 2 * T + k + before, sink.to(tl.int32), mask=m)
    tl.store(counts_ptr + row * T + sink, before.to(counts_ptr.dtype.element_ty), mask=m)
    score = tl.load(sink_sorted_ptr + row * T + k, mask=m, other=0.0)
    tl.store(slot_score_ptr + row * 2 * T + k + before, tl.where(score < float("inf"), score, 0.0), mask=m)
    before = tl.load(src_before_ptr + row * T + k, mask=m, other=0)
    src = tl.load(src_order_ptr + row * T + k, mask=m, other=0)
    tl.store(order_ptr + row * 2 * T + k + before, (src + T).to(tl.int32), mask=m)
    score = tl.load(src_sorted_ptr + row * T + k, mask=m, other=0.0)
    tl.store(slot_score_ptr + row * 2 * T + k + before, tl.where(score < float("inf"), score, 0.0), mask=m)


@triton.jit
def relu_scalars_kernel(
    s_ptr, rank_ptr, rank_le_ptr, p_t_ptr, count_ptr, eps_ptr, queries_ptr, bad_ptr,
    c1_ptr, scale_ptr, dden_ptr, balance_ptr, mass_ptr,
    T, HAS_QUERIES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Sliced ReLU's per-query scalars in one pass (grid: rows, blocks of queries), from the ranks
    ``r_i = #{t < s_i}``, ``#{t <= s_i}`` and the exclusive prefix sums ``p_t`` of the sorted keys:
    ``den_i = Σ_j |s_i - t_j| = s_i (2 r_i - n) + Σ t - 2 Σ_{t_j<s_i} t_j``, the scale
    ``a_i = 2 / max(den_i, eps)`` (0 off ``queries``), ``c1 = a s`` (the forward stream's ``c2`` is
    ``-a``); for the backward ``dden_i = da_i/dden_i = -a_i² / 2`` (0 where the clamp holds),
    ``#{t < s} - #{t > s}`` and ``R_i = Σ_{t_j<s_i} (s_i - t_j)``. ``c1`` is NaN at the kept
    queries of a ``bad`` row (a non-finite score): the stream then writes their NaN outputs itself,
    where a masked fill afterwards would read and write the whole output again."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < T
    at = row * T + i
    s = tl.load(s_ptr + at, mask=m, other=0.0)
    rank = tl.load(rank_ptr + at, mask=m, other=0)
    rank_le = tl.load(rank_le_ptr + at, mask=m, other=0)
    below = tl.load(p_t_ptr + row * (T + 1) + rank, mask=m, other=0.0)
    total = tl.load(p_t_ptr + row * (T + 1) + T)
    n = tl.load(count_ptr + row)
    eps = tl.load(eps_ptr)
    r = rank.to(s.dtype)
    den = s * (2 * r - n) + total - 2 * below
    scale = 2.0 / tl.maximum(den, eps)
    kept = m
    if HAS_QUERIES:
        kept = tl.load(queries_ptr + at, mask=m, other=0) != 0
        scale = tl.where(kept, scale, 0.0)
    poisoned = kept & (tl.load(bad_ptr + row) != 0)
    tl.store(c1_ptr + at, tl.where(poisoned, float("nan"), scale * s), mask=m)
    tl.store(scale_ptr + at, scale, mask=m)
    tl.store(dden_ptr + at, tl.where(den >= eps, -0.5 * scale * scale, 0.0), mask=m)
    tl.store(balance_ptr + at, (rank + rank_le).to(s.dtype) - n, mask=m)
    tl.store(mass_ptr + at, s * r - below, mask=m)


@triton.jit
def _chunk_sums64(totals_ptr, row, c, C, PLANES, d, dm, D):
    """A chunk's two sums in float64: each plane (0, 1) plus its compensation (2, 3)."""
    base = totals_ptr + ((row * C + c) * PLANES) * D + d
    a = tl.load(base, mask=dm, other=0.0).to(tl.float64) + tl.load(base + 2 * D, mask=dm, other=0.0).to(
        tl.float64
    )
    b = tl.load(base + D, mask=dm, other=0.0).to(tl.float64) + tl.load(base + 3 * D, mask=dm, other=0.0).to(
        tl.float64
    )
    return a, b


@triton.jit
def chunk_carry_kernel(
    totals_ptr, scalars_ptr, count_ptr, pivot_ptr, carry_ptr, mean_ptr, C, D, PLANES,
    MODE: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Each chunk's starting sums for a stream walked in ``C`` chunks (grid: rows, D blocks), from
    the chunks' totals ``(rows, C, PLANES, D)`` (``stream_totals_kernel``: planes 0, 1 the sums,
    2, 3 their compensations), summed in float64 and written as ``(rows, C, 4, D)``: each start's
    nearest value in the accumulation dtype, then the remainder, so that each chunk starts exact.

    ``MODE`` 0: the sums over the chunks before (``stream``'s carry). 1: the same over the centred
    sources from the totals of ``x - p`` (``p``: one source's row, plane 0 of ``pivot (rows, 2, D)``:
    the block sums inside a chunk are rounded, and of values near p far less than of x itself),
    ``Σ w (x - vbar) = Σ w (x - p) - (vbar - p) Σ w`` with ``scalars (rows, C, 4)``: ``Σ w``,
    ``Σ w u`` and their compensations, and ``vbar = p + Σ (x - p) / count`` written to ``mean (rows,
    2, D)`` first, in two parts (``_shift``: the very value the walks subtract). 2: minus the sums
    over the chunk and the ones after it (the backward's query sums above), and ``mean`` = plane
    4's total / count (dL/dw's mean).
    """
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    acc = carry_ptr.dtype.element_ty
    count = tl.load(count_ptr + row).to(tl.float64)
    vbar = tl.full([BD], 0.0, tl.float64)  # mode 1: vbar - p
    if MODE != 0:
        total = tl.full([BD], 0.0, tl.float64)
        for c in range(0, C):
            if MODE == 1:
                part, _ = _chunk_sums64(totals_ptr, row, c, C, PLANES, d, dm, D)
            else:
                part = tl.load(totals_ptr + ((row * C + c) * PLANES + 4) * D + d, mask=dm, other=0.0).to(
                    tl.float64
                )
            total += part
        if MODE == 1:  # the value shift, in two parts (``_shift``)
            pivot = tl.load(pivot_ptr + (row * 2) * D + d, mask=dm, other=0.0).to(tl.float64)
            real = count > 0  # a row without a real key: mean 0 (its pivot is a padded key's row)
            mean64 = tl.where(real, pivot + total / count, 0.0)
            mean = mean64.to(acc)
            low = (mean64 - mean.to(tl.float64)).to(acc)
            tl.store(mean_ptr + (row * 2) * D + d, mean, mask=dm)
            tl.store(mean_ptr + (row * 2 + 1) * D + d, low, mask=dm)
            vbar = tl.where(real, (mean.to(tl.float64) + low.to(tl.float64)) - pivot, 0.0)
        else:
            tl.store(mean_ptr + row * D + d, (total / count).to(acc), mask=dm)
    run_a = tl.full([BD], 0.0, tl.float64)
    run_b = tl.full([BD], 0.0, tl.float64)
    for i in range(0, C):
        c = i
        if MODE == 2:
            c = C - 1 - i
        a, b = _chunk_sums64(totals_ptr, row, c, C, PLANES, d, dm, D)
        if MODE == 1:
            mass = scalars_ptr + (row * C + c) * 4
            a -= (tl.load(mass).to(tl.float64) + tl.load(mass + 2).to(tl.float64)) * vbar
            b -= (tl.load(mass + 1).to(tl.float64) + tl.load(mass + 3).to(tl.float64)) * vbar
        if MODE == 2:
            run_a += a
            run_b += b
            start_a = -run_a
            start_b = -run_b
        else:
            start_a = run_a
            start_b = run_b
            run_a += a
            run_b += b
        high_a = start_a.to(acc)
        high_b = start_b.to(acc)
        out = carry_ptr + ((row * C + c) * 4) * D + d
        tl.store(out, high_a, mask=dm)
        tl.store(out + D, high_b, mask=dm)
        tl.store(out + 2 * D, (start_a - high_a.to(tl.float64)).to(acc), mask=dm)
        tl.store(out + 3 * D, (start_b - high_b.to(tl.float64)).to(acc), mask=dm)


@triton.jit
def relu_query_grads_kernel(
    q_order_ptr, dots_ptr, dden_ptr, s_ptr, scale_ptr, balance_ptr, queries_ptr, bad_ptr,
    grad_s_ptr, den_sorted_ptr, N, T, HAS_QUERIES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dL/ds at the queries and dL/dden in their sorted order (grid: rows, blocks of sorted
    positions k, query ``i = q_order[k]``), from the backward walk's ``dots (3, N, T)``: with
    ``o_i = a_i (s_i P - P_t)``, ``dL/dden_i = dden_i (s_i g·P - g·P_t)`` and ``dL/ds_i = a_i g·P
    + dL/dden_i · balance_i``; NaN at the kept queries of a ``bad`` row."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = k < T
    i = tl.load(q_order_ptr + row * T + k, mask=m, other=0)
    at = row * T + i
    plane = N.to(tl.int64) * T
    g_below = tl.load(dots_ptr + at, mask=m, other=0.0)
    g_scored = tl.load(dots_ptr + plane + at, mask=m, other=0.0)
    s = tl.load(s_ptr + at, mask=m, other=0.0)
    grad_den = tl.load(dden_ptr + at, mask=m, other=0.0) * (s * g_below - g_scored)
    grad_s = tl.load(scale_ptr + at, mask=m, other=0.0) * g_below
    grad_s += grad_den * tl.load(balance_ptr + at, mask=m, other=0.0)
    kept = m
    if HAS_QUERIES:
        kept = tl.load(queries_ptr + at, mask=m, other=0) != 0
    grad_s = tl.where(kept & (tl.load(bad_ptr + row) != 0), float("nan"), grad_s)
    tl.store(grad_s_ptr + at, grad_s, mask=m)
    tl.store(den_sorted_ptr + row * T + k, grad_den, mask=m)


@triton.jit
def relu_key_grads_kernel(
    q_den_ptr, q_lt_ptr, q_le_ptr, dots_ptr, valid_ptr, bad_ptr, grad_t_ptr, N, T,
    HAS_VALID: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """dL/dt at the keys (grid: rows, blocks of keys): ``Σ_{s_i<t_j} dL/dden_i - Σ_{s_i>t_j}
    dL/dden_i - (v_j - vbar) · Q_j``, the sums read from ``q_den (N, T + 1)``, the exclusive prefix
    sums of dL/dden over the sorted queries, at the key's ranks ``#{s < t_j}``, ``#{s <= t_j}``;
    0 at padded keys, NaN at the real keys of a ``bad`` row."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < T
    at = row * T + j
    sums = q_den_ptr + row * (T + 1)
    below = tl.load(sums + tl.load(q_lt_ptr + at, mask=m, other=0), mask=m, other=0.0)
    above = tl.load(sums + T) - tl.load(sums + tl.load(q_le_ptr + at, mask=m, other=0), mask=m, other=0.0)
    grad_t = below - above - tl.load(dots_ptr + 2 * N.to(tl.int64) * T + at, mask=m, other=0.0)
    real = m
    if HAS_VALID:
        real = tl.load(valid_ptr + at, mask=m, other=0) != 0
    grad_t = tl.where(real, grad_t, 0.0)
    grad_t = tl.where(real & (tl.load(bad_ptr + row) != 0), float("nan"), grad_t)
    tl.store(grad_t_ptr + at, grad_t, mask=m)
