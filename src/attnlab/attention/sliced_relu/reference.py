"""Sliced ReLU attention written the obvious way (T×T differences), bidirectional and causal, and the
authors' sort-based formulation (the benchmark's baseline). Imports nothing from the ops (a
reference that called their helpers would share their bugs).
"""

from __future__ import annotations

import torch

from attnlab.attention.common.reference_masks import allowed_keys, kept_queries, key_mask

__all__ = ["causal_sliced_relu_attention", "sliced_relu_attention", "sliced_relu_attention_concat"]


def sliced_relu_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-4,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """``o_i = 2 Σ_j ReLU(s_i - t_j)(v_j - vbar) / max(Σ_j |s_i - t_j|, eps)``, sums over real keys."""
    valid = key_mask(key_padding_mask, s)  # (B, 1, T)
    count = valid.sum(dim=-1, keepdim=True).clamp_min(1)  # (B, 1, 1)
    v_real = torch.where(valid[..., None], v, torch.zeros_like(v))
    vbar = v_real.sum(dim=-2, keepdim=True) / count[..., None]  # (B, H, 1, D)
    centred = torch.where(valid[..., None], v - vbar, torch.zeros_like(v))
    diff = s[..., :, None] - t[..., None, :]  # (B, H, T_query, T_key)
    key_valid = valid[:, :, None, :]
    relu = torch.where(key_valid, torch.relu(diff), torch.zeros_like(diff))
    dist = torch.where(key_valid, diff.abs(), torch.zeros_like(diff))
    out = 2 * (relu @ centred) / dist.sum(dim=-1, keepdim=True).clamp_min(eps)
    return torch.where(kept_queries(key_padding_mask, s, padded_queries), out, torch.zeros_like(out))


def sliced_relu_attention_concat(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Sliced ReLU attention as the public reference code computes it: the benchmark's baseline.

    Keys and queries go into one list of 2T scores (keys first), which is sorted once. Values live
    on the keys (centred, zero on padded keys) and are zero on the queries; in sorted order
    ``Σ_{j≤i} (z_i - z_j) w_j = z_i·cumsum(w)_i - cumsum(z w)_i`` gives every ReLU sum at once,
    over all 2T positions and all D channels, and a gather with the inverse permutation brings
    the query rows back. The normaliser repeats this with weight 1 on real keys and uses
    ``|r| = 2 ReLU(r) - r``. Plain autograd differentiates through the sorts and cumsums, which is
    what makes it slow and memory hungry next to ``attnlab.attention.sliced_common``.
    """
    length, dim = v.shape[-2], v.shape[-1]
    valid = key_mask(key_padding_mask, s).expand_as(s)  # (B, H, T)
    count = valid.sum(dim=-1, keepdim=True).clamp_min(1)[..., None]
    v_real = torch.where(valid[..., None], v, torch.zeros_like(v))
    centred = torch.where(valid[..., None], v - v_real.sum(dim=-2, keepdim=True) / count, 0.0)

    # Padded keys are moved out of the way (after every real score) and carry zero weight.
    t_keys = torch.where(valid, t, torch.full_like(t, float("inf")))
    scores = torch.cat([torch.where(valid, t, 0.0), s], dim=-1)  # (B, H, 2T), finite
    sort_key = torch.cat([t_keys, s], dim=-1)
    _, order = torch.sort(sort_key, dim=-1)
    inverse = torch.argsort(order, dim=-1)
    z = torch.gather(scores, -1, order)  # sorted scores, differentiable w.r.t. s and t

    weights = torch.cat([centred, torch.zeros_like(centred)], dim=-2)  # (B, H, 2T, D)
    w_sorted = torch.gather(weights, -2, order[..., None].expand(-1, -1, -1, dim))
    relu_sums = z[..., None] * torch.cumsum(w_sorted, dim=-2) - torch.cumsum(z[..., None] * w_sorted, dim=-2)
    numer = torch.gather(relu_sums, -2, inverse[..., None].expand(-1, -1, -1, dim))[..., length:, :]

    ones = torch.cat([valid.to(s.dtype), torch.zeros_like(s)], dim=-1)
    ones_sorted = torch.gather(ones, -1, order)
    relu_count = z * torch.cumsum(ones_sorted, dim=-1) - torch.cumsum(z * ones_sorted, dim=-1)
    total, total_z = ones_sorted.sum(-1, keepdim=True), (ones_sorted * z).sum(-1, keepdim=True)
    dist_sorted = 2 * relu_count - (z * total - total_z)
    dist = torch.gather(dist_sorted, -1, inverse)[..., length:]

    out = 2 * numer / dist.clamp_min(eps)[..., None]
    return torch.where(valid[..., None], out, torch.zeros_like(out))


def causal_sliced_relu_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """``o_i = 2 Σ_{j≤i} ReLU(s_i − t_j)(v_j − vbar_i) / max(Σ_{j≤i} |s_i − t_j|, eps)``, real j only,
    ``vbar_i`` the mean of the real ``v_j`` with ``j ≤ i``."""
    allowed = allowed_keys(key_padding_mask, s, causal=True)  # (B, 1, T, T)
    count = allowed.sum(dim=-1).clamp_min(1)  # (B, 1, T)
    v_real = torch.where(key_mask(key_padding_mask, s)[..., None], v, torch.zeros_like(v))
    vbar = (allowed.to(v.dtype) @ v_real) / count[..., None]  # (B, H, T, D): prefix means
    diff = s[..., :, None] - t[..., None, :]
    relu = torch.where(allowed, torch.relu(diff), torch.zeros_like(diff))
    dist = torch.where(allowed, diff.abs(), torch.zeros_like(diff))
    numer = relu @ v_real - relu.sum(dim=-1, keepdim=True) * vbar  # Σ_j relu_ij (v_j − vbar_i)
    out = 2 * numer / dist.sum(dim=-1, keepdim=True).clamp_min(eps)
    return torch.where(key_mask(key_padding_mask, s)[..., None], out, torch.zeros_like(out))
