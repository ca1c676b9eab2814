"""Causal dominance sums whose levels are ordered once for both passes (causal sliced ReLU).

``_dominance_sums`` sorts every block's left half at each level and binary-searches the right
half's thresholds in it; its transpose ``_dominated_sums`` (the backward pass) sorts the right
halves and searches the left keys: two sorts and two searches per level for the same pairs of
positions. Here one merged sort per level, of the left keys and the right thresholds together
(thresholds before equal keys, so that a key counts for a threshold iff it is strictly below),
answers all four questions with counting: the left keys' order and every threshold's rank (forward
pass), the thresholds' order and every key's count of thresholds above it (backward pass, which
keeps these from the forward and neither sorts nor searches).

For float32 on CPU the merged sort is one sort of a flat int64 tensor (block, order-preserving
score bits, side): PyTorch sorts 1-D integer tensors of at least 32,768 elements by radix sort,
several times faster than sorting float rows (T = 16K, B·H = 8: about 1.5 ms a level against 6 ms
for a row sort and a search). Other dtypes and devices sort the float rows (stable), with the same
order; ``test_causal_sliced`` checks that the two agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.sliced.dominance import _dense_chunks, _level_layout, _pad_to, _prefix_sums_

RADIX_MIN = 32768  # torch.sort takes its radix path for 1-D integer CPU tensors of this size and up


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
    """One level's merged order (``_merge_rows`` over every block's left keys and right
    thresholds): ``left_order``, ``rank`` and the ``_Level`` the backward pass reads. Right
    positions past the end are -inf thresholds (below every key: counted for none)."""
    n_rows = key.shape[0]
    block, span = 2 * half, 2 * half * n_blocks
    right = _pad_to(x, span, -float("inf"))[:, :span].view(n_rows, n_blocks, block)[..., half:]
    left = _pad_to(key, span, float("inf"))[:, :span].view(n_rows, n_blocks, block)[..., :half]
    shape = (n_rows, n_blocks, half)
    parts = _merge_rows(right.reshape(-1, half), left.reshape(-1, half))
    left_order, rank, right_order, above = (part.view(shape) for part in parts)
    return left_order, rank, _Level(half, n_blocks, right_order, above)


def _merge_rows(right: torch.Tensor, left: torch.Tensor):
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


def _merged_dominance_sums(key: torch.Tensor, x: torch.Tensor, table: torch.Tensor, chunk: int):
    """``Σ_{j ≤ i, key_j < x_i} table_j`` for every i, ``(N, T, W)`` (``_dominance_sums`` with one
    "left" query), and the levels for ``_merged_dominated_sums``. ``key`` may hold +inf for keys
    that never count; ``x`` is finite or -inf (counts nothing)."""
    out = table.new_empty(table.shape)
    _dense_chunks(key, x, table, "left", chunk, out)
    levels = []
    for group in _level_groups(table.shape[1], chunk):
        merges = [_merge_level(key, x, _level_layout(table.shape[1], half)[0], half) for half in group]
        levels += [level for _, _, level in merges]
        orders = [(left_order, level, 0) for left_order, _, level in merges]
        reads = [(rank, level, 1) for _, rank, level in merges]  # right halves read
        _add_level_rows(out, table, orders, reads)
    return out, levels


def _merged_dominated_sums(key, x, table: torch.Tensor, chunk: int, levels: list[_Level]) -> torch.Tensor:
    """``Σ_{i ≥ j, key_j < x_i} table_i`` for every j (``_dominated_sums`` with one "left" key set),
    over the pairs and with the levels of the ``_merged_dominance_sums`` call on ``key`` and ``x``."""
    out = table.new_empty(table.shape)
    _dense_chunks(key, x, table, "left", chunk, out, transpose=True)
    for first in range(0, len(levels), FUSED_LEVELS):
        group = levels[first : first + FUSED_LEVELS]
        orders = [(level.right_order, level, 1) for level in group]  # right halves, descending
        reads = [(level.above, level, 0) for level in group]  # left halves read
        _add_level_rows(out, table, orders, reads)
    return out


FUSED_LEVELS = 4  # levels whose prefix tables are read in one gather (memory: 2 (N, T, W) tables)


def _level_groups(length: int, chunk: int) -> list[list[int]]:
    halves, half = [], chunk
    while half < length:
        halves.append(half)
        half *= 2
    return [halves[k : k + FUSED_LEVELS] for k in range(0, len(halves), FUSED_LEVELS)]


def _add_level_rows(out: torch.Tensor, table: torch.Tensor, orders, reads) -> None:
    """``out += `` the rows that several levels read, in one gather and one add.

    ``orders``: per level ``(order (N, n_blocks, half), level, side)``, the rows of every block's
    left (side 0) or right (side 1) half in the order of their exclusive prefix sums, which one
    gather lays out level after level (row 0 of each block zero). ``reads``: per level
    ``(count (N, n_blocks, half), level, side)``, how many rows of that prefix each position of
    the other half reads. Every position then sums one row per level (the zero row where it reads
    none) in one ``embedding_bag``: instead of a gather and an add of half the table per level,
    one of the whole table per group of levels.
    """
    n_rows, length, width = table.shape
    device = table.device
    row_base = (torch.arange(n_rows, device=device) * length)[:, None, None]
    gather, offsets, offset = [], [], 0
    for order, level, side in orders:
        half, n_blocks = level.half, level.n_blocks
        first = half * side
        positions = order + (torch.arange(n_blocks, device=device) * (2 * half) + first)[:, None]
        if side:  # the last block's right half may pass the end: its rows are never read
            positions = positions.clamp_max(length - 1)
        gather.append((torch.cat([positions[..., :1], positions], dim=-1) + row_base).view(-1))
        offsets.append(offset)
        offset += gather[-1].numel()
    prefixes = F.embedding_bag(torch.cat(gather)[:, None], table.view(-1, width), mode="sum")
    bags = []
    for (_, level, _), (count, _, side), start in zip(orders, reads, offsets, strict=True):
        half, n_blocks = level.half, level.n_blocks
        prefix = prefixes[start : start + n_rows * n_blocks * (half + 1)].view(-1, half + 1, width)
        prefix[:, 0] = 0
        _prefix_sums_(prefix)
        block_rows = torch.arange(n_rows * n_blocks, device=device).view(n_rows, n_blocks, 1) * (half + 1)
        span = 2 * half * n_blocks  # may end before the sequence (a last block without right half)
        index = torch.full((n_rows, max(span, length)), start, dtype=torch.int64, device=device)
        blocks = index[:, :span].view(n_rows, n_blocks, 2 * half)  # start: the zero row
        blocks[..., half * side : half * side + half] += count + block_rows
        bags.append(index[:, :length])
    rows = F.embedding_bag(torch.stack(bags, dim=-1).view(-1, len(bags)), prefixes, mode="sum")
    out += rows.view(out.shape)
