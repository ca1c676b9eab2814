"""Rotary position embedding (Su et al. 2021) for q, k of shape (B, H, T, D).

Channel pairs (i, i + D/2) are rotated by the angle pos · base^(-2i/D), so the dot product of a rotated
query and key depends on the positions only through their difference.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.attention.common import compiler


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis: a 90° turn of every channel pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, D) with tables cos, sin broadcastable to it."""
    return x * cos + rotate_half(x) * sin


#: cos, sin tables per (head_dim, base, device, dtype), grown on demand (`_cached_tables`)
_CACHE: dict[tuple[int, float, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


@torch.inference_mode(False)
def _compute(size: int, head_dim: int, base: float, device: torch.device, dtype: torch.dtype):
    """cos, sin (size, head_dim): angles in float64, cast once. Never inference tensors, even when
    first asked for under ``torch.inference_mode`` (a validation step): training reuses the cache,
    and autograd cannot save an inference tensor."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(size, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _cached_tables(length: int, head_dim: int, base: float, device, dtype):
    """The first ``length`` rows of the cached tables, the cache doubled when it is too short."""
    key = (head_dim, base, torch.device(device), dtype)
    cached = _CACHE.get(key)
    if cached is None or cached[0].shape[0] < length:
        size = max(length, 2 * cached[0].shape[0]) if cached is not None else length
        cached = _CACHE[key] = _compute(size, head_dim, base, device, dtype)
    return cached[0][:length], cached[1][:length]


def _rope_tables(
    length: int, head_dim: int, base: float, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attnlab::rope_tables``: the tables as ``torch.compile`` reads them, one op whose outputs are
    buffers. Traced instead, inductor fuses the angles' float64 cos and sin into every element of q
    and k that reads them (forward and backward), which cost a compiled model more than its attention
    at 4,096 tokens (docs/benchmarks.md, "CPU: torch.compile"). On the CPU the op returns copies of
    the cache (a compiled graph may reuse its buffers' memory); elsewhere it computes the tables, so
    that a CUDA graph replaying it never reads a cache that has since grown and been freed."""
    if device.type != "cpu":
        return _compute(length, head_dim, base, device, dtype)
    cos, sin = _cached_tables(length, head_dim, base, device, dtype)
    return cos.clone(), sin.clone()


def _rope_tables_fake(length, head_dim, base, dtype, device):
    return tuple(torch.empty(length, head_dim, dtype=dtype, device=device) for _ in range(2))


_ROPE_TABLES = compiler.library_op("rope_tables", _rope_tables, fake=_rope_tables_fake)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k; the cos/sin tables are cached per (head_dim, base, device, dtype) and
    grown on demand (`_cached_tables`).

    The tables are computed in float64 and cast once, and kept out of the module's buffers on purpose:
    `model.half()` would otherwise round the angles of far positions.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim < 2 or head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension >= 2, got head_dim={head_dim}")
        if base <= 0:
            raise ValueError(f"rope base must be positive, got {base}")
        self.head_dim = head_dim
        self.base = float(base)

    def tables(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (length, D) for positions 0..length-1."""
        if compiler.compiling():  # one custom op: the tables are read from the cache, not recomputed
            return _ROPE_TABLES(length, self.head_dim, self.base, dtype, device)
        return _cached_tables(length, self.head_dim, self.base, device, dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q, k (B, H, T, D) as if their first token sat at position `offset` (for decoding), or
        each token at its own position: ``positions`` (B, T), each below T (a packed batch's)."""
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoPE was built for head_dim={self.head_dim}; got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        t = q.shape[-2]
        cos, sin = self.tables(offset + t, q.device, q.dtype)
        if positions is not None:
            cos, sin = cos[positions][:, None], sin[positions][:, None]  # (B, 1, T, D)
        else:
            cos, sin = cos[offset:], sin[offset:]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"
