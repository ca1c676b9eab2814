"""Dominance sums over time and score: the engine of the causal sliced ops (``sliced.causal``).

For thresholds ``x_i`` and a table of weight columns, ``Σ_{j ≤ i, key_j < x_i} table_j`` for every
position i at once: a two-dimensional query (time and score), vectorised over rows and columns with a
Python loop over log₂(T / chunk) levels only (divide and conquer over time):

- inside chunks of ``chunk`` consecutive tokens, a dense masked ``(chunk × chunk)`` matrix product
  (``[j ≤ i][key_j < x_i]``), which also takes the diagonal ``j = i``;
- at level ``h`` (h = chunk, 2·chunk, ...) time splits into blocks of 2h: the keys of each block's
  left half are sorted (``torch.sort`` on a ``(rows, blocks, h)`` view), the weight columns get
  per-block prefix sums in that order, and every query of the right half finds its rank with a
  batched ``searchsorted`` and reads one prefix row. Each pair ``j < i`` in different chunks is
  counted at exactly one level (the highest bit where i and j differ).

``dominance_sums`` returns the sums themselves, one ``(N, T, w)`` tensor per query set.
``combined_sums`` returns weighted combinations of them, ``Σ_terms coef_i · (sum of one column block
at one threshold)``: where an op only needs such a combination (the ReLU-bump's hat window is
``b·Σ hat = (b − c) L + L_x + (b + c) R − R_x`` of four window sums), each level reads the prefix
rows of all terms in one ``embedding_bag`` call (a fused gather and weighted sum) and adds one row
per query, instead of materialising every sum at full width: several times less memory traffic.

Cost: O(T·W·(chunk + log T)) arithmetic and O(T log² T) comparisons (the sorts) for W columns;
memory O(T·W).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.sliced_common import dominance_native
from attnlab.attention.sliced_common.rows import row_offsets

TORCH_CHUNK = 32  # the dense local block (the ops' chunk=None): below it a masked matmul beats sorting (CPU)


def torch_chunk(chunk: int | None) -> int:
    """The local block of the torch code for the ops' ``chunk`` (None: ``TORCH_CHUNK``)."""
    return TORCH_CHUNK if chunk is None else chunk


def _gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[n, index[n, m]]`` for a contiguous ``(N, L, W)`` table: ``(N, M, W)``.

    An ``embedding_bag`` of one row per bag: the same numbers as ``index_select`` (a sum of one
    row), and measured 1.2-1.8x faster on CPU for the rows of a few dozen to a few hundred
    numbers the levels read.
    """
    n_rows, row_len, width = table.shape
    flat = (index + row_offsets(n_rows, row_len, index.device)).reshape(-1, 1)
    return F.embedding_bag(flat, table.view(-1, width), mode="sum").view(n_rows, -1, width)


def pad_to(x: torch.Tensor, length: int, value: float) -> torch.Tensor:
    extra = length - x.shape[1]
    return x if extra <= 0 else F.pad(x, (0, extra), value=value)


LOOP_ROWS = 257  # prefix_sums_ adds row after row up to this length (measured)


def prefix_sums_(table: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In-place cumulative sum over dim 1 of a contiguous ``(R, L, W)`` table (W = a few dozen).

    On CPU ``cumsum`` over a middle dimension scans each of the W columns on its own, a strided walk
    that made it the largest cost of the causal ops (about 2 GB/s). Here rows are added one after
    another, ``block`` rows at a time (each add is one vectorised op over R·W numbers), and the
    blocks' running totals are carried by one small ``cumsum``: three to four times faster. Up to
    ``LOOP_ROWS`` rows the rows are added all the way down instead: the carry costs one more pass
    over the table, more than the extra adds (measured at T = 16K, 8 rows of 130 numbers: a third
    less time for the levels' tables of 65 to 257 rows).
    """
    rows, length, width = table.shape
    n_blocks = length // block
    if n_blocks < 2 or length <= LOOP_ROWS:
        for k in range(1, length):
            table[:, k] += table[:, k - 1]
        return table
    body = table[:, : n_blocks * block].view(rows, n_blocks, block, width)
    for k in range(1, block):
        body[:, :, k] += body[:, :, k - 1]
    carry = body[:, :, -1, :].cumsum(1)  # running total at the end of each block
    body[:, 1:] += carry[:, :-1, None, :]
    tail = table[:, n_blocks * block :]
    for k in range(1, tail.shape[1]):
        tail[:, k] += tail[:, k - 1]
    tail += carry[:, -1:, :]
    return table


def suffix_sums_(table: torch.Tensor, block: int = 32) -> torch.Tensor:
    """In-place ``Σ_{k ≥ j}`` over dim 1 of a contiguous ``(R, L, W)`` table: ``prefix_sums_`` run
    from the end (blocks aligned to the last row), without the two copies ``flip`` would make."""
    rows, length, width = table.shape
    n_blocks = length // block
    if n_blocks < 2:
        for k in range(length - 2, -1, -1):
            table[:, k] += table[:, k + 1]
        return table
    head = length - n_blocks * block
    body = table[:, head:].view(rows, n_blocks, block, width)
    for k in range(block - 2, -1, -1):
        body[:, :, k] += body[:, :, k + 1]
    carry = body[:, :, 0, :].flip(1).cumsum(1).flip(1)  # running total from each block's start on
    body[:, :-1] += carry[:, 1:, None, :]
    front = table[:, :head]
    for k in range(head - 2, -1, -1):
        front[:, k] += front[:, k + 1]
    front += carry[:, :1, :]
    return table


def _left_halves(
    key: torch.Tensor, tables: list[torch.Tensor], n_blocks: int, half: int, second: bool = False
):
    """At one level: the keys of every block's left half sorted, ``(N, n_blocks, half)``, and for
    each table the exclusive prefix sums of its rows in that order (``_ordered_prefix``).

    ``second``: the right halves instead (``dominated_sums``); positions past the end (the last
    block's right half may be short) sort last (+inf keys), and no sum that counts only finite
    keys below a threshold ever reaches their rows."""
    n_rows = key.shape[0]
    block = 2 * half
    span = n_blocks * block
    first = half if second else 0
    halves = pad_to(key, span, float("inf"))[:, :span].view(n_rows, n_blocks, block)
    sorted_keys, order = torch.sort(halves[..., first : first + half], dim=-1)
    return sorted_keys, [_ordered_prefix(table, order, n_blocks, half, first) for table in tables]


def _ordered_prefix(table: torch.Tensor, order: torch.Tensor, n_blocks: int, half: int, first: int = 0):
    """Exclusive prefix sums of the rows of every block's left half (``first = 0``) or right half
    (``first = half``) taken in ``order (N, n_blocks, half)`` (indices within the half):
    ``(N, n_blocks·(half + 1), W)``, row 0 of each block 0. Right-half positions past the end
    read the last row (their sums must never be read)."""
    n_rows, length, width = table.shape
    starts = torch.arange(n_blocks, device=table.device) * (2 * half) + first
    positions = order + starts[:, None]  # a left half always lies before its right half: < length
    if first:
        positions = positions.clamp_max(length - 1)
    index = torch.cat([positions[..., :1], positions], dim=-1).view(n_rows, -1)  # row 0: zeroed
    prefix = _gather_rows(table, index).view(n_rows * n_blocks, half + 1, width)
    prefix[:, 0] = 0
    return prefix_sums_(prefix).view(n_rows, n_blocks * (half + 1), width)


def dense_chunks(key, x, table, side: str, chunk: int, out: torch.Tensor, transpose: bool = False) -> None:
    """The level below the sorted ones, written into every row of ``out``: inside chunks of
    ``chunk`` consecutive tokens, ``out_i = Σ_{j ≤ i, key_j < x_i} table_j`` (``<=`` for side
    "right") as a dense masked product, which also takes the diagonal ``j = i``; with
    ``transpose`` the same pairs the other way, ``out_j = Σ_{i ≥ j, key_j < x_i} table_i``."""
    n_rows, length, width = table.shape
    compare = torch.lt if side == "left" else torch.le

    def local(start: int, size: int, count: int) -> None:
        stop = start + size * count
        keys = key[:, start:stop].reshape(n_rows, count, 1, size)
        thresholds = x[:, start:stop].reshape(n_rows, count, size, 1)
        weights = table.new_empty(n_rows, count, size, size)
        compare(keys, thresholds, out=weights).tril_()  # [i, j]: key_j below x_i, j <= i
        if transpose:
            weights = weights.transpose(-1, -2)
        rows = table[:, start:stop].reshape(n_rows, count, size, width)
        out[:, start:stop] = torch.matmul(weights, rows).reshape(n_rows, -1, width)

    _over_chunks(local, length, chunk)


class Query(NamedTuple):
    """Thresholds ``x (N, T)`` (finite), ``side`` "left" (keys < x) or "right" (keys <= x), and the
    table columns to sum (a slice)."""

    x: torch.Tensor
    side: str
    cols: slice = slice(None)


def dominance_sums(key: torch.Tensor, table: torch.Tensor, queries: list[Query], chunk: int) -> list:
    """For every query set and position i: ``Σ_{j ≤ i, key_j < x_i} table_j`` (or ``key_j <= x_i``).

    ``key (N, T)`` may hold +inf for keys that must never count; ``table (N, T, W)`` is finite and
    contiguous. Returns one ``(N, T, w)`` tensor per query set (w = width of its column slice).
    On the CPU the C++ kernels run (``dominance_native``).
    """
    found = dominance_native.kernels(table, key, *[q.x for q in queries])
    if found is not None:
        return [
            dominance_native.sums(found, key, q.x, table[..., q.cols], q.side == "left", chunk)[0]
            for q in queries
        ]
    chunk = torch_chunk(chunk)
    n_rows, length, width = table.shape
    outs = [table.new_empty(n_rows, length, table[0, 0, q.cols].numel()) for q in queries]
    for q, out in zip(queries, outs, strict=True):
        dense_chunks(key, q.x, table[..., q.cols], q.side, chunk, out)

    half = chunk
    while half < length:
        n_blocks, span, _, last_size, n_queries = level_layout(length, half)
        block = 2 * half
        sorted_keys, (prefix,) = _left_halves(key, [table], n_blocks, half)
        row_starts = (torch.arange(n_blocks, device=key.device) * (half + 1))[:, None]
        for q, out in zip(queries, outs, strict=True):
            right = pad_to(q.x, span, 0.0)[:, :span].view(n_rows, n_blocks, block)[..., half:]
            rank = torch.searchsorted(sorted_keys, right.contiguous(), side=q.side)
            flat = (rank + row_starts).view(n_rows, -1)[:, :n_queries]
            if q.cols == slice(None):
                rows = _gather_rows(prefix, flat)
            else:
                narrow = prefix[..., q.cols]
                rows = torch.gather(narrow, 1, flat[..., None].expand(-1, -1, narrow.shape[-1]))
            _add_right_halves(out, rows, n_blocks, half, last_size)
        half = block
    return outs


def dominated_sums(x: torch.Tensor, table: torch.Tensor, keys: list[Query], chunk: int) -> list:
    """For every key set and position j: ``Σ_{i ≥ j, key_j < x_i} table_i`` (``key_j <= x_i`` for
    side "right"): the transpose of ``dominance_sums``, over the same pairs of positions.

    The backward passes sum the queries' gradient rows over the later queries above each key.
    Reversing time would turn that into ``dominance_sums`` at the price of copying every table
    and result (``flip``); here the levels sort the *right* half of each block instead (by
    ``-x``: the rows in descending ``x``) and every key of the left half reads the sum of the
    rows above it, and the dense chunks multiply by the transposed mask. ``x (N, T)`` may hold
    -inf at rows that must never count; the keys' ``key_j`` may hold +inf (they count nothing).
    On the CPU the C++ kernels run (``dominance_native``).
    """
    found = dominance_native.kernels(table, x, *[q.x for q in keys])
    if found is not None:
        return [
            dominance_native.sums(found, q.x, x, table[..., q.cols], q.side == "left", chunk, transpose=True)[
                0
            ]
            for q in keys
        ]
    chunk = torch_chunk(chunk)
    n_rows, length, width = table.shape
    outs = [table.new_empty(n_rows, length, table[0, 0, q.cols].numel()) for q in keys]
    for q, out in zip(keys, outs, strict=True):
        dense_chunks(q.x, x, table[..., q.cols], q.side, chunk, out, transpose=True)

    neg = -x  # x_i > k  <=>  -x_i < -k: right halves sorted by -x, rows in descending x
    half = chunk
    while half < length:
        n_blocks, span, _, _, _ = level_layout(length, half)
        block = 2 * half
        sorted_neg, (prefix,) = _left_halves(neg, [table], n_blocks, half, second=True)
        row_starts = (torch.arange(n_blocks, device=x.device) * (half + 1))[:, None]
        for q, out in zip(keys, outs, strict=True):
            left = pad_to(-q.x, span, 0.0)[:, :span].view(n_rows, n_blocks, block)[..., :half]
            rank = torch.searchsorted(sorted_neg, left.contiguous(), side=q.side)
            flat = (rank + row_starts).view(n_rows, -1)
            if q.cols == slice(None):
                rows = _gather_rows(prefix, flat)
            else:
                narrow = prefix[..., q.cols]
                rows = torch.gather(narrow, 1, flat[..., None].expand(-1, -1, narrow.shape[-1]))
            _add_left_halves(out, rows, n_blocks, half)
        half = block
    return outs


def _add_left_halves(out: torch.Tensor, rows: torch.Tensor, n_blocks: int, half: int) -> None:
    """``out``'s left-half positions at one level += ``rows (N, n_blocks·half, w)`` (left halves
    always lie inside the sequence; only the last block's span may pass its end)."""
    n_rows, _, w = out.shape
    block, full = 2 * half, n_blocks - 1
    if full:
        view = out[:, : full * block].view(n_rows, full, block, w)[:, :, :half]
        view += rows[:, : full * half].view(n_rows, full, half, w)
    out[:, full * block : full * block + half] += rows[:, full * half :]


class Term(NamedTuple):
    """One term of a combination: threshold number ``query``, the table's column block ``block``
    (columns ``[block·w, (block + 1)·w)``) and a per-position coefficient ``coef (N, T)``."""

    query: int
    block: int
    coef: torch.Tensor


def _over_chunks(local, length: int, chunk: int) -> None:
    """``local(start, size, count)`` over the ``count`` full chunks of ``size`` tokens, then the rest:
    the dense level below the sorted ones, shared by the causal sums."""
    full = length // chunk
    if full:
        local(0, chunk, full)
    if length - full * chunk:
        local(full * chunk, length - full * chunk, 1)


def level_layout(length: int, half: int):
    """Blocks of 2·half at one level: (number of blocks whose right half is not empty, padded span,
    start of the last right half, its size, number of right-half positions < length)."""
    block = 2 * half
    n_blocks = (length - half + block - 1) // block
    last_right = (n_blocks - 1) * block + half
    last_size = min(half, length - last_right)
    return n_blocks, n_blocks * block, last_right, last_size, (n_blocks - 1) * half + last_size


def _right_halves(x: torch.Tensor, n_blocks: int, half: int, n_queries: int) -> torch.Tensor:
    """The right-half positions of ``x (N, T)`` at one level, in order: ``(N, n_queries)``."""
    span = 2 * half * n_blocks
    return (
        pad_to(x, span, 0.0)[:, :span]
        .reshape(x.shape[0], n_blocks, 2 * half)[..., half:]
        .reshape(x.shape[0], -1)[:, :n_queries]
    )


def _add_right_halves(out: torch.Tensor, rows: torch.Tensor, n_blocks: int, half: int, last_size: int):
    """``out``'s right-half positions at one level += ``rows (N, n_queries, w)``."""
    n_rows, _, w = out.shape
    block, done = 2 * half, (n_blocks - 1) * half
    if n_blocks > 1:
        view = out[:, : (n_blocks - 1) * block].view(n_rows, n_blocks - 1, block, w)[:, :, half:]
        view += rows[:, :done].view(n_rows, n_blocks - 1, half, w)
    last_right = (n_blocks - 1) * block + half
    out[:, last_right : last_right + last_size] += rows[:, done:]


def combined_sums(
    key: torch.Tensor,
    table: torch.Tensor,
    thresholds: list[tuple[torch.Tensor, str]],
    combos: list[list[Term]],
    width: int,
    chunk: int,
    raw: torch.Tensor | None = None,
    shifted: bool = False,
    later: bool = False,
) -> list[torch.Tensor]:
    """For every combination and position i: ``Σ_terms coef_i · Σ_{j ≤ i, key_j < x_i} table_j[block]``
    (``key_j <= x_i`` for a threshold whose side is "right").

    ``thresholds`` are ``(x (N, T) finite, side)``; ``table (N, T, W)`` is contiguous with W a
    multiple of ``width``, the column-block width every term reads. Returns one ``(N, T, width)``
    tensor per combination. Same levels as ``dominance_sums``; in the local chunks each column block
    takes one matrix product with the terms' masks summed first. ``raw (N, T, E)``, a few columns,
    adds the plain dominance sums of its columns at every threshold, ``(thresholds, N, T, E)``, last
    in the list (sharing the sorts and binary searches). On the CPU the C++ kernels run
    (``dominance_native``); ``shifted`` tells them the thresholds are the first one plus a constant
    per row, so that one sort orders them all. ``later``: the sums over ``j >= i`` instead (the
    backward pass's keys), which the kernels walk as they are and the torch code takes with time
    reversed (every input and output flipped).
    """
    found = dominance_native.kernels(table, key, *[x for x, _ in thresholds])
    if found is not None:
        return dominance_native.combined(
            found, key, table, thresholds, combos, width, chunk, raw, shifted, later
        )
    if later:
        flipped = [[Term(term.query, term.block, term.coef.flip(1)) for term in combo] for combo in combos]
        outs = combined_sums(
            key.flip(1),
            table.flip(1).contiguous(),
            [(x.flip(1), side) for x, side in thresholds],
            flipped,
            width,
            chunk,
            None if raw is None else raw.flip(1).contiguous(),
        )
        return [out.flip(-2) for out in outs]
    chunk = torch_chunk(chunk)
    n_rows, length, full_width = table.shape
    per_row = full_width // width
    dtype = table.dtype
    outs = [table.new_zeros(n_rows, length, width) for _ in combos]
    # every combination's coefficients side by side, (N, T, terms), and its terms' rows in the bag
    # table: prefix row r of threshold q, block b -> r·per_row + b
    coefs = [
        torch.stack([term.coef.to(dtype).expand(n_rows, length) for term in combo], dim=-1)
        for combo in combos
    ]
    term_queries = [torch.tensor([term.query for term in combo], device=key.device) for combo in combos]
    term_blocks = [torch.tensor([term.block for term in combo], device=key.device) for combo in combos]
    raw_sums = None if raw is None else raw.new_zeros(len(thresholds), *raw.shape)

    def local(start: int, size: int, count: int) -> None:
        stop = start + size * count
        kc = key[:, start:stop].reshape(n_rows, count, size)[..., None, :]
        tc = table[:, start:stop].reshape(n_rows, count, size, full_width)
        causal = torch.ones(size, size, dtype=torch.bool, device=key.device).tril()
        masks = []
        for x, side in thresholds:
            xc = x[:, start:stop].reshape(n_rows, count, size)[..., :, None]
            masks.append((((kc < xc) if side == "left" else (kc <= xc)) & causal).to(dtype))
        for combo, coef, out in zip(combos, coefs, outs, strict=True):
            coef = coef[:, start:stop].reshape(n_rows, count, size, 1, -1)
            weights: dict[int, torch.Tensor] = {}
            for k, term in enumerate(combo):
                if term.block not in weights:
                    weights[term.block] = masks[term.query] * coef[..., k]
                else:
                    weights[term.block].addcmul_(masks[term.query], coef[..., k])
            total = None
            for blk, matrix in weights.items():
                part = torch.matmul(matrix, tc[..., blk * width : (blk + 1) * width])
                total = part if total is None else total.add_(part)
            out[:, start:stop] = total.reshape(n_rows, -1, width)
        if raw is not None:
            rc = raw[:, start:stop].reshape(n_rows, count, size, raw.shape[-1])
            for k, mask in enumerate(masks):
                raw_sums[k, :, start:stop] = torch.matmul(mask, rc).reshape(n_rows, -1, raw.shape[-1])

    _over_chunks(local, length, chunk)

    half = chunk
    while half < length:
        n_blocks, span, _, last_size, n_queries = level_layout(length, half)
        block = 2 * half
        sorted_keys, prefixes = _left_halves(key, [table] if raw is None else [table, raw], n_blocks, half)
        bag_table = prefixes[0].view(-1, width)
        # global prefix row of each (row, block) start: n·n_blocks·(half + 1) + block·(half + 1)
        row_starts = (torch.arange(n_rows * n_blocks, device=key.device) * (half + 1)).view(
            n_rows, n_blocks, 1
        )
        ranks = []
        for x, side in thresholds:
            right = pad_to(x, span, 0.0)[:, :span].view(n_rows, n_blocks, block)[..., half:]
            rank = torch.searchsorted(sorted_keys, right.contiguous(), side=side)
            ranks.append((rank + row_starts).view(n_rows, -1)[:, :n_queries])
        ranks = torch.stack(ranks, dim=-1)  # (N, n_queries, thresholds)
        positions = _right_halves(torch.arange(length, device=key.device)[None], n_blocks, half, n_queries)[0]
        for coef, queries, blocks, out in zip(coefs, term_queries, term_blocks, outs, strict=True):
            bags = ranks[..., queries] * per_row + blocks
            rows = F.embedding_bag(
                bags.view(-1, len(queries)),
                bag_table,
                per_sample_weights=coef[:, positions].reshape(-1, len(queries)),
                mode="sum",
            )
            _add_right_halves(out, rows.view(n_rows, n_queries, width), n_blocks, half, last_size)
        if raw is not None:
            raw_prefix = prefixes[1].view(-1, raw.shape[-1])
            for k in range(len(thresholds)):
                rows = raw_prefix[ranks[..., k].reshape(-1)].view(n_rows, n_queries, -1)
                _add_right_halves(raw_sums[k], rows, n_blocks, half, last_size)
        half = block
    return outs if raw is None else [*outs, raw_sums]
