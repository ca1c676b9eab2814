"""The sliced kernels evaluated densely, in O(T²): the fast path for short sequences (what both share).

The dense ops are ``attnlab.attention.sliced_relu.dense`` and ``attnlab.attention.sliced_relu_bump.dense``;
this module holds their row helpers (score cleaning, key weights, non-finite rows, tie slopes).

At short T the sorted ops (``relu``, ``bump``, ``causal``) spend their time on launch and dispatch
overhead (sorts, searches, gathers, prefix tables: dozens of small ops per call), while the dense
form is a handful of batched ``(T × T)`` element-wise ops and one ``bmm``. Below a measured
crossover length (``attnlab.attention.sliced_common.path``) it is the faster of the two.

These functions are the kernels' definitions written with plain torch ops, so autograd gives the
backward; memory is O(N·T²) per call, fine at the lengths where they are chosen. They compute
the same functions as the sorted ops, kinks and ties included (``relu'(0) = 0``, ``abs'(0) = 0``,
as autograd differentiates the naive formula), on the same rows: ``s, t (N, T)``, ``v (N, T, D)``
in the accumulation dtype, ``valid (N, T)`` (real keys) and ``queries (N, T)`` (the queries whose
output is kept) or None, bandwidth ``b (N, 1)``. Padded slots may hold any finite value (scores:
anything, inf and NaN included); they reach no real position, and receive zero gradient.

Non-finite scores at real positions follow the sorted ops (``finite_rows``): the row's kept
outputs and the gradients of its real inputs are NaN, every other row is exact.
"""

from __future__ import annotations

import torch

from attnlab.attention.common import compiler
from attnlab.attention.sliced_common.rows import score_centre


def clean_scores(s, t, valid, queries, causal=False):
    """Scores shifted by one detached constant per row, with padded keys, dropped queries and rows
    holding a non-finite score set to 0; and those rows ``bad (N,)``. Zeroing (``masked_fill``)
    passes no gradient to the zeroed slots.

    The shift keeps ``Σ_j (s_i − t_j)`` free of the scores' offset: the sorted ops' centre
    (``score_centre``, exact in ``s − t``) or, causal, the first real key score (no future token).
    """
    with torch.no_grad():
        if causal:
            first = 0 if valid is None else valid.to(torch.int8).argmax(dim=1)
            centre = t[torch.arange(t.shape[0], device=t.device), first][:, None]
        else:
            n_rows, length = s.shape
            full = s.new_full((n_rows,), float(length))
            count = full if valid is None else valid.sum(dim=1).clamp_min(1).to(s.dtype)
            centre = score_centre(s, t, valid, count)
        centre = centre.masked_fill(~torch.isfinite(centre), 0.0)
    s, t = s - centre, t - centre
    if valid is not None:
        t = t.masked_fill(~valid, 0.0)
    if queries is not None:
        s = s.masked_fill(~queries, 0.0)
    bad = ~(torch.isfinite(s).all(dim=1) & torch.isfinite(t).all(dim=1))
    if not compiler.host_reads_allowed(s) or bool(bad.any()):
        s, t = s.masked_fill(bad[:, None], 0.0), t.masked_fill(bad[:, None], 0.0)
    return s, t, bad


def poison_rows(out, bad, s, t, v, b, valid, queries):
    """``out`` with NaN at the kept queries of the ``bad`` rows, and NaN gradients flowing from there
    to the row's kept ``s``, real ``t`` and ``v`` and its bandwidth (the sorted ops' ``nan_rows``).

    The NaN is ``nan · (Σ s + Σ t + Σ v [+ b])`` over those positions, so autograd carries it to
    exactly them; the other rows take ``out`` through ``where`` untouched (their factor is 0, not
    NaN: the ``where`` sends them a zero gradient, and 0 · NaN would poison them).
    """
    if compiler.host_reads_allowed(out) and not bool(bad.any()):
        return out
    s_kept = s if queries is None else s.masked_fill(~queries, 0.0)
    t_real = t if valid is None else t.masked_fill(~valid, 0.0)
    v_real = v if valid is None else v.masked_fill(~valid[..., None], 0.0)
    total = s_kept.sum(dim=1) + t_real.sum(dim=1) + v_real.sum(dim=(1, 2))
    if b is not None:
        total = total + b[:, 0]
    nan_where_bad = torch.zeros_like(total).masked_fill(bad, float("nan"))  # 0 · finite elsewhere
    term = (total * nan_where_bad)[:, None, None].expand_as(out)
    where = bad[:, None] if queries is None else bad[:, None] & queries
    return torch.where(where[..., None], term, out)


def key_weights(valid, like):
    """Real keys as ``(N, T)`` 0/1 weights in ``like``'s dtype, and their count ``(N, 1)`` (>= 1)."""
    if valid is None:
        n_rows, length = like.shape
        return None, like.new_full((n_rows, 1), float(length))
    real = valid.to(like.dtype)
    return real, real.sum(dim=1, keepdim=True).clamp_min(1.0)


def keep_queries(out, queries):
    return out if queries is None else out.masked_fill(~queries[..., None], 0.0)


def score_differences(s, t):
    """``s_i − t_j`` as ``(N, T_query, T_key)``, written as ``s_i + (−t_j)`` so that autograd's
    backward reduces the T×T gradient straight into both (a subtraction would negate all of it)."""
    return s[:, :, None] + (-t)[:, None, :]


def tie_correction(diff, s, t, real):
    """A term of value 0 whose gradient turns ``2 ReLU(r) − r`` into ``|r|``'s at ties (``r = 0``).

    ``Σ_j |r_ij| = 2 Σ_j ReLU(r_ij) − Σ_j r_ij`` holds for the values, but at ``r = 0`` the right side
    has slope −1 where autograd gives ``abs'(0) = 0``. Adding ``Σ_j [r_ij = 0] r_ij`` (zero, slope
    +1 there) restores it; it costs a T×T comparison and runs only when some pair is tied.
    """
    # on a CPU, skip the term cheaply when no pair in the whole call is tied: the scores are finite
    # here, so a tie is |r| = 0, and one min over |r| costs a sixth of scanning the bool ``r == 0``
    if compiler.host_reads_allowed(diff):
        with torch.no_grad():
            if diff.numel() == 0 or bool(diff.abs().amin() > 0):
                return None
    ties = diff == 0
    weights = ties.to(s.dtype) if real is None else ties.to(s.dtype) * real[:, None, :]
    count = weights.sum(dim=2)
    term = s * count - torch.bmm(weights, t[..., None])[..., 0]  # Σ_j [tie] (s_i − t_j), 0 in value
    return term - term.detach()


def causal_keys(valid, like):
    """``allowed (N, T_query, T_key)``: key j is real and j <= i; and ``n_i`` (N, T) >= 1."""
    length = like.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool, device=like.device).tril()[None]
    if valid is None:
        n = torch.arange(1, length + 1, device=like.device, dtype=like.dtype)[None]
        return allowed, n
    allowed = allowed & valid[:, None, :]
    return allowed, valid.to(like.dtype).cumsum(dim=1).clamp_min(1.0)
