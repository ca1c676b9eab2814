"""Performer's recurrent decoding: (S, z) on FAVOR+ features, kept scaled to the running key stabiliser
(the maximum key logit so far), plus Σ v_j and the count for the stabiliser's ε terms
(``attnlab.attention.performer.ops``'s causal form). ``attnlab.attention.decoding`` calls
``layer_state`` and ``layer_step``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.performer.ops import favor_features, favor_logits


class PerformerState(NamedTuple):
    """Causal FAVOR+ state: S (B, H, M, Dv) and z (B, H, M) = Σ exp(l_j − |k_j'|²/2 − m) [v_j, 1] with m
    (B, H) the running key stabiliser; v_sum (B, H, Dv) and count for the stabiliser's ε terms."""

    S: torch.Tensor
    z: torch.Tensor
    shift: torch.Tensor
    v_sum: torch.Tensor
    count: int
    position: int


STABILIZER_EPS = 1e-4  # performer_attention's default, which the layer uses


def layer_state(layer, q, k, v) -> PerformerState:
    with no_autocast(k.device):
        acc = accumulation_dtype(q.dtype)
        logits, half_sq_norm = favor_logits(k.to(acc), layer.feature_map.projection)
        shift = logits.amax(dim=(-1, -2))  # the running maximum after the last token
        features = torch.exp(logits - half_sq_norm - shift[..., None, None])
        values = v.to(acc)
        s = torch.einsum("bhtm,bhte->bhme", features, values)
        return PerformerState(s, features.sum(2), shift, values.sum(2), k.shape[2], k.shape[2])


def layer_step(layer, q, k, v, state: PerformerState | None):
    position = 0 if state is None else state.position
    dtype, projection = v.dtype, layer.feature_map.projection
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype)
        q, k, v = q.to(acc)[:, :, None], k.to(acc)[:, :, None], v.to(acc)
        logits, half_sq_norm = favor_logits(k, projection)  # (B, H, 1, M), (B, H, 1, 1)
        logits, half_sq_norm = logits[:, :, 0], half_sq_norm[:, :, 0]
        if state is None:
            shift = logits.amax(-1)
            s = v.new_zeros(*v.shape[:2], logits.shape[-1], v.shape[-1])
            z, v_sum, count = torch.zeros_like(logits), torch.zeros_like(v), 0
        else:
            shift = torch.maximum(state.shift, logits.amax(-1))
            decay = torch.exp(state.shift - shift)[..., None]  # <= 1: the past rescaled to the new max
            s, z, v_sum, count = state.S * decay[..., None], state.z * decay, state.v_sum, state.count
        feature = torch.exp(logits - half_sq_norm - shift[..., None])  # (B, H, M)
        s = s + feature[..., None] * v[..., None, :]
        z, v_sum, count = z + feature, v_sum + v, count + 1
        phi_q = favor_features(q, projection, is_query=True, stabilizer_eps=STABILIZER_EPS)[:, :, 0]
        q_total = phi_q.sum(-1, keepdim=True)
        num = torch.einsum("bhm,bhme->bhe", phi_q, s) + STABILIZER_EPS * q_total * v_sum
        den = (phi_q * z).sum(-1, keepdim=True) + STABILIZER_EPS * q_total * count
        scale = projection.shape[0] ** -0.5
        o = (num * scale / (den * scale + layer.eps)).to(dtype)
    return o, PerformerState(s, z, shift, v_sum, count, position + 1)
