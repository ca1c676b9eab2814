"""Causal sliced ReLU / ReLU-bump attention: exact O(T log² T) parallel ops and O(log² n) decoding.

The causal ops are the bidirectional ones (``attnlab.attention.sliced_relu``) restricted to keys
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

Decoding (``sliced_relu_attention_step``) uses the logarithmic method: the past keys are kept as a
few sorted runs of sizes 2^k (the binary digits of n), each storing, at every key, the key score
and the values of the piecewise-linear functions ``F(x) = Σ_{t_j<x} (x − t_j) [v_j, 1]`` at that key
(D + 2 numbers per past token; a softmax KV cache holds 2·D). ``F`` is linear between consecutive
keys, so a run evaluates it anywhere by one binary search and a linear interpolation; a new token
is a run of one, and equal-size runs merge (each evaluating the other's F at its keys). A step
costs O(D log n + log² n) amortised.

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

__all__ = [
    "SlicedDecodeState",
    "causal_sliced_relu_attention",
    "causal_sliced_relu_bump_attention",
    "sliced_relu_attention_state",
    "sliced_relu_attention_step",
    "sliced_relu_bump_attention_state",
    "sliced_relu_bump_attention_step",
]

DEFAULT_CHUNK = 32  # dense local block: below it a masked matmul beats sorting (measured on CPU)


# --------------------------------------------------------------------------------------------
# Row helpers
# --------------------------------------------------------------------------------------------


def _take(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[n, index[n, m]]`` for a contiguous ``(N, L, C)`` table and ``index (N, M)``: one
    ``index_select`` on the flattened table (much faster than ``gather`` on CPU)."""
    n_rows, length, width = table.shape
    flat = (index + torch.arange(n_rows, device=index.device)[:, None] * length).reshape(-1)
    return table.reshape(-1, width).index_select(0, flat).view(n_rows, -1, width)


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i ≥ j} x_i`` along dim 1."""
    return x.flip(1).cumsum(1).flip(1)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ntd,ntd->nt", a, b)


def _pad_to(x: torch.Tensor, length: int, value: float) -> torch.Tensor:
    extra = length - x.shape[1]
    return x if extra <= 0 else F.pad(x, (0, extra), value=value)


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
        prefix.cumsum_(1)
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
        below, at_or_below = _dominance_sums(
            key, table, [_Query(s, "left"), _Query(s, "right", slice(2 * dim, 2 * dim + 1))], chunk
        )
        del table
        sum_v, sum_tv = below[..., :dim].contiguous(), below[..., dim : 2 * dim]  # A_i, B_i
        count, sum_t = below[..., 2 * dim], below[..., 2 * dim + 1]  # C_i, E_i: keys below s_i
        count_le = at_or_below[..., 0]
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
        ctx.valid, ctx.eps, ctx.chunk = valid, eps, chunk
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, sum_v, vbar, count, count_le, n, relu_mass, den, out = ctx.saved_tensors
        valid, eps, chunk = ctx.valid, ctx.eps, ctx.chunk
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
        above, at_or_above = _dominance_sums(
            _reverse_key(-s, valid),
            table.flip(1).contiguous(),
            [_Query((-t).flip(1), "left"), _Query((-t).flip(1), "right", slice(2 * dim, 2 * dim + 1))],
            chunk,
        )
        above, at_or_above = above.flip(1), at_or_above.flip(1)[..., 0]
        sum_a, sum_sa = above[..., :dim], above[..., dim : 2 * dim]
        den_above, vbar_a_above = above[..., 2 * dim], above[..., 2 * dim + 1]
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
    """Rows ``s, t (N, T)``, ``v (N, T, D)``, bandwidth ``b (N, 1)``; ``valid (N, T)`` or None."""

    @staticmethod
    def forward(ctx, s, t, v, b, valid, chunk):
        with no_autocast(v.device):
            return _CausalSlicedReLUBump._forward(ctx, s, t, v, b, valid, chunk)

    @staticmethod
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _CausalSlicedReLUBump._backward(ctx, grad_out)

    @staticmethod
    def _prepare(s, t, v, b, valid):
        s, t, _ = _shift_scores(s, t, valid)
        real = None if valid is None else valid.to(v.dtype)
        if real is not None:
            v = v * real[..., None]
        n = (torch.ones_like(t) if real is None else real).cumsum(1).clamp_min(1)
        coef = 1.0 / (n * b)  # 1 / (n_i b)
        if valid is not None:
            coef = coef.masked_fill(~valid, 0.0)
        key = t if valid is None else t.masked_fill(~valid, float("inf"))
        return s, t, v, coef, key

    @staticmethod
    def _forward(ctx, s, t, v, b, valid, chunk):
        dim = v.shape[-1]
        s, t, v, coef, key = _CausalSlicedReLUBump._prepare(s, t, v, b, valid)
        table = torch.cat([v, t[..., None] * v], dim=-1).contiguous()
        width = b.expand_as(s)
        lo, mid, hi = _dominance_sums(key, table, _window_queries(s, width), chunk)
        out, _ = _hat_sums(lo, mid, hi, s, width, dim)
        out = out * coef[..., None]
        ctx.save_for_backward(s, t, v, b, coef, key)
        ctx.valid, ctx.chunk = valid, chunk
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, b, coef, key = ctx.saved_tensors
        valid, chunk = ctx.valid, ctx.chunk
        dim = v.shape[-1]
        width = b.expand_as(s)
        grad_out = grad_out.contiguous()

        # Queries (recomputed window sums, nothing T×D kept from the forward pass):
        #   dL/ds_i = c_i g_i·(Σ_{t∈(s,s+b)} v − Σ_{t∈(s−b,s)} v),   dL/db = Σ_i c_i/b g_i·Σ_window |r| v
        table = torch.cat([v, t[..., None] * v], dim=-1).contiguous()
        lo, mid, hi, below = _dominance_sums(
            key, table, [*_window_queries(s, width), _Query(s, "left", slice(0, dim))], chunk
        )
        del table
        _, (left, left_x, right, right_x) = _hat_sums(lo, mid, hi, s, width, dim)
        tied = mid[..., :dim] - below  # keys with t_j = s_i sit in the left window but have hat' = 0
        g = grad_out * coef[..., None]
        grad_s = _rowdot(g, right - left + tied)
        abs_moment = s[..., None] * (left - right) + right_x - left_x  # Σ_window |s − t| v
        grad_b = (_rowdot(g, abs_moment) / width).sum(dim=1, keepdim=True)
        del lo, mid, hi, below, left, left_x, right, right_x, abs_moment

        # Keys: windows around t_j over the later queries' s_i (time reversed), weights c_i g_i.
        q_table = torch.cat([g, s[..., None] * g], dim=-1).flip(1).contiguous()
        t_rev, w_rev = t.flip(1), width.flip(1)
        k_lo, k_mid, k_hi, k_below = _dominance_sums(
            _reverse_key(s, valid),
            q_table,
            [*_window_queries(t_rev, w_rev), _Query(t_rev, "left", slice(0, dim))],
            chunk,
        )
        grad_v, (k_left, _, k_right, _) = _hat_sums(k_lo, k_mid, k_hi, t_rev, w_rev, dim)
        k_tied = k_mid[..., :dim] - k_below
        grad_t = _rowdot(v.flip(1), k_right - k_left + k_tied).flip(1)
        grad_v = grad_v.flip(1)
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, grad_b, None, None


# --------------------------------------------------------------------------------------------
# Public parallel ops (called through sliced_relu_attention(..., causal=True))
# --------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:]).to(dtype).contiguous()


def _valid_rows(key_padding_mask, heads, device):
    if key_padding_mask is None:
        return None
    return key_padding_mask.repeat_interleave(heads, dim=0).to(device)


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


def causal_sliced_relu_bump_attention(s, t, v, bandwidth, key_padding_mask=None, chunk=DEFAULT_CHUNK):
    """Causal sliced ReLU-bump attention: ``o_i = (1/n_i) Σ_{j≤i} max(0, 1 − |s_i − t_j|/b_h) v_j``,
    n_i the number of real keys j ≤ i; inputs already checked by the public op."""
    _check_chunk(chunk)
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    valid = _valid_rows(key_padding_mask, heads, v.device)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]
    out = _CausalSlicedReLUBump.apply(_rows(s, acc), _rows(t, acc), _rows(v, acc), width, valid, chunk)
    return out.view(batch, heads, length, dim).to(v.dtype)


# --------------------------------------------------------------------------------------------
# Decoding: the logarithmic method over sorted runs
# --------------------------------------------------------------------------------------------


class SlicedDecodeState(NamedTuple):
    """What a causal sliced decoder keeps of the past: sorted runs of keys (the logarithmic method).

    Run r (sizes 2^k, decreasing, the binary digits of ``count``) holds ``keys[r] (B, H, m)`` sorted
    (shifted) key scores, ``tables[r] (B, H, m, D + 1)`` the values at each key of
    ``F(x) = Σ_{j in run, t_j < x} (x − t_j) [v_j, 1]``, and ``totals[r] (B, H, D + 1)`` = Σ [v_j, 1].
    ``shift_t (B, H)``/``shift_v (B, H, D)`` are the first token's key score and (sliced ReLU only)
    value, ``sum_v``/``sum_t`` running sums of the shifted values and keys. ``kind`` is "relu" or
    "bump": the two steps centre values differently and do not share states.
    """

    keys: tuple[torch.Tensor, ...]
    tables: tuple[torch.Tensor, ...]
    totals: tuple[torch.Tensor, ...]
    count: int
    shift_t: torch.Tensor
    shift_v: torch.Tensor
    sum_v: torch.Tensor
    sum_t: torch.Tensor
    kind: str

    def nbytes(self) -> int:
        """Bytes of tensor memory held: (D + 2) numbers per past token plus O(D log n)."""
        tensors = [*self.keys, *self.tables, *self.totals, self.shift_t, self.shift_v, self.sum_v, self.sum_t]
        return sum(x.numel() * x.element_size() for x in tensors)


def _evaluate_run(keys, table, total, x):
    """F of one run at points ``x (B, H, K)`` → ``(B, H, K, D + 1)``: 0 below the smallest key, linear
    interpolation between neighbouring keys (F is linear there), slope ``total`` above the largest."""
    size = keys.shape[-1]
    rank = torch.searchsorted(keys, x.contiguous(), side="left")  # keys[rank-1] < x <= keys[rank]
    lo, hi = (rank - 1).clamp_min(0), rank.clamp_max(size - 1)
    key_lo, key_hi = torch.gather(keys, -1, lo), torch.gather(keys, -1, hi)
    width = table.shape[-1]
    f_lo = torch.gather(table, -2, lo[..., None].expand(*lo.shape, width))
    f_hi = torch.gather(table, -2, hi[..., None].expand(*hi.shape, width))
    inside = (rank > 0) & (rank < size)
    # inside: f_lo + (x − k_lo)/(k_hi − k_lo)·(f_hi − f_lo), a fraction in (0, 1]: no cancellation
    # blows up even for nearly tied keys; above: f_lo + (x − k_lo)·total
    step = torch.where(inside, (x - key_lo) / torch.where(inside, key_hi - key_lo, 1.0), x - key_lo)
    slope = torch.where(inside[..., None], f_hi - f_lo, total[..., None, :])
    return torch.where((rank > 0)[..., None], f_lo + step[..., None] * slope, 0.0)


def _build_run(keys: torch.Tensor, rows: torch.Tensor):
    """A run from keys ``(B, H, m)`` and rows ``(B, H, m, D + 1)``: sorted keys, F at each, total."""
    keys, order = torch.sort(keys, dim=-1)
    rows = torch.gather(rows, -2, order[..., None].expand_as(rows))
    prefix = F.pad(rows.cumsum(-2), (0, 0, 1, 0))[..., :-1, :]  # Σ over smaller keys (ties add 0)
    prefix_t = F.pad((keys[..., None] * rows).cumsum(-2), (0, 0, 1, 0))[..., :-1, :]
    return keys, keys[..., None] * prefix - prefix_t, rows.sum(-2)


def _merge_runs(a, b):
    """Merge two runs: each one's F evaluated at the other's keys, then one sort."""
    (keys_a, table_a, total_a), (keys_b, table_b, total_b) = a, b
    table = torch.cat(
        [table_a + _evaluate_run(keys_b, table_b, total_b, keys_a), table_b + _evaluate_run(*a, keys_b)],
        dim=-2,
    )
    keys, order = torch.sort(torch.cat([keys_a, keys_b], dim=-1), dim=-1)
    return keys, torch.gather(table, -2, order[..., None].expand_as(table)), total_a + total_b


def _evaluate_all(state: SlicedDecodeState, x: torch.Tensor) -> torch.Tensor:
    out = None
    for run in zip(state.keys, state.tables, state.totals, strict=True):
        part = _evaluate_run(*run, x)
        out = part if out is None else out + part
    return out


def _check_step(name, s_t, t_t, v_t, state, kind):
    for label, x in (("s_t", s_t), ("t_t", t_t), ("v_t", v_t)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name}: {label} must be a float tensor")
    if v_t.dim() != 3 or s_t.shape != v_t.shape[:2] or t_t.shape != v_t.shape[:2]:
        raise ValueError(
            f"{name}: expected s_t, t_t (B, H) and v_t (B, H, D); got "
            f"{tuple(s_t.shape)}, {tuple(t_t.shape)}, {tuple(v_t.shape)}"
        )
    if state is None:
        return
    if not isinstance(state, SlicedDecodeState):
        raise TypeError(f"{name}: state must be a SlicedDecodeState or None, got {type(state).__name__}")
    if state.kind != kind:
        raise ValueError(f"{name}: got a state of sliced_{state.kind} decoding; start a new one (state=None)")
    if tuple(state.sum_v.shape) != tuple(v_t.shape):
        raise ValueError(
            f"{name}: state holds (B, H, D) = {tuple(state.sum_v.shape)}, got v_t {tuple(v_t.shape)}"
        )


def _push(state, s_t, t_t, v_t, kind):
    """The state with token (t_t, v_t) appended, and the shifted query score."""
    acc = accumulation_dtype(s_t.dtype, t_t.dtype, v_t.dtype)
    s_t, t_t, v_t = s_t.to(acc), t_t.to(acc), v_t.to(acc)
    if state is None:
        shift_v = v_t if kind == "relu" else torch.zeros_like(v_t)
        state = SlicedDecodeState(
            (), (), (), 0, t_t, shift_v, torch.zeros_like(v_t), torch.zeros_like(t_t), kind
        )
    t, v = t_t - state.shift_t, v_t - state.shift_v
    rows = torch.cat([v, torch.ones_like(t)[..., None]], dim=-1)
    runs = list(zip(state.keys, state.tables, state.totals, strict=True))
    runs.append((t[..., None], torch.zeros_like(rows)[..., None, :], rows))
    size = state.count + 1
    while len(runs) >= 2 and runs[-1][0].shape[-1] == runs[-2][0].shape[-1]:  # equal runs merge
        runs[-2:] = [_merge_runs(runs[-2], runs[-1])]
    keys, tables, totals = (tuple(part) for part in zip(*runs, strict=True))
    new = SlicedDecodeState(
        keys, tables, totals, size, state.shift_t, state.shift_v, state.sum_v + v, state.sum_t + t, kind
    )
    return new, s_t - state.shift_t


def sliced_relu_attention_step(
    s_t: torch.Tensor,
    t_t: torch.Tensor,
    v_t: torch.Tensor,
    state: SlicedDecodeState | None = None,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, SlicedDecodeState]:
    """One decoding step of causal sliced ReLU attention: ``(o_t (B, H, D), new state)``.

    ``s_t, t_t (B, H)`` are the new token's query and key scores, ``v_t (B, H, D)`` its value;
    ``state`` is None before the first token. The token is inserted, then queried (j <= i includes
    itself), so the outputs equal ``sliced_relu_attention(..., causal=True)`` row by row. Time
    O(D log n + log² n) amortised, memory (D + 2) numbers per past token; in float32 at least.
    """
    _check_step("sliced_relu_attention_step", s_t, t_t, v_t, state, "relu")
    if not eps > 0:
        raise ValueError(f"sliced_relu_attention_step: eps must be > 0, got {eps}")
    with no_autocast(v_t.device):
        state, s = _push(state, s_t, t_t, v_t, "relu")
        f = _evaluate_all(state, s[..., None])[..., 0, :]  # (B, H, D + 1): [Σ ReLU·v, Σ ReLU]
        n = float(state.count)
        relu_v, relu_mass = f[..., :-1], f[..., -1]
        num = relu_v - state.sum_v / n * relu_mass[..., None]
        den = 2 * relu_mass - n * s + state.sum_t  # Σ |s − t_j| = 2 Σ ReLU(s − t_j) − Σ (s − t_j)
        out = 2 * num / den.clamp_min(eps)[..., None]
    return out.to(v_t.dtype), state


def sliced_relu_bump_attention_step(
    s_t: torch.Tensor,
    t_t: torch.Tensor,
    v_t: torch.Tensor,
    bandwidth: torch.Tensor,
    state: SlicedDecodeState | None = None,
) -> tuple[torch.Tensor, SlicedDecodeState]:
    """One decoding step of causal sliced ReLU-bump attention (``bandwidth (H,)``), as
    ``sliced_relu_attention_step``. The hat is ``(F(s+b) − 2F(s) + F(s−b)) / b``: in float32 a
    bandwidth narrow next to the score spread loses digits to that second difference."""
    _check_step("sliced_relu_bump_attention_step", s_t, t_t, v_t, state, "bump")
    if not isinstance(bandwidth, torch.Tensor) or tuple(bandwidth.shape) != (v_t.shape[1],):
        raise ValueError(
            f"sliced_relu_bump_attention_step: bandwidth must have shape (H,) = ({v_t.shape[1]},)"
        )
    with no_autocast(v_t.device):
        state, s = _push(state, s_t, t_t, v_t, "bump")
        b = bandwidth.to(s.dtype)[None, :]
        f = _evaluate_all(state, torch.stack([s - b, s, s + b], dim=-1))[..., :-1]  # (B, H, 3, D)
        out = (f[..., 0, :] - 2 * f[..., 1, :] + f[..., 2, :]) / (b * state.count)[..., None]
    return out.to(v_t.dtype), state


def _prefill(t: torch.Tensor, v: torch.Tensor, kind: str) -> SlicedDecodeState:
    if t.dim() != 3 or v.dim() != 4 or tuple(t.shape) != tuple(v.shape[:3]) or t.shape[-1] < 1:
        raise ValueError(
            f"expected t (B, H, T) and v (B, H, T, D) with T >= 1; got {tuple(t.shape)}, {tuple(v.shape)}"
        )
    acc = accumulation_dtype(t.dtype, v.dtype)
    with no_autocast(v.device):
        t, v = t.to(acc), v.to(acc)
        shift_t = t[..., 0]
        shift_v = v[..., 0, :] if kind == "relu" else torch.zeros_like(v[..., 0, :])
        t, v = t - shift_t[..., None], v - shift_v[..., None, :]
        rows = torch.cat([v, torch.ones_like(t)[..., None]], dim=-1)
        runs, start, length = [], 0, t.shape[-1]
        for bit in reversed(range(length.bit_length())):  # binary digits, largest run first
            if length >> bit & 1:
                runs.append(
                    _build_run(t[..., start : start + (1 << bit)], rows[..., start : start + (1 << bit), :])
                )
                start += 1 << bit
        keys, tables, totals = (tuple(part) for part in zip(*runs, strict=True))
        return SlicedDecodeState(keys, tables, totals, length, shift_t, shift_v, v.sum(-2), t.sum(-1), kind)


def sliced_relu_attention_state(t: torch.Tensor, v: torch.Tensor) -> SlicedDecodeState:
    """The decoding state after a whole prefix (prefill): key scores ``t (B, H, T)``, values
    ``v (B, H, T, D)``, every token real. Stepping on from it continues the causal sequence."""
    return _prefill(t, v, "relu")


def sliced_relu_bump_attention_state(t: torch.Tensor, v: torch.Tensor) -> SlicedDecodeState:
    """As ``sliced_relu_attention_state``, for ``sliced_relu_bump_attention_step``."""
    return _prefill(t, v, "bump")
