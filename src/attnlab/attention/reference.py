"""Naive O(T²) definitions of every attention backend, for tests and benchmarks only.

Each function is written the obvious way, with broadcasting, so that it can be read against
the math of docs/attention.md line by line. They build T×T tensors on purpose: never use them in a
model. Shapes follow the ops: ``q, k, v`` are ``(B, H, T, D)``, scores ``s, t`` are ``(B, H, T)``,
``key_padding_mask`` is a bool ``(B, T)`` with True = real token.

They repeat, on purpose, what the ops also do (shape checks, masks, the centring of values): a
reference that called the op's helpers would share its bugs, so nothing here imports from the ops.

Conventions shared with the fast ops:

- padded keys have no influence at all (they are dropped from every sum, mean and count);
- padded query positions output zeros (never NaN), and so does a query with no visible key;
  with ``padded_queries="attend"`` (bidirectional) they attend to the real keys instead
  (``attnlab.attention.padding``);
- kinks are differentiated the way torch autograd does it (``relu'(0) = 0``, ``abs'(0) = 0``),
  which is what the fast ops reproduce at tied scores.

``sliced_relu_attention_concat`` is different in kind: it is the straightforward sort-based
formulation of the public sliced-ReLU reference code (arXiv 2512.11411), kept as the baseline
the benchmark compares the fast op against; it is O(T log T) but plain autograd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "causal_sliced_relu_attention",
    "causal_sliced_relu_bump_attention",
    "linear_attention",
    "sliced_relu_attention",
    "sliced_relu_attention_concat",
    "sliced_relu_bump_attention",
    "softmax_attention",
]


def _key_mask(key_padding_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, 1, T)`` (broadcasts over heads) of real tokens; all True without a mask."""
    batch, _, length = like.shape[:3]
    if key_padding_mask is None:
        return torch.ones(batch, 1, length, dtype=torch.bool, device=like.device)
    return key_padding_mask.to(device=like.device, dtype=torch.bool)[:, None, :]


def _kept(key_padding_mask: torch.Tensor | None, like: torch.Tensor, padded_queries: str) -> torch.Tensor:
    """Bool ``(B, 1, T, 1)``: the queries whose output is kept (all of them under ``"attend"``)."""
    if padded_queries == "attend":
        key_padding_mask = None
    return _key_mask(key_padding_mask, like)[..., None]


def _allowed(key_padding_mask: torch.Tensor | None, like: torch.Tensor, causal: bool) -> torch.Tensor:
    """Bool ``(B, 1, T_query, T_key)`` (or ``(B, 1, 1, T_key)``): key j is real, and j <= i if causal."""
    allowed = _key_mask(key_padding_mask, like)[:, :, None, :]
    if causal:
        length = like.shape[2]
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=like.device).tril()
    return allowed


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
    allowed = _allowed(key_padding_mask, q, causal)
    scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(dim=-1, keepdim=True)  # a row with no visible key would be all -inf
    probs = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1).masked_fill(~allowed, 0.0)
    out = probs @ v
    return torch.where(_kept(key_padding_mask, q, padded_queries) & has_key, out, torch.zeros_like(out))


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
    weights = torch.where(_allowed(key_padding_mask, q, causal), weights, torch.zeros_like(weights))
    out = (weights @ v) / (weights.sum(dim=-1, keepdim=True) + eps)
    return torch.where(_kept(key_padding_mask, q, padded_queries), out, torch.zeros_like(out))


def sliced_relu_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-4,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """``o_i = 2 Σ_j ReLU(s_i - t_j)(v_j - vbar) / max(Σ_j |s_i - t_j|, eps)``, sums over real keys."""
    valid = _key_mask(key_padding_mask, s)  # (B, 1, T)
    count = valid.sum(dim=-1, keepdim=True).clamp_min(1)  # (B, 1, 1)
    v_real = torch.where(valid[..., None], v, torch.zeros_like(v))
    vbar = v_real.sum(dim=-2, keepdim=True) / count[..., None]  # (B, H, 1, D)
    centred = torch.where(valid[..., None], v - vbar, torch.zeros_like(v))
    diff = s[..., :, None] - t[..., None, :]  # (B, H, T_query, T_key)
    key_valid = valid[:, :, None, :]
    relu = torch.where(key_valid, torch.relu(diff), torch.zeros_like(diff))
    dist = torch.where(key_valid, diff.abs(), torch.zeros_like(diff))
    out = 2 * (relu @ centred) / dist.sum(dim=-1, keepdim=True).clamp_min(eps)
    return torch.where(_kept(key_padding_mask, s, padded_queries), out, torch.zeros_like(out))


def sliced_relu_bump_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    bandwidth: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """``o_i = (1/n) Σ_j max(0, 1 - |s_i - t_j| / b_h) v_j`` over the n real keys (values not centred)."""
    valid = _key_mask(key_padding_mask, s)
    count = valid.sum(dim=-1, keepdim=True).clamp_min(1)  # (B, 1, 1)
    diff = s[..., :, None] - t[..., None, :]
    hat = torch.relu(1 - diff.abs() / bandwidth[None, :, None, None])
    hat = torch.where(valid[:, :, None, :], hat, torch.zeros_like(hat))
    v_real = torch.where(valid[..., None], v, torch.zeros_like(v))
    out = (hat @ v_real) / count[..., None]
    return torch.where(_kept(key_padding_mask, s, padded_queries), out, torch.zeros_like(out))


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
    what makes it slow and memory hungry next to ``attnlab.attention.sliced``.
    """
    length, dim = v.shape[-2], v.shape[-1]
    valid = _key_mask(key_padding_mask, s).expand_as(s)  # (B, H, T)
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
    allowed = _allowed(key_padding_mask, s, causal=True)  # (B, 1, T, T)
    count = allowed.sum(dim=-1).clamp_min(1)  # (B, 1, T)
    v_real = torch.where(_key_mask(key_padding_mask, s)[..., None], v, torch.zeros_like(v))
    vbar = (allowed.to(v.dtype) @ v_real) / count[..., None]  # (B, H, T, D): prefix means
    diff = s[..., :, None] - t[..., None, :]
    relu = torch.where(allowed, torch.relu(diff), torch.zeros_like(diff))
    dist = torch.where(allowed, diff.abs(), torch.zeros_like(diff))
    numer = relu @ v_real - relu.sum(dim=-1, keepdim=True) * vbar  # Σ_j relu_ij (v_j − vbar_i)
    out = 2 * numer / dist.sum(dim=-1, keepdim=True).clamp_min(eps)
    return torch.where(_key_mask(key_padding_mask, s)[..., None], out, torch.zeros_like(out))


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
    allowed = _allowed(key_padding_mask, s, causal=True)
    diff = s[..., :, None] - t[..., None, :]
    hat = torch.relu(1 - diff.abs() / bandwidth[None, :, None, None])
    hat = torch.where(allowed, hat, torch.zeros_like(hat))
    if normaliser == "count":
        den = allowed.sum(dim=-1).clamp_min(1).to(v.dtype)
    else:
        den = hat.sum(dim=-1) + mass_eps
    v_real = torch.where(_key_mask(key_padding_mask, s)[..., None], v, torch.zeros_like(v))
    out = (hat @ v_real) / den[..., None]
    return torch.where(_key_mask(key_padding_mask, s)[..., None], out, torch.zeros_like(out))
