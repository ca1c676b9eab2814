"""Softmax attention written the obvious way, O(T²), float64 in the tests: the op's reference.

Explicit `softmax(q kᵀ / sqrt(D)) v` (not SDPA); imports nothing from the ops (a reference that
called their helpers would share their bugs).
"""

from __future__ import annotations

import math

import torch

from attnlab.attention.common.reference_masks import allowed_keys, kept_queries

__all__ = ["softmax_attention"]


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """Explicit ``softmax(q kᵀ / sqrt(D)) v`` (not SDPA), padded keys and future keys removed."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    allowed = allowed_keys(key_padding_mask, q, causal)
    scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(dim=-1, keepdim=True)  # a row with no visible key would be all -inf
    probs = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1).masked_fill(~allowed, 0.0)
    out = probs @ v
    return torch.where(
        kept_queries(key_padding_mask, q, padded_queries) & has_key, out, torch.zeros_like(out)
    )
