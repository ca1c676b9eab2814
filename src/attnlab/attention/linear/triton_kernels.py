"""Causal linear attention kernels (φ = elu + 1), chunked: quadratic inside a chunk of C tokens, a
float32 ``(D, Dv)`` state across chunks. Executed by ``runtime.kernels()`` into the module of
``attnlab.attention.common.triton.kernels`` (whose helper ``_add`` they use); never imported directly.

Grid ``(rows, segments)``: a row's tokens are split into segments of ``SEG`` tokens (a multiple of C)
walked in parallel, each from a carried state. The forward's carries come from one pass over k and v
(``linear_causal_state_kernel``: each segment's ``Σ φ(k) vᵀ``, ``Σ φ(k)``, summed over the earlier
segments by the caller); the dq walk starts from the same carries and sums each segment's
``Σ φ(q) dnumᵀ``, ``Σ φ(q) dden`` on the way, whose sums over the later segments start the dk/dv
walk. With one segment (``HAS_START`` off) nothing is carried and a program walks its whole row.
"""

from __future__ import annotations

import triton
import triton.language as tl

_add = globals()["_add"]  # from common/triton/kernels.py, executed into the same module first


@triton.jit
def _phi(x):
    return tl.where(x > 0, x + 1.0, tl.exp(x))


@triton.jit
def _dphi(x):
    return tl.where(x > 0, 1.0, tl.exp(x))


@triton.jit
def _load_chunk(ptr, row, pos, pmask, cols, cmask, T, W):
    return tl.load(
        ptr + (row * T + pos)[:, None] * W + cols[None, :], mask=pmask[:, None] & cmask[None, :], other=0.0
    ).to(tl.float32)


@triton.jit
def _store_chunk(ptr, x, row, pos, pmask, cols, cmask, T, W):
    tl.store(
        ptr + (row * T + pos)[:, None] * W + cols[None, :],
        x.to(ptr.dtype.element_ty),
        mask=pmask[:, None] & cmask[None, :],
    )


@triton.jit
def _walk_start(D, DV, BD: tl.constexpr, BDV: tl.constexpr, C: tl.constexpr):
    """What every causal linear kernel starts a row with: the row, its column ranges and masks, the
    chunk's positions, the causal mask inside a chunk ([i, j]: query i sees key j) and a zero
    float32 state ``(BD, BDV)`` with its ``(BD,)`` normaliser."""
    row = tl.program_id(0).to(tl.int64)
    cd = tl.arange(0, BD)
    cv = tl.arange(0, BDV)
    ci = tl.arange(0, C)
    state = tl.full([BD, BDV], 0.0, tl.float32)
    norm = tl.full([BD], 0.0, tl.float32)
    return row, cd, cv, cd < D, cv < DV, ci, ci[:, None] >= ci[None, :], state, norm


@triton.jit
def _segment(T, SEG):
    """This program's segment: its index and its first and past-the-last token."""
    seg = tl.program_id(1)
    start = seg * SEG
    return seg, start, tl.minimum(start + SEG, T)


@triton.jit
def _load_state(state_ptr, norm_ptr, row, seg, NSEG, cd, cv, BD: tl.constexpr, BDV: tl.constexpr):
    """A segment's carried ``(BD, BDV)`` state and ``(BD,)`` normaliser (``(rows, NSEG, ...)`` float32)."""
    at = (row * NSEG + seg) * BD + cd
    return tl.load(state_ptr + at[:, None] * BDV + cv[None, :]), tl.load(norm_ptr + at)


@triton.jit
def _store_state(
    state_ptr, norm_ptr, state, norm, row, seg, NSEG, cd, cv, BD: tl.constexpr, BDV: tl.constexpr
):
    at = (row * NSEG + seg) * BD + cd
    tl.store(state_ptr + at[:, None] * BDV + cv[None, :], state)
    tl.store(norm_ptr + at, norm)


@triton.jit
def _carry_keys(state, norm, fk, v, PRECISION: tl.constexpr):
    """The state after a chunk: its keys' φ(k_j) v_jᵀ and φ(k_j) added."""
    return state + tl.dot(tl.trans(fk), v, input_precision=PRECISION), norm + tl.reduce(fk, 0, _add)


@triton.jit
def _chunk_features(
    q_ptr, k_ptr, v_ptr, mask_ptr, row, pos, pmask, cd, dmask, cv, vmask, T, D, DV, HEADS,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """One chunk's q, k, v (float32), which keys are real (``keep``) and the features φ(q), φ(k)
    (zero on padded positions and columns): what every causal linear kernel starts a chunk with."""
    q = _load_chunk(q_ptr, row, pos, pmask, cd, dmask, T, D)
    k = _load_chunk(k_ptr, row, pos, pmask, cd, dmask, T, D)
    v = _load_chunk(v_ptr, row, pos, pmask, cv, vmask, T, DV)
    keep = pmask
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + (row // HEADS) * T + pos, mask=pmask, other=0) != 0)
    fq = tl.where(pmask[:, None] & dmask[None, :], _phi(q), 0.0)
    fk = tl.where(keep[:, None] & dmask[None, :], _phi(k), 0.0)
    return q, k, v, keep, fq, fk


@triton.jit
def _chunk_numerator(fq, fk, v, state, causal, PRECISION: tl.constexpr):
    """The chunk's causal scores φ(q_i)·φ(k_j) (j <= i inside it) and numerators: the chunk's own
    keys plus the carried state of every earlier chunk."""
    scores = tl.where(causal, tl.dot(fq, tl.trans(fk), input_precision=PRECISION), 0.0)
    num = tl.dot(scores, v, input_precision=PRECISION) + tl.dot(fq, state, input_precision=PRECISION)
    return scores, num


@triton.jit
def linear_causal_state_kernel(
    k_ptr, v_ptr, mask_ptr, state_ptr, norm_ptr,
    T, D, DV, HEADS, SEG, NSEG,
    HAS_MASK: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Each segment's ``Σ_j φ(k_j) v_jᵀ`` and ``Σ_j φ(k_j)`` over its real keys (the forward's carries,
    once summed over the earlier segments)."""
    row, cd, cv, dmask, vmask, ci, _, state, norm = _walk_start(D, DV, BD, BDV, C)
    seg, start, stop = _segment(T, SEG)
    for c0 in range(start, stop, C):
        pos = c0 + ci
        pmask = pos < stop
        k = _load_chunk(k_ptr, row, pos, pmask, cd, dmask, T, D)
        v = _load_chunk(v_ptr, row, pos, pmask, cv, vmask, T, DV)
        keep = pmask
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + (row // HEADS) * T + pos, mask=pmask, other=0) != 0)
        fk = tl.where(keep[:, None] & dmask[None, :], _phi(k), 0.0)
        state, norm = _carry_keys(state, norm, fk, v, PRECISION)
    _store_state(state_ptr, norm_ptr, state, norm, row, seg, NSEG, cd, cv, BD, BDV)


@triton.jit
def linear_causal_fwd_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, den_ptr, start_ptr, start_norm_ptr,
    T, D, DV, HEADS, eps, SEG, NSEG,
    HAS_MASK: tl.constexpr, HAS_START: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """``out_i = φ(q_i)ᵀ S_i / (φ(q_i)ᵀ z_i + eps)`` with ``S_i, z_i`` over keys ``j <= i``; saves the
    denominators ``φ(q_i)ᵀ z_i`` (without eps) for the backward pass."""
    row, cd, cv, dmask, vmask, ci, causal, state, norm = _walk_start(D, DV, BD, BDV, C)
    seg, start, stop = _segment(T, SEG)
    if HAS_START:
        state, norm = _load_state(start_ptr, start_norm_ptr, row, seg, NSEG, cd, cv, BD, BDV)
    for c0 in range(start, stop, C):
        pos = c0 + ci
        pmask = pos < stop
        q, k, v, keep, fq, fk = _chunk_features(
            q_ptr, k_ptr, v_ptr, mask_ptr, row, pos, pmask, cd, dmask, cv, vmask, T, D, DV, HEADS, HAS_MASK
        )
        scores, num = _chunk_numerator(fq, fk, v, state, causal, PRECISION)
        den = tl.reduce(scores, 1, _add) + tl.reduce(fq * norm[None, :], 1, _add)
        out = num / (den + eps)[:, None]
        if HAS_MASK:
            out = tl.where(keep[:, None], out, 0.0)
        _store_chunk(out_ptr, out, row, pos, pmask, cv, vmask, T, DV)
        tl.store(den_ptr + row * T + pos, den, mask=pmask)
        state, norm = _carry_keys(state, norm, fk, v, PRECISION)


@triton.jit
def linear_causal_bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, g_ptr, den_ptr, dq_ptr, gnum_ptr, gden_ptr,
    start_ptr, start_norm_ptr, back_ptr, back_norm_ptr,
    T, D, DV, HEADS, eps, SEG, NSEG,
    HAS_MASK: tl.constexpr, HAS_START: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Gradient w.r.t. q (forward scan over the chunks, the forward's state), and the per-query
    ``dnum_i = g_i / (den_i + eps)`` (stored, float32) and ``dden_i = -g_i·o_i / (den_i + eps)``.
    With ``HAS_START`` (several segments) also the segment's ``Σ φ(q_i) dnum_iᵀ``, ``Σ φ(q_i) dden_i``
    (``back``), which start the dk/dv walk of the segments before it."""
    row, cd, cv, dmask, vmask, ci, causal, state, norm = _walk_start(D, DV, BD, BDV, C)
    seg, start, stop = _segment(T, SEG)
    back = tl.full([BD, BDV], 0.0, tl.float32)
    back_norm = tl.full([BD], 0.0, tl.float32)
    if HAS_START:
        state, norm = _load_state(start_ptr, start_norm_ptr, row, seg, NSEG, cd, cv, BD, BDV)
    for c0 in range(start, stop, C):
        pos = c0 + ci
        pmask = pos < stop
        q, k, v, keep, fq, fk = _chunk_features(
            q_ptr, k_ptr, v_ptr, mask_ptr, row, pos, pmask, cd, dmask, cv, vmask, T, D, DV, HEADS, HAS_MASK
        )
        g = _load_chunk(g_ptr, row, pos, pmask, cv, vmask, T, DV)
        g = tl.where(keep[:, None], g, 0.0)  # padded outputs are zeroed: no gradient flows there
        _, num = _chunk_numerator(fq, fk, v, state, causal, PRECISION)
        den = tl.load(den_ptr + row * T + pos, mask=pmask, other=1.0)
        inv = 1.0 / (den + eps)
        gnum = g * inv[:, None]
        gden = -tl.reduce(gnum * num, 1, _add) * inv  # -(g · o) / (den + eps)
        gscores = tl.dot(gnum, tl.trans(v), input_precision=PRECISION) + gden[:, None]
        gscores = tl.where(causal, gscores, 0.0)
        gfq = tl.dot(gscores, fk, input_precision=PRECISION)
        gfq += tl.dot(gnum, tl.trans(state), input_precision=PRECISION) + gden[:, None] * norm[None, :]
        _store_chunk(dq_ptr, gfq * _dphi(q), row, pos, pmask, cd, dmask, T, D)
        _store_chunk(gnum_ptr, gnum, row, pos, pmask, cv, vmask, T, DV)
        tl.store(gden_ptr + row * T + pos, gden, mask=pmask)
        state, norm = _carry_keys(state, norm, fk, v, PRECISION)
        if HAS_START:
            back += tl.dot(tl.trans(fq), gnum, input_precision=PRECISION)
            back_norm += tl.reduce(fq * gden[:, None], 0, _add)
    if HAS_START:
        _store_state(back_ptr, back_norm_ptr, back, back_norm, row, seg, NSEG, cd, cv, BD, BDV)


@triton.jit
def linear_causal_bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, gnum_ptr, gden_ptr, dk_ptr, dv_ptr, start_ptr, start_norm_ptr,
    T, D, DV, HEADS, SEG, NSEG,
    HAS_MASK: tl.constexpr, HAS_START: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Gradients w.r.t. k and v: the chunks walked from the last, carrying
    ``U = Σ_{later i} φ(q_i) dnum_iᵀ`` and ``u = Σ_{later i} φ(q_i) dden_i`` (with ``HAS_START``,
    starting from the later segments' sums)."""
    row, cd, cv, dmask, vmask, ci, causal, back, back_norm = _walk_start(D, DV, BD, BDV, C)
    seg, start, stop = _segment(T, SEG)
    if HAS_START:
        back, back_norm = _load_state(start_ptr, start_norm_ptr, row, seg, NSEG, cd, cv, BD, BDV)
    chunks = (stop - start + C - 1) // C
    for step in range(0, chunks):
        c0 = start + (chunks - 1 - step) * C
        pos = c0 + ci
        pmask = pos < stop
        _, k, v, keep, fq, fk = _chunk_features(
            q_ptr, k_ptr, v_ptr, mask_ptr, row, pos, pmask, cd, dmask, cv, vmask, T, D, DV, HEADS, HAS_MASK
        )
        gnum = _load_chunk(gnum_ptr, row, pos, pmask, cv, vmask, T, DV)
        gden = tl.load(gden_ptr + row * T + pos, mask=pmask, other=0.0)
        scores = tl.where(causal, tl.dot(fq, tl.trans(fk), input_precision=PRECISION), 0.0)
        gscores = tl.dot(gnum, tl.trans(v), input_precision=PRECISION) + gden[:, None]
        gscores = tl.where(causal, gscores, 0.0)
        # dφk_j = Σ_{i>=j} φq_i (dnum_i·v_j + dden_i);  dv_j = Σ_{i>=j} (φq_i·φk_j) dnum_i
        gfk = tl.dot(tl.trans(gscores), fq, input_precision=PRECISION)
        gfk += tl.dot(v, tl.trans(back), input_precision=PRECISION) + back_norm[None, :]
        gv = tl.dot(tl.trans(scores), gnum, input_precision=PRECISION)
        gv += tl.dot(fk, back, input_precision=PRECISION)
        _store_chunk(dk_ptr, tl.where(keep[:, None], gfk * _dphi(k), 0.0), row, pos, pmask, cd, dmask, T, D)
        _store_chunk(dv_ptr, gv, row, pos, pmask, cv, vmask, T, DV)
        back += tl.dot(tl.trans(fq), gnum, input_precision=PRECISION)
        back_norm += tl.reduce(fq * gden[:, None], 0, _add)
