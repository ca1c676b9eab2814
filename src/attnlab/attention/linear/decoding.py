"""Recurrent decoding of causal linear attention: the state (S, z) after a prefix, one token at a time,
and the layer's state and step (``attnlab.attention.decoding`` calls them)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.common import compiler, native
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.linear.chunked import elu_feature_map


def linear_attention_state(
    k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoding state ``(S, z)`` after a whole prefix (prefill): k (B, H, T, D), v (B, H, T, Dv).

    Stepping `linear_attention_step` from this state continues the causal sequence exactly as if
    every prefix token had been stepped through; padded keys add nothing. In float32 at least.
    """
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"expected k (B, H, T, D) and v (B, H, T, Dv); got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    with no_autocast(k.device):
        acc = accumulation_dtype(k.dtype)
        phi_k = elu_feature_map(k.to(acc))
        if key_padding_mask is not None:
            phi_k = phi_k * key_padding_mask[:, None, :, None].to(acc)
        return torch.einsum("bhtd,bhte->bhde", phi_k, v.to(acc)), phi_k.sum(dim=2)


def linear_attention_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    inplace: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding step of causal linear attention: constant memory and time per token.

    q_t, k_t (B, H, D), v_t (B, H, Dv); `state = (S, z)` of shapes (B, H, D, Dv) and (B, H, D), kept in
    float32 (float64 for float64 input), or None before the first token. Returns (o_t, new_state); the
    sequence of o_t equals `linear_attention(..., causal=True)`. ``inplace``: add the token to the given
    state's tensors instead of new ones (a decoder's loop: no allocation, fewer kernel launches).
    """
    if q_t.dim() != 3 or q_t.shape != k_t.shape or v_t.dim() != 3 or v_t.shape[:2] != k_t.shape[:2]:
        raise ValueError(
            "linear_attention_step expects q_t, k_t (B, H, D) and v_t (B, H, Dv); got "
            f"{tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}"
        )
    with no_autocast(q_t.device):
        acc = accumulation_dtype(q_t.dtype)
        if inplace and state is not None:
            out = _step_natively(q_t, k_t, v_t, state, eps)
            if out is not None:  # the CPU: the step in one C++ call, the state updated in place
                return out.to(v_t.dtype), state
        phi = F.elu(torch.stack([q_t, k_t]).to(acc)).add_(1.0)  # φ(q), φ(k) = elu + 1 in one pass
        phi_q, phi_k = phi[0], phi[1]
        v = v_t.to(acc)
        b, h, d = phi_k.shape
        if state is None:
            s_prev = phi_k.new_zeros(b, h, d, v.shape[-1])
            z_prev = phi_k.new_zeros(b, h, d)
        else:
            s_prev, z_prev = state
            if s_prev.shape != (b, h, d, v.shape[-1]) or z_prev.shape != (b, h, d):
                raise ValueError(
                    f"state must be (S, z) of shapes {(b, h, d, v.shape[-1])} and {(b, h, d)}; "
                    f"got {tuple(s_prev.shape)} and {tuple(z_prev.shape)}"
                )
        # in place only in eager: inductor (torch 2.10, CPU) miscompiles the matmul of an input updated
        # in place beside a reduction, and fuses the new tensors' form anyway
        if inplace and state is not None and s_prev.dtype == acc == z_prev.dtype and not compiler.compiling():
            # S += φ(k) vᵀ, z += φ(k), into the state's memory: no allocation
            s_new, z_new = s_prev.addcmul_(phi_k.unsqueeze(-1), v.unsqueeze(-2)), z_prev.add_(phi_k)
        else:
            s_new = s_prev + phi_k.unsqueeze(-1) * v.unsqueeze(-2)
            z_new = z_prev + phi_k
        num = torch.matmul(phi_q.unsqueeze(-2), s_new).squeeze(-2)  # φ(q)ᵀ S
        den = (phi_q * z_new).sum(-1, keepdim=True).add_(eps)
        out = num.div_(den)
    return out.to(v_t.dtype), (s_new, z_new)


KERNELS = Path(__file__).with_name("decode_kernels.cpp")
_ARGTYPES = {"linear_step": [ctypes.c_void_p] * 5 + [ctypes.c_double, ctypes.c_void_p] + [ctypes.c_int64] * 3}


def _step_natively(q_t, k_t, v_t, state, eps: float) -> torch.Tensor | None:
    """The in-place step by the C++ kernel (``decode_kernels.cpp``), or None where the torch code runs:
    not the CPU, inputs not of the state's dtype (half inputs: float32 state) or a state not
    contiguous, gradients wanted, a compiler tracing, an inference-mode state outside inference mode
    (torch refuses to change it), no compiler. A dozen small torch ops per step become one call; the
    state's version counters are bumped as an in-place torch op bumps them, so a graph that saved the
    state before the step refuses its backward instead of reading the changed values."""
    s_prev, z_prev = state
    acc = s_prev.dtype
    inputs = (q_t, k_t, v_t)
    if compiler.compiling() or any(x.device.type != "cpu" or x.dtype != acc for x in (*inputs, z_prev)):
        return None
    b, h, d = k_t.shape
    if s_prev.shape != (b, h, d, v_t.shape[-1]) or z_prev.shape != (b, h, d):
        return None  # the torch code names the mismatch
    if not (s_prev.is_contiguous() and z_prev.is_contiguous()):
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in (*inputs, *state)):
        return None
    if not torch.is_inference_mode_enabled() and (s_prev.is_inference() or z_prev.is_inference()):
        return None
    found = native.kernels(KERNELS, acc, _ARGTYPES)
    if found is None:
        return None
    q, k, v = (x.contiguous() for x in inputs)
    out = torch.empty_like(v)
    pointers = [native.pointer(x) for x in (q, k, v, s_prev, z_prev)]
    found["linear_step"](*pointers, float(eps), native.pointer(out), b * h, d, v.shape[-1])
    if not (s_prev.is_inference() or z_prev.is_inference()):  # inference tensors keep no version
        torch.autograd.graph.increment_version((s_prev, z_prev))
    return out


class LinearAttentionState(NamedTuple):
    """Decoding state of a causal LinearAttention layer: S (B, H, D, Dv), z (B, H, D), tokens seen."""

    S: torch.Tensor
    z: torch.Tensor
    position: int


def layer_state(layer, q, k, v) -> LinearAttentionState:
    s, z = linear_attention_state(k, v)
    return LinearAttentionState(s, z, k.shape[2])


def layer_step(layer, q, k, v, state: LinearAttentionState | None):
    position = 0 if state is None else state.position
    previous = None if state is None else (state.S, state.z)
    o, (s_new, z_new) = linear_attention_step(q, k, v, previous, eps=layer.eps, inplace=True)
    return o, LinearAttentionState(s_new, z_new, position + 1)
