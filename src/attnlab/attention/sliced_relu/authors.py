"""Sliced ReLU with the authors' padding rule (SiwanB/Sliced_ReLU_Attention), for comparisons.

attnlab's sliced ReLU is invariant to padding: every statistic runs over real tokens, padded keys get
no weight, so a padded batch gives at real positions what each sequence gives alone. The authors'
layer, given a padding mask, instead

- zeroes the padded scores, then standardises with the real tokens' mean but a variance that sums
  (x − mean)² over *every* position (padded ones sit at −mean), divided by the real count;
- zeroes the padded values, then centres them by their mean over all T positions (the real sum / T),
  so each padded key keeps the value −(Σ real v)/T and the score −mean/std, and enters the numerator;
- divides by Σ |s_i − t_j| over the real keys only.

Its real outputs therefore move when a sequence is padded further. The numerator is the unmasked op
on the masked values; the normaliser differs from the unmasked op's (all keys) by the padded keys'
share, so the op's output is rescaled by (Σ over all keys) / (Σ over real keys): two O(T log T) sums
of scalars (`distance_sums`), nothing D-wide besides the op itself.
"""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.sliced_relu.ops import sliced_relu_attention

PADDING_RULES = ("invariant", "authors")


def standardise_scores_authors(
    s: torch.Tensor, t: torch.Tensor, key_padding_mask: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' score standardisation with a padding mask, s, t (B, H, T), in float32 at least.

    Padded scores are set to 0; the shared mean is over real tokens, each variance sums over all T
    positions and divides by the real count. Without padding this is `standardise_scores`.
    """
    acc = accumulation_dtype(s.dtype)
    real = key_padding_mask[:, None, :].to(acc)
    s, t = s.to(acc) * real, t.to(acc) * real
    count = real.sum(dim=-1, keepdim=True).clamp_min(1.0)
    mean = (s.sum(-1, keepdim=True) + t.sum(-1, keepdim=True)) / (2 * count)
    var_s = ((s - mean) ** 2).sum(-1, keepdim=True) / count
    var_t = ((t - mean) ** 2).sum(-1, keepdim=True) / count
    std = torch.sqrt((var_s + var_t) / 2 + eps)
    return (s - mean) / std, (t - mean) / std


def distance_sums(s: torch.Tensor, t: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_j w_j |s_i − t_j| for every query i: (B, H, T), in O(T log T), differentiable in s and t.

    Keys sorted by t, prefix sums of w and w·t; with W_<, (wt)_< the sums over the keys below s_i,
    the sum is s_i (2 W_< − W) − 2 (wt)_< + (wt). ``weight`` (broadcastable to t) defaults to 1.
    """
    acc = accumulation_dtype(s.dtype)
    s, t = s.to(acc), t.to(acc)
    w = torch.ones_like(t) if weight is None else weight.to(acc).expand_as(t)
    keys, order = t.sort(dim=-1)
    w = w.gather(-1, order)
    zero = torch.zeros_like(w[..., :1])
    cum_w = torch.cat([zero, w.cumsum(-1)], dim=-1)
    cum_tw = torch.cat([zero, (w * keys).cumsum(-1)], dim=-1)
    rank = torch.searchsorted(keys.contiguous(), s.contiguous())  # keys strictly below s_i
    below_w, below_tw = cum_w.gather(-1, rank), cum_tw.gather(-1, rank)
    return s * (2 * below_w - cum_w[..., -1:]) - 2 * below_tw + cum_tw[..., -1:]


def authors_padded_sliced_relu(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor,
    eps: float = 1e-4,
    padded_queries: str = "zero",
    path: str = "auto",
) -> torch.Tensor:
    """Standardisation and sliced ReLU as the authors' layer computes them under a padding mask.

    s, t are Π's raw scores (B, H, T), v (B, H, T, D), ``key_padding_mask`` (B, T) with True = real.
    Every position is a query (the authors' layer computes them all); ``padded_queries="zero"``
    zeroes the padded ones afterwards, ``"attend"`` keeps them.
    """
    s, t = standardise_scores_authors(s, t, key_padding_mask)
    real = key_padding_mask[:, None, :]
    out = sliced_relu_attention(s, t, v * real[..., None].to(v.dtype), None, eps=eps, path=path)
    every, real_only = distance_sums(s, t), distance_sums(s, t, real)
    out = out * (every.clamp_min(eps) / real_only.clamp_min(eps))[..., None].to(out.dtype)
    if padded_queries == "zero":
        out = out * real[..., None].to(out.dtype)
    return out
