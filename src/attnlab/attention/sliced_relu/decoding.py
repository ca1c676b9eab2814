"""Causal sliced ReLU decoding: one token at a time over the sorted runs of
``attnlab.attention.sliced_common.decoding``, and the layer's state and step (Π of the new token,
the running standardisation of ``standardise="prefix"``) that ``attnlab.attention.decoding`` calls."""

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
from attnlab.attention.sliced_common.scores import slice_tokens, standardise_scores_prefix, standardise_step


def sliced_relu_attention_step(
    s_t: torch.Tensor,
    t_t: torch.Tensor,
    v_t: torch.Tensor,
    state: SlicedDecodeState | None = None,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, SlicedDecodeState]:
    """One decoding step of causal sliced ReLU attention: ``(o_t (B, H, D), state)``.

    ``s_t, t_t (B, H)`` are the new token's query and key scores, ``v_t (B, H, D)`` its value;
    ``state`` is None before the first token, and is updated in place. The token is inserted, then
    queried (j <= i includes itself), so the outputs equal ``sliced_relu_attention(..., causal=True)``
    row by row. Time O(D log n + log² n) amortised, memory (D + 2) numbers per past token (D + 4 in
    float32: the search key); sums in float32 at least.
    """
    check_step("sliced_relu_attention_step", s_t, t_t, v_t, state, "relu")
    if not eps > 0:
        raise ValueError(f"sliced_relu_attention_step: eps must be > 0, got {eps}")
    with no_autocast(v_t.device):
        if state is not None:
            acc = accumulation_dtype(s_t.dtype, t_t.dtype, v_t.dtype)
            out = state.relu_step_natively(s_t.to(acc), t_t.to(acc), v_t.to(acc), eps)
            if out is not None:  # the CPU: the steps below in one C++ call
                return out.to(v_t.dtype), state
        state, s = push_token(state, s_t, t_t, v_t, "relu")
        f = state.evaluate(s[..., None])[..., 0, :]  # (B, H, D + 1): [Σ ReLU·v, Σ ReLU]
        n = float(state.count)
        relu_v, relu_mass = f[..., :-1], f[..., -1:]
        num = torch.addcmul(relu_v, state.sum_v, relu_mass, value=-1.0 / n)  # Σ ReLU·(v − v̄)
        # Σ |s − t_j| = 2 Σ ReLU(s − t_j) − Σ (s − t_j)
        den = torch.add(torch.add(state.sum_t, s, alpha=-n)[..., None], relu_mass, alpha=2.0)
        out = num.div_(den.clamp_min_(eps)).mul_(2.0)
    return out.to(v_t.dtype), state


def sliced_relu_attention_state(t: torch.Tensor, v: torch.Tensor) -> SlicedDecodeState:
    """The decoding state after a whole prefix (prefill): key scores ``t (B, H, T)``, values
    ``v (B, H, T, D)``, every token real. Stepping on from it continues the causal sequence."""
    return prefill_state(t, v, "relu")


def prefix_stats(s: torch.Tensor, t: torch.Tensor):
    """The running statistics of `standardise_step` after a whole prefix of raw scores (B, H, T)."""
    acc = accumulation_dtype(s.dtype)
    s, t = s.to(acc), t.to(acc)
    shift = t[..., 0]
    ds, dt = s - shift[..., None], t - shift[..., None]
    return shift, (ds + dt).sum(-1), (ds * ds + dt * dt).sum(-1)


def layer_state(layer, q, k, v) -> SlicedAttentionState:
    s, t = slice_tokens(layer.slicer, q), slice_tokens(layer.slicer, k)
    stats = None
    if layer.standardise == "prefix":
        stats = prefix_stats(s, t)
        s, t = standardise_scores_prefix(s, t, None)
    return SlicedAttentionState(sliced_relu_attention_state(t, v), stats, k.shape[2])


def layer_step(layer, q, k, v, state: SlicedAttentionState | None):
    s, t = slice_one_token(layer, q, k, state)
    if state is None:
        stats = None
        if layer.standardise == "prefix":
            s, t, stats = standardise_step(s, t, None, 0)
        o, op_state = sliced_relu_attention_step(s, t, v, None, layer.eps)
        return o, SlicedAttentionState(op_state, stats, 1)
    stats = state.stats if layer.standardise == "prefix" else None
    if compiler.compiling():  # the op's step as one custom op, its statistics updated in place
        o = _compiled_step(state.op.handle, s, t, v, *(stats or (None, None, None)), layer.eps)
    else:
        o, stats = _op_step(state.op, s, t, v, stats, layer.eps)
    return o, SlicedAttentionState(state.op, stats, state.position + 1)


def _op_step(op_state: SlicedDecodeState, s, t, v, stats, eps: float):
    """The op's part of a layer step on an existing state: the output and the statistics after it.
    On the CPU standardisation and op are one C++ call, which updates ``stats`` in place."""
    acc = op_state.keys.dtype
    o = op_state.relu_step_natively(s.to(acc), t.to(acc), v.to(acc), eps, stats)
    if o is not None:
        return o.to(v.dtype), stats
    if stats is not None:
        s, t, stats = standardise_step(s, t, stats, op_state.count)
    return sliced_relu_attention_step(s, t, v, op_state, eps)[0], stats


def _step_op(
    handle: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    shift: torch.Tensor | None,
    total: torch.Tensor | None,
    squares: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """`_op_step` on the state named by ``handle``; the statistics (shift, total, squares), if any,
    are updated in place."""
    stats = None if shift is None else (shift, total, squares)
    o, after = _op_step(state_of(handle), s, t, v, stats, eps)
    if after is not None:
        for kept, new in zip(stats, after, strict=True):
            if new is not kept:  # the torch code returns new tensors; the kernel wrote in place
                kept.copy_(new)
    return o


_compiled_step = compiler.library_op(
    "sliced_relu_decode_step",
    _step_op,
    fake=lambda handle, s, t, v, *rest: torch.empty_like(v),
    mutates_args=("handle", "shift", "total", "squares"),
)
