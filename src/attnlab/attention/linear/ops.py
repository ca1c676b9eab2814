"""Linear attention (Katharopoulos et al. 2020), φ(x) = elu(x) + 1: parallel, causal-chunked, recurrent.

Non-causal uses associativity: S = Σ_j φ(k_j) v_jᵀ and z = Σ_j φ(k_j) are computed once, so the cost
is O(T·D·Dv) instead of O(T²). Causal needs prefix sums S_i, z_i; materialising one (D, Dv) state per
token would cost O(T·D·Dv) memory, so the sequence is cut into chunks: inside a chunk the masked
(chunk × chunk) quadratic form, across chunks the state carried from all earlier chunks (one exclusive
cumsum over chunk states). The recurrent form `linear_attention_step` keeps only (S, z).

Precision: states are accumulated in float32 for half inputs and float64 for float64 inputs. Prefix
sums are sums of positive terms here (φ > 0), so the denominators do not cancel; the numerators can
mix signs through v and lose relative precision at very large T in float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from attnlab.attention.common import compiler
from attnlab.attention.common.checks import check_qkv
from attnlab.attention.common.dispatch import Implementation, Request, check_choice, device_type, run_first
from attnlab.attention.common.packing import check_segments, run_ids
from attnlab.attention.common.padding import check_padded_queries
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.common.triton import runtime, selfcheck
from attnlab.attention.linear.chunked import (
    DEFAULT_CHUNK_SIZE,
    elu_feature_map,
    linear_attention_from_features,
    linear_attention_segments_from_features,
)
from attnlab.attention.linear.triton import MAX_HEAD_DIM

__all__ = ["IMPLEMENTATIONS", "linear_attention", "linear_attention_segments"]

OP = "linear_attention"


class _Call(NamedTuple):
    """A checked call, as every implementation takes it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_padding_mask: torch.Tensor | None
    causal: bool
    eps: float
    chunk_size: int
    padded_queries: str
    impl: str


def _triton(c: _Call) -> torch.Tensor | None:
    def call():
        from attnlab.attention.linear import triton  # imported when used: triton loads slowly

        return triton.causal_linear_attention(c.q, c.k, c.v, c.key_padding_mask, c.eps)

    check = lambda: selfcheck.trusted(OP, c.q.device, c.v.dtype, lambda: _case(c.v))  # noqa: E731
    # None: `auto`, and Triton could not build a kernel here or failed its first check (warned)
    return runtime.launch(OP, c.impl, c.q.device, call, check=check)


def _torch(c: _Call) -> torch.Tensor:
    with no_autocast(c.q.device):
        acc = accumulation_dtype(c.q.dtype)
        phi_q = elu_feature_map(c.q.to(acc))
        phi_k = elu_feature_map(c.k.to(acc))
        out = linear_attention_from_features(
            phi_q, phi_k, c.v.to(acc), c.key_padding_mask, c.causal, c.eps, c.chunk_size, c.padded_queries
        )
    return out.to(c.v.dtype)


#: in the order they are preferred: the first that accepts a call runs it
IMPLEMENTATIONS: tuple[Implementation, ...] = (
    Implementation(
        "triton",
        "O(T·D·Dv) time, the (D, Dv) state on chip",
        _triton,
        impl="triton",
        devices=("cuda",),
        dtypes=(torch.float32,),
        causal=(True,),
        max_head_dim=MAX_HEAD_DIM,
        interpreted=True,
        available=lambda r: runtime.triton_problem(r.op, r.impl, r.device, cuda=r.device_type == "cuda"),
        notes={
            "dtype": "the kernels keep float32 states",
            "causal": "the non-causal form is two matmuls, run by torch",
            "head_dim": "a wider (D, Dv) state spills registers",
        },
    ),
    Implementation("chunked", "O(T·D·Dv) time, chunk × chunk blocks", _torch, traceable=True),
)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    impl: str = "auto",
    padded_queries: str = "zero",
) -> torch.Tensor:
    """o_i = φ(q_i)ᵀ S / (φ(q_i)ᵀ z + eps) for q, k of shape (B, H, T, D), v (B, H, T, Dv).

    Padded keys (`key_padding_mask` False) contribute nothing; outputs at padded queries are zero
    (`padded_queries="attend"`: they attend to the real keys, `attnlab.attention.common.padding`).
    With `causal`, S and z only sum keys j <= i, computed chunk by chunk (`chunk_size` tokens).
    `impl` ("auto", "triton", "torch") narrows `IMPLEMENTATIONS`, of which the first that accepts
    the call runs: "auto" runs the causal form's Triton kernel (`attnlab.attention.linear.triton`,
    its own chunk size) on CUDA tensors other than float64 with head dims up to 64, the torch code
    otherwise; the non-causal form is two matmuls and runs in torch only, so "triton" refuses it. A
    call no implementation accepts is one ValueError naming each and why it declined.
    """
    check_qkv(q, k, v, key_padding_mask)
    check_padded_queries(OP, padded_queries, causal)
    check_choice(OP, impl)
    batch, heads, length, dim = q.shape
    acc = accumulation_dtype(q.dtype, k.dtype, v.dtype)
    width = max(dim, v.shape[-1])
    request = Request(
        OP, q.device, device_type(q, k, v), acc, impl, "auto", causal, width, length, padded_queries
    )
    call = _Call(q, k, v, key_padding_mask, causal, eps, chunk_size, padded_queries, impl)
    opaque = lambda: _OPAQUE(q, k, v, key_padding_mask, causal, float(eps), chunk_size, impl, padded_queries)  # noqa: E731
    return run_first(IMPLEMENTATIONS, request, call, opaque)


def linear_attention_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """`linear_attention` on packed rows (q, k (B, H, L, D), v (B, H, L, Dv)): a query sums only the
    keys of its own segment (``segments`` (B, L), contiguous runs; `PackedLayout.segments`), so each
    sequence gets its own output without being laid out alone. The torch code on every device (the
    Triton kernels read no segments)."""
    check_qkv(q, k, v, None)
    check_segments(segments, q)
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype, k.dtype, v.dtype)
        phi_q, phi_k = elu_feature_map(q.to(acc)), elu_feature_map(k.to(acc))
        out = linear_attention_segments_from_features(
            phi_q, phi_k, v.to(acc), run_ids(segments), causal, eps, chunk_size
        )
    return out.to(v.dtype)


#: the op as ``torch.compile`` calls its Triton kernels (``attnlab.attention.common.compiler``)
_OPAQUE = compiler.opaque_op(
    OP,
    linear_attention,
    "Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float eps, int chunk_size, "
    "str impl, str padded_queries",
    differentiable=3,
)


def _case(like: torch.Tensor):
    """The first-use check's case (``selfcheck.trusted``) of the causal Triton kernels: two rows of
    200 tokens, one padded to 150, in ``like``'s dtype, device and head dim."""
    inputs, mask = selfcheck.random_case("qkv", 2, 2, 200, like.shape[-1], like.dtype, like.device)
    keywords = {"key_padding_mask": mask, "causal": True}
    fast = functools.partial(linear_attention, impl="triton")
    return fast, functools.partial(linear_attention, impl="torch"), inputs, keywords
