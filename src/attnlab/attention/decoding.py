"""Recurrent decoding of the causal attention layers: prefill a prompt in parallel, then one token at a time.

A causal layer maps ``(B, T, dim)`` to ``(B, T, dim)`` with position i seeing tokens ≤ i only, so it can
also run as a recurrence over a state that summarises the past (`AttentionLayer.prefill` and `.step`
call the functions here; each family's ``decoding.py`` holds its state and step):

- softmax: a KV cache, the rotated keys and the values of every past token (grows by 2·D per token
  and head; a step reads all of it);
- linear: ``(S, z)`` = (Σ φ(k_j) v_jᵀ, Σ φ(k_j)), constant size (`attnlab.attention.linear.decoding`);
- performer: the same on FAVOR+ features, kept scaled to the running key stabiliser (the maximum
  key logit so far), plus Σ v_j and the count for the stabiliser's ε terms
  (`attnlab.attention.performer.decoding`);
- sliced ReLU / ReLU-bump: the sorted runs of `attnlab.attention.sliced_common.decoding`, and for
  ``standardise="prefix"`` the running score statistics.

``prefill(layer, x)`` runs the layer's own parallel causal forward for the outputs and builds the state
from the same q, k, v; ``step(layer, x_t, state)`` advances one token. Fed the same tokens, the steps give
the rows of the parallel forward (the tests hold them equal in float64). A step may update the state's
tensors in place: decode forward from a state, do not branch two continuations from one.
"""

from __future__ import annotations

import torch

from attnlab.attention.linear import decoding as linear
from attnlab.attention.linear.decoding import LinearAttentionState
from attnlab.attention.performer import decoding as performer
from attnlab.attention.performer.decoding import PerformerState
from attnlab.attention.sliced_common.decoding import SlicedAttentionState, SlicedDecodeState
from attnlab.attention.sliced_relu import decoding as sliced_relu
from attnlab.attention.sliced_relu_bump import decoding as sliced_relu_bump
from attnlab.attention.softmax import decoding as softmax
from attnlab.attention.softmax.decoding import KVCache

__all__ = [
    "DECODERS",
    "KVCache",
    "LinearAttentionState",
    "PerformerState",
    "SlicedAttentionState",
    "attention_step",
    "check_step_input",
    "prefill",
    "state_nbytes",
    "step",
]


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


#: backend name -> (state after a prefix from its q, k, v (B, H, T, D); one step of the attention alone:
#: (layer, q_t, k_t, v_t (B, H, D) after RoPE, state) -> (o_t (B, H, Dv), new state)), each family's
#: ``decoding.layer_state`` and ``decoding.layer_step``
DECODERS = {
    "softmax": (softmax.layer_state, softmax.layer_step),
    "linear": (linear.layer_state, linear.layer_step),
    "performer": (performer.layer_state, performer.layer_step),
    "sliced_relu": (sliced_relu.layer_state, sliced_relu.layer_step),
    "sliced_relu_bump": (sliced_relu_bump.layer_state, sliced_relu_bump.layer_step),
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
