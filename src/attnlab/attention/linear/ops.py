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

import torch

from attnlab.attention.common.checks import check_qkv
from attnlab.attention.common.padding import check_padded_queries
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.common.triton import selfcheck
from attnlab.attention.common.triton.runtime import launch, resolve_impl
from attnlab.attention.linear.chunked import (
    DEFAULT_CHUNK_SIZE,
    elu_feature_map,
    linear_attention_from_features,
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
    `impl` ("auto", "triton", "torch") chooses the causal form's code: "auto" runs the Triton
    kernel (`attnlab.attention.linear.triton`, its own chunk size) on CUDA tensors other than
    float64, torch otherwise; the non-causal form is two matmuls and always runs in torch.
    """
    check_qkv(q, k, v, key_padding_mask)
    check_padded_queries("linear_attention", padded_queries, causal)
    use = resolve_impl("linear_attention", impl, q, k, v)
    if use == "triton" and causal:
        from attnlab.attention.linear.triton import MAX_HEAD_DIM

        if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:  # the kernels' state would spill registers
            if impl == "triton":
                raise ValueError(
                    f"linear_attention: impl='triton' runs head dims up to {MAX_HEAD_DIM}, got q/k "
                    f"{q.shape[-1]} and v {v.shape[-1]}; use impl='auto' or 'torch'"
                )
        elif torch.float64 not in (q.dtype, k.dtype, v.dtype):
            from attnlab.attention.linear.triton import causal_linear_attention

            out = launch(
                "linear_attention",
                impl,
                q.device,
                lambda: causal_linear_attention(q, k, v, key_padding_mask, eps),
                check=lambda: selfcheck.trusted("linear_attention", q.device, v.dtype, lambda: _case(v)),
            )
            if out is not None:  # None: `auto`, and Triton could not build a kernel here (warned)
                return out
        if impl == "triton" and torch.float64 in (q.dtype, k.dtype, v.dtype):
            raise TypeError(
                "linear_attention: impl='triton' has no float64 kernel; use impl='torch' or 'auto' "
                f"for float64 inputs (got {q.dtype}, {k.dtype}, {v.dtype})"
            )
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype)
        phi_q = elu_feature_map(q.to(acc))
        phi_k = elu_feature_map(k.to(acc))
        out = linear_attention_from_features(
            phi_q, phi_k, v.to(acc), key_padding_mask, causal, eps, chunk_size, padded_queries
        )
    return out.to(v.dtype)


def _case(like: torch.Tensor):
    """The first-use check's case (``selfcheck.trusted``) of the causal Triton kernels: two rows of
    200 tokens, one padded to 150, in ``like``'s dtype, device and head dim."""
    inputs, mask = selfcheck.random_case("qkv", 2, 2, 200, like.shape[-1], like.dtype, like.device)
    keywords = {"key_padding_mask": mask, "causal": True}
    fast = functools.partial(linear_attention, impl="triton")
    return fast, functools.partial(linear_attention, impl="torch"), inputs, keywords
