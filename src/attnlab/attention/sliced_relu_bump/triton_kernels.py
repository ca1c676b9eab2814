"""ReLU-bump's Triton kernels, executed into the module of ``attnlab.attention.common.triton.kernels``
by ``runtime.kernels()`` (they use its ``_add``, ``_max`` and ``_program_block``); the op and the
derivation are in ``triton.py`` beside this file.

The walk (``bump_walk_kernel``) sees *sinks* (a block of ``BS`` consecutive sorted positions
whose results a program keeps in registers) and *sources* (the other side's sorted rows, ``x``,
walked in tiles of ``BK``). A pair's weight comes from the two scores alone: with
``u = sink - source``, the pair is in the window when the key ``t`` lies in ``(s - b, s + b)``,
written as the torch op's ``searchsorted`` ranks decide it (``fl(s - b) < t < fl(s + b)``, ties
``t = s`` included), and then ``W = b - |u|`` (the hat times b), ``M = |u|`` and the sign ``π``
(+1 when the source is below the sink, -1 above, 0 tied). A block walks from its first sink's
lowest window edge to its last sink's highest (``bump_plan_kernel``), summing tiles with
``tl.dot``; a run of sources that holds no sink's edge (its first and last source lie on the same
sides of every sink, ``_same_sides``) has weights linear in the two scores, so its sum comes from
two prefix-table rows (``Σ x`` and ``Σ score · x`` in float64, ``bump_table_kernel``): the walk
jumps over it.
"""

from __future__ import annotations

import triton
import triton.language as tl

_add = globals()["_add"]  # from common/triton/kernels.py, executed into the same module first
_max = globals()["_max"]
_program_block = globals()["_program_block"]
_packed_segment = globals()["_packed_segment"]


@triton.jit
def _bump_weights(sink, src, width, KEY_SINKS: tl.constexpr):
    """``(W, M, π)`` for a (sinks × sources) tile: ``sink (BS,)``, ``src (BK,)`` (NaN where not a
    position: no pair). ``KEY_SINKS``: the sinks are keys, the sources queries."""
    if KEY_SINKS:
        s = src[None, :]
        t = sink[:, None]
    else:
        s = sink[:, None]
        t = src[None, :]
    below = (t > s - width) & (t < s)  # key below the query, inside the window
    above = (t > s) & (t < s + width)
    inside = below | above | (t == s)
    u = tl.abs(sink[:, None] - src[None, :])
    weight = tl.where(inside, width - u, 0.0)
    dist = tl.where(inside, u, 0.0)
    if KEY_SINKS:
        sign = tl.where(above, 1.0, 0.0) - tl.where(below, 1.0, 0.0)
    else:
        sign = tl.where(below, 1.0, 0.0) - tl.where(above, 1.0, 0.0)
    return weight, dist, sign


@triton.jit
def _outer_sum64(acc, w, x, BK: tl.constexpr):
    """``acc + w @ x`` in float64 as BK rank-1 updates: dL/db's sums cancel, so a float32 ``tl.dot``
    loses digits inside the tile (float32 products are exact in float64). A float64 ``tl.dot``
    (f64 ``mma.sync``) does not build in Triton 3.6 beside the kernel's bf16 or tf32 dot, and alone
    spills 1,200 B a thread on sm_80 (``tests/triton_builds.py`` builds these)."""
    w = w.to(tl.float64)
    x = x.to(tl.float64)
    k = tl.arange(0, BK)
    for c in tl.static_range(BK):
        column = tl.reduce(tl.where(k[None, :] == c, w, 0.0), 1, _add)  # exact: one term, zeros
        row = tl.reduce(tl.where(k[:, None] == c, x, 0.0), 0, _add)
        acc += column[:, None] * row[None, :]
    return acc


@triton.jit
def _head(a, DOT: tl.constexpr):
    """``a`` (float32) cut to the dot's part format: bf16 (rounded, ``DOT`` 1) or tf32 (its low 13
    bits cleared, ``DOT`` 2), as float32; ``a - head`` is then exact."""
    if DOT == 1:
        head = a.to(tl.bfloat16).to(tl.float32)
    else:
        head = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return head


@triton.jit
def _dot_parts(acc, w, x, PARTS: tl.constexpr, DOT: tl.constexpr, OPERAND: tl.constexpr,
               PRECISION: tl.constexpr):  # fmt: skip
    """``acc + w @ x`` (float32 sums) with every product exact. ``DOT`` 0: one float32 dot (CUDA
    cores). 1 and 2 (tensor cores): ``x`` is exact in the part format (bf16 values in bf16, fp16
    values in tf32) and ``w`` goes in ``PARTS`` parts that are (three cover float32's 24 bits: 8 + 8
    + 8 for bf16, 11 + 11 + 2 for tf32; one for w in {-1, 0, 1}), a dot each. ``OPERAND``: the
    dots' input dtype (bf16 on a GPU; float32 holding bf16 values in the interpreter, whose bf16
    dot is not a product of values)."""
    if DOT == 0:
        acc += tl.dot(w, x, input_precision="ieee")
    else:
        rest = w
        for _ in tl.static_range(PARTS):  # what is left after the last part is zero
            head = _head(rest, DOT)
            acc = tl.dot(head.to(OPERAND), x, acc, input_precision=PRECISION)
            rest = rest - head
    return acc


@triton.jit
def _table_row(loc_ptr, carry_ptr, row, j, NT, NC, RPB: tl.constexpr, d, mask, D):
    """Prefix-table row ``j``: ``(Σ x, Σ score · x)`` over the first ``j · TB`` sources, float64,
    as a block's local row plus the block's carry (see ``bump_table_kernel``)."""
    at = loc_ptr + ((row * NT + j) * 2) * D + d
    carry = carry_ptr + ((row * NC + j // RPB) * 2) * D + d
    p1 = tl.load(at, mask=mask, other=0.0) + tl.load(carry, mask=mask, other=0.0)
    p2 = tl.load(at + D, mask=mask, other=0.0) + tl.load(carry + D, mask=mask, other=0.0)
    return p1, p2


@triton.jit
def _write_table(x64, score64, loc_ptr, tot_ptr, row, blk, NT, NB, d, dmask, D,
                 BS: tl.constexpr, TB: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """A block's rows of a prefix table: ``loc[j]`` = sums over the block's sources before
    ``j · TB`` (``x64 (BS, BD)``, zero off the sources; ``score64 (BS,)``), and the block's totals
    ``tot[blk]`` (the caller turns them into each block's carry)."""
    R: tl.constexpr = BS // TB
    for plane in tl.static_range(2):
        rows = x64
        if plane == 1:
            rows = x64 * score64[:, None]
        sums = tl.reduce(tl.reshape(rows, (R, TB, BD)), 1, _add)  # (R, BD)
        before = tl.associative_scan(sums, 0, _add) - sums
        j = blk * R + tl.arange(0, R)
        at = loc_ptr + ((row * NT + j)[:, None] * 2 + plane) * D + d[None, :]
        tl.store(at, before, mask=dmask[None, :])
        tl.store(tot_ptr + ((row * NB + blk) * 2 + plane) * D + d, tl.reduce(sums, 0, _add), mask=dmask)


@triton.jit
def _sorted_run(seg_ptr, prog, T, HAS_SEGMENTS: tl.constexpr):
    """``(row, base, length)``: a program's row of the (N, T) token arrays and the start and length
    of its run of the row's sorted lists, the whole row or a segment of a packed row
    (``_packed_segment``)."""
    row, start, size = _packed_segment(seg_ptr, prog, T, HAS_SEGMENTS)
    return row, row * T + start, size.to(tl.int32)


@triton.jit
def bump_table_kernel(
    order_ptr, score_ptr, x_ptr, n_ptr, loc_ptr, tot_ptr, seg_ptr, T, D, NT, NB,
    HAS_SEGMENTS: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """The sources' prefix table in blocks of ``BS`` sorted positions (grid: rows, blocks, D blocks):
    each block writes its local rows and its totals (``_write_table``); the first ``n`` positions
    of a row are sources (``order``: their rows in ``x``, ``score``: their sorted scores)."""
    prog, blk, _, d, dmask = _program_block(D, BD)
    row, base, _ = _sorted_run(seg_ptr, prog, T, HAS_SEGMENTS)
    p = blk * BS + tl.arange(0, BS)
    valid = p < tl.load(n_ptr + prog)
    idx = tl.load(order_ptr + base + p, mask=valid, other=0)
    x = tl.load(
        x_ptr + (row * T + idx)[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0
    )
    score = tl.load(score_ptr + base + p, mask=valid, other=0.0)
    _write_table(
        x.to(tl.float64), score.to(tl.float64), loc_ptr, tot_ptr, prog, blk, NT, NB, d, dmask, D, BS, TB, BD
    )


@triton.jit
def _walk_tile(acc1, acc2, kt, src_score_ptr, src_order_ptr, x_ptr, base, token_base, D, n_src, d, dmask,
               sink_nan, width, MODE: tl.constexpr, KEY_SINKS: tl.constexpr, BK: tl.constexpr,
               DOT: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """``acc1``, ``acc2`` plus tile ``kt`` of the sorted sources, pair by pair (``_bump_weights``);
    the sorted run starts at ``base``, its row's tokens at ``token_base``."""
    k = kt * BK + tl.arange(0, BK)
    kmask = k < n_src
    idx = tl.load(src_order_ptr + base + k, mask=kmask, other=0)
    src = tl.load(src_score_ptr + base + k, mask=kmask, other=0.0).to(width.dtype)
    x = tl.load(
        x_ptr + (token_base + idx)[:, None] * D + d[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0
    )
    x_dot = x.to(OPERAND)  # exact: the dot's format holds x's dtype
    weight, dist, sign = _bump_weights(sink_nan, tl.where(kmask, src, float("nan")), width, KEY_SINKS)
    if MODE == 1:
        acc1 = _dot_parts(acc1, sign.to(OPERAND), x_dot, 1, DOT, OPERAND, PRECISION)
        acc2 = _outer_sum64(acc2, dist, x.to(width.dtype), BK)
    else:
        acc1 = _dot_parts(acc1, weight, x_dot, 3, DOT, OPERAND, PRECISION)
        if MODE == 2:
            acc2 = _dot_parts(acc2, sign.to(OPERAND), x_dot, 1, DOT, OPERAND, PRECISION)
    return acc1, acc2


@triton.jit
def _sides(y, sink, width, KEY_SINKS: tl.constexpr):
    """Where a source of score ``y`` (a scalar) lies for each sink: ``(p0, p1, p2, p3)``, whether
    it comes before each of the sink's four window edges, with the very comparisons of
    ``_bump_weights`` (and ``_window_edge``): below the window (``p0``), below the sink (``p1``),
    not above it (``p2``), inside or below the window (``p3``). Along the sorted sources each is
    true up to its edge and false from it on."""
    if KEY_SINKS:  # sinks are keys t, the source a query s
        p0 = y + width <= sink
        p3 = y - width < sink
    else:
        p0 = y <= sink - width
        p3 = y < sink + width
    return p0, y < sink, y <= sink, p3


@triton.jit
def _same_sides(first, last, sink, width, valid, KEY_SINKS: tl.constexpr):
    """Whether the sources of scores ``first`` and ``last`` lie on the same sides (``_sides``) of
    every real sink: then so does every source between them (the sides change once, at the edges)."""
    p0, p1, p2, p3 = _sides(first, sink, width, KEY_SINKS)
    q0, q1, q2, q3 = _sides(last, sink, width, KEY_SINKS)
    moved = valid & ((p0 != q0) | (p1 != q1) | (p2 != q2) | (p3 != q3))
    return tl.reduce(moved.to(tl.int32), 0, _max) == 0


@triton.jit
def _score(src_score_ptr, base, length, at):
    """The sorted source score at position ``at`` of the run from ``base``; +inf past its ``length``
    (a padded source's score)."""
    return tl.load(src_score_ptr + base + at, mask=at < length, other=float("inf"))


@triton.jit
def _jump_run(acc1, acc2, j0, j1, tau, valid, sink, width, loc_ptr, carry_ptr, row, NT, NC, d, dmask, D,
              MODE: tl.constexpr, RPB: tl.constexpr, KEY_SINKS: tl.constexpr):  # fmt: skip
    """``acc1``, ``acc2`` plus the sources of table rows ``[j0, j1)``, which every sink sees on one
    side of it, inside its window or outside (as its first source, of score ``tau``, does): their
    weights are linear in the two scores, so the run's sums are two differences of prefix-table
    rows (float64, scores taken from τ)."""
    a1, a2 = _table_row(loc_ptr, carry_ptr, row, j0, NT, NC, RPB, d, dmask, D)
    b1, b2 = _table_row(loc_ptr, carry_ptr, row, j1, NT, NC, RPB, d, dmask, D)
    tau64 = tau.to(tl.float64)
    run1_64 = b1 - a1
    run_u64 = (b2 - a2) - tau64 * run1_64
    acc_dtype = width.dtype
    run1, run_u = run1_64.to(acc_dtype), run_u64.to(acc_dtype)
    p0, p1, p2, p3 = _sides(tau, sink, width, KEY_SINKS)
    below = valid & ~p0 & p1  # the run below the sink, inside its window
    tied = valid & ~p1 & p2
    above = valid & ~p2 & p3
    on = tl.where(below | tied | above, 1.0, 0.0).to(acc_dtype)
    side = (tl.where(below, 1.0, 0.0) - tl.where(above, 1.0, 0.0)).to(acc_dtype)  # π of the run
    if MODE == 1:
        acc1 += side[:, None] * run1[None, :]
        # dL/db's jump term in float64 too: rounded to float32 first, it would undo acc2's care
        side64 = side.to(tl.float64)
        du64 = sink.to(tl.float64) - tau64
        acc2 += (side64 * du64)[:, None] * run1_64[None, :] - side64[:, None] * run_u64[None, :]
    else:
        du = sink - tau
        acc1 += (on * (width - side * du))[:, None] * run1[None, :] + side[:, None] * run_u[None, :]
        if MODE == 2:
            acc2 += side[:, None] * run1[None, :]
    return acc1, acc2


@triton.jit
def bump_walk_kernel(
    sink_score_ptr, sink_order_ptr, src_score_ptr, src_order_ptr, x_ptr, y_ptr,
    loc_ptr, carry_ptr, plan_ptr, width_ptr, count_ptr, n_sink_ptr, n_src_ptr,
    out_ptr, scal_ptr, part_ptr, tloc_ptr, ttot_ptr, bad_ptr, stats_ptr, seg_ptr,
    N, T, D, NB, NT, NC, TNT,
    MODE: tl.constexpr, KEY_SINKS: tl.constexpr, RPB: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    BS: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr, BD: tl.constexpr,
    DOT: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    """One block of ``BS`` sorted sinks, one block of D columns (grid: rows, blocks, D blocks).

    Sums ``acc1 = Σ F1 x``, ``acc2 = Σ F2 x`` over the sources inside some sink's window: from
    the block's first sink's lowest edge to its last sink's highest (``plan[row, blk]``), tile
    by tile, except that at each table row whose sources every sink sees on one side (no window
    edge inside: its first and last source lie on the same sides, ``_same_sides``) the walk
    jumps, as far as that holds (found by bisection), and adds the run from the table
    (``_jump_run``). So a block costs about as many tiles as hold its edges, however far apart
    they lie (clustered scores). ``MODE`` 0, forward (sinks: queries, x = v): F1 = W;
    ``out[sink] = coef · acc1``.
    1, query side of the backward (x = v, y = g at the sinks): F1 = π, F2 = M;
    ``scal[dblk, row, sink] = -coef g · acc1`` (dL/ds), ``part[row, blk, dblk] = Σ coef/b g · acc2``
    (dL/db), and the prefix table of the sinks' g (``tloc``, ``ttot``) for the key side.
    2, key side (sinks: keys, x = g, y = v at the sinks): F1 = W, F2 = π; ``out[sink] = coef ·
    acc1`` (dL/dv), ``scal[dblk, row, sink] = -coef v · acc2`` (dL/dt).
    ``out`` and ``scal`` are NaN at the real sinks of a ``bad`` row (a non-finite score): written
    here, where masked fills afterwards would read and write them again. ``STATS``: the tiles
    walked and table rows jumped go to ``stats[row, blk]`` (tests and benchmarks).
    """
    prog, blk, dblk, d, dmask = _program_block(D, BD)
    row, base, length = _sorted_run(seg_ptr, prog, T, HAS_SEGMENTS)
    token_base = row * T
    acc_dtype = width_ptr.dtype.element_ty
    width = tl.load(width_ptr + prog)
    # coef = 1 / (n b) in float64 (n: the row's real keys): dL/db's factor 1 / (n b²) must not round twice
    coef64 = 1.0 / (tl.load(count_ptr + prog).to(tl.float64) * width.to(tl.float64))
    coef = coef64.to(acc_dtype)
    n_src = tl.load(n_src_ptr + prog)
    p = blk * BS + tl.arange(0, BS)
    pmask = p < length
    valid = p < tl.load(n_sink_ptr + prog)
    sink = tl.load(sink_score_ptr + base + p, mask=valid, other=0.0).to(acc_dtype)
    sink_nan = tl.where(valid, sink, float("nan"))
    acc1 = tl.full([BS, BD], 0.0, acc_dtype)
    # dL/db sums every query's Σ |s - t| v_j · g_i: they cancel, so acc2 is float64 in mode 1
    acc2 = tl.full([BS, BD], 0.0, tl.float64 if MODE == 1 else acc_dtype)
    PER_ROW: tl.constexpr = TB // BK
    kt = tl.load(plan_ptr + (prog * NB + blk) * 2) // BK  # the tile of the lowest edge
    end = tl.load(plan_ptr + (prog * NB + blk) * 2 + 1)  # the highest edge: no window reaches past it
    last_row = tl.minimum((end + TB - 1) // TB, NT - 1)
    end_tile = (end + BK - 1) // BK
    walked = 0
    jumped = 0
    while kt * BK < end:
        j0 = kt // PER_ROW
        j1 = j0  # the end of the run jumped over from here (none yet)
        if kt % PER_ROW == 0:  # a table row starts: do its first and last sources lie alike?
            tau = _score(src_score_ptr, base, length, j0 * TB)
            last = _score(src_score_ptr, base, length, j0 * TB + TB - 1)
            if _same_sides(tau, last, sink, width, valid, KEY_SINKS):
                lo = j0 + 1  # then the run's end: the last row whose last source still does
                hi = tl.maximum(last_row, lo)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    last = _score(src_score_ptr, base, length, mid * TB - 1)
                    if _same_sides(tau, last, sink, width, valid, KEY_SINKS):
                        lo = mid
                    else:
                        hi = mid - 1
                j1 = lo
                acc1, acc2 = _jump_run(
                    acc1, acc2, j0, j1, tau, valid, sink, width, loc_ptr, carry_ptr,
                    prog, NT, NC, d, dmask, D, MODE, RPB, KEY_SINKS,
                )  # fmt: skip
        # no jump: walk the tiles up to the next table row, where the test comes again
        stop = tl.where(j1 > j0, kt, tl.minimum((j0 + 1) * PER_ROW, end_tile))
        for tile in range(kt, stop):
            acc1, acc2 = _walk_tile(
                acc1, acc2, tile, src_score_ptr, src_order_ptr, x_ptr, base, token_base, D, n_src, d, dmask,
                sink_nan,
                width, MODE, KEY_SINKS, BK, DOT, OPERAND, PRECISION,
            )  # fmt: skip
        if STATS:
            walked += stop - kt
            jumped += j1 - j0
        kt = tl.where(j1 > j0, j1 * PER_ROW, stop)
    if STATS and dblk == 0:
        tl.store(stats_ptr + (prog * NB + blk) * 2, walked)
        tl.store(stats_ptr + (prog * NB + blk) * 2 + 1, jumped)
    idx = tl.load(sink_order_ptr + base + p, mask=pmask, other=0)
    at = (token_base + idx)[:, None] * D + d[None, :]
    both = pmask[:, None] & dmask[None, :]
    poisoned = valid & (tl.load(bad_ptr + prog) != 0)
    value = coef * acc1
    value = tl.where(poisoned[:, None], float("nan"), value)
    if out_ptr.dtype.element_ty != acc_dtype:  # via float32, as torch converts float64
        value = value.to(tl.float32)
    if MODE == 0:
        tl.store(out_ptr + at, value.to(out_ptr.dtype.element_ty), mask=both)
    else:
        y = tl.load(y_ptr + at, mask=valid[:, None] & dmask[None, :], other=0.0).to(acc_dtype)
        if MODE == 1:
            scal_at = scal_ptr + (dblk * N.to(tl.int64) + row) * T + idx  # 64-bit: N·T can pass 2³¹
            scal = tl.where(poisoned, float("nan"), -coef * tl.reduce(y * acc1, 1, _add))
            tl.store(scal_at, scal, mask=pmask)
            # dL/db sums over every query and column with cancellation: in float64
            y64 = y.to(tl.float64)
            part = tl.reduce(tl.reduce(y64 * acc2, 1, _add), 0, _add)
            tl.store(
                part_ptr + (prog * NB + blk) * tl.num_programs(2) + dblk,
                part * (coef64 / width.to(tl.float64)),
            )
            _write_table(
                y64, tl.where(valid, sink, 0.0).to(tl.float64), tloc_ptr, ttot_ptr,
                prog, blk, TNT, NB, d, dmask, D, BS, TB, BD,
            )  # fmt: skip
        else:
            tl.store(out_ptr + at, value.to(out_ptr.dtype.element_ty), mask=both)
            scal_at = scal_ptr + (dblk * N.to(tl.int64) + row) * T + idx
            scal = tl.where(poisoned, float("nan"), -coef * tl.reduce(y * acc2, 1, _add))
            tl.store(scal_at, scal, mask=pmask)


@triton.jit
def _rank(sorted_ptr, base, T, x, shift, SHIFTED: tl.constexpr, STRICT: tl.constexpr):
    """How many of a row's ``T`` ascending scores ``y`` have ``y (+ shift) < x`` (``STRICT``) or
    ``<= x`` (``searchsorted`` by bisection; ``y + shift`` rounded as torch's ``sorted + width``
    would be, so the two agree on every tie)."""
    lo = tl.full(x.shape, 0, tl.int32)
    hi = lo + T
    span = T
    while span > 0:  # as many steps as T has bits
        open_ = lo < hi
        mid = (lo + hi) // 2
        y = tl.load(sorted_ptr + base + mid, mask=open_, other=0.0)
        if SHIFTED:
            y = y + shift
        if STRICT:  # noqa: SIM108 - a constexpr branch, not a runtime select
            below = y < x
        else:
            below = y <= x
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
        span = span // 2
    return lo


@triton.jit
def _window_edge(sink_ptr, src_ptr, base, T, at, live, width, HIGH: tl.constexpr, KEY_SINKS: tl.constexpr):
    """The lowest window edge (``HIGH``: the highest) of the sinks at sorted positions ``at``, as
    positions among the row's T sorted sources: among sorted keys ``#{t <= s - b}`` (``#{t < s +
    b}``) for a query ``s``; among sorted queries ``#{s + b <= t}`` (``#{s - b < t}``) for a key
    ``t`` (the same pairs). No source before the lowest or from the highest on lies in the window."""
    c = tl.load(sink_ptr + base + at, mask=live, other=0.0)
    if KEY_SINKS:
        if HIGH:
            edge = _rank(src_ptr, base, T, c, -width, True, True)
        else:
            edge = _rank(src_ptr, base, T, c, width, True, False)
    elif HIGH:
        edge = _rank(src_ptr, base, T, c + width, width, False, True)
    else:
        edge = _rank(src_ptr, base, T, c - width, width, False, False)
    return edge


@triton.jit
def bump_plan_kernel(
    sink_ptr, src_ptr, n_sink_ptr, width_ptr, plan_ptr, seg_ptr, T, NB,
    KEY_SINKS: tl.constexpr, SINKS: tl.constexpr, HAS_SEGMENTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Where each block of ``SINKS`` sorted sinks walks (grid: rows, groups of ``BLOCK`` blocks):
    ``plan[row, blk, 0:2]`` = the lowest window edge of the block's first real sink and the
    highest of its last (``_window_edge``): no sink's window holds a source outside (the edges
    grow with the score). Zeros for a block with no real sink."""
    prog = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _, base, length = _sorted_run(seg_ptr, prog, T, HAS_SEGMENTS)
    first = blk * SINKS
    last = tl.minimum(first + SINKS, tl.load(n_sink_ptr + prog)) - 1
    live = (blk < NB) & (last >= first)
    width = tl.load(width_ptr + prog)
    low = _window_edge(sink_ptr, src_ptr, base, length, first, live, width, False, KEY_SINKS)
    high = _window_edge(sink_ptr, src_ptr, base, length, tl.maximum(last, 0), live, width, True, KEY_SINKS)
    out = plan_ptr + (prog * NB + blk) * 2
    inside = blk < NB
    tl.store(out, tl.where(live, low, 0), mask=inside)
    tl.store(out + 1, tl.where(live, high, 0), mask=inside)
