"""Packed rows for the tests of the ops on them: two layouts of seven sequences and random inputs."""

from __future__ import annotations

import torch

from attnlab.attention.common.packing import PackedLayout

SHORT = ([5, 3, 1, 7, 2, 2, 9], [[0, 1, 2], [3], [4, 5], [6]])  # rows of 9 slots, two partly empty
LONG = ([37, 3, 24, 1, 70, 9, 2], [[0, 1, 2], [3, 4, 5], [6]])  # rows of 80 slots


def packed_inputs(lengths, rows, grid: bool, seed: int = 0, heads: int = 2, dim: int = 5):
    """``(layout, s, t, v)`` float64: scores (B, H, L) and values (B, H, L, D) on the packed rows;
    ``grid``: scores on a 0.25 grid (ties between queries and keys, keys on window edges)."""
    gen = torch.Generator().manual_seed(seed)
    layout = PackedLayout.from_rows(lengths, rows)
    batch, length = layout.pack_index.shape
    s, t = (torch.randn(batch, heads, length, generator=gen, dtype=torch.float64) for _ in range(2))
    if grid:
        s, t = (torch.round(x * 4) / 4 for x in (s, t))
    v = torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64)
    return layout, s, t, v
