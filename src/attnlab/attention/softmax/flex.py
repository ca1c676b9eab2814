"""Softmax attention on packed rows through FlexAttention's block mask (CUDA).

SDPA with a dense (L, L) mask computes every block of a packed row's score matrix, so the row pays L²
whatever its sequences; FlexAttention skips the blocks that no query's own sequence reaches and pays
about the sum of each sequence's M². torch has FlexAttention itself (``torch.nn.attention.
flex_attention``): this module only says which pairs are allowed (same sequence, and ``j <= i``
when causal), compiles the kernel once per process (FlexAttention is fast only compiled) and, before
the first use on a device and dtype, runs a small forward and backward against SDPA: a kernel that
fails to build or disagrees is never used there (one warning; SDPA instead).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from attnlab.attention.common.packing import segment_mask
from attnlab.errors import first_line

OP = "softmax_attention_segments"


def allowed_pairs(runs: torch.Tensor, causal: bool):
    """FlexAttention's ``mask_mod`` for packed rows: query ``i`` sees key ``j`` of its own run
    (``runs`` (B, L): each position's sequence, `packing.run_ids`), and ``j <= i`` when ``causal``."""

    def mask_mod(b, h, q_idx, kv_idx):
        same = runs[b, q_idx] == runs[b, kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    return mask_mod


@functools.cache
def _compiled():
    """FlexAttention and its block-mask builder, compiled (once per process)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), functools.partial(create_block_mask, _compile=True)


def _eager():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_attention, create_block_mask


def attend(q, k, v, runs: torch.Tensor, causal: bool, compiled: bool = True) -> torch.Tensor:
    """Softmax attention of q, k, v (B, H, L, D) inside the sequences of ``runs`` (B, L) through
    FlexAttention (``compiled=False``: its eager form, every score materialised; what the CPU tests
    check the mask with)."""
    batch, _, length, _ = q.shape
    flex, block_mask = _compiled() if compiled else _eager()
    mask = block_mask(allowed_pairs(runs, causal), batch, None, length, length, device=q.device)
    return flex(q, k, v, block_mask=mask)


_TRUSTED: dict[tuple, bool] = {}  # (device, dtype, head dims) -> the first-use check's verdict


def flex_segments(q, k, v, runs: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """``attend`` compiled, or None where it is not trusted on q's device, dtype and head dims (the
    caller takes SDPA with a dense mask). Inside a ``torch.compile``d model the graph takes
    FlexAttention as it is."""
    if torch.compiler.is_compiling():
        return attend(q, k, v, runs, causal, compiled=False)
    key = (str(q.device), q.dtype, q.shape[-1], v.shape[-1])
    if key not in _TRUSTED:
        _TRUSTED[key] = _first_use_check(q, v.shape[-1])
    return attend(q, k, v, runs, causal) if _TRUSTED[key] else None


def _first_use_check(like: torch.Tensor, dim_v: int) -> bool:
    """A packed row of three sequences, causal and not, forward and backward, in ``like``'s device,
    dtype and head dim: FlexAttention compiled against SDPA with the dense mask."""
    gen = torch.Generator(device=like.device).manual_seed(0)
    length, dim = 256, like.shape[-1]
    runs = (torch.arange(length, device=like.device) * 3 // length)[None]
    try:
        for causal in (False, True):
            q, k = (
                torch.randn(1, 2, length, dim, generator=gen, device=like.device, dtype=like.dtype)
                for _ in "qk"
            )
            v = torch.randn(1, 2, length, dim_v, generator=gen, device=like.device, dtype=like.dtype)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            got = attend(*leaves, runs, causal)
            got_grads = torch.autograd.grad(got.sum(), leaves)
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            want = F.scaled_dot_product_attention(*leaves, attn_mask=segment_mask(runs, causal)[:, None])
            want_grads = torch.autograd.grad(want.sum(), leaves)
            tol = 1e-2 if like.dtype in (torch.float16, torch.bfloat16) else 1e-4
            for a, b in zip((got, *got_grads), (want, *want_grads), strict=True):
                if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
                    raise ValueError("FlexAttention disagrees with SDPA on the check's packed row")
    except Exception as error:  # noqa: BLE001 - any failure only costs the speed: SDPA runs instead
        warnings.warn(
            f"{OP}: FlexAttention is not used on {like.device} {like.dtype} ({first_line(error)}); "
            "SDPA with a dense mask instead",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True
