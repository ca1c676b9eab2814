"""Sliced ReLU attention on packed rows: each query sums the keys of its own segment only, one sort
by (segment, score) per row (``attnlab.attention.sliced_common.segments`` has the method)."""

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

__all__ = ["sliced_relu_attention_segments"]

OP = "sliced_relu_attention_segments"


def sliced_relu_attention_segments(
    s: torch.Tensor, t: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, eps: float = 1e-4
) -> torch.Tensor:
    """Bidirectional `sliced_relu_attention` inside segments: s, t (B, H, L), v (B, H, L, D) hold
    several sequences end to end in each row, ``segments`` (B, L) says which each position belongs
    to (contiguous runs, `PackedLayout.segments`), and every sum and mean runs over the query's own
    segment: each sequence gets what it gets alone. O(L log L) per row, torch code on every device
    (no Triton kernel reads segments yet); differentiable in s, t and v."""
    check_segment_inputs(OP, s, t, v, segments)
    if not eps > 0:
        raise ValueError(f"{OP}: eps must be > 0, got {eps}")
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    with no_autocast(v.device):
        s, t = (x.reshape(-1, length).to(acc) for x in (s, t))
        v_rows = v.reshape(-1, length, dim).to(acc)
        out = _segmented(s, t, v_rows, segment_runs(segments, heads), float(eps))
    return out.view(batch, heads, length, dim).to(v.dtype)


def _segmented(s, t, v, runs, eps):
    bad = broken_segments(runs, s, t, v)
    s, t, v = s.masked_fill(bad, 0.0), t.masked_fill(bad, 0.0), v.masked_fill(bad[..., None], 0.0)
    centre = segment_centre(s, t, runs)
    s, t = s - centre, t - centre
    w = v - segment_mean(v, runs)  # centred per segment: each segment's totals are of its own order

    keys = sort_keys(t, [s], runs)
    t_sorted = torch.gather(t, 1, keys.order)
    dim = w.shape[2]
    # one table of w and t·w (one gather, one cumsum); the key scores' sums in float64 beside it
    table = exclusive_prefix(take(torch.cat([w, w * t[..., None]], dim=2), keys.order)[0])
    p_t = exclusive_prefix(t_sorted.to(torch.float64))
    below, at_or_below = keys.rank(0, "left"), keys.rank(0, "right")  # global sorted positions
    start, end = runs.start, runs.end

    # Σ_{t_j<s_i} (s_i − t_j) w_j over the segment = s_i (P_w[below] − P_w[start]) − (P_tw[...] − ...)
    at_below, at_start = take(table, below, start)
    sums = at_below - at_start
    num = s[..., None] * sums[..., :dim] - sums[..., dim:]
    # Σ_j |s_i − t_j| = s_i (#below − #above) + Σ_{above} t − Σ_{below} t: tied keys add 0, value and slope
    counts = (below + at_or_below - 2 * start - runs.size).to(s.dtype)
    t_end, t_start, t_below, t_at = take(p_t, end, start, below, at_or_below)
    den = s * counts + (t_end + t_start - t_below - t_at).to(s.dtype)
    out = num * (2.0 / den.clamp_min(eps))[..., None]
    return out.masked_fill(bad[..., None], float("nan"))
