"""The sliced ops' shared Triton kernel, executed into the module of
``attnlab.attention.common.triton.kernels`` by ``runtime.kernels()`` (it uses its ``_add``).

``score_prologue_kernel`` is what both Triton ops start with, ``rows.centre_scores`` and
``rows.finite_rows`` of the torch op in one launch per call instead of about fifty torch ops: each
row's real-token count, its centre (the mean of the real scores rounded to a power of two near
their spread), the centred scores with padded keys and dropped queries at 0, whether the row holds a
non-finite score (then every score of it is 0), and the sort keys (+inf where a position is not a
real key or a kept query: sorted last).
"""

from __future__ import annotations

import triton
import triton.language as tl

_add = globals()["_add"]  # from common/triton/kernels.py, executed into the same module first


@triton.jit
def _round_half_even(x):
    """``torch.round``: to the nearest integer, ties to even, by adding and taking away 1.5 · 2^p
    (p: the fraction's bits), exact below 2^(p-1); floats from 2^p on are integers already."""
    if x.dtype == tl.float64:
        magic = 6755399441055744.0  # 1.5 * 2**52
        whole = 4503599627370496.0  # 2**52
    else:
        magic = 12582912.0  # 1.5 * 2**23
        whole = 8388608.0  # 2**23
    return tl.where(tl.abs(x) < whole, (x + magic) - magic, x)


@triton.jit
def _power_of_two_below(x):
    """``exp2(floor(log2(x)))`` for normal ``x > 0``, exactly (its exponent bits alone: no
    approximate log2); 0 for 0 and subnormals, inf for inf and NaN."""
    if x.dtype == tl.float64:
        return (x.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)
    return (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _scores_block(s_ptr, t_ptr, valid_ptr, queries_ptr, base, p, T,
                  HAS_VALID: tl.constexpr, HAS_QUERIES: tl.constexpr):  # fmt: skip
    """A block of a row's scores ``s, t`` at positions ``p``, which of them are real keys and
    which kept queries (positions past T: neither, and scores 0)."""
    inside = p < T
    s = tl.load(s_ptr + base + p, mask=inside, other=0.0)
    t = tl.load(t_ptr + base + p, mask=inside, other=0.0)
    real = inside
    if HAS_VALID:
        real = real & (tl.load(valid_ptr + base + p, mask=inside, other=0) != 0)
    kept = inside
    if HAS_QUERIES:
        kept = kept & (tl.load(queries_ptr + base + p, mask=inside, other=0) != 0)
    return s, t, inside, real, kept


@triton.jit
def score_prologue_kernel(
    s_ptr, t_ptr, valid_ptr, queries_ptr, s_out, t_out, s_key, t_key, count_ptr, bad_ptr, T,
    HAS_VALID: tl.constexpr, HAS_QUERIES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row (grid: rows) in four passes over its scores: the sums (count, mean), the spread
    (centre), the centred scores' finiteness, then the writes. The statistics read the real
    positions only, as ``rows.score_centre``; ``s`` outside the kept queries and ``t`` at padded keys
    come back 0, and a row with any other non-finite centred score comes back all 0 (``bad``)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    acc = s_out.dtype.element_ty
    lanes = tl.arange(0, BLOCK)
    sum_s = tl.full([BLOCK], 0.0, acc)
    sum_t = tl.full([BLOCK], 0.0, acc)
    real_n = tl.full([BLOCK], 0.0, acc)
    for first in range(0, T, BLOCK):
        s, t, _, real, _ = _scores_block(s_ptr, t_ptr, valid_ptr, queries_ptr, base, first + lanes, T,
                                         HAS_VALID, HAS_QUERIES)  # fmt: skip
        sum_s += tl.where(real, s, 0.0)
        sum_t += tl.where(real, t, 0.0)
        real_n += tl.where(real, 1.0, 0.0)
    count = tl.maximum(tl.reduce(real_n, 0, _add), 1.0)
    mean = (tl.reduce(sum_s, 0, _add) + tl.reduce(sum_t, 0, _add)) / (2 * count)

    spread = tl.full([BLOCK], 0.0, acc)
    for first in range(0, T, BLOCK):
        s, t, _, real, _ = _scores_block(s_ptr, t_ptr, valid_ptr, queries_ptr, base, first + lanes, T,
                                         HAS_VALID, HAS_QUERIES)  # fmt: skip
        spread += tl.where(real, (s - mean) * (s - mean) + (t - mean) * (t - mean), 0.0)
    std = tl.sqrt(tl.reduce(spread, 0, _add) / (2 * count))
    step = _power_of_two_below(std)
    ok = (step > 0) & (step < float("inf"))
    centre = tl.where(ok, _round_half_even(mean / tl.where(ok, step, 1.0)) * step, mean)

    broken = tl.full([BLOCK], 0, tl.int32)
    for first in range(0, T, BLOCK):
        s, t, inside, real, kept = _scores_block(s_ptr, t_ptr, valid_ptr, queries_ptr, base, first + lanes,
                                                 T, HAS_VALID, HAS_QUERIES)  # fmt: skip
        s = tl.where(kept, s - centre, 0.0)
        t = tl.where(real, t - centre, 0.0)
        finite = (tl.abs(s) < float("inf")) & (tl.abs(t) < float("inf"))  # NaN compares false
        broken += tl.where(inside & ~finite, 1, 0)
    bad = tl.reduce(broken, 0, _add) > 0

    for first in range(0, T, BLOCK):
        p = first + lanes
        s, t, inside, real, kept = _scores_block(s_ptr, t_ptr, valid_ptr, queries_ptr, base, p, T,
                                                 HAS_VALID, HAS_QUERIES)  # fmt: skip
        s = tl.where(kept & ~bad, s - centre, 0.0)
        t = tl.where(real & ~bad, t - centre, 0.0)
        tl.store(s_out + base + p, s, mask=inside)
        tl.store(t_out + base + p, t, mask=inside)
        tl.store(s_key + base + p, tl.where(kept, s, float("inf")), mask=inside)
        tl.store(t_key + base + p, tl.where(real, t, float("inf")), mask=inside)
    tl.store(count_ptr + row, count)
    tl.store(bad_ptr + row, bad.to(tl.int8))
