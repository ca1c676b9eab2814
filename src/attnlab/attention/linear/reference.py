"""Linear attention written as a T×T weight matrix: the reference of the chunked, Triton and recurrent
forms. Imports nothing from the ops (a reference that called their helpers would share their bugs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.common.reference_masks import allowed_keys, kept_queries

__all__ = ["linear_attention"]


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """``o_i = φ(q_i)ᵀ S / (φ(q_i)ᵀ z + eps)`` with ``φ = elu + 1``, written as a T×T weight matrix.

    ``φ(q_i)ᵀ S = Σ_j (φ(q_i)·φ(k_j)) v_j`` and ``φ(q_i)ᵀ z = Σ_j φ(q_i)·φ(k_j)``, so the weights
    ``A_ij = φ(q_i)·φ(k_j)`` restricted to real (and, when causal, past) keys give both.
    """
    phi_q = F.elu(q) + 1
    phi_k = F.elu(k) + 1
    weights = phi_q @ phi_k.transpose(-1, -2)  # (B, H, T, T)
    weights = torch.where(allowed_keys(key_padding_mask, q, causal), weights, torch.zeros_like(weights))
    out = (weights @ v) / (weights.sum(dim=-1, keepdim=True) + eps)
    return torch.where(kept_queries(key_padding_mask, q, padded_queries), out, torch.zeros_like(out))
