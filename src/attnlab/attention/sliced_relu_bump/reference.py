"""Sliced ReLU-bump attention written the obvious way (a T×T hat matrix), bidirectional and causal.
Imports nothing from the ops (a reference that called their helpers would share their bugs).
"""

from __future__ import annotations

import torch

from attnlab.attention.common.reference_masks import allowed_keys, kept_queries, key_mask

__all__ = ["causal_sliced_relu_bump_attention", "sliced_relu_bump_attention"]


def sliced_relu_bump_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    bandwidth: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """``o_i = (1/n) Σ_j max(0, 1 - |s_i - t_j| / b_h) v_j`` over the n real keys (values not centred)."""
    valid = key_mask(key_padding_mask, s)
    count = valid.sum(dim=-1, keepdim=True).clamp_min(1)  # (B, 1, 1)
    diff = s[..., :, None] - t[..., None, :]
    hat = torch.relu(1 - diff.abs() / bandwidth[None, :, None, None])
    hat = torch.where(valid[:, :, None, :], hat, torch.zeros_like(hat))
    v_real = torch.where(valid[..., None], v, torch.zeros_like(v))
    out = (hat @ v_real) / count[..., None]
    return torch.where(kept_queries(key_padding_mask, s, padded_queries), out, torch.zeros_like(out))


def causal_sliced_relu_bump_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    bandwidth: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    normaliser: str = "count",
    mass_eps: float = 1e-2,
) -> torch.Tensor:
    """``o_i = (1/n_i) Σ_{j≤i} max(0, 1 − |s_i − t_j| / b_h) v_j``, n_i real keys with ``j ≤ i``;
    ``normaliser="mass"`` divides by ``Σ_{j≤i} max(0, 1 − |s_i − t_j| / b_h) + mass_eps`` instead."""
    allowed = allowed_keys(key_padding_mask, s, causal=True)
    diff = s[..., :, None] - t[..., None, :]
    hat = torch.relu(1 - diff.abs() / bandwidth[None, :, None, None])
    hat = torch.where(allowed, hat, torch.zeros_like(hat))
    if normaliser == "count":
        den = allowed.sum(dim=-1).clamp_min(1).to(v.dtype)
    else:
        den = hat.sum(dim=-1) + mass_eps
    v_real = torch.where(key_mask(key_padding_mask, s)[..., None], v, torch.zeros_like(v))
    out = (hat @ v_real) / den[..., None]
    return torch.where(key_mask(key_padding_mask, s)[..., None], out, torch.zeros_like(out))
