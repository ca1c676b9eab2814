"""Causal sliced ReLU-bump attention in O(T log² T): a hand-written autograd function over dominance sums.

The shared machinery (and the derivation, precision notes) is in ``attnlab.attention.sliced_common.causal``.
"""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced_common.causal import (
    DEFAULT_CHUNK,
    check_chunk,
    running_sum,
    segment_codes,
    shift_scores,
    tied_pairs,
)
from attnlab.attention.sliced_common.dominance import (
    Term,
    combined_sums,
)
from attnlab.attention.sliced_common.rows import as_rows, rowdot, valid_rows
from attnlab.attention.sliced_common.segments import Runs

__all__ = ["causal_sliced_relu_bump_attention"]


# The hat window of a centre c and width b over sorted scores x: left window (c − b, c], right window
# (c, c + b), read at three thresholds of the dominance sums: c − b (≤), c (≤), c + b (<).
# Column blocks of the tables: ROW = the weights (values, or the queries' gradient weights), X = the
# score times them.
ROW, X = 0, 1


def _compared(key, centre, width, valid, runs: Runs | None, later_first: bool):
    """What the dominance sums compare: the keys (+inf at padded ones) and the window thresholds
    c − b (≤), c (≤), c + b (<); on packed rows their `segment_codes` (scores of one segment
    compared as they are, other segments' keys beyond every threshold)."""
    values = [key, centre - width, centre, centre + width]
    if runs is not None:
        return segment_codes(values, runs, later_first)
    if valid is not None:
        values[0] = key.masked_fill(~valid, float("inf"))
    return values


def _window_thresholds(lo, mid, hi):
    return [(lo, "right"), (mid, "right"), (hi, "left")]


def _hat_terms(centre, width) -> list[Term]:
    """``b · Σ_j hat(c − x_j) row_j = (b − c) L + L_x + (b + c) R − R_x`` over the windows'
    sums L, R (rows) and L_x, R_x (score · rows), as terms at the thresholds c − b, c, c + b.

    The coefficients are float64 (exact for float32 scores): where a window is empty its terms cancel,
    (c − b) − 2c + (b + c) = 0, exactly only if c ± b is not rounded (the C++ kernels combine in double;
    the torch code rounds them to the table's dtype)."""
    centre, width = centre.double(), width.double()
    ones = torch.ones_like(centre)
    return [
        Term(0, ROW, centre - width),
        Term(0, X, -ones),
        Term(1, ROW, -2 * centre),
        Term(1, X, 2 * ones),
        Term(2, ROW, width + centre),
        Term(2, X, -ones),
    ]


def _slope_terms(centre, tied_pass: bool) -> list[Term]:
    """``Σ_{x∈(c,c+b)} row − Σ_{x∈(c−b,c)} row = R − L + (tied)``: the hat's slope (−sign(c − x) / b,
    0 at x = c) times b. Scores tied with c sit in L; with ``tied_pass`` a fourth threshold
    (c, <) takes them out (L' = P[c, <] − P[c − b]); otherwise the caller adds them back."""
    ones = torch.ones_like(centre)
    mid = [Term(1, ROW, -ones), Term(3, ROW, -ones)] if tied_pass else [Term(1, ROW, -2 * ones)]
    return [Term(0, ROW, ones), *mid, Term(2, ROW, ones)]


def _window_parts(lo, mid, hi):
    """The left and right windows' [count, score sum] from the sums at c − b, c and c + b."""
    return mid - lo, hi - mid


class _CausalSlicedReLUBump(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)``, bandwidth ``b (N, 1)``; ``valid (N, T)`` or None.

    ``mass_eps`` None: divide by the count of real keys ``n_i`` (authors' code). A float: divide
    by the hat mass seen plus ``mass_eps``, ``M_i + eps`` with ``M_i = Σ_{j≤i} hat(s_i − t_j)``,
    from the keys' counts and score sums in the same windows. Those are summed apart from the
    values (``combined_sums``' ``raw`` sums), window differences first: combined like the values,
    their prefix totals (counts of every key below a window, up to T) meet coefficients of the size
    of the scores and cancel far less exactly in float32 (the mass's relative error grew 40x).

    ``runs``: packed rows (valid None), each token attending the earlier keys of its own segment
    (compared by `segment_codes`, counts restarting at each segment's start).
    """

    @staticmethod
    def forward(ctx, s, t, v, b, valid, chunk, mass_eps, query_grads, runs=None):
        with no_autocast(v.device):
            return _CausalSlicedReLUBump._forward(ctx, s, t, v, b, valid, chunk, mass_eps, query_grads, runs)

    @staticmethod
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _CausalSlicedReLUBump._backward(ctx, grad_out)

    @staticmethod
    def _prepare(s, t, v, valid, runs):
        """Shifted scores, values zero at padded keys and the real-key indicator (float)."""
        s, t, _ = shift_scores(s, t, valid, runs)
        real = torch.ones_like(t) if valid is None else valid.to(v.dtype)
        if valid is not None:  # padding, NaN or not, vanishes (a product by 0 keeps NaN)
            v = v.masked_fill(~valid[..., None], 0.0)
        return s, t, v, real

    @staticmethod
    def _forward(ctx, s, t, v, b, valid, chunk, mass_eps, query_grads, runs):
        dim = v.shape[-1]
        s, t, v, real = _CausalSlicedReLUBump._prepare(s, t, v, valid, runs)
        width = b.expand_as(s)
        key, *bounds = _compared(t, s, width, valid, runs, later_first=True)  # bounds: c − b, c, c + b
        thresholds = _window_thresholds(*bounds)
        table = torch.cat([v, t[..., None] * v], dim=-1).contiguous()
        combos = [_hat_terms(s, width)]  # b Σ_j hat_ij v_j
        pairs = None
        if query_grads:
            # dL/ds and dL/db need two more sums over the same keys, table and windows, which do
            # not depend on the output's gradient: taken here, in the same pass (one pass less).
            # Keys tied with s_i sit in the left window but have hat'(0) = 0: taken out by a fourth
            # threshold (t < s) when there are many, else added back from the list of tied pairs.
            pairs = tied_pairs(bounds[1], key, valid)
            thresholds += [(bounds[1], "left")] if pairs is None else []
            ones = torch.ones_like(s)
            moment = [Term(0, ROW, -s), Term(1, ROW, 2 * s), Term(2, ROW, -s)]  # s (L − R) + R_x − L_x
            moment += [Term(0, X, ones), Term(1, X, -2 * ones), Term(2, X, ones)]
            combos += [_slope_terms(s, pairs is None), moment]
        # the mass normaliser's counts: plain sums of [1, t] at every threshold, (thresholds, N, T, 2)
        counts = None if mass_eps is None else torch.stack([real, t * real], dim=-1)
        shifted = runs is None  # c − b, c, c + b: one order (not so the packed rows' codes)
        sums, *query_sums = combined_sums(
            key, table, thresholds, combos, dim, chunk, raw=counts, shifted=shifted
        )
        del table
        windows = query_sums.pop() if counts is not None else None
        if pairs is not None:
            query_sums[0].view(-1, dim).index_add_(0, pairs[0], v.reshape(-1, dim)[pairs[1]])
        if mass_eps is None:
            coef = 1.0 / (running_sum(real, runs).clamp_min(1) * b)  # 1 / (n_i b)
        else:
            (left_n, left_t), (right_n, right_t) = (w.unbind(-1) for w in _window_parts(*windows[:3]))
            mass = (width - s) * left_n + left_t + (width + s) * right_n - right_t  # b · M_i
            coef = 1.0 / (mass + mass_eps * b)  # 1 / (b (M_i + eps))
        if valid is not None:
            coef = coef.masked_fill(~valid, 0.0)
        out = sums.mul_(coef[..., None])
        mass_parts = () if windows is None else (out, windows)
        ctx.save_for_backward(s, t, v, b, coef, real, *query_sums, *mass_parts)
        ctx.valid, ctx.chunk, ctx.pairs, ctx.query_grads = valid, chunk, pairs, query_grads
        ctx.runs = runs
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, b, coef, real, *rest = ctx.saved_tensors
        valid, chunk, pairs, query_grads, runs = ctx.valid, ctx.chunk, ctx.pairs, ctx.query_grads, ctx.runs
        query_sums, mass_parts = (rest[:2], rest[2:]) if query_grads else ((), rest)
        dim = v.shape[-1]
        width = b.expand_as(s)
        # The loss depends on the window sums Σ_j hat_ij v_j through the weights g_i = coef_i g_i
        # (coef carries the 1/b) and, with the mass normaliser o_i = N_i / (M_i + eps), on the mass
        # through dL/dM_i = −(g_i · o_i) / (M_i + eps), i.e. a weight g_mass_i on a column of ones.
        g = grad_out.contiguous() * coef[..., None]
        g_mass = -rowdot(grad_out, mass_parts[0]) * coef if mass_parts else None

        # The keys' side (below) compares the later queries' s_i with the windows around t_j.
        query_key, *key_bounds = _compared(s, t, width, valid, runs, later_first=False)

        # Queries: dL/ds_i = g_i·(Σ_{t∈(s,s+b)} v − Σ_{t∈(s−b,s)} v) and dL/db = Σ_i g_i/b·Σ_window |r| v,
        # from the window sums the forward pass took (only when s or b needed a gradient).
        grad_s = grad_b = None
        if query_grads:
            slope, abs_moment = query_sums
            grad_s, grad_b = rowdot(g, slope), rowdot(g, abs_moment)
        else:
            pairs = tied_pairs(query_key, key_bounds[1], valid)  # for the keys below
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

        # Keys: windows around t_j over the later queries' s_i (``later``: i >= j), weights g_i (and
        # g_mass_i on the keys' column of ones).
        if g_mass is not None:
            g, v = torch.cat([g, g_mass[..., None]], dim=-1), torch.cat([v, real[..., None]], dim=-1)
        q_table = torch.cat([g, s[..., None] * g], dim=-1)
        thresholds = _window_thresholds(*key_bounds) + ([(key_bounds[1], "left")] if pairs is None else [])
        grad_v, k_slope = combined_sums(
            query_key,
            q_table,
            thresholds,
            [_hat_terms(t, width), _slope_terms(t, pairs is None)],
            g.shape[-1],
            chunk,
            shifted=runs is None,
            later=True,
        )
        grad_t = rowdot(v, k_slope)
        if pairs is not None:  # tied pairs: v_j · g_i added to dL/dt_j
            width_k = g.shape[-1]
            tied = rowdot(v.reshape(-1, width_k)[pairs[1]][None], g.reshape(-1, width_k)[pairs[0]][None])[0]
            grad_t.view(-1).index_add_(0, pairs[1], tied)
        grad_v = grad_v[..., :dim].contiguous()  # the ones column has no gradient
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = None if grad_s is None else grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, grad_b, None, None, None, None, None


def causal_sliced_relu_bump_attention(
    s, t, v, bandwidth, key_padding_mask=None, chunk=DEFAULT_CHUNK, normaliser="count", mass_eps=1e-2
):
    """Causal sliced ReLU-bump attention; inputs already checked by the public op.

    ``normaliser="count"``: ``o_i = (1/n_i) Σ_{j≤i} hat(s_i − t_j) v_j``, n_i the number of real keys
    j ≤ i (authors' code). ``"mass"``: ``o_i = Σ_{j≤i} hat(s_i − t_j) v_j / (Σ_{j≤i} hat(s_i − t_j)
    + mass_eps)``, so that an output does not shrink like 1/i with its position.
    """
    check_chunk(chunk)
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    valid = valid_rows(key_padding_mask, heads, v.device)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]
    eps = None if normaliser == "count" else float(mass_eps)
    query_grads = torch.is_grad_enabled() and (s.requires_grad or bandwidth.requires_grad)
    out = _CausalSlicedReLUBump.apply(
        as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), width, valid, chunk, eps, query_grads
    )
    return out.view(batch, heads, length, dim).to(v.dtype)


def causal_sliced_relu_bump_rows(
    s, t, v, width, runs: Runs, chunk: int | None = DEFAULT_CHUNK, mass_eps: float | None = None
) -> torch.Tensor:
    """The causal op on packed rows ``s, t (N, L)``, ``v (N, L, D)``, per-row bandwidth ``width (N, 1)``
    (accumulation dtype): each token attends the keys ``j ≤ i`` of its own segment
    (`sliced_relu_bump_attention_segments` with causal). ``mass_eps`` None: the count normaliser."""
    check_chunk(chunk)
    query_grads = torch.is_grad_enabled() and (s.requires_grad or width.requires_grad)
    return _CausalSlicedReLUBump.apply(s, t, v, width, None, chunk, mass_eps, query_grads, runs)
