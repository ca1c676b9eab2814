"""Causal linear attention (φ = elu + 1) on Triton, chunked: the torch op's ``_causal_chunked``
(inside a chunk the masked quadratic form, across chunks the carried state) in one kernel per
row that keeps the float32 state ``(S, z)`` on chip, so no per-chunk state is ever stored.

Backward in two walks: forward over the chunks for dL/dq (the forward's state again), then backward
over the chunks for dL/dk and dL/dv, carrying ``U = Σ_{i later} φ(q_i) dnum_iᵀ`` and
``u = Σ φ(q_i) dden_i`` (``o = num / (den + eps)``: ``dnum = g / (den + eps)``,
``dden = -g·o / (den + eps)``). Padded keys contribute nothing and padded queries output zeros,
as in ``attnlab.attention.linear``. Matmuls take float32 operands (exact float32 products for
float32 inputs; TF32 for half inputs, whose values carry fewer bits than TF32 anyway). float64 has
no kernel here (``impl="auto"`` keeps it on torch).
"""

from __future__ import annotations

import torch

from attnlab.attention.precision import no_autocast
from attnlab.attention.triton.runtime import kernels

CHUNK = 32  # tokens per chunk: the quadratic block is CHUNK × CHUNK (64 spills registers on sm_90)
NUM_WARPS = 8


def _sizes(length: int, dim: int, dim_v: int) -> tuple[int, int, int]:
    chunk = max(16, min(CHUNK, 1 << (length - 1).bit_length()))
    return chunk, max(16, 1 << (dim - 1).bit_length()), max(16, 1 << (dim_v - 1).bit_length())


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class CausalLinearTriton(torch.autograd.Function):
    """Rows ``q, k (N, T, D)``, ``v (N, T, Dv)`` in their dtype; ``mask (B, T)`` int8 or None."""

    @staticmethod
    def forward(ctx, q, k, v, mask, heads, eps):
        rows, length, dim = q.shape
        dim_v = v.shape[-1]
        chunk, block_d, block_v = _sizes(length, dim, dim_v)
        out = torch.empty_like(v)
        den = torch.empty(rows, length, dtype=torch.float32, device=q.device)
        with no_autocast(q.device):
            kernels().linear_causal_fwd_kernel[(rows,)](
                q, k, v, mask if mask is not None else den, out, den,
                length, dim, dim_v, heads, float(eps),
                HAS_MASK=mask is not None, C=chunk, BD=block_d, BDV=block_v,
                PRECISION=_precision(q.dtype), num_warps=NUM_WARPS,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, den, *([] if mask is None else [mask]))
        ctx.heads, ctx.eps = heads, eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, den, *maybe_mask = ctx.saved_tensors
        mask = maybe_mask[0] if maybe_mask else None
        if torch.is_grad_enabled():
            raise RuntimeError(
                "linear_attention (Triton, causal): double backward is not supported; "
                "use impl='torch' for higher-order gradients"
            )
        rows, length, dim = q.shape
        dim_v = v.shape[-1]
        chunk, block_d, block_v = _sizes(length, dim, dim_v)
        g = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        gnum = torch.empty(rows, length, dim_v, dtype=torch.float32, device=q.device)
        gden = torch.empty(rows, length, dtype=torch.float32, device=q.device)
        common = {
            "HAS_MASK": mask is not None,
            "C": chunk,
            "BD": block_d,
            "BDV": block_v,
            "PRECISION": _precision(q.dtype),
            "num_warps": NUM_WARPS,
        }
        mask_arg = mask if mask is not None else den
        with no_autocast(q.device):
            k_ = kernels()
            k_.linear_causal_bwd_q_kernel[(rows,)](
                q, k, v, mask_arg, g, den, dq, gnum, gden, length, dim, dim_v, ctx.heads, float(ctx.eps),
                **common,
            )  # fmt: skip
            k_.linear_causal_bwd_kv_kernel[(rows,)](
                q, k, v, mask_arg, gnum, gden, dk, dv, length, dim, dim_v, ctx.heads, -(-length // chunk),
                **common,
            )  # fmt: skip
        return dq, dk, dv, None, None, None


def causal_linear_attention(q, k, v, key_padding_mask, eps):
    """``(B, H, T, Dv)`` causal linear attention; inputs checked by ``linear_attention``."""
    batch, heads, length, _ = q.shape
    dim_v = v.shape[-1]
    rows = [x.reshape(batch * heads, length, x.shape[-1]).contiguous() for x in (q, k, v)]
    mask = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8)
    out = CausalLinearTriton.apply(*rows, mask, heads, eps)
    return out.view(batch, heads, length, dim_v)
