"""Exact sliced ReLU and sliced ReLU-bump attention in O(T log T) time and O(T·D) memory.

The math is in docs/attention.md. Both kernels are piecewise linear in the score difference
``r = s_i - t_j``, so once the keys are sorted by ``t`` every query's sum splits into
"keys below ``s_i``" and "keys above ``s_i``", and each part is an affine function of ``s_i``
whose coefficients are prefix sums over the sorted keys::

    Σ_{t_j < s_i} (s_i - t_j) w_j = s_i · P_w[p_i] - P_tw[p_i],     p_i = #{j : t_j < s_i}

``p_i`` comes from ``torch.searchsorted``. The backward pass is the same computation with queries
and keys exchanged (queries sorted, prefix sums of the scaled output gradient, gathered at each
key's rank), written by hand in a ``torch.autograd.Function`` so that nothing of size T×T is
ever built and autograd does not keep the sort/cumsum intermediates alive.

Implementation notes (why the code looks the way it does):

- Everything runs on rows ``(N = B·H, T, D)`` kept in the ``(T, D)`` layout of the inputs; row
  gathers are ``index_select`` on the flattened tensor, much faster on CPU than ``gather``.
- Large fresh allocations are what costs most on CPU (page faults), so prefix tables are built
  in place (``cumsum_``) and results are written with ``out=`` or in-place ops where that is safe.
- Padded keys are sorted after every real key (score +inf) and carry zero weight; padded queries
  get score 0, so whatever sits in padded slots (huge values included) never reaches a real
  position. Padded values must be finite (0 · inf is NaN in any formulation).
- Kinks are differentiated like torch autograd does on the naive formula (``relu'(0) = 0``,
  ``abs'(0) = 0``): tied scores take part in neither side of a gradient sum, hence the separate
  "strictly below" and "strictly above" ranks.

Precision: sums are accumulated in float32 for half/bfloat16/float32 inputs (float64 for float64)
and the result is cast back. Prefix sums are differences of running totals: a window or a
tail sum ``P[b] - P[a]`` loses about ``|P| / |P[b] - P[a]|`` ulps, and ``s_i · P_w - P_tw`` loses
about ``|s_i|·|P_w| / |result|``. So that this does not depend on where the scores sit, each row's
scores are shifted by one constant (exact: see ``_centre_scores``) and the tables hold centred
values (ReLU-bump: ``v - vbar``, with ``vbar`` times the hat mass added from float64 scalar tables).
What remains grows with T and with the scores' spread over the bump width. Measured float32
against float64: sliced ReLU with standard-normal scores, relative error 2e-6 on the output and
<= 1.5e-6 on the gradients at T = 65,536, the same at a score offset of 1,000; ReLU-bump at
T = 16,384, b = 0.005, 4e-4 on the output at offset 0 or 30 (``tests/attention/test_sliced_relu.py``
prints the figures).
"""

from __future__ import annotations

import functools

import torch

from attnlab.attention.precision import FLOAT_DTYPES, accumulation_dtype, no_autocast
from attnlab.attention.triton.runtime import IMPLS, resolve_impl

__all__ = ["sliced_relu_attention", "sliced_relu_bump_attention"]


# --------------------------------------------------------------------------------------------
# Small helpers on rows (N, T, ...)
# --------------------------------------------------------------------------------------------


def _row_offsets(n_rows: int, row_len: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(n_rows, device=device) * row_len)[:, None]


def _take(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``table[n, index[n, m]]`` for a contiguous table ``(N, L, C)`` and ``index (N, M)``.

    One ``index_select`` on the flattened table (rows of C contiguous numbers) instead of a
    ``gather`` with an expanded index: same result, several times faster on CPU.
    """
    n_rows, row_len, width = table.shape
    flat = (index + _row_offsets(n_rows, row_len, index.device)).reshape(-1)
    if out is None:
        return table.view(-1, width).index_select(0, flat).view(n_rows, -1, width)
    torch.index_select(table.view(-1, width), 0, flat, out=out.view(-1, width))
    return out


def _reuse(table: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A contiguous ``shape`` view on the front of ``table``'s memory, for a result that replaces it.

    Big fresh allocations are slow on CPU (page faults) and raise the peak: once a prefix table
    has been read for the last time, the gathered result is written over it.
    """
    return table.view(-1)[: shape.numel()].view(shape)


def _take_scalar(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[n, index[n, m]]`` for a table ``(N, L)``."""
    return torch.gather(table, 1, index)


def _sorted_rows(
    values: torch.Tensor, order: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None
) -> torch.Tensor:
    """``(values[order] - shift) · scale`` as a contiguous ``(N, T + 1, D)`` table whose row 0 is 0.

    The extra zero row makes the in-place ``cumsum_`` of the table an *exclusive* prefix sum:
    ``P[:, k] = Σ_{m<k} row_m``, so ``P[:, rank]`` is the sum over the ``rank`` smallest scores.
    ``shift`` is ``(N, D)`` (centring), ``scale`` is ``(N, T)`` in sorted order (masks, per-query
    weights); ``None`` skips the step. One row gather builds the table.
    """
    n_rows = values.shape[0]
    index = torch.cat([order.new_zeros(n_rows, 1), order], dim=1)  # row 0: any row, zeroed next
    table = _take(values, index)
    table[:, 0] = 0
    rows = table[:, 1:]
    if shift is not None:
        rows.sub_(shift[:, None, :])
    if scale is not None:
        rows.mul_(scale[..., None])
    return table


def _times_scores(table: torch.Tensor, scores_sorted: torch.Tensor) -> torch.Tensor:
    """The table of ``score · row`` beside a table from ``_sorted_rows`` (before its cumsum)."""
    out = torch.empty_like(table)
    out[:, 0] = 0
    torch.mul(table[:, 1:], scores_sorted[..., None], out=out[:, 1:])
    return out


def _cumsum_rows_(table: torch.Tensor, block: int = 128) -> torch.Tensor:
    """In-place cumulative sum over dim 1 of a contiguous ``(N, L, D)`` table, cache-blocked.

    ``cumsum`` over a middle dimension scans each of the D columns separately through the whole
    table (a cache line is fetched once per column); scanning blocks of ``block`` rows that fit
    in cache, then adding each block's carried total, reads the table about twice instead.
    """
    n_rows, length, width = table.shape
    n_blocks = length // block
    if n_blocks < 2:
        return table.cumsum_(1)
    body = table[:, : n_blocks * block].view(n_rows, n_blocks, block, width)
    body.cumsum_(2)
    carry = body[:, :, -1, :].cumsum(1)  # running total at the end of each block
    body[:, 1:].add_(carry[:, :-1, None, :])
    tail = table[:, n_blocks * block :]
    if tail.shape[1]:
        tail.cumsum_(1).add_(carry[:, -1:, :])
    return table


def _count_greater(rank: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """For each key j (original order): ``#{i : rank_i > position of key j in sorted order}``.

    ``rank (N, T)`` are query ranks among the sorted keys (values 0..T), ``order`` the key sort
    order. A histogram of the ranks, summed from the top, is read at every sorted position.
    """
    n_rows, length = rank.shape
    hist = torch.zeros(n_rows, length + 1, dtype=rank.dtype, device=rank.device)
    hist.scatter_add_(1, rank, torch.ones_like(rank))
    greater = length - hist.cumsum_(1)  # greater[:, r] = #{i : rank_i > r}
    return torch.empty_like(order).scatter_(1, order, greater[:, :length])


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``(N, T)`` → ``(N, T + 1)`` prefix sums starting at 0."""
    return torch.nn.functional.pad(torch.cumsum(x, dim=1), (1, 0))


def _valid_rows(key_padding_mask: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """``(B, T)`` mask → one row per (batch, head), ``(B·H, T)``."""
    if key_padding_mask is None:
        return None
    return key_padding_mask.repeat_interleave(heads, dim=0)


def _counts(valid: torch.Tensor | None, n_rows: int, length: int, dtype, device) -> torch.Tensor:
    """Number of real tokens per row, at least 1 (an all-padded row then outputs zeros)."""
    if valid is None:
        return torch.full((n_rows,), float(length), dtype=dtype, device=device)
    return valid.sum(dim=1).clamp_min(1).to(dtype)


def _sort_real_first(scores: torch.Tensor, valid: torch.Tensor | None):
    """Sort scores ascending with padded slots last. Returns the sorted scores with padded = +inf
    (for ``searchsorted``: no finite score ranks past a real one), the same with padded = 0 (for
    arithmetic: never inf · 0) and the sort order."""
    key = scores if valid is None else scores.masked_fill(~valid, float("inf"))
    ordered, order = torch.sort(key, dim=1)
    if valid is None:
        return ordered, ordered, order
    return ordered, ordered.masked_fill(~torch.gather(valid, 1, order), 0.0), order


def _masked_mean_rows(values: torch.Tensor, valid: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens of ``values (N, T, D)`` → ``(N, D)``, via a matmul (no T×D temporary)."""
    if valid is None:
        return values.mean(dim=1)
    weights = valid.to(values.dtype)[:, None, :]  # (N, 1, T)
    return torch.bmm(weights, values)[:, 0, :] / count[:, None]


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``(N, T, D)`` tensors without a T×D temporary."""
    return torch.einsum("ntd,ntd->nt", a, b)


def _centre_scores(s, t, valid, count):
    """Shift s and t by one constant per row, near the mean of its real scores; padded slots stay 0.

    The kernels depend on s - t only, so the shift changes nothing in exact arithmetic (and needs
    no gradient), but it does in floating point: the prefix tables of t·v and the products s·P
    grow with the scores' offset, so at an offset of 100 float32 kept about 3 digits of a narrow
    bump window. The shift is the mean rounded to a power of two near the scores' spread, so
    that s - c is exact for any score within about |c| of c (the kernels see the very same
    differences, kinks and ties included) while the centred scores stay of the order of the spread.
    """
    weight = None if valid is None else valid.to(s.dtype)
    mean = ((s.sum(dim=1) + t.sum(dim=1)) / (2 * count))[:, None]  # padded slots hold 0
    spread = (s - mean).square() + (t - mean).square()
    if weight is not None:
        spread = spread * weight
    std = (spread.sum(dim=1, keepdim=True) / (2 * count[:, None])).sqrt()
    step = torch.exp2(torch.floor(torch.log2(std)))  # 0 when all scores are equal
    ok = (step > 0) & torch.isfinite(step)
    centre = torch.where(ok, torch.round(mean / torch.where(ok, step, 1.0)) * step, mean)
    s, t = s - centre, t - centre
    if valid is not None:
        s, t = s.masked_fill(~valid, 0.0), t.masked_fill(~valid, 0.0)
    return s, t


def _first_order_only(op_name: str):
    """Refuse double backward up front: the hand-written backward passes are first order only.

    Run with ``create_graph=True``, they would fail deep inside with an ``out=`` error (or, run
    without a graph, give silently wrong second derivatives); this names the op and the way out.
    """

    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():  # the engine enables grad mode only for create_graph=True
                raise RuntimeError(
                    f"{op_name}: double backward (create_graph=True, e.g. gradient penalties, "
                    "Hessian-vector products, gradgradcheck) is not supported: its O(T log T) "
                    "backward pass is hand-written and first order only. For higher-order "
                    f"gradients use attnlab.attention.reference.{op_name} (O(T²) memory)."
                )
            return backward(ctx, *grads)

        return checked

    return decorate


# --------------------------------------------------------------------------------------------
# Sliced ReLU
# --------------------------------------------------------------------------------------------


class _SlicedReLU(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)`` in the accumulation dtype; ``valid (N, T)`` or None."""

    @staticmethod
    def forward(ctx, s, t, v, valid, eps):
        with no_autocast(v.device):
            return _SlicedReLU._forward(ctx, s, t, v, valid, eps)

    @staticmethod
    @_first_order_only("sliced_relu_attention")
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _SlicedReLU._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, s, t, v, valid, eps):
        n_rows, length, _ = v.shape
        count = _counts(valid, n_rows, length, v.dtype, v.device)
        if valid is not None:  # padded slots get harmless finite scores
            s = s.masked_fill(~valid, 0.0)
            t = t.masked_fill(~valid, 0.0)
        s, t = _centre_scores(s, t, valid, count)
        t_search, t_sorted, order = _sort_real_first(t, valid)

        # Prefix sums over sorted keys of w = v - vbar, of t·w and of t. Padded keys sit after
        # every real key and no rank ever reaches past the real ones, so their rows of the tables
        # (whatever they hold) are never read: no masking pass is needed.
        vbar = _masked_mean_rows(v, valid, count)
        p_w = _sorted_rows(v, order, vbar, None)
        p_tw = _times_scores(p_w, t_sorted)
        _cumsum_rows_(p_w)
        _cumsum_rows_(p_tw)
        p_t = _exclusive_cumsum(t_sorted)

        rank = torch.searchsorted(t_search, s, side="left")  # p_i = #{j : t_j < s_i}
        below_w = _take(p_w, rank)  # Σ_{t_j<s_i} w_j, kept for the backward pass
        out = _take(p_tw, rank, out=_reuse(p_w, below_w.shape))  # Σ_{t_j<s_i} t_j w_j
        del p_tw
        # Σ_j |s_i - t_j| = s_i (2 p_i - n) + Σ_j t_j - 2 Σ_{t_j<s_i} t_j   (ties add 0 either way)
        den = s * (2 * rank.to(s.dtype) - count[:, None]) + p_t[:, -1:] - 2 * _take_scalar(p_t, rank)
        scale = 2.0 / den.clamp_min(eps)
        if valid is not None:
            scale = scale.masked_fill(~valid, 0.0)
        out.mul_(-scale[..., None]).addcmul_(below_w, (s * scale)[..., None])  # 2 (s P_w - P_tw) / den

        ctx.save_for_backward(s, t, t_search, order, rank, below_w, den, out, v, vbar, count)
        ctx.valid = valid
        ctx.eps = eps
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, t_search, order, rank, below_w, den, out, v, vbar, count = ctx.saved_tensors
        valid, eps = ctx.valid, ctx.eps
        grad_out = grad_out.contiguous()

        # o_i = 2 N_i / d_i with d_i = max(den_i, eps):  dL/dN_i = a_i = 2 g_i / d_i and
        # dL/dden_i = -(g_i · o_i) / d_i where den_i >= eps (where clamp passes the gradient).
        inv_d = 1.0 / den.clamp_min(eps)
        a_scale = 2.0 * inv_d
        grad_den = -_rowdot(grad_out, out) * inv_d * (den >= eps)
        if valid is not None:
            a_scale = a_scale.masked_fill(~valid, 0.0)
            grad_den = grad_den.masked_fill(~valid, 0.0)

        # Queries: dL/ds_i = a_i · Σ_{t_j<s_i} w_j + dden_i (#{t_j<s_i} - #{t_j>s_i}).
        rank_le = torch.searchsorted(t_search, s, side="right")  # #{j : t_j <= s_i}
        grad_s = a_scale * _rowdot(grad_out, below_w)
        grad_s += grad_den * (rank + rank_le - count[:, None]).to(s.dtype)

        # Keys: queries sorted by -s, so that prefix sums are sums over {i : s_i > t_j}.
        # Padded queries (score 0, zero weight) stay in the order so that it matches the counts.
        _, neg_sorted, q_order = _sort_real_first(-s, None)
        q_a = _sorted_rows(grad_out, q_order, None, torch.gather(a_scale, 1, q_order))
        q_sa = _times_scores(q_a, -neg_sorted)
        _cumsum_rows_(q_a)  # Σ a_i
        _cumsum_rows_(q_sa)  # Σ s_i a_i
        q_den = _exclusive_cumsum(torch.gather(grad_den, 1, q_order))

        # s_i > t_j  <=>  #{keys < s_i} > (sorted position of key j), and s_i >= t_j  <=>
        # #{keys <= s_i} > (its position): counting ranks gives every key's count of queries above
        # it without another binary search.
        above = _count_greater(rank, order)  # #{i : s_i > t_j}
        at_or_above = _count_greater(rank_le, order)  # #{i : s_i >= t_j}
        sum_a = _take(q_a, above)
        grad_v = _take(q_sa, above, out=_reuse(q_a, sum_a.shape))
        del q_sa
        # dL/dw_j = Σ_{s_i>t_j} (s_i - t_j) a_i
        # dL/dt_j = -w_j · Σ_{s_i>t_j} a_i - Σ_{s_i>t_j} dden_i + Σ_{s_i<t_j} dden_i
        grad_v.addcmul_(sum_a, t[..., None], value=-1.0)
        w_dot_a = _rowdot(v, sum_a) - torch.bmm(sum_a, vbar[:, :, None])[..., 0]
        den_above = _take_scalar(q_den, above)
        den_below = q_den[:, -1:] - _take_scalar(q_den, at_or_above)
        grad_t = den_below - den_above - w_dot_a

        # vbar depends on every real v_k: subtract the mean of dL/dw over the real keys.
        grad_v -= _masked_mean_rows(grad_v, valid, count)[:, None, :]
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, None, None


# --------------------------------------------------------------------------------------------
# Sliced ReLU-bump
# --------------------------------------------------------------------------------------------


def _hat_windows(search: torch.Tensor, centres: torch.Tensor, width: torch.Tensor):
    """Ranks bounding the windows (c - b, c] and (c, c + b) of each centre among sorted scores."""
    lo = torch.searchsorted(search, centres - width, side="right")  # #{x <= c - b}
    mid = torch.searchsorted(search, centres, side="right")  # #{x <= c}
    hi = torch.searchsorted(search, centres + width, side="left")  # #{x < c + b}
    return lo, mid, hi


def _gather_combine(table, terms, dots_with=None, out=None, buffer=None):
    """``out += Σ_k coef_k · table[index_k]`` (row-wise) and the row dots ``dots_with · table[index_k]``.

    ``terms`` is a list of ``(index (N, T), coef (N, T) or None)``; a ``None`` coefficient only
    takes the dot. Every gathered row goes through one reused buffer, so a combination of any
    number of prefix-table lookups costs two ``(N, T, D)`` tensors at most.
    Returns ``(out, [dots...] or None, buffer)``.
    """
    dots = [] if dots_with is not None else None
    for index, coef in terms:
        buffer = _take(table, index, out=buffer)
        if dots is not None:
            dots.append(_rowdot(dots_with, buffer))
        if coef is None:
            continue
        if out is None:
            out, buffer = buffer.mul_(coef[..., None]), None
        else:
            out.addcmul_(buffer, coef[..., None])
    return out, dots, buffer


def _hat_terms(lo, mid, hi, centres, width, coef):
    """Coefficients of ``Σ_{x∈(c-b, c+b)} (1 - |c - x|/b) row`` on the prefix tables P (rows) and
    P_x (score·rows): with L = P[mid] - P[lo] (window (c-b, c]) and R = P[hi] - P[mid] ((c, c+b)),
    b·Σ = (b - c) L + L_x + (b + c) R - R_x, i.e. P[lo]·-(b - c) + P[mid]·-2c + P[hi]·(b + c)
    and P_x[lo]·-1 + P_x[mid]·2 + P_x[hi]·-1; ``coef`` (per centre) multiplies everything."""
    rows = [(lo, -(width - centres) * coef), (mid, -2 * centres * coef), (hi, (width + centres) * coef)]
    scored = [(lo, -coef), (mid, 2 * coef), (hi, -coef)]
    return rows, scored


def _key_windows(p_t, lo, mid, hi, dtype):
    """Key counts and key-score sums of the windows (c - b, c] and (c, c + b) of every centre c.

    ``p_t`` is the float64 exclusive prefix sum of the sorted key scores: unlike the vector tables,
    its running total is of order T·E|t| (no sign cancellation), so its differences are taken in
    float64 (an (N, T) table: cheap) before the result is rounded to ``dtype``.
    """
    left_n, right_n = (mid - lo).to(dtype), (hi - mid).to(dtype)
    at_lo, at_mid, at_hi = (torch.gather(p_t, 1, k) for k in (lo, mid, hi))
    return left_n, right_n, (at_mid - at_lo).to(dtype), (at_hi - at_mid).to(dtype)


class _SlicedReLUBump(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)``, per-row bandwidth ``b (N, 1)``; ``valid`` or None."""

    @staticmethod
    def forward(ctx, s, t, v, b, valid):
        with no_autocast(v.device):
            return _SlicedReLUBump._forward(ctx, s, t, v, b, valid)

    @staticmethod
    @_first_order_only("sliced_relu_bump_attention")
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _SlicedReLUBump._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, s, t, v, b, valid):
        n_rows, length, _ = v.shape
        count = _counts(valid, n_rows, length, v.dtype, v.device)
        if valid is not None:
            s = s.masked_fill(~valid, 0.0)
            t = t.masked_fill(~valid, 0.0)
        s, t = _centre_scores(s, t, valid, count)
        t_search, t_sorted, order = _sort_real_first(t, valid)
        # Tables of the centred values w = v - vbar (running totals stay of order sqrt(T) instead of
        # T·|vbar|); vbar comes back as vbar · (hat mass), from the scalar tables below.
        # Padded rows are never read (see _SlicedReLU).
        vbar = _masked_mean_rows(v, valid, count)
        p_v = _sorted_rows(v, order, vbar, None)
        p_tv = _times_scores(p_v, t_sorted)
        _cumsum_rows_(p_v)
        _cumsum_rows_(p_tv)
        p_t = _exclusive_cumsum(t_sorted.to(torch.float64))

        lo, mid, hi = _hat_windows(t_search, s, b)
        coef = (1.0 / (count[:, None] * b)).expand(-1, length)  # 1 / (n b)
        if valid is not None:
            coef = coef.masked_fill(~valid, 0.0)
        rows, scored = _hat_terms(lo, mid, hi, s, b, coef)
        out, _, buffer = _gather_combine(p_v, rows)
        out, _, _ = _gather_combine(p_tv, scored, out=out, buffer=buffer)
        # (1/n) Σ_j hat(s_i - t_j) = coef · ((b - s) n_left + t_left + (b + s) n_right - t_right)
        left_n, right_n, left_t, right_t = _key_windows(p_t, lo, mid, hi, s.dtype)
        mass = coef * ((b - s) * left_n + left_t + (b + s) * right_n - right_t)
        out.addcmul_(mass[..., None], vbar[:, None, :])

        ctx.save_for_backward(s, t, v, b, t_search, p_v, p_tv, p_t, vbar, lo, mid, hi, coef)
        ctx.valid = valid
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, b, t_search, p_v, p_tv, p_t, vbar, lo, mid, hi, coef = ctx.saved_tensors
        valid = ctx.valid
        grad_out = grad_out.contiguous()

        # Queries. hat'(r) = -sign(r)/b inside the window and 0 at r = 0 and |r| = b, so
        #   dL/ds_i = coef g_i · (Σ_{t∈(s,s+b)} v - Σ_{t∈(s-b,s)} v)
        #           = coef g_i · (P[hi] - P[mid] + P[lo] - P[below])   (keys tied with s_i drop out)
        #   dL/db   = Σ_i coef/b · g_i · Σ_{|r|<b} |r| v_j = coef/b · g_i · (s (L - R) + R_x - L_x).
        # The tables hold w = v - vbar: window sums of v add vbar times the window's key count
        # (resp. its key-score sum), i.e. g·vbar times a scalar window term.
        below = torch.searchsorted(t_search, s, side="left")  # #{t < s}
        _, (g_lo, g_mid, g_hi, g_below), buffer = _gather_combine(
            p_v, [(lo, None), (mid, None), (hi, None), (below, None)], dots_with=grad_out
        )
        _, (gx_lo, gx_mid, gx_hi), buffer = _gather_combine(
            p_tv, [(lo, None), (mid, None), (hi, None)], dots_with=grad_out, buffer=buffer
        )
        g_vbar = torch.bmm(grad_out, vbar[:, :, None])[..., 0]
        left_n, right_n, left_t, right_t = _key_windows(p_t, lo, mid, hi, s.dtype)
        tied = (mid - below).to(s.dtype)  # keys with t = s: in the left window, not in the derivative
        grad_s = coef * (g_hi - g_mid + g_lo - g_below + g_vbar * (right_n - left_n + tied))
        left, right = g_mid - g_lo + g_vbar * left_n, g_hi - g_mid + g_vbar * right_n
        left_x, right_x = gx_mid - gx_lo + g_vbar * left_t, gx_hi - gx_mid + g_vbar * right_t
        grad_b = (coef / b * (s * (left - right) + right_x - left_x)).sum(dim=1, keepdim=True)

        # Keys: the same windows with queries and keys exchanged (the hat is symmetric), on
        # prefix tables of c_i g_i and s_i c_i g_i over the queries sorted by s (c = coef).
        #   dL/dv_j = Σ_i c_i hat(s_i - t_j) g_i
        #   dL/dt_j = v_j · (Σ_{s∈(t,t+b)} c g - Σ_{s∈(t-b,t)} c g)
        s_search, s_sorted, q_order = _sort_real_first(s, valid)
        q_g = _sorted_rows(grad_out, q_order, None, torch.gather(coef, 1, q_order))
        q_sg = _times_scores(q_g, s_sorted)
        _cumsum_rows_(q_g)
        _cumsum_rows_(q_sg)
        k_lo, k_mid, k_hi = _hat_windows(s_search, t, b)
        k_below = torch.searchsorted(s_search, t, side="left")
        rows, scored = _hat_terms(k_lo, k_mid, k_hi, t, b, torch.ones_like(coef))
        grad_v, (v_lo, v_mid, v_hi), buffer = _gather_combine(q_g, rows, dots_with=v, buffer=buffer)
        _, (v_below,), buffer = _gather_combine(q_g, [(k_below, None)], dots_with=v, buffer=buffer)
        grad_v, _, _ = _gather_combine(q_sg, scored, out=grad_v, buffer=buffer)
        grad_t = v_hi - v_mid + v_lo - v_below
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, grad_b, None


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _check_inputs(name, s, t, v, key_padding_mask) -> None:
    for label, x in (("s", s), ("t", t), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {label} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: {label} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if v.dim() != 4:
        raise ValueError(f"{name}: v must have shape (B, H, T, D), got {tuple(v.shape)}")
    batch, heads, length, _ = v.shape
    for label, x in (("s", s), ("t", t)):
        if tuple(x.shape) != (batch, heads, length):
            raise ValueError(
                f"{name}: {label} must have shape (B, H, T) = {(batch, heads, length)} to match "
                f"v {tuple(v.shape)}, got {tuple(x.shape)}"
            )
    if length == 0:
        raise ValueError(
            f"{name}: sequences must hold at least one position (T >= 1), got v {tuple(v.shape)}"
        )
    if not (s.device == t.device == v.device):
        raise ValueError(f"{name}: s, t, v must be on one device, got {s.device}, {t.device}, {v.device}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{name}: key_padding_mask must be a bool tensor (True = real token)")
        if tuple(key_padding_mask.shape) != (batch, length):
            raise ValueError(
                f"{name}: key_padding_mask must have shape (B, T) = {(batch, length)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, T, ...)`` → contiguous ``(B·H, T, ...)`` in ``dtype``."""
    return x.reshape(-1, *x.shape[2:]).to(dtype).contiguous()


def _torch_only_causal(op: str, impl: str) -> None:
    """The causal ops have no Triton kernel yet: ``auto`` runs the torch code, ``triton`` is refused."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "triton":
        raise ValueError(f"{op}: causal=True has no Triton kernel yet; use impl='auto' or impl='torch'")


def sliced_relu_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-4,
    causal: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """Exact sliced ReLU attention in O(T log T): ``(B, H, T, D)`` output.

    ``o_i = 2 Σ_j ReLU(s_i - t_j)(v_j - vbar) / max(Σ_j |s_i - t_j|, eps)`` with sums and the
    mean ``vbar`` over real keys. ``s`` (query scores) and ``t`` (key scores) are ``(B, H, T)``,
    ``v`` is ``(B, H, T, D)``, ``key_padding_mask`` a bool ``(B, T)`` with True = real token.
    Padded query positions output zeros. Differentiable in ``s``, ``t`` and ``v``.
    ``causal=True``: keys j <= i only, every statistic over that prefix, in O(T log² T)
    (``attnlab.attention.causal_sliced``; torch code only, no Triton kernel yet). ``impl``:
    ``"auto"`` (Triton kernels for CUDA tensors, this torch code otherwise), ``"triton"`` or
    ``"torch"`` (see ``attnlab.attention.triton``).
    """
    _check_inputs("sliced_relu_attention", s, t, v, key_padding_mask)
    if not eps > 0:
        raise ValueError(f"sliced_relu_attention: eps must be > 0, got {eps}")
    if causal:
        from attnlab.attention.causal_sliced import causal_sliced_relu_attention

        _torch_only_causal("sliced_relu_attention", impl)
        return causal_sliced_relu_attention(s, t, v, key_padding_mask, eps)
    impl = resolve_impl("sliced_relu_attention", impl, s, t, v)
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    valid = _valid_rows(key_padding_mask, heads)
    if valid is not None:
        valid = valid.to(v.device)
    if impl == "triton":
        from attnlab.attention.triton import sliced

        return sliced.sliced_relu(s, t, v, valid, eps, acc)
    out = _SlicedReLU.apply(_rows(s, acc), _rows(t, acc), _rows(v, acc), valid, float(eps))
    return out.view(batch, heads, length, dim).to(v.dtype)


def sliced_relu_bump_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    bandwidth: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """Exact sliced ReLU-bump attention in O(T log T): ``(B, H, T, D)`` output.

    ``o_i = (1/n) Σ_j max(0, 1 - |s_i - t_j| / b_h) v_j`` over the n real keys (values are not
    centred). ``bandwidth`` is a positive finite ``(H,)`` tensor, one width per head, and receives a
    gradient (it is a learned parameter of the layer). Other arguments as in
    ``sliced_relu_attention``. The window sums are prefix-sum differences, so in float32 very
    narrow bandwidths at long T lose precision (the window is small next to the running totals);
    the scores' offset does not matter (the op centres them).
    ``causal=True``: keys j <= i only, n_i = real keys j <= i, in O(T log² T) (torch code only).
    ``impl`` as in ``sliced_relu_attention``.
    """
    _check_inputs("sliced_relu_bump_attention", s, t, v, key_padding_mask)
    batch, heads, length, dim = v.shape
    if not isinstance(bandwidth, torch.Tensor) or tuple(bandwidth.shape) != (heads,):
        shape = tuple(bandwidth.shape) if isinstance(bandwidth, torch.Tensor) else type(bandwidth).__name__
        raise ValueError(
            f"sliced_relu_bump_attention: bandwidth must have shape (H,) = ({heads},), got {shape}"
        )
    if not bandwidth.is_floating_point():
        raise TypeError(
            f"sliced_relu_bump_attention: bandwidth must be a float tensor, got {bandwidth.dtype}"
        )
    # b = inf would be the plain mean of v, but the window formula turns it into inf - inf = NaN
    positive = "sliced_relu_bump_attention: bandwidth must be finite and > 0 everywhere"
    good = ((bandwidth > 0) & torch.isfinite(bandwidth)).all()
    if bandwidth.is_cuda:  # checked on the device: a host-side check would stall every layer call
        torch._assert_async(good, positive)
    elif not bool(good):
        raise ValueError(f"{positive}, got {bandwidth.detach().tolist()}")
    if causal:
        from attnlab.attention.causal_sliced import causal_sliced_relu_bump_attention

        _torch_only_causal("sliced_relu_bump_attention", impl)
        return causal_sliced_relu_bump_attention(s, t, v, bandwidth, key_padding_mask)
    impl = resolve_impl("sliced_relu_bump_attention", impl, s, t, v)
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    valid = _valid_rows(key_padding_mask, heads)
    if valid is not None:
        valid = valid.to(v.device)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]  # row n = (b, h) → b_h
    if impl == "triton":
        from attnlab.attention.triton import sliced

        return sliced.sliced_relu_bump(s, t, v, width, valid, acc)
    out = _SlicedReLUBump.apply(_rows(s, acc), _rows(t, acc), _rows(v, acc), width, valid)
    return out.view(batch, heads, length, dim).to(v.dtype)
