"""Causal dominance sums whose levels are ordered once for both passes (causal sliced ReLU).

``dominance_sums`` sorts every block's left half at each level and binary-searches the right
half's thresholds in it; its transpose ``dominated_sums`` (the backward pass) sorts the right
halves and searches the left keys: two sorts and two searches per level for the same pairs of
positions. Here one merged sort per level, of the left keys and the right thresholds together
(thresholds before equal keys, so that a key counts for a threshold iff it is strictly below),
answers all four questions with counting: the left keys' order and every threshold's rank (forward
pass), the thresholds' order and every key's count of thresholds above it (backward pass, which
keeps these from the forward and neither sorts nor searches).

For float32 on CPU the merged sort is one sort of a flat int64 tensor (block, order-preserving
score bits, side): PyTorch sorts 1-D integer tensors of at least 32,768 elements by radix sort,
several times faster than sorting float rows. Measured at T = 16K, B·H = 8, one thread: the
merged sort and its counting take about 3 ms a level, where a row sort and a binary search took
6 ms in each pass. Other dtypes and devices sort the float rows (stable), into the same order;
``tests/attention/sliced_common/test_causal.py`` checks that the two agree and give the same sums bit for bit.

The levels' sums are then read ``FUSED_LEVELS`` levels at a time (``_add_level_rows``): one
gather lays out the group's prefix tables and every position sums its rows of all of them in
one ``embedding_bag``, so the output is added to once per group instead of once per level
(about a tenth of the op's time at 16K). Groups are as few and as even as ``FUSED_LEVELS``
allows (nine levels at 16K: five and four); their tables raise the peak memory a little: 613 MiB
at 16K, forward and backward, B·H = 8, D = 64, against 530 MiB for the per-level passes before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.sliced_common import dominance_native
from attnlab.attention.sliced_common.dominance import (
    dense_chunks,
    level_layout,
    pad_to,
    prefix_sums_,
    torch_chunk,
)

RADIX_MIN = 32768  # torch.sort takes its radix path for 1-D integer CPU tensors of this size and up
FUSED_LEVELS = 5  # levels read in one gather and one add (their tables: 2.5 (N, T, W) tables)


class _Level(NamedTuple):
    """What the backward pass needs of one level: the right halves' indices in descending threshold
    order and, for every left key, how many thresholds of its block's right half lie above it."""

    half: int
    n_blocks: int
    right_order: torch.Tensor  # (N, n_blocks, half)
    above: torch.Tensor  # (N, n_blocks, half)


def _merged_order(values: torch.Tensor, half: int) -> torch.Tensor:
    """Stable ascending order within each row of ``values (S, 2·half)``, ties ordered by column:
    the first ``half`` columns (thresholds) before equal later ones (keys). Returned as flat
    indices into ``values`` (row r's entries are ``r·2·half + column``), ``(S·2·half,)``."""
    segments, width = values.shape
    rows = torch.arange(segments, device=values.device)
    if not (values.dtype == torch.float32 and values.device.type == "cpu" and values.numel() >= RADIX_MIN):
        order = torch.sort(values, dim=1, stable=True).indices
        return (order + (rows * width)[:, None]).view(-1)
    # float32 bits -> an unsigned 32-bit integer with the floats' order (-0.0 made +0.0 first: equal)
    bits = (values + 0.0).view(torch.int32).to(torch.int64)
    code = (bits ^ ((bits >> 31) | (1 << 31))) << 1
    code[:, half:] += 1  # keys after equal thresholds
    code += (rows << 33)[:, None]  # rows apart
    return torch.sort(code.view(-1), stable=True).indices


def _merge_level(key: torch.Tensor, x: torch.Tensor, n_blocks: int, half: int):
    """One level's merged order (``merge_rows`` over every block's left keys and right
    thresholds): ``left_order``, ``rank`` and the ``_Level`` the backward pass reads. Right
    positions past the end are -inf thresholds (below every key: counted for none)."""
    n_rows = key.shape[0]
    block, span = 2 * half, 2 * half * n_blocks
    right = pad_to(x, span, -float("inf"))[:, :span].view(n_rows, n_blocks, block)[..., half:]
    left = pad_to(key, span, float("inf"))[:, :span].view(n_rows, n_blocks, block)[..., :half]
    shape = (n_rows, n_blocks, half)
    parts = merge_rows(right.reshape(-1, half), left.reshape(-1, half))
    left_order, rank, right_order, above = (part.view(shape) for part in parts)
    return left_order, rank, _Level(half, n_blocks, right_order, above)


def merge_rows(right: torch.Tensor, left: torch.Tensor):
    """Thresholds ``right (S, h)`` and keys ``left (S, h)`` of each row sorted together (thresholds
    before equal keys), as four ``(S, h)`` integer tensors: ``left_order``, the keys' indices in
    ascending order; ``rank``, per threshold ``#{keys < it}``; ``right_order``, the thresholds'
    indices in descending order; ``above``, per key ``#{thresholds > it}``."""
    segments, half = right.shape
    block, size = 2 * half, 2 * half * segments
    merged = _merged_order(torch.cat([right, left], dim=1), half)
    base = (torch.arange(segments, device=right.device) * block)[:, None]
    is_key = merged.view(segments, block) - base >= half  # columns 0..half-1: thresholds
    keys_before = is_key.cumsum(1)
    keys_before -= is_key.to(torch.int64)
    # per element (original column): #keys and #thresholds before it in the merged order
    position = torch.empty_like(merged).scatter_(0, merged, torch.arange(size, device=right.device))
    keys_ahead = keys_before.view(-1)[position].view(segments, block)
    thresholds_ahead = position.view(segments, block) - base - keys_ahead
    # every element's slot in [thresholds in order | keys in order]
    slot = torch.cat([thresholds_ahead[:, :half], keys_ahead[:, half:] + half], dim=1) + base
    columns = torch.arange(block, device=right.device).repeat(segments)
    grouped = torch.empty_like(merged).scatter_(0, slot.view(-1), columns).view(segments, block)
    left_order = grouped[:, half:] - half
    right_order = grouped[:, :half].flip(-1)  # descending
    return left_order, keys_ahead[:, :half], right_order, half - thresholds_ahead[:, half:]


class Pairs(NamedTuple):
    """The rows ``[scale·u, scale·score·u, first, second]`` (width 2·D + 2) of causal sliced ReLU's
    tables, by parts: ``u (N, T, D)``, the rest ``(N, T)``, ``scale`` None for one. The C++ kernels
    build each row as they read it (half the memory of the table); the torch code builds the table."""

    u: torch.Tensor
    scale: torch.Tensor | None
    score: torch.Tensor
    first: torch.Tensor
    second: torch.Tensor

    def table(self) -> torch.Tensor:
        weighted = self.u if self.scale is None else self.u * self.scale[..., None]
        columns = [weighted, self.score[..., None] * weighted, self.first[..., None], self.second[..., None]]
        return torch.cat(columns, dim=-1).contiguous()


def _apart(sums: torch.Tensor, dim: int):
    """The sums of a ``Pairs`` table, apart as ``pair_sums`` returns them."""
    return sums[..., :dim].contiguous(), sums[..., dim : 2 * dim], sums[..., 2 * dim], sums[..., 2 * dim + 1]


def merged_dominance_sums(key: torch.Tensor, x: torch.Tensor, pairs: Pairs, chunk: int):
    """``Σ_{j ≤ i, key_j < x_i} row_j`` of the ``pairs``' rows for every i (``dominance_sums`` with
    one "left" query), as ``(Σ scale·u, Σ scale·score·u, Σ first, Σ second)``, and the levels for
    ``merged_dominated_sums``. ``key`` may hold +inf for keys that never count; ``x`` is finite or
    -inf (counts nothing). On the CPU the C++ kernels run (``dominance_native``), and the "levels"
    are the orders they sorted by."""
    found = dominance_native.kernels(pairs.u, key, x)
    if found is not None:
        return dominance_native.pair_sums(found, key, x, pairs, strict=True, chunk=chunk)
    chunk = torch_chunk(chunk)
    table = pairs.table()
    out = table.new_empty(table.shape)
    dense_chunks(key, x, table, "left", chunk, out)
    levels = []
    for group in _level_groups(table.shape[1], chunk):
        merges = [_merge_level(key, x, level_layout(table.shape[1], half)[0], half) for half in group]
        levels += [level for _, _, level in merges]
        reads = [(level.half, level.n_blocks, left_order, rank) for left_order, rank, level in merges]
        _add_level_rows(out, table, reads, sorted_side=0)
    return _apart(out, pairs.u.shape[-1]), levels


def merged_dominated_sums(key, x, pairs: Pairs, chunk: int, levels):
    """``Σ_{i ≥ j, key_j < x_i} row_i`` for every j (``dominated_sums`` with one "left" key set), apart
    as ``merged_dominance_sums`` returns them, over the pairs and with the levels of its call on
    ``key`` and ``x``."""
    if isinstance(levels, dominance_native.Orders):
        found = dominance_native.kernels(pairs.u, key, x)
        return dominance_native.pair_sums(found, key, x, pairs, True, chunk, orders=levels, transpose=True)[0]
    chunk = torch_chunk(chunk)
    table = pairs.table()
    out = table.new_empty(table.shape)
    dense_chunks(key, x, table, "left", chunk, out, transpose=True)
    for group in _level_groups(table.shape[1], chunk):
        group = [level for level in levels if level.half in group]
        reads = [(level.half, level.n_blocks, level.right_order, level.above) for level in group]
        _add_level_rows(out, table, reads, sorted_side=1)
    return _apart(out, pairs.u.shape[-1])


def _level_groups(length: int, chunk: int) -> list[list[int]]:
    """The levels' halves (chunk, 2·chunk, ... < T) in as few groups of at most ``FUSED_LEVELS``
    as possible, of equal sizes give or take one (each group costs one add of the whole table)."""
    halves, half = [], chunk
    while half < length:
        halves.append(half)
        half *= 2
    n_groups = -(-len(halves) // FUSED_LEVELS)
    bounds = [round(k * len(halves) / n_groups) for k in range(n_groups + 1)] if halves else [0]
    return [halves[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _add_level_rows(out: torch.Tensor, table: torch.Tensor, reads, sorted_side: int) -> None:
    """``out += `` the rows that several levels read, in one gather and one add.

    ``reads``: per level ``(half, n_blocks, order, count)`` with ``order, count (N, n_blocks,
    half)``. At every block the rows of one half (``sorted_side`` 0: left, 1: right) are summed in
    ``order`` (exclusive prefix sums; one gather lays out all the levels' tables), and position k
    of the other half reads the sum of the first ``count[..., k]`` of them. Every position then
    adds one row per level (the zero row where it reads none) in one ``embedding_bag``: one gather
    and one add of the whole table per group, instead of both of half the table per level.
    """
    n_rows, length, width = table.shape
    device = table.device
    row_base = (torch.arange(n_rows, device=device) * length)[:, None, None]
    gather, starts, start = [], [], 0
    for half, n_blocks, order, _ in reads:
        first = half * sorted_side
        positions = order + (torch.arange(n_blocks, device=device) * (2 * half) + first)[:, None]
        if sorted_side:  # the last block's right half may pass the end: its rows are never read
            positions = positions.clamp_max(length - 1)
        gather.append((torch.cat([positions[..., :1], positions], dim=-1) + row_base).view(-1))
        starts.append(start)
        start += gather[-1].numel()
    prefixes = F.embedding_bag(torch.cat(gather)[:, None], table.view(-1, width), mode="sum")
    bags = []
    for (half, n_blocks, _, count), start in zip(reads, starts, strict=True):
        prefix = prefixes[start : start + n_rows * n_blocks * (half + 1)].view(-1, half + 1, width)
        prefix[:, 0] = 0
        prefix_sums_(prefix)
        block_rows = torch.arange(n_rows * n_blocks, device=device).view(n_rows, n_blocks, 1) * (half + 1)
        span = 2 * half * n_blocks  # may end before the sequence (a last block without right half)
        index = torch.full((n_rows, max(span, length)), start, dtype=torch.int64, device=device)
        blocks = index[:, :span].view(n_rows, n_blocks, 2 * half)  # start: the zero row
        read = half * (1 - sorted_side)
        blocks[..., read : read + half] += count + block_rows
        bags.append(index[:, :length])
    rows = F.embedding_bag(torch.stack(bags, dim=-1).view(-1, len(bags)), prefixes, mode="sum")
    out += rows.view(out.shape)
