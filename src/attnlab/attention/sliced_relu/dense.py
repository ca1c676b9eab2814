"""Sliced ReLU evaluated densely in O(T²), bidirectional and causal: the fast path for short
sequences (``attnlab.attention.sliced_common.dense`` has the rules both sliced families follow)."""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.sliced_common.dense import (
    causal_keys,
    clean_scores,
    keep_queries,
    key_weights,
    poison_rows,
    score_differences,
    tie_correction,
)

__all__ = ["dense_causal_sliced_relu", "dense_sliced_relu"]


def dense_sliced_relu(s, t, v, valid, queries, eps):
    """``o_i = 2 Σ_j ReLU(s_i − t_j)(v_j − vbar) / max(Σ_j |s_i − t_j|, eps)`` over real keys j.

    One ReLU matrix and one ``bmm`` give both sums: the numerator against the centred values and
    the ReLU mass against the key mask, and ``Σ_j |r_ij| = 2 Σ_j ReLU(r_ij) − Σ_j r_ij`` (with
    ``tie_correction`` for the slope at ties).
    """
    with no_autocast(v.device):
        s0, t0, bad = clean_scores(s, t, valid, queries)
        real, count = key_weights(valid, t0)
        v_real = v if real is None else v.masked_fill(~valid[..., None], 0.0)  # padding, NaN or not, vanishes
        w = v_real - v_real.sum(dim=1, keepdim=True) / count[..., None]
        ones = torch.ones_like(t0) if real is None else real
        if real is not None:
            w = w * real[..., None]
        diff = score_differences(s0, t0)  # (N, T_query, T_key)
        fix = tie_correction(diff, s0, t0, real)
        sums = torch.bmm(diff.relu_(), torch.cat([w, ones[..., None]], dim=2))
        key_sum = (t0 * ones).sum(dim=1, keepdim=True)
        dist = 2 * sums[..., -1] - (s0 * count - key_sum)  # Σ_j |s_i − t_j| over real keys
        if fix is not None:
            dist = dist + fix
        out = sums[..., :-1] * (2.0 / dist.clamp_min(eps))[..., None]
        return poison_rows(keep_queries(out, queries), bad, s, t, v, None, valid, queries)


def dense_causal_sliced_relu(s, t, v, valid, eps):
    """``o_i = 2 Σ_{j≤i} ReLU(s_i − t_j)(v_j − vbar_i) / max(Σ_{j≤i} |s_i − t_j|, eps)``, real j only,
    ``vbar_i`` the mean of the real ``v_j``, j <= i. Padded queries output zeros."""
    with no_autocast(v.device):
        s0, t0, bad = clean_scores(s, t, valid, valid, causal=True)
        allowed, n = causal_keys(valid, t0)
        # The output does not change when every v moves by one constant: shift by the row's first
        # real value (detached, from no future token) so that Σ relu·v − (Σ relu)·vbar does not cancel.
        first = 0 if valid is None else valid.to(torch.int8).argmax(dim=1)
        shift = v[torch.arange(v.shape[0], device=v.device), first].detach()
        v_real = v - shift[:, None, :]
        if valid is not None:
            v_real = v_real.masked_fill(~valid[..., None], 0.0)
        vbar = v_real.cumsum(dim=1) / n[..., None]
        diff = s0[:, :, None] - t0[:, None, :]
        zero = diff.new_zeros(())
        relu = torch.where(allowed, diff.relu(), zero)
        dist = torch.where(allowed, diff.abs(), zero).sum(dim=2)
        num = torch.bmm(relu, v_real) - relu.sum(dim=2)[..., None] * vbar
        out = keep_queries(num * (2.0 / dist.clamp_min(eps))[..., None], valid)
        return poison_rows(out, bad, s, t, v, None, valid, valid)
