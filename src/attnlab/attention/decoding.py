"""Recurrent decoding of the causal attention layers: prefill a prompt in parallel, then one token at a time.

A causal layer maps ``(B, T, dim)`` to ``(B, T, dim)`` with position i seeing tokens ≤ i only, so it can
also run as a recurrence over a state that summarises the past (`AttentionLayer.prefill` and `.step`
call the functions here):

- softmax: a KV cache, the rotated keys and the values of every past token (grows by 2·D per token
  and head; a step reads all of it);
- linear: ``(S, z)`` = (Σ φ(k_j) v_jᵀ, Σ φ(k_j)), constant size (`attnlab.attention.linear`);
- performer: the same on FAVOR+ features, kept scaled to the running key stabiliser (the maximum
  key logit so far), plus Σ v_j and the count for the stabiliser's ε terms (`performer._causal_favor`);
- sliced ReLU / ReLU-bump: the sorted runs of `attnlab.attention.sliced.decode`, and for
  ``standardise="prefix"`` the running score statistics.

``prefill(layer, x)`` runs the layer's own parallel causal forward for the outputs and builds the state
from the same q, k, v; ``step(layer, x_t, state)`` advances one token. Fed the same tokens, the steps give
the rows of the parallel forward (the tests hold them equal in float64). A step may update the state's
tensors in place: decode forward from a state, do not branch two continuations from one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.linear import linear_attention_state, linear_attention_step
from attnlab.attention.performer import _favor_logits, favor_features
from attnlab.attention.precision import accumulation_dtype, no_autocast
from attnlab.attention.scores import slice_tokens, standardise_scores_prefix, standardise_step
from attnlab.attention.sliced.decode import (
    SlicedDecodeState,
    sliced_relu_attention_state,
    sliced_relu_attention_step,
    sliced_relu_bump_attention_state,
    sliced_relu_bump_attention_step,
)


class KVCache(NamedTuple):
    """Softmax's decoding state: rotated keys and values ``(B, H, capacity, D)``, the first ``length``
    rows used (the buffers double when full, so appending is amortised O(1))."""

    k: torch.Tensor
    v: torch.Tensor
    length: int

    @property
    def position(self) -> int:
        return self.length


class LinearAttentionState(NamedTuple):
    """Decoding state of a causal LinearAttention layer: S (B, H, D, Dv), z (B, H, D), tokens seen."""

    S: torch.Tensor
    z: torch.Tensor
    position: int


class PerformerState(NamedTuple):
    """Causal FAVOR+ state: S (B, H, M, Dv) and z (B, H, M) = Σ exp(l_j − |k_j'|²/2 − m) [v_j, 1] with m
    (B, H) the running key stabiliser; v_sum (B, H, Dv) and count for the stabiliser's ε terms."""

    S: torch.Tensor
    z: torch.Tensor
    shift: torch.Tensor
    v_sum: torch.Tensor
    count: int
    position: int


class SlicedAttentionState(NamedTuple):
    """Decoding state of a causal sliced ReLU(-bump) layer: the op's sorted runs, the running score
    statistics of `standardise="prefix"` (shift, count, Σ, Σ² of the shifted scores; None otherwise),
    tokens seen."""

    op: SlicedDecodeState
    stats: tuple[torch.Tensor, ...] | None
    position: int


def check_step_input(layer, x_t: torch.Tensor) -> None:
    if not layer.causal:
        raise ValueError(
            f"{type(layer).__name__}: recurrent decoding needs a causal layer (causal=True): a non-causal "
            "output depends on future tokens, which a recurrent decoder has not seen"
        )
    if x_t.dim() != 2 or x_t.shape[-1] != layer.dim:
        raise ValueError(f"expected x_t of shape (B, dim={layer.dim}), got {tuple(x_t.shape)}")


def _check_prefill_input(layer, x: torch.Tensor) -> None:
    check_step_input(layer, x[:, 0] if x.dim() == 3 and x.shape[1] else x)
    if x.dim() != 3 or x.shape[1] < 1:
        raise ValueError(f"expected x of shape (B, T >= 1, dim={layer.dim}), got {tuple(x.shape)}")


# ------------------------------------------------------------------------------------------- softmax


def _softmax_state(q, k, v, x) -> KVCache:
    return KVCache(k.contiguous(), v.contiguous(), k.shape[2])


def _softmax_step(layer, q, k, v, state: KVCache | None):
    n = 0 if state is None else state.length
    if state is None or n == state.k.shape[2]:  # full: double the buffers
        grown = [k.new_empty(*k.shape[:2], max(16, 2 * n), k.shape[-1]) for _ in range(2)]
        if state is not None:
            grown[0][:, :, :n].copy_(state.k)
            grown[1][:, :, :n].copy_(state.v)
        state = KVCache(grown[0], grown[1], n)
    state.k[:, :, n].copy_(k)
    state.v[:, :, n].copy_(v)
    keys, values = state.k[:, :, : n + 1], state.v[:, :, : n + 1]
    o = F.scaled_dot_product_attention(q[:, :, None], keys, values)  # the last query sees every cached key
    return o[:, :, 0], KVCache(state.k, state.v, n + 1)


# -------------------------------------------------------------------------------------------- linear


def _linear_state(layer, q, k, v) -> LinearAttentionState:
    s, z = linear_attention_state(k, v)
    return LinearAttentionState(s, z, k.shape[2])


def _linear_step(layer, q, k, v, state: LinearAttentionState | None):
    position = 0 if state is None else state.position
    previous = None if state is None else (state.S, state.z)
    o, (s_new, z_new) = linear_attention_step(q, k, v, previous, eps=layer.eps, inplace=True)
    return o, LinearAttentionState(s_new, z_new, position + 1)


# ----------------------------------------------------------------------------------------- performer

STABILIZER_EPS = 1e-4  # performer_attention's default, which the layer uses


def _performer_state(layer, q, k, v) -> PerformerState:
    with no_autocast(k.device):
        acc = accumulation_dtype(q.dtype)
        logits, half_sq_norm = _favor_logits(k.to(acc), layer.feature_map.projection)
        shift = logits.amax(dim=(-1, -2))  # the running maximum after the last token
        features = torch.exp(logits - half_sq_norm - shift[..., None, None])
        values = v.to(acc)
        s = torch.einsum("bhtm,bhte->bhme", features, values)
        return PerformerState(s, features.sum(2), shift, values.sum(2), k.shape[2], k.shape[2])


def _performer_step(layer, q, k, v, state: PerformerState | None):
    position = 0 if state is None else state.position
    dtype, projection = v.dtype, layer.feature_map.projection
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype)
        q, k, v = q.to(acc)[:, :, None], k.to(acc)[:, :, None], v.to(acc)
        logits, half_sq_norm = _favor_logits(k, projection)  # (B, H, 1, M), (B, H, 1, 1)
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


# -------------------------------------------------------------------------------------------- sliced


def _prefix_stats(s: torch.Tensor, t: torch.Tensor):
    """The running statistics of `standardise_step` after a whole prefix of raw scores (B, H, T)."""
    acc = accumulation_dtype(s.dtype)
    s, t = s.to(acc), t.to(acc)
    shift = t[..., 0]
    ds, dt = s - shift[..., None], t - shift[..., None]
    return shift, 2.0 * s.shape[-1], (ds + dt).sum(-1), (ds * ds + dt * dt).sum(-1)


def _sliced_state(layer, q, k, v) -> SlicedAttentionState:
    s, t = slice_tokens(layer.slicer, q), slice_tokens(layer.slicer, k)
    if layer.name == "sliced_relu_bump":
        return SlicedAttentionState(sliced_relu_bump_attention_state(t, v), None, k.shape[2])
    stats = None
    if layer.standardise == "prefix":
        stats = _prefix_stats(s, t)
        s, t = standardise_scores_prefix(s, t, None)
    return SlicedAttentionState(sliced_relu_attention_state(t, v), stats, k.shape[2])


def _slice_one_token(layer, q, k):
    """Π of the new token's query and key (B, H, D) in one call: scores s, t (B, H)."""
    b = q.shape[0]
    return layer.slicer(torch.cat([q.reshape(b, -1), k.reshape(b, -1)])).split(b)


def _sliced_relu_step(layer, q, k, v, state: SlicedAttentionState | None):
    position = 0 if state is None else state.position
    s, t = _slice_one_token(layer, q, k)
    stats = None
    if layer.standardise == "prefix":
        s, t, stats = standardise_step(s, t, None if state is None else state.stats)
    previous = None if state is None else state.op
    o, op_state = sliced_relu_attention_step(s, t, v, previous, layer.eps)
    return o, SlicedAttentionState(op_state, stats, position + 1)


def _sliced_relu_bump_step(layer, q, k, v, state: SlicedAttentionState | None):
    position = 0 if state is None else state.position
    s, t = _slice_one_token(layer, q, k)
    o, op_state = sliced_relu_bump_attention_step(
        s, t, v, layer.bandwidth, None if state is None else state.op,
        normaliser=layer.normaliser, mass_eps=layer.mass_eps,
    )  # fmt: skip
    return o, SlicedAttentionState(op_state, None, position + 1)


# ------------------------------------------------------------------------------------------ dispatch

#: backend name -> (state after a prefix from its q, k, v (B, H, T, D); one step of the attention alone:
#: (layer, q_t, k_t, v_t (B, H, D) after RoPE, state) -> (o_t (B, H, Dv), new state))
DECODERS = {
    "softmax": (lambda layer, q, k, v: _softmax_state(q, k, v, None), _softmax_step),
    "linear": (_linear_state, _linear_step),
    "performer": (_performer_state, _performer_step),
    "sliced_relu": (_sliced_state, _sliced_relu_step),
    "sliced_relu_bump": (_sliced_state, _sliced_relu_bump_step),
}


def _decoder(layer):
    try:
        return DECODERS[layer.name]
    except KeyError:
        raise ValueError(
            f"attention backend {layer.name!r} has no recurrent step; backends that decode: "
            f"{', '.join(DECODERS)}"
        ) from None


def prefill(layer, x: torch.Tensor):
    """The causal layer's parallel forward on x (B, T, dim) and the decoding state after it."""
    _check_prefill_input(layer, x)
    make_state, _ = _decoder(layer)
    q, k, v = layer.heads(x)
    y = layer.out_proj(layer.merge(layer.attend(q, k, v, None)))
    return y, make_state(layer, q, k, v)


def step(layer, x_t: torch.Tensor, state=None):
    """One token x_t (B, dim) -> (y_t (B, dim), new state); ``state`` None before the first token."""
    check_step_input(layer, x_t)
    _, attend_step = _decoder(layer)
    q, k, v = layer.heads(x_t[:, None, :], offset=0 if state is None else state.position)
    o, state = attend_step(layer, q[:, :, 0], k[:, :, 0], v[:, :, 0], state)
    return layer.out_proj(layer.output_dropout(o).reshape(o.shape[0], layer.qkv_dim)), state


def attention_step(layer, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, state=None):
    """The backend's part of a step: (B, H, D) q, k, v of the new token (RoPE applied) -> (o_t, state).
    What `step` does between the shared q/k/v and output projections (what `attnlab bench generate`
    times as the attention's cost per token)."""
    return _decoder(layer)[1](layer, q_t, k_t, v_t, state)


def state_nbytes(state) -> int:
    """Bytes of tensor memory a decoding state holds (a KV cache: its used rows, not its spare capacity)."""
    if isinstance(state, KVCache):
        used = (state.k[:, :, : state.length], state.v[:, :, : state.length])
        return sum(x.numel() * x.element_size() for x in used)
    if isinstance(state, SlicedDecodeState):
        return state.nbytes()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, tuple | list):
        return sum(state_nbytes(part) for part in state)
    return 0
