"""Causal sliced ReLU / ReLU-bump attention: exact O(T log² T) parallel ops.

The causal ops are the bidirectional ones (``attnlab.attention.sliced``) restricted to keys
``j ≤ i``, with every statistic over that prefix: value mean ``vbar_i``, normaliser
``Σ_{j≤i} |s_i − t_j|``, bump count ``n_i``. Both kernels are piecewise linear in ``s_i − t_j``, so
every output is a combination of *dominance sums* ``Σ_{j≤i, t_j<x_i} w_j`` (x_i = s_i, or s_i ± b
for the bump) of a few weight columns ``w``: a two-dimensional query (time and score).

``_dominance_sums`` answers them for all i at once, vectorised over rows and columns, with a Python
loop over log₂(T / chunk) levels only (divide and conquer over time):

- inside chunks of ``chunk`` consecutive tokens, a dense masked ``(chunk × chunk)`` matrix product
  (``[j ≤ i][t_j < x_i]``), which also takes the diagonal ``j = i``;
- at level ``h`` (h = chunk, 2·chunk, ...) time splits into blocks of 2h: the keys of each block's
  left half are sorted (``torch.sort`` on a ``(rows, blocks, h)`` view), the weight columns get
  per-block prefix sums in that order, and every query of the right half finds its rank with a
  batched ``searchsorted`` and gathers one prefix row. Each pair ``j < i`` in different chunks is
  counted at exactly one level (the highest bit where i and j differ).

Cost: O(T·W·(chunk + log T)) arithmetic and O(T log² T) comparisons (the sorts) for W columns;
memory O(T·W). The backward passes (hand-written ``autograd.Function``s) use the same routine with
time reversed (``j ≥ i`` becomes a prefix) and queries and keys exchanged.

Precision. Sums accumulate in float32 for half/float32 inputs and float64 for float64. Scores are
shifted by the key score of the row's first real token (and, for sliced ReLU, whose output does
not depend on a common shift of the values, values by that token's value): a per-row constant that
cancels exactly in ``s_i − t_j`` and in ``v_j − vbar_i``, removes large offsets, and depends on no
future token. Cancellation can still bite where the formulas subtract: ``s_i · Σ w − Σ t w``
(loses about |s_i|·|Σ w| / |result| ulps, growing with T and the score spread), the prefix mean
``vbar_i · (s_i C_i − E_i)`` subtracted from the uncentred sum (values with a mean far from the first
token's value), and the bump's window sums for bandwidths narrow next to the score spread. Measured
figures are in ``tests/attention/test_causal_sliced.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced.common import _rowdot, _rows, _take, _valid_rows

__all__ = ["DEFAULT_CHUNK", "causal_sliced_relu_attention", "causal_sliced_relu_bump_attention"]

DEFAULT_CHUNK = 32  # dense local block: below it a masked matmul beats sorting (measured on CPU)


# --------------------------------------------------------------------------------------------
# Row helpers
# --------------------------------------------------------------------------------------------


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i ≥ j} x_i`` along dim 1."""
    return x.flip(1).cumsum(1).flip(1)


def _pad_to(x: torch.Tensor, length: int, value: float) -> torch.Tensor:
    extra = length - x.shape[1]
    return x if extra <= 0 else F.pad(x, (0, extra), value=value)


def _prefix_sums_(table: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In-place cumulative sum over dim 1 of a contiguous ``(R, L, W)`` table (W = a few dozen).

    On CPU ``cumsum`` over a middle dimension scans each of the W columns on its own, a strided walk
    that made it the largest cost of the causal ops (about 2 GB/s). Here rows are added one after
    another, ``block`` rows at a time (each add is one vectorised op over R·W numbers), and the
    blocks' running totals are carried by one small ``cumsum``: three to four times faster.
    """
    rows, length, width = table.shape
    n_blocks = length // block
    if n_blocks < 2:
        for k in range(1, length):
            table[:, k] += table[:, k - 1]
        return table
    body = table[:, : n_blocks * block].view(rows, n_blocks, block, width)
    for k in range(1, block):
        body[:, :, k] += body[:, :, k - 1]
    carry = body[:, :, -1, :].cumsum(1)  # running total at the end of each block
    body[:, 1:] += carry[:, :-1, None, :]
    tail = table[:, n_blocks * block :]
    for k in range(1, tail.shape[1]):
        tail[:, k] += tail[:, k - 1]
    tail += carry[:, -1:, :]
    return table


class _Query(NamedTuple):
    """Thresholds ``x (N, T)`` (finite), ``side`` "left" (keys < x) or "right" (keys <= x), and the
    table columns to sum (a slice)."""

    x: torch.Tensor
    side: str
    cols: slice = slice(None)


def _dominance_sums(key: torch.Tensor, table: torch.Tensor, queries: list[_Query], chunk: int) -> list:
    """For every query set and position i: ``Σ_{j ≤ i, key_j < x_i} table_j`` (or ``key_j <= x_i``).

    ``key (N, T)`` may hold +inf for keys that must never count; ``table (N, T, W)`` is finite and
    contiguous. Returns one ``(N, T, w)`` tensor per query set (w = width of its column slice).
    """
    n_rows, length, width = table.shape
    outs = [table.new_zeros(n_rows, length, table[0, 0, q.cols].numel()) for q in queries]
    causal_mask = {}

    def local(start: int, size: int, count: int) -> None:
        stop = start + size * count
        kc = key[:, start:stop].reshape(n_rows, count, size)
        tc = table[:, start:stop].reshape(n_rows, count, size, width)
        if size not in causal_mask:
            causal_mask[size] = torch.ones(size, size, dtype=torch.bool, device=key.device).tril()
        for q, out in zip(queries, outs, strict=True):
            xc = q.x[:, start:stop].reshape(n_rows, count, size)
            keys, thresholds = kc[..., None, :], xc[..., :, None]
            below = keys < thresholds if q.side == "left" else keys <= thresholds
            weights = (below & causal_mask[size]).to(table.dtype)
            out[:, start:stop] = torch.matmul(weights, tc[..., q.cols]).reshape(n_rows, -1, out.shape[-1])

    full = length // chunk
    if full:
        local(0, chunk, full)
    if length - full * chunk:
        local(full * chunk, length - full * chunk, 1)

    half = chunk
    while half < length:
        block = 2 * half
        n_blocks = (length - half + block - 1) // block  # blocks whose right half is not empty
        span = n_blocks * block
        left_keys = _pad_to(key, span, float("inf"))[:, :span].view(n_rows, n_blocks, block)[..., :half]
        sorted_keys, order = torch.sort(left_keys, dim=-1)
        starts = torch.arange(n_blocks, device=key.device) * block
        positions = order + starts[:, None]  # all < length: left halves lie before a right half
        index = torch.cat([positions[..., :1], positions], dim=-1).view(n_rows, -1)  # row 0: zeroed
        prefix = _take(table, index).view(n_rows * n_blocks, half + 1, width)
        prefix[:, 0] = 0
        _prefix_sums_(prefix)
        prefix = prefix.view(n_rows, n_blocks * (half + 1), width)
        last_right = (n_blocks - 1) * block + half  # start of the last (maybe partial) right half
        last_size = min(half, length - last_right)
        n_queries = (n_blocks - 1) * half + last_size  # right-half positions < length
        row_starts = (torch.arange(n_blocks, device=key.device) * (half + 1))[:, None]
        for q, out in zip(queries, outs, strict=True):
            right = _pad_to(q.x, span, 0.0)[:, :span].view(n_rows, n_blocks, block)[..., half:]
            rank = torch.searchsorted(sorted_keys, right.contiguous(), side=q.side)
            flat = (rank + row_starts).view(n_rows, -1)[:, :n_queries]
            if q.cols == slice(None):
                rows = _take(prefix, flat)
            else:
                narrow = prefix[..., q.cols]
                rows = torch.gather(narrow, 1, flat[..., None].expand(-1, -1, narrow.shape[-1]))
            w = out.shape[-1]
            done = (n_blocks - 1) * half
            if n_blocks > 1:
                view = out[:, : (n_blocks - 1) * block].view(n_rows, n_blocks - 1, block, w)[:, :, half:]
                view += rows[:, :done].view(n_rows, n_blocks - 1, half, w)
            out[:, last_right : last_right + last_size] += rows[:, done:]
        half = block
    return outs


def _first_real(valid: torch.Tensor | None, n_rows: int, device) -> torch.Tensor:
    """Index of each row's first real token (0 for an all-padded row)."""
    if valid is None:
        return torch.zeros(n_rows, dtype=torch.long, device=device)
    return valid.to(torch.int8).argmax(dim=1)


def _shift_scores(s, t, valid):
    """Scores minus the row's first real key score (exact in ``s − t``; see the module docstring)."""
    first = _first_real(valid, s.shape[0], s.device)
    shift = torch.gather(t, 1, first[:, None])
    s, t = s - shift, t - shift
    if valid is not None:
        s, t = s.masked_fill(~valid, 0.0), t.masked_fill(~valid, 0.0)
    return s, t, first


TIE_PAIR_BUDGET = 4  # tied (query, key) pairs listed per position at most; beyond, an exact extra pass


def _tied_pairs(s: torch.Tensor, t: torch.Tensor, valid: torch.Tensor | None):
    """The pairs ``j <= i`` of real positions with ``s_i == t_j`` exactly, as flat indices
    ``(n·T + i, n·T + j)``; None when there are more than ``TIE_PAIR_BUDGET · N · T`` of them.

    The ops need sums over ``t_j <= s_i`` beside those over ``t_j < s_i`` (kinks: relu'(0) = 0,
    hat'(0) = 0). They differ by the tied pairs only, which scores from real data have by accident
    (float32 at T = 16K: a few dozen per row), so the difference is added from this list instead
    of one more dominance pass over every level. Many ties (quantised scores, constant rows) return
    None and the caller takes that exact pass. One sort and two binary searches per row.
    """
    n_rows, length = s.shape
    if valid is not None:  # padded positions never tie: -inf queries against +inf keys
        s, t = s.masked_fill(~valid, -float("inf")), t.masked_fill(~valid, float("inf"))
    keys, key_order = torch.sort(t, dim=1)
    lo = torch.searchsorted(keys, s, side="left")
    counts = (torch.searchsorted(keys, s, side="right") - lo).view(-1)
    total = int(counts.sum())
    if total > TIE_PAIR_BUDGET * s.numel():
        return None
    query = torch.repeat_interleave(torch.arange(s.numel(), device=s.device), counts)
    run_start = torch.cumsum(counts, 0) - counts  # where each query's pairs start in the list
    position = lo.view(-1)[query] + torch.arange(total, device=s.device) - run_start[query]
    row_start = query - query % length
    key = key_order.view(-1)[row_start + position] + row_start
    keep = key <= query  # j <= i (same row)
    return query[keep], key[keep]


def _reverse_key(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return (x if valid is None else x.masked_fill(~valid, float("inf"))).flip(1)


# --------------------------------------------------------------------------------------------
# Causal sliced ReLU
# --------------------------------------------------------------------------------------------


class _CausalSlicedReLU(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)`` in the accumulation dtype; ``valid (N, T)`` or None."""

    @staticmethod
    def forward(ctx, s, t, v, valid, eps, chunk):
        with no_autocast(v.device):
            return _CausalSlicedReLU._forward(ctx, s, t, v, valid, eps, chunk)

    @staticmethod
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _CausalSlicedReLU._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, s, t, v, valid, eps, chunk):
        n_rows, length, dim = v.shape
        s, t, first = _shift_scores(s, t, valid)
        v = v - _take(v, first[:, None])  # output is invariant to a common value shift
        real = None if valid is None else valid.to(v.dtype)
        if real is not None:
            v = v * real[..., None]  # padded values (finite garbage) vanish from every sum
        key = t if valid is None else t.masked_fill(~valid, float("inf"))
        ones = torch.ones_like(t) if real is None else real
        table = torch.cat([v, t[..., None] * v, ones[..., None], t[..., None]], dim=-1).contiguous()
        # #{j <= i : t_j <= s_i} (for the gradient) is #{t_j < s_i} plus the tied pairs
        pairs = _tied_pairs(s, t, valid)
        queries = [_Query(s, "left")]
        if pairs is None:  # too many ties to list: count them in a pass of their own
            queries.append(_Query(s, "right", slice(2 * dim, 2 * dim + 1)))
        below, *at_or_below = _dominance_sums(key, table, queries, chunk)
        del table
        sum_v, sum_tv = below[..., :dim].contiguous(), below[..., dim : 2 * dim]  # A_i, B_i
        count, sum_t = below[..., 2 * dim], below[..., 2 * dim + 1]  # C_i, E_i: keys below s_i
        if pairs is None:
            count_le = at_or_below[0][..., 0]
        else:
            count_le = count.contiguous()
            count_le.view(-1).index_add_(0, pairs[0], torch.ones_like(pairs[0], dtype=count.dtype))
        del below

        n = ones.cumsum(1)  # real keys j <= i
        n_safe = n.clamp_min(1)
        vbar = v.cumsum(1) / n_safe[..., None]
        total_t = t.cumsum(1)
        relu_mass = s * count - sum_t  # Σ_{j≤i} ReLU(s_i − t_j)
        # numerator Σ_{j≤i, t_j<s_i} (s_i − t_j)(v_j − vbar_i) = s A − B − vbar (s C − E)
        num = torch.addcmul(-sum_tv, sum_v, s[..., None]).sub_(vbar * relu_mass[..., None])
        den = s * (2 * count - n) + total_t - 2 * sum_t  # Σ_{j≤i} |s_i − t_j|
        scale = 2.0 / den.clamp_min(eps)
        if valid is not None:
            scale = scale.masked_fill(~valid, 0.0)
        out = num.mul_(scale[..., None])
        ctx.save_for_backward(s, t, v, sum_v, vbar, count, count_le, n_safe, relu_mass, den, out)
        ctx.valid, ctx.eps, ctx.chunk, ctx.pairs = valid, eps, chunk, pairs
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, sum_v, vbar, count, count_le, n, relu_mass, den, out = ctx.saved_tensors
        valid, eps, chunk, pairs = ctx.valid, ctx.eps, ctx.chunk, ctx.pairs
        dim = v.shape[-1]
        inv_d = 1.0 / den.clamp_min(eps)
        a = grad_out * (2.0 * inv_d)[..., None]  # dL/dnum_i
        grad_den = -_rowdot(grad_out, out) * inv_d * (den >= eps)
        if valid is not None:
            a = a.masked_fill(~valid[..., None], 0.0)
            grad_den = grad_den.masked_fill(~valid, 0.0)
        a_vbar = _rowdot(a, vbar)

        # Queries: dL/ds_i = a_i·(A_i − C_i vbar_i) + dden_i (#{t_j<s_i} − #{t_j>s_i}), j ≤ i.
        grad_s = _rowdot(a, sum_v) - count * a_vbar + grad_den * (count + count_le - n)

        # Keys: sums over later queries i ≥ j with s_i > t_j, i.e. a prefix in reversed time with
        # negated scores (-s_i < -t_j).
        table = torch.cat([a, s[..., None] * a, grad_den[..., None], a_vbar[..., None]], dim=-1)
        queries = [_Query((-t).flip(1), "left")]
        if pairs is None:
            queries.append(_Query((-t).flip(1), "right", slice(2 * dim, 2 * dim + 1)))
        above, *at_or_above = _dominance_sums(
            _reverse_key(-s, valid), table.flip(1).contiguous(), queries, chunk
        )
        above = above.flip(1)
        sum_a, sum_sa = above[..., :dim], above[..., dim : 2 * dim]
        den_above, vbar_a_above = above[..., 2 * dim], above[..., 2 * dim + 1]
        if pairs is None:
            at_or_above = at_or_above[0].flip(1)[..., 0]
        else:  # Σ_{i≥j, s_i>=t_j} dden_i: the tied pairs' share added to the strict sum
            at_or_above = den_above.contiguous()
            at_or_above.view(-1).index_add_(0, pairs[1], grad_den.reshape(-1)[pairs[0]])
        # dL/dv_j = Σ_{i≥j, s_i>t_j} (s_i − t_j) a_i − Σ_{i≥j} (ReLU mass_i / n_i) a_i   (vbar_i's share)
        grad_v = sum_sa.addcmul_(sum_a, t[..., None], value=-1.0)
        grad_v -= _suffix_sum(a * (relu_mass / n)[..., None])
        # dL/dt_j = −(v_j − vbar_i)·a_i over s_i > t_j, − dden_i over s_i > t_j, + dden_i over s_i < t_j
        den_below = _suffix_sum(grad_den) - at_or_above
        grad_t = vbar_a_above - _rowdot(v, sum_a) - den_above + den_below
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, None, None, None


# --------------------------------------------------------------------------------------------
# Causal sliced ReLU-bump
# --------------------------------------------------------------------------------------------


def _hat_sums(lo, mid, hi, centre, width, dim):
    """``b · Σ_{x∈(c−b, c+b)} hat(c − x) row`` from the dominance sums [Σ row, Σ x·row] at the
    thresholds c − b (≤), c (≤) and c + b (<): left window (c−b, c], right window (c, c+b)."""
    left, left_x = mid[..., :dim] - lo[..., :dim], mid[..., dim:] - lo[..., dim:]
    right, right_x = hi[..., :dim] - mid[..., :dim], hi[..., dim:] - mid[..., dim:]
    c = centre[..., None]
    return (width[..., None] - c) * left + left_x + (width[..., None] + c) * right - right_x, (
        left,
        left_x,
        right,
        right_x,
    )


def _window_queries(centre, width):
    return [_Query(centre - width, "right"), _Query(centre, "right"), _Query(centre + width, "left")]


class _CausalSlicedReLUBump(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)``, bandwidth ``b (N, 1)``; ``valid (N, T)`` or None.

    ``mass_eps`` None: divide by the count of real keys ``n_i`` (the paper's bump). A float: divide
    by the hat mass seen plus ``mass_eps``, ``M_i + eps`` with ``M_i = Σ_{j≤i} hat(s_i − t_j)``:
    the mass is one more column (a column of ones beside v) in the same window sums.
    """

    @staticmethod
    def forward(ctx, s, t, v, b, valid, chunk, mass_eps):
        with no_autocast(v.device):
            return _CausalSlicedReLUBump._forward(ctx, s, t, v, b, valid, chunk, mass_eps)

    @staticmethod
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _CausalSlicedReLUBump._backward(ctx, grad_out)

    @staticmethod
    def _prepare(s, t, v, b, valid, mass_eps):
        s, t, _ = _shift_scores(s, t, valid)
        real = None if valid is None else valid.to(v.dtype)
        if real is not None:
            v = v * real[..., None]
        if mass_eps is not None:  # the ones column whose hat sum is the mass M_i
            ones = torch.ones_like(t) if real is None else real
            v = torch.cat([v, ones[..., None]], dim=-1)
        key = t if valid is None else t.masked_fill(~valid, float("inf"))
        return s, t, v, key

    @staticmethod
    def _forward(ctx, s, t, v, b, valid, chunk, mass_eps):
        dim = v.shape[-1]
        s, t, v, key = _CausalSlicedReLUBump._prepare(s, t, v, b, valid, mass_eps)
        width = b.expand_as(s)
        table = torch.cat([v, t[..., None] * v], dim=-1).contiguous()
        lo, mid, hi = _dominance_sums(key, table, _window_queries(s, width), chunk)
        sums, _ = _hat_sums(lo, mid, hi, s, width, v.shape[-1])  # b · Σ_j hat_ij [v_j (, 1)]
        if mass_eps is None:
            real = torch.ones_like(t) if valid is None else valid.to(t.dtype)
            coef = 1.0 / (real.cumsum(1).clamp_min(1) * b)  # 1 / (n_i b)
        else:
            coef = 1.0 / (sums[..., dim] + mass_eps * b)  # 1 / (b (M_i + eps))
        if valid is not None:
            coef = coef.masked_fill(~valid, 0.0)
        out = sums[..., :dim] * coef[..., None]
        ctx.save_for_backward(s, t, v, b, coef, key, out if mass_eps is not None else None)
        ctx.valid, ctx.chunk = valid, chunk
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, b, coef, key, out = ctx.saved_tensors
        valid, chunk = ctx.valid, ctx.chunk
        value_dim = grad_out.shape[-1]
        width = b.expand_as(s)
        # The loss depends on the window sums Σ_j hat_ij [v_j (, 1)] through weights g (per query):
        # c_i g_i on the values and, with the mass normaliser o_i = N_i / (M_i + eps), also
        # dL/dM_i = −(g_i · o_i) / (M_i + eps) on the ones column. Both carry c_i = coef_i's 1/b.
        g = grad_out.contiguous() * coef[..., None]
        if out is not None:
            g = torch.cat([g, -_rowdot(grad_out, out)[..., None] * coef[..., None]], dim=-1)
        dim = v.shape[-1]

        # Queries (recomputed window sums, nothing T×D kept from the forward pass):
        #   dL/ds_i = g_i·(Σ_{t∈(s,s+b)} v − Σ_{t∈(s−b,s)} v),   dL/db = Σ_i g_i/b·Σ_window |r| v
        # Keys with t_j = s_i sit in the left window but have hat' = 0: their sum is added back,
        # from the list of tied pairs (or, with too many ties, one more pass over t_j < s_i).
        pairs = _tied_pairs(s, t, valid)
        table = torch.cat([v, t[..., None] * v], dim=-1).contiguous()
        tied_pass = [_Query(s, "left", slice(0, dim))] if pairs is None else []
        lo, mid, hi, *below = _dominance_sums(key, table, _window_queries(s, width) + tied_pass, chunk)
        del table
        _, (left, left_x, right, right_x) = _hat_sums(lo, mid, hi, s, width, dim)
        slope = right - left
        if pairs is None:
            slope += mid[..., :dim] - below[0]
        else:
            slope.view(-1, dim).index_add_(0, pairs[0], v.reshape(-1, dim)[pairs[1]])
        grad_s = _rowdot(g, slope)
        abs_moment = s[..., None] * (left - right) + right_x - left_x  # Σ_window |s − t| v
        grad_b = (_rowdot(g, abs_moment) / width).sum(dim=1, keepdim=True)
        del lo, mid, hi, below, left, left_x, right, right_x, abs_moment, slope

        # Keys: windows around t_j over the later queries' s_i (time reversed), weights g_i.
        q_table = torch.cat([g, s[..., None] * g], dim=-1).flip(1).contiguous()
        t_rev, w_rev = t.flip(1), width.flip(1)
        tied_pass = [_Query(t_rev, "left", slice(0, dim))] if pairs is None else []
        k_lo, k_mid, k_hi, *k_below = _dominance_sums(
            _reverse_key(s, valid), q_table, _window_queries(t_rev, w_rev) + tied_pass, chunk
        )
        grad_v, (k_left, _, k_right, _) = _hat_sums(k_lo, k_mid, k_hi, t_rev, w_rev, dim)
        k_slope = k_right - k_left
        if pairs is None:
            k_slope += k_mid[..., :dim] - k_below[0]
        grad_t = _rowdot(v.flip(1), k_slope).flip(1)
        if pairs is not None:  # tied pairs: v_j · g_i added to dL/dt_j
            tied = _rowdot(v.reshape(-1, dim)[pairs[1]][None], g.reshape(-1, dim)[pairs[0]][None])[0]
            grad_t.view(-1).index_add_(0, pairs[1], tied)
        grad_v = grad_v.flip(1)[..., :value_dim].contiguous()  # the ones column has no gradient
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, grad_b, None, None, None


# --------------------------------------------------------------------------------------------
# Public parallel ops (called through sliced_relu_attention(..., causal=True))
# --------------------------------------------------------------------------------------------


def _check_chunk(chunk: int) -> None:
    if type(chunk) is not int or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")


def causal_sliced_relu_attention(s, t, v, key_padding_mask=None, eps=1e-4, chunk=DEFAULT_CHUNK):
    """Causal sliced ReLU attention, ``(B, H, T, D)``; inputs already checked by the public op.

    ``o_i = 2 Σ_{j≤i} ReLU(s_i − t_j)(v_j − vbar_i) / max(Σ_{j≤i} |s_i − t_j|, eps)``, vbar_i the
    mean of the real v_j, j ≤ i. ``chunk`` is the dense local block (a speed knob, not semantics).
    """
    _check_chunk(chunk)
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    valid = _valid_rows(key_padding_mask, heads, v.device)
    out = _CausalSlicedReLU.apply(_rows(s, acc), _rows(t, acc), _rows(v, acc), valid, float(eps), chunk)
    return out.view(batch, heads, length, dim).to(v.dtype)


def causal_sliced_relu_bump_attention(
    s, t, v, bandwidth, key_padding_mask=None, chunk=DEFAULT_CHUNK, normaliser="count", mass_eps=1e-2
):
    """Causal sliced ReLU-bump attention; inputs already checked by the public op.

    ``normaliser="count"``: ``o_i = (1/n_i) Σ_{j≤i} hat(s_i − t_j) v_j``, n_i the number of real keys
    j ≤ i (the paper's bump). ``"mass"``: ``o_i = Σ_{j≤i} hat(s_i − t_j) v_j / (Σ_{j≤i} hat(s_i − t_j)
    + mass_eps)``, so that an output does not shrink like 1/i with its position.
    """
    _check_chunk(chunk)
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    valid = _valid_rows(key_padding_mask, heads, v.device)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]
    eps = None if normaliser == "count" else float(mass_eps)
    out = _CausalSlicedReLUBump.apply(_rows(s, acc), _rows(t, acc), _rows(v, acc), width, valid, chunk, eps)
    return out.view(batch, heads, length, dim).to(v.dtype)
