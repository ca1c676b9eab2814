"""Decoding for the causal sliced ops: one token at a time, in O(D log n + log² n) amortised.

Decoding (``sliced_relu_attention_step``) uses the logarithmic method: the past keys are kept as a
few sorted runs of sizes 2^k (the binary digits of n), each storing, at every key, the key score
and the values of the piecewise-linear functions ``F(x) = Σ_{t_j<x} (x − t_j) [v_j, 1]`` at that key
(D + 2 numbers per past token; a softmax KV cache holds 2·D). ``F`` is linear between consecutive
keys, so a run evaluates it anywhere by one binary search and a linear interpolation; a new token
is a run of one, and equal-size runs merge (each evaluating the other's F at its keys). A step
costs O(D log n + log² n) amortised.

Precision as in ``attnlab.attention.sliced.causal``: scores shifted by the first key score (and,
for sliced ReLU, values by the first value), sums in at least float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced.normaliser import check_bump_normaliser

__all__ = [
    "SlicedDecodeState",
    "sliced_relu_attention_state",
    "sliced_relu_attention_step",
    "sliced_relu_bump_attention_state",
    "sliced_relu_bump_attention_step",
]

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
    normaliser: str = "count",
    mass_eps: float = 1e-2,
) -> tuple[torch.Tensor, SlicedDecodeState]:
    """One decoding step of causal sliced ReLU-bump attention (``bandwidth (H,)``), as
    ``sliced_relu_attention_step``; ``normaliser``/``mass_eps`` as in ``sliced_relu_bump_attention``.
    The hat is ``(F(s+b) − 2F(s) + F(s−b)) / b``: in float32 a bandwidth narrow next to the score
    spread loses digits to that second difference."""
    _check_step("sliced_relu_bump_attention_step", s_t, t_t, v_t, state, "bump")
    if not isinstance(bandwidth, torch.Tensor) or tuple(bandwidth.shape) != (v_t.shape[1],):
        raise ValueError(
            f"sliced_relu_bump_attention_step: bandwidth must have shape (H,) = ({v_t.shape[1]},)"
        )
    check_bump_normaliser("sliced_relu_bump_attention_step", normaliser, mass_eps, causal=True)
    with no_autocast(v_t.device):
        state, s = _push(state, s_t, t_t, v_t, "bump")
        b = bandwidth.to(s.dtype)[None, :]
        f = _evaluate_all(state, torch.stack([s - b, s, s + b], dim=-1))  # (B, H, 3, D + 1)
        hat_sums = f[..., 0, :] - 2 * f[..., 1, :] + f[..., 2, :]  # b · Σ_j hat_j [v_j, 1]
        den = b * state.count if normaliser == "count" else hat_sums[..., -1] + mass_eps * b
        out = hat_sums[..., :-1] / den[..., None]
    return out.to(v_t.dtype), state


def _prefill(t: torch.Tensor, v: torch.Tensor, kind: str) -> SlicedDecodeState:
    if t.dim() != 3 or v.dim() != 4 or tuple(t.shape) != tuple(v.shape[:3]) or t.shape[-1] < 1:
        raise ValueError(
            f"expected t (B, H, T) and v (B, H, T, D) with T >= 1; got {tuple(t.shape)}, {tuple(v.shape)}"
        )
    acc = accumulation_dtype(t.dtype, v.dtype)
    with no_autocast(v.device):
        t, v = t.to(acc).contiguous(), v.to(acc).contiguous()  # scores may arrive as a transposed view
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
