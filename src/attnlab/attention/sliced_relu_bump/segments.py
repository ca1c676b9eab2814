"""Sliced ReLU-bump attention on packed rows: each query's hat window reads the keys of its own
segment only, one sort by (segment, score) per row (``attnlab.attention.sliced_common.segments``
has the method)."""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced_common.segments import (
    broken_segments,
    check_segment_inputs,
    exclusive_prefix,
    segment_centre,
    segment_mean,
    segment_runs,
    sort_keys,
    take,
)
from attnlab.attention.sliced_relu_bump.ops import check_bandwidth

__all__ = ["sliced_relu_bump_attention_segments"]

OP = "sliced_relu_bump_attention_segments"


def sliced_relu_bump_attention_segments(
    s: torch.Tensor, t: torch.Tensor, v: torch.Tensor, bandwidth: torch.Tensor, segments: torch.Tensor
) -> torch.Tensor:
    """Bidirectional `sliced_relu_bump_attention` (count normaliser) inside segments:
    ``o_i = (1/n) Σ_j max(0, 1 − |s_i − t_j| / b_h) v_j`` over the n keys of the query's own segment
    (``segments`` (B, L), contiguous runs, `PackedLayout.segments`); s, t (B, H, L), v (B, H, L, D),
    ``bandwidth`` (H,). O(L log L) per row, torch code on every device; differentiable in s, t, v
    and the bandwidth."""
    check_segment_inputs(OP, s, t, v, segments)
    batch, heads, length, dim = v.shape
    check_bandwidth(OP, bandwidth, heads)
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    with no_autocast(v.device):
        s, t = (x.reshape(-1, length).to(acc) for x in (s, t))
        v_rows = v.reshape(-1, length, dim).to(acc)
        width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]  # row (b, h) → b_h
        out = _segmented(s, t, v_rows, width, segment_runs(segments, heads))
    return out.view(batch, heads, length, dim).to(v.dtype)


def _segmented(s, t, v, b, runs):
    bad = broken_segments(runs, s, t, v)
    s, t, v = s.masked_fill(bad, 0.0), t.masked_fill(bad, 0.0), v.masked_fill(bad[..., None], 0.0)
    centre = segment_centre(s, t, runs)
    s, t = s - centre, t - centre
    vbar = segment_mean(v, runs)
    w = v - vbar  # tables of centred values; vbar returns times the hat mass, from the scalar tables

    keys = sort_keys(t, [s - b, s, s + b], runs)
    t_sorted = torch.gather(t, 1, keys.order)
    dim = w.shape[2]
    # one table of w and t·w (one gather, one cumsum); the key scores' sums in float64 beside it
    table = exclusive_prefix(take(torch.cat([w, w * t[..., None]], dim=2), keys.order)[0])
    p_t = exclusive_prefix(t_sorted.to(torch.float64))
    lo = keys.rank(0, "right")  # keys <= s − b: outside the window
    tied_lo, tied_hi = keys.rank(1, "left"), keys.rank(1, "right")  # keys < s, keys <= s
    hi = keys.rank(2, "left")  # keys < s + b
    bounds = (lo, tied_lo, tied_hi, hi)

    # b · Σ_j hat(s − t_j) x_j over the window, split so tied keys (weight b, slope 0) stand alone:
    # (b − s) Σ_{(s−b, s)} x + Σ_{(s−b, s)} t x + b Σ_{t = s} x + (b + s) Σ_{(s, s+b)} x − Σ_{(s, s+b)} t x
    def hat_sum(left, left_t, tied, right, right_t, scale):
        return scale(b - s) * left + left_t + scale(b) * tied + scale(b + s) * right - right_t

    at = take(table, *bounds)
    left, tied, right = (z - a for a, z in zip(at[:-1], at[1:], strict=True))  # window sums of [w, t·w]
    weighted = hat_sum(
        left[..., :dim],
        left[..., dim:],
        tied[..., :dim],
        right[..., :dim],
        right[..., dim:],
        lambda c: c[..., None],
    )
    # the same with x = 1: key counts are position differences, key-score sums float64 differences
    n_left, n_tied, n_right = ((z - a).to(s.dtype) for a, z in zip(bounds[:-1], bounds[1:], strict=True))
    at_t = take(p_t, *bounds)
    t_left, _, t_right = ((z - a).to(s.dtype) for a, z in zip(at_t[:-1], at_t[1:], strict=True))
    mass = hat_sum(n_left, t_left, n_tied, n_right, t_right, lambda c: c)
    out = (weighted + mass[..., None] * vbar) / (b * runs.size.to(s.dtype))[..., None]
    return out.masked_fill(bad[..., None], float("nan"))
