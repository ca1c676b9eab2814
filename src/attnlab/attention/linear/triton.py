"""Causal linear attention (φ = elu + 1) on Triton, chunked: the torch op's ``_causal_chunked``
(inside a chunk the masked quadratic form, across chunks the carried state) in kernels that keep
the float32 state ``(S, z)`` on chip, so no per-chunk state is ever stored. A row is walked by
several programs when there are too few rows to fill the GPU (``segments``): each walks a segment of
at least ``MIN_SEGMENT`` tokens from a carried state, one ``(D, Dv)`` state per segment in memory,
from one extra pass over k and v in the forward (``kernels`` ``linear_causal_state_kernel``).

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

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.common.triton.runtime import kernels

NUM_WARPS = 8
# Each program keeps a (D, Dv) float32 state on chip: up to 64 × 64 it fits every target's registers
# (spills ≤ 1 KiB, tests/attention/common/triton/test_compile.py); at 128 it spills 1–8.7 KB, so wider heads
# run the torch code (impl="auto") or are refused (impl="triton").
MAX_HEAD_DIM = 64


def launch_config(dtype: torch.dtype, capability: tuple[int, int]) -> dict:
    """Chunk length ``C``, warps and pipeline stages for ``dtype`` on a GPU of ``capability``.

    Chosen so that no kernel spills more than 1 KiB of registers per thread on sm_70, sm_80 or sm_90
    in fp16, bf16 or fp32 (``tests/attention/common/triton/test_compile.py`` builds every combination):
    half inputs take 32-token chunks on sm_90 (tensor-core tiles, no spills) and 16 elsewhere (32
    spilled up to 2 KB on sm_80 and 6.7 KB on sm_70); float32 (exact products, no tensor cores) takes
    16-token chunks without software pipelining (with it: 2.9 KB spilled on sm_80/90; with it at 32
    tokens, as before: up to 6.5 KB on sm_80 and 5.8 KB on sm_90). Head dims up to `MAX_HEAD_DIM`.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    config = {"C": 32 if half and capability >= (9, 0) else 16, "num_warps": NUM_WARPS}
    if not half:
        config["num_stages"] = 1
    return config


MIN_SEGMENT = 1024  # tokens per segment at least: its carried state is small next to its k, v, q
SEGMENT: int | None = None  # tokens per segment, whatever the GPU (tests); None: from the SM count


def segments(rows: int, length: int, chunk: int, device: torch.device) -> tuple[int, int]:
    """``(tokens per segment, segments per row)``: enough programs for about four per SM (one per
    row if the rows alone do that), segments of at least ``MIN_SEGMENT`` tokens, whole chunks."""
    if SEGMENT is not None:
        seg = SEGMENT
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        seg = max(MIN_SEGMENT, -(-length // -(-4 * sms // rows)))
    seg = min(-(-seg // chunk) * chunk, -(-length // chunk) * chunk)
    return seg, -(-length // seg)


def _carried(state: torch.Tensor, norm: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each segment's start from the segments' own sums ``(rows, NSEG, ...)``: the sum over the
    earlier segments (``reverse``: over the later ones), float32 like the kernels' state."""

    def exclusive(x):
        inclusive = x.cumsum(dim=1)
        return inclusive[:, -1:] - inclusive if reverse else inclusive - x

    return exclusive(state), exclusive(norm)


def _capability(x: torch.Tensor) -> tuple[int, int]:
    """The GPU's compute capability; under the interpreter (CPU tensors) an H100's."""
    return torch.cuda.get_device_capability(x.device) if x.is_cuda else (9, 0)


def _sizes(length: int, dim: int, dim_v: int, chunk: int) -> tuple[int, int, int]:
    chunk = max(16, min(chunk, 1 << (length - 1).bit_length()))
    return chunk, max(16, 1 << (dim - 1).bit_length()), max(16, 1 << (dim_v - 1).bit_length())


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: exact float32 products for float32, TF32 for half inputs (whose
    values carry fewer bits than TF32 anyway)."""
    return "ieee" if dtype == torch.float32 else "tf32"


class CausalLinearTriton(torch.autograd.Function):
    """Rows ``q, k (N, T, D)``, ``v (N, T, Dv)`` in their dtype; ``mask (B, T)`` int8 or None."""

    @staticmethod
    def forward(ctx, q, k, v, mask, heads, eps):
        rows, length, dim = q.shape
        dim_v = v.shape[-1]
        config = launch_config(q.dtype, _capability(q))
        chunk, block_d, block_v = _sizes(length, dim, dim_v, config.pop("C"))
        seg, n_seg = segments(rows, length, chunk, q.device)
        out = torch.empty_like(v)
        den = torch.empty(rows, length, dtype=torch.float32, device=q.device)
        common = {"C": chunk, "BD": block_d, "BDV": block_v, "PRECISION": precision(q.dtype), **config}
        mask_arg = mask if mask is not None else den
        start = start_norm = den  # unused with one segment
        with no_autocast(q.device):
            k_ = kernels()
            if n_seg > 1:
                state = torch.empty(rows, n_seg, block_d, block_v, dtype=torch.float32, device=q.device)
                norm = torch.empty(rows, n_seg, block_d, dtype=torch.float32, device=q.device)
                k_.linear_causal_state_kernel[(rows, n_seg)](
                    k, v, mask_arg, state, norm, length, dim, dim_v, heads, seg, n_seg,
                    HAS_MASK=mask is not None, **common,
                )  # fmt: skip
                start, start_norm = _carried(state, norm, reverse=False)
            k_.linear_causal_fwd_kernel[(rows, n_seg)](
                q, k, v, mask_arg, out, den, start, start_norm,
                length, dim, dim_v, heads, float(eps), seg, n_seg,
                HAS_MASK=mask is not None, HAS_START=n_seg > 1, **common,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, den, start, start_norm, *([] if mask is None else [mask]))
        ctx.heads, ctx.eps = heads, eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, den, start, start_norm, *maybe_mask = ctx.saved_tensors
        mask = maybe_mask[0] if maybe_mask else None
        if torch.is_grad_enabled():
            raise RuntimeError(
                "linear_attention (Triton, causal): double backward is not supported; "
                "use impl='torch' for higher-order gradients"
            )
        rows, length, dim = q.shape
        dim_v = v.shape[-1]
        config = launch_config(q.dtype, _capability(q))
        chunk, block_d, block_v = _sizes(length, dim, dim_v, config.pop("C"))
        seg, n_seg = segments(rows, length, chunk, q.device)
        g = grad_out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        gnum = torch.empty(rows, length, dim_v, dtype=torch.float32, device=q.device)
        gden = torch.empty(rows, length, dtype=torch.float32, device=q.device)
        common = {
            "HAS_MASK": mask is not None,
            "HAS_START": n_seg > 1,
            "C": chunk,
            "BD": block_d,
            "BDV": block_v,
            "PRECISION": precision(q.dtype),
            **config,
        }
        mask_arg = mask if mask is not None else den
        back = back_norm = den  # unused with one segment
        if n_seg > 1:
            back = torch.empty(rows, n_seg, block_d, block_v, dtype=torch.float32, device=q.device)
            back_norm = torch.empty(rows, n_seg, block_d, dtype=torch.float32, device=q.device)
        with no_autocast(q.device):
            k_ = kernels()
            k_.linear_causal_bwd_q_kernel[(rows, n_seg)](
                q, k, v, mask_arg, g, den, dq, gnum, gden, start, start_norm, back, back_norm,
                length, dim, dim_v, ctx.heads, float(ctx.eps), seg, n_seg, **common,
            )  # fmt: skip
            if n_seg > 1:
                back, back_norm = _carried(back, back_norm, reverse=True)
            k_.linear_causal_bwd_kv_kernel[(rows, n_seg)](
                q, k, v, mask_arg, gnum, gden, dk, dv, back, back_norm, length, dim, dim_v, ctx.heads,
                seg, n_seg, **common,
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
