"""Causal sliced ReLU-bump decoding: one token at a time over the sorted runs of
``attnlab.attention.sliced_common.decoding``, and the layer's state and step that
``attnlab.attention.decoding`` calls."""

from __future__ import annotations

import torch

from attnlab.attention.common import compiler
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced_common.decoding import (
    SlicedAttentionState,
    SlicedDecodeState,
    check_step,
    prefill_state,
    push_token,
    slice_one_token,
    state_of,
)
from attnlab.attention.sliced_common.scores import slice_tokens
from attnlab.attention.sliced_relu_bump.normaliser import check_bump_normaliser


def sliced_relu_bump_attention_step(
    s_t: torch.Tensor,
    t_t: torch.Tensor,
    v_t: torch.Tensor,
    bandwidth: torch.Tensor,
    state: SlicedDecodeState | None = None,
    normaliser: str = "count",
    mass_eps: float = 1e-2,
) -> tuple[torch.Tensor, SlicedDecodeState]:
    """One decoding step of causal sliced ReLU-bump attention (``bandwidth (H,)``), as
    ``sliced_relu_attention_step``; ``normaliser``/``mass_eps`` as in ``sliced_relu_bump_attention``.
    The hat is ``(F(s+b) − 2F(s) + F(s−b)) / b``: in float32 a bandwidth narrow next to the score
    spread loses digits to that second difference."""
    check_step("sliced_relu_bump_attention_step", s_t, t_t, v_t, state, "bump")
    if not isinstance(bandwidth, torch.Tensor) or tuple(bandwidth.shape) != (v_t.shape[1],):
        raise ValueError(
            f"sliced_relu_bump_attention_step: bandwidth must have shape (H,) = ({v_t.shape[1]},)"
        )
    check_bump_normaliser("sliced_relu_bump_attention_step", normaliser, mass_eps, causal=True)
    with no_autocast(v_t.device):
        if state is not None:
            acc = accumulation_dtype(s_t.dtype, t_t.dtype, v_t.dtype)
            out = state.bump_step_natively(
                s_t.to(acc), t_t.to(acc), v_t.to(acc), bandwidth, normaliser, mass_eps
            )
            if out is not None:  # the CPU: the steps below in one C++ call
                return out.to(v_t.dtype), state
        state, s = push_token(state, s_t, t_t, v_t, "bump")
        b = bandwidth.to(s.dtype)[None, :]
        f = state.evaluate(torch.stack([s - b, s, s + b], dim=-1))  # (B, H, 3, D + 1)
        hat_sums = f[..., 0, :] - 2 * f[..., 1, :] + f[..., 2, :]  # b · Σ_j hat_j [v_j, 1]
        den = b * state.count if normaliser == "count" else hat_sums[..., -1] + mass_eps * b
        out = hat_sums[..., :-1] / den[..., None]
    return out.to(v_t.dtype), state


def sliced_relu_bump_attention_state(t: torch.Tensor, v: torch.Tensor) -> SlicedDecodeState:
    """As ``sliced_relu_attention_state``, for ``sliced_relu_bump_attention_step``."""
    return prefill_state(t, v, "bump")


def layer_state(layer, q, k, v) -> SlicedAttentionState:
    t = slice_tokens(layer.slicer, k)
    return SlicedAttentionState(sliced_relu_bump_attention_state(t, v), None, k.shape[2])


def layer_step(layer, q, k, v, state: SlicedAttentionState | None):
    s, t = slice_one_token(layer, q, k, state)
    if state is not None and compiler.compiling():  # the op's step as one custom op
        o = _compiled_step(state.op.handle, s, t, v, layer.bandwidth, layer.normaliser, layer.mass_eps)
        return o, SlicedAttentionState(state.op, None, state.position + 1)
    o, op_state = sliced_relu_bump_attention_step(
        s, t, v, layer.bandwidth, None if state is None else state.op,
        normaliser=layer.normaliser, mass_eps=layer.mass_eps,
    )  # fmt: skip
    return o, SlicedAttentionState(op_state, None, 1 if state is None else state.position + 1)


def _step_op(
    handle: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    bandwidth: torch.Tensor,
    normaliser: str,
    mass_eps: float,
) -> torch.Tensor:
    """`sliced_relu_bump_attention_step` on the state named by ``handle``."""
    state = state_of(handle)
    return sliced_relu_bump_attention_step(s, t, v, bandwidth, state, normaliser, mass_eps)[0]


_compiled_step = compiler.library_op(
    "sliced_relu_bump_decode_step",
    _step_op,
    fake=lambda handle, s, t, v, *rest: torch.empty_like(v),
    mutates_args=("handle",),
)
