"""Causal sliced ReLU / ReLU-bump attention: exact O(T log² T) parallel ops.

The causal ops are the bidirectional ones (``attnlab.attention.sliced``) restricted to keys
``j ≤ i``, with every statistic over that prefix: value mean ``vbar_i``, normaliser
``Σ_{j≤i} |s_i − t_j|``, bump count ``n_i``. Both kernels are piecewise linear in ``s_i − t_j``, so
every output is a combination of *dominance sums* ``Σ_{j≤i, t_j<x_i} w_j`` (x_i = s_i, or s_i ± b
for the bump) of a few weight columns ``w``: a two-dimensional query (time and score).

``attnlab.attention.sliced.dominance`` answers them for all i at once, vectorised over rows and
columns, with a Python loop over log₂(T / chunk) levels only (divide and conquer over time: dense
masked products inside chunks, sorted left halves and binary searches across them). The backward
passes (hand-written ``autograd.Function``s) sum over the same pairs the other way (``j ≥ i``, queries
and keys exchanged). What keeps them within a few times the bidirectional ops (``attnlab bench
attention`` prints the ratio):

- sliced ReLU: one merged sort of keys and queries per level (``attnlab.attention.sliced.merged``;
  a radix sort of integer codes for float32) gives both passes their orders and counts, so the
  backward pass neither sorts nor searches, and the levels are read up to five at a time (one gather
  and one add per group instead of per level);
- ReLU-bump: the hat window is a combination of four window sums; each level reads the prefix rows
  of all of it in one fused gather-and-weigh (``_combined_sums``), and the window sums the score
  and bandwidth gradients need (they do not depend on the output's gradient) are taken in the
  forward pass over the same sorts, so the backward pass only runs the keys' side (time reversed);
- tied scores (``t_j = s_i``: kinks of both kernels) are taken apart from a list of the tied pairs
  (``_tied_pairs``) instead of one more pass over every level, unless there are many;
- prefix sums over a middle dimension add rows instead of calling ``cumsum`` (``_prefix_sums_``).

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

import torch

from attnlab.attention.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced.common import _rowdot, _rows, _take, _valid_rows
from attnlab.attention.sliced.dominance import (
    _combined_sums,
    _dominance_sums,
    _dominated_sums,
    _prefix_sums_,
    _Query,
    _suffix_sums_,
    _Term,
)
from attnlab.attention.sliced.merged import _merge_rows, _merged_dominance_sums, _merged_dominated_sums

__all__ = ["DEFAULT_CHUNK", "causal_sliced_relu_attention", "causal_sliced_relu_bump_attention"]

DEFAULT_CHUNK = 32  # dense local block: below it a masked matmul beats sorting (measured on CPU)


# --------------------------------------------------------------------------------------------
# Row helpers
# --------------------------------------------------------------------------------------------


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i ≥ j} x_i`` along dim 1 (``(N, T)``, or ``(N, T, D)``: in place, ``_suffix_sums_``)."""
    return x.flip(1).cumsum(1).flip(1) if x.dim() == 2 else _suffix_sums_(x.contiguous())


def _prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{j ≤ i} x_j`` along dim 1 of ``(N, T, D)`` (``_prefix_sums_``: faster than ``cumsum`` there)."""
    return _prefix_sums_(x.clone(memory_format=torch.contiguous_format))


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
    None and the caller takes that exact pass. One merged sort of each row's keys and queries
    (``_merge_rows``: the keys' order and every query's rank among them) and a scan of the runs.
    """
    n_rows, length = s.shape
    if valid is not None:  # padded positions never tie: -inf queries against +inf keys
        s, t = s.masked_fill(~valid, -float("inf")), t.masked_fill(~valid, float("inf"))
    key_order, lo, _, _ = _merge_rows(s, t)
    keys = torch.gather(t, 1, key_order)
    # the end of the run of equal keys at each sorted position (instead of a second binary search)
    last = torch.arange(length, device=s.device).expand(n_rows, -1)
    run_end = torch.where(keys[:, 1:] != keys[:, :-1], last[:, :-1] + 1, length)
    run_end = torch.cat([run_end, run_end.new_full((n_rows, 1), length)], dim=1)
    run_end = run_end.flip(1).cummin(1).values.flip(1)
    at = lo.clamp_max(length - 1)
    tied = torch.gather(keys, 1, at) == s
    counts = torch.where(tied, torch.gather(run_end, 1, at) - lo, 0).view(-1)
    total = int(counts.sum())
    if total > TIE_PAIR_BUDGET * s.numel():
        return None
    query = torch.repeat_interleave(torch.arange(s.numel(), device=s.device), counts)
    run_start = torch.cumsum(counts, 0) - counts  # where each query's pairs start in the list
    position = lo.reshape(-1)[query] + torch.arange(total, device=s.device) - run_start[query]
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
        below, levels = _merged_dominance_sums(key, s, table, chunk)
        del table
        sum_v, sum_tv = below[..., :dim].contiguous(), below[..., dim : 2 * dim]  # A_i, B_i
        count, sum_t = below[..., 2 * dim], below[..., 2 * dim + 1]  # C_i, E_i: keys below s_i
        # #{j <= i : t_j <= s_i} (for the gradient) is #{t_j < s_i} plus the tied pairs
        pairs = _tied_pairs(s, t, valid)
        if pairs is None:  # too many ties to list: count them in a pass of their own
            weights = ones[..., None].contiguous()
            count_le = _dominance_sums(key, weights, [_Query(s, "right")], chunk)[0][..., 0]
        else:
            count_le = count.contiguous()
            count_le.view(-1).index_add_(0, pairs[0], torch.ones_like(pairs[0], dtype=count.dtype))
        del below

        n = ones.cumsum(1)  # real keys j <= i
        n_safe = n.clamp_min(1)
        vbar = _prefix_sum(v).div_(n_safe[..., None])
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
        ctx.valid, ctx.eps, ctx.chunk, ctx.pairs, ctx.levels = valid, eps, chunk, pairs, levels
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

        # Keys: sums over the later queries i ≥ j with s_i > t_j (the transposed dominance sums,
        # over the forward pass's levels).
        table = torch.cat([a, s[..., None] * a, grad_den[..., None], a_vbar[..., None]], dim=-1)
        key = t if valid is None else t.masked_fill(~valid, float("inf"))
        above = _merged_dominated_sums(key, s, table, chunk, ctx.levels)
        del table
        sum_a, sum_sa = above[..., :dim], above[..., dim : 2 * dim]
        den_above, vbar_a_above = above[..., 2 * dim], above[..., 2 * dim + 1]
        if pairs is None:  # Σ_{i≥j, s_i>=t_j} dden_i in a pass of its own
            weights = grad_den[..., None].contiguous()
            at_or_above = _dominated_sums(s, weights, [_Query(key, "right")], chunk)[0][..., 0]
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


# The hat window of a centre c and width b over sorted scores x: left window (c − b, c], right window
# (c, c + b), read at three thresholds of the dominance sums: c − b (≤), c (≤), c + b (<).
# Column blocks of the tables: ROW = the weights (values, or the queries' gradient weights), X = the
# score times them.
ROW, X = 0, 1


def _window_thresholds(centre, width):
    return [(centre - width, "right"), (centre, "right"), (centre + width, "left")]


def _hat_terms(centre, width) -> list[_Term]:
    """``b · Σ_j hat(c − x_j) row_j = (b − c) L + L_x + (b + c) R − R_x`` over the windows'
    sums L, R (rows) and L_x, R_x (score · rows), as terms at the thresholds c − b, c, c + b."""
    ones = torch.ones_like(centre)
    return [
        _Term(0, ROW, centre - width),
        _Term(0, X, -ones),
        _Term(1, ROW, -2 * centre),
        _Term(1, X, 2 * ones),
        _Term(2, ROW, width + centre),
        _Term(2, X, -ones),
    ]


def _slope_terms(centre, tied_pass: bool) -> list[_Term]:
    """``Σ_{x∈(c,c+b)} row − Σ_{x∈(c−b,c)} row = R − L + (tied)``: the hat's slope (−sign(c − x) / b,
    0 at x = c) times b. Scores tied with c sit in L; with ``tied_pass`` a fourth threshold
    (c, <) takes them out (L' = P[c, <] − P[c − b]); otherwise the caller adds them back."""
    ones = torch.ones_like(centre)
    mid = [_Term(1, ROW, -ones), _Term(3, ROW, -ones)] if tied_pass else [_Term(1, ROW, -2 * ones)]
    return [_Term(0, ROW, ones), *mid, _Term(2, ROW, ones)]


def _window_parts(lo, mid, hi):
    """The left and right windows' [count, score sum] from the sums at c − b, c and c + b."""
    return mid - lo, hi - mid


class _CausalSlicedReLUBump(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)``, bandwidth ``b (N, 1)``; ``valid (N, T)`` or None.

    ``mass_eps`` None: divide by the count of real keys ``n_i`` (authors' code). A float: divide
    by the hat mass seen plus ``mass_eps``, ``M_i + eps`` with ``M_i = Σ_{j≤i} hat(s_i − t_j)``,
    from the keys' counts and score sums in the same windows. Those are summed apart from the
    values (``_combined_sums``' ``raw`` sums), window differences first: combined like the values,
    their prefix totals (counts of every key below a window, up to T) meet coefficients of the size
    of the scores and cancel far less exactly in float32 (the mass's relative error grew 40x).
    """

    @staticmethod
    def forward(ctx, s, t, v, b, valid, chunk, mass_eps, query_grads):
        with no_autocast(v.device):
            return _CausalSlicedReLUBump._forward(ctx, s, t, v, b, valid, chunk, mass_eps, query_grads)

    @staticmethod
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _CausalSlicedReLUBump._backward(ctx, grad_out)

    @staticmethod
    def _prepare(s, t, v, valid):
        """Shifted scores, values zero at padded keys, the sort key (+inf at padded keys) and the
        real-key indicator (float)."""
        s, t, _ = _shift_scores(s, t, valid)
        real = torch.ones_like(t) if valid is None else valid.to(v.dtype)
        if valid is not None:
            v = v * real[..., None]
        key = t if valid is None else t.masked_fill(~valid, float("inf"))
        return s, t, v, key, real

    @staticmethod
    def _forward(ctx, s, t, v, b, valid, chunk, mass_eps, query_grads):
        dim = v.shape[-1]
        s, t, v, key, real = _CausalSlicedReLUBump._prepare(s, t, v, valid)
        width = b.expand_as(s)
        thresholds = _window_thresholds(s, width)
        table = torch.cat([v, t[..., None] * v], dim=-1).contiguous()
        combos = [_hat_terms(s, width)]  # b Σ_j hat_ij v_j
        pairs = None
        if query_grads:
            # dL/ds and dL/db need two more sums over the same keys, table and windows, which do
            # not depend on the output's gradient: taken here, in the same pass (one pass less).
            # Keys tied with s_i sit in the left window but have hat'(0) = 0: taken out by a fourth
            # threshold (t < s) when there are many, else added back from the list of tied pairs.
            pairs = _tied_pairs(s, t, valid)
            thresholds += [(s, "left")] if pairs is None else []
            ones = torch.ones_like(s)
            moment = [_Term(0, ROW, -s), _Term(1, ROW, 2 * s), _Term(2, ROW, -s)]  # s (L − R) + R_x − L_x
            moment += [_Term(0, X, ones), _Term(1, X, -2 * ones), _Term(2, X, ones)]
            combos += [_slope_terms(s, pairs is None), moment]
        # the mass normaliser's counts: plain sums of [1, t] at every threshold, (thresholds, N, T, 2)
        counts = None if mass_eps is None else torch.stack([real, t * real], dim=-1)
        sums, *query_sums = _combined_sums(key, table, thresholds, combos, dim, chunk, raw=counts)
        del table
        windows = query_sums.pop() if counts is not None else None
        if pairs is not None:
            query_sums[0].view(-1, dim).index_add_(0, pairs[0], v.reshape(-1, dim)[pairs[1]])
        if mass_eps is None:
            coef = 1.0 / (real.cumsum(1).clamp_min(1) * b)  # 1 / (n_i b)
        else:
            (left_n, left_t), (right_n, right_t) = (w.unbind(-1) for w in _window_parts(*windows[:3]))
            mass = (width - s) * left_n + left_t + (width + s) * right_n - right_t  # b · M_i
            coef = 1.0 / (mass + mass_eps * b)  # 1 / (b (M_i + eps))
        if valid is not None:
            coef = coef.masked_fill(~valid, 0.0)
        out = sums.mul_(coef[..., None])
        mass_parts = () if windows is None else (out, windows)
        ctx.save_for_backward(s, t, v, b, coef, key, real, *query_sums, *mass_parts)
        ctx.valid, ctx.chunk, ctx.pairs, ctx.query_grads = valid, chunk, pairs, query_grads
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, b, coef, key, real, *rest = ctx.saved_tensors
        valid, chunk, pairs, query_grads = ctx.valid, ctx.chunk, ctx.pairs, ctx.query_grads
        query_sums, mass_parts = (rest[:2], rest[2:]) if query_grads else ((), rest)
        dim = v.shape[-1]
        width = b.expand_as(s)
        # The loss depends on the window sums Σ_j hat_ij v_j through the weights g_i = coef_i g_i
        # (coef carries the 1/b) and, with the mass normaliser o_i = N_i / (M_i + eps), on the mass
        # through dL/dM_i = −(g_i · o_i) / (M_i + eps), i.e. a weight g_mass_i on a column of ones.
        g = grad_out.contiguous() * coef[..., None]
        g_mass = -_rowdot(grad_out, mass_parts[0]) * coef if mass_parts else None

        # Queries: dL/ds_i = g_i·(Σ_{t∈(s,s+b)} v − Σ_{t∈(s−b,s)} v) and dL/db = Σ_i g_i/b·Σ_window |r| v,
        # from the window sums the forward pass took (only when s or b needed a gradient).
        grad_s = grad_b = None
        if query_grads:
            slope, abs_moment = query_sums
            grad_s, grad_b = _rowdot(g, slope), _rowdot(g, abs_moment)
        else:
            pairs = _tied_pairs(s, t, valid)  # for the keys below
        if query_grads and g_mass is not None:  # the mass's share: the windows' counts and score sums
            windows = mass_parts[1]
            (left_n, left_t), (right_n, right_t) = (w.unbind(-1) for w in _window_parts(*windows[:3]))
            if pairs is not None:
                tied_n = torch.zeros_like(s)
                tied_n.view(-1).index_add_(0, pairs[0], real.reshape(-1)[pairs[1]])
            else:  # the fourth threshold: keys below s_i
                tied_n = windows[1][..., 0] - windows[3][..., 0]
            grad_s += g_mass * (right_n - left_n + tied_n)
            grad_b += g_mass * (s * (left_n - right_n) + right_t - left_t)
        if query_grads:
            grad_b = (grad_b / width).sum(dim=1, keepdim=True)

        # Keys: windows around t_j over the later queries' s_i (time reversed), weights g_i (and
        # g_mass_i on the keys' column of ones).
        if g_mass is not None:
            g, v = torch.cat([g, g_mass[..., None]], dim=-1), torch.cat([v, real[..., None]], dim=-1)
        q_table = torch.cat([g, s[..., None] * g], dim=-1).flip(1).contiguous()
        t_rev, w_rev = t.flip(1), width.flip(1)
        thresholds = _window_thresholds(t_rev, w_rev) + ([(t_rev, "left")] if pairs is None else [])
        grad_v, k_slope = _combined_sums(
            _reverse_key(s, valid),
            q_table,
            thresholds,
            [_hat_terms(t_rev, w_rev), _slope_terms(t_rev, pairs is None)],
            g.shape[-1],
            chunk,
        )
        grad_t = _rowdot(v.flip(1), k_slope).flip(1)
        if pairs is not None:  # tied pairs: v_j · g_i added to dL/dt_j
            width_k = g.shape[-1]
            tied = _rowdot(v.reshape(-1, width_k)[pairs[1]][None], g.reshape(-1, width_k)[pairs[0]][None])[0]
            grad_t.view(-1).index_add_(0, pairs[1], tied)
        grad_v = grad_v.flip(1)[..., :dim].contiguous()  # the ones column has no gradient
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = None if grad_s is None else grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, grad_b, None, None, None, None


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
    j ≤ i (authors' code). ``"mass"``: ``o_i = Σ_{j≤i} hat(s_i − t_j) v_j / (Σ_{j≤i} hat(s_i − t_j)
    + mass_eps)``, so that an output does not shrink like 1/i with its position.
    """
    _check_chunk(chunk)
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    valid = _valid_rows(key_padding_mask, heads, v.device)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]
    eps = None if normaliser == "count" else float(mass_eps)
    query_grads = torch.is_grad_enabled() and (s.requires_grad or bandwidth.requires_grad)
    out = _CausalSlicedReLUBump.apply(
        _rows(s, acc), _rows(t, acc), _rows(v, acc), width, valid, chunk, eps, query_grads
    )
    return out.view(batch, heads, length, dim).to(v.dtype)
