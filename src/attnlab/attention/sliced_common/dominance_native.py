"""The causal dominance sums in C++ on the CPU (``dominance_kernels.cpp``).

``attnlab.attention.sliced_common.dominance`` and ``merged`` answer the causal ops' two-dimensional
queries (time and score) level by level in torch: a sort, a search and a gather of prefix tables per
level, about two full passes over the (T, W) table each. The kernels cut time into blocks of
``chunk`` tokens once, sum the pairs inside a block directly, and take the pairs across blocks from
one walk per row up the sorted scores, with a Fenwick tree over the blocks that stays in the cache:
one read of each table row and one write of each output row besides (the walk's sums go through a
buffer of one row's outputs per thread, so that the outputs are written in time order). The orders come from
``rows.sort_rows`` (a radix sort in C++); the backward pass reuses the forward's. The functions below
take the torch functions' arguments and return what they return; they run where ``kernels`` finds
the library (CPU, float32/float64, a compiler: ``attnlab.attention.common.native``).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from attnlab.attention.common import native
from attnlab.attention.sliced_common.path import KERNEL_SOURCES
from attnlab.attention.sliced_common.rows import sort_rows

#: the blocks of time whose pairs the kernels sum directly, for the ops' chunk=None: 16 took the
#: causal ops 5–15 % less time than 32 at 4K and 16K, B·H = 8, D = 64 (2-core VM); the tree over the
#: blocks then holds 0.5–1 MiB, in the L2 cache
BLOCK = 16
SOURCE = KERNEL_SOURCES["causal_relu"]  # dominance_kernels.cpp beside this file (both causal ops')
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = {
    "dominance_sums": [_P] * 4 + [_I] * 2 + [_P] * 2 + [_I] * 6,
    "pair_sums": [_P] * 4 + [_I] * 2 + [_P] * 9 + [_I] * 6,
    "combined_sums": [_P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I],
    "tied_pairs": [_P] * 8 + [_I] * 5,
}


class Orders(NamedTuple):
    """The ascending orders of the keys and the thresholds, ``(N, T)`` each: what the backward pass
    (the transposed sums) needs of the forward's."""

    key: torch.Tensor
    x: torch.Tensor


def kernels(table: torch.Tensor, *compared: torch.Tensor) -> dict | None:
    """The kernels for ``table``'s dtype on the CPU, or None (the torch code runs). Keys and thresholds
    are read in the table's dtype: scores are, and the packed rows' codes (exact integers in float32 or
    float64) convert exactly unless they are float64 beyond float32's 2^24 (then the torch code)."""
    if table.device.type != "cpu" or any(x.dtype not in (table.dtype, torch.float32) for x in compared):
        return None
    return native.kernels(SOURCE, table.dtype, _ARGTYPES)


def _block(chunk: int | None) -> int:
    return BLOCK if chunk is None else chunk


def ascending(x: torch.Tensor) -> torch.Tensor:
    return sort_rows(x.detach())[1]


def _same_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.detach().to(dtype).contiguous()


def sums(
    found, key, x, table, strict: bool, chunk: int, orders: Orders | None = None, transpose: bool = False
):
    """``Σ_{j ≤ i, key_j < x_i} table_j`` for every i (``<=`` unless ``strict``), or with ``transpose``
    ``Σ_{i ≥ j, key_j < x_i} table_i`` for every j; ``(N, T, W)``, and the orders used."""
    key, x, table = _same_dtype(key, table.dtype), _same_dtype(x, table.dtype), table.contiguous()
    orders = orders or Orders(ascending(key), ascending(x))
    out = torch.empty_like(table)
    rows, length, width = table.shape
    pointers = [native.pointer(a) for a in (key, orders.key, x, orders.x)]
    tail = [native.pointer(table), native.pointer(out), length, width, _block(chunk)]

    threads = native.threads_for(rows, rows * length * width)
    found["dominance_sums"](*pointers, int(strict), int(transpose), *tail, 0, rows, threads)
    return out, orders


def pair_sums(
    found, key, x, parts, strict: bool, chunk: int, orders: Orders | None = None, transpose: bool = False
):
    """``sums`` of the rows ``[scale·u, scale·score·u, first, second]`` (``merged.Pairs``), each row
    built as it is read, and returned apart: ``(Σ scale·u, Σ scale·score·u, Σ first, Σ second)``."""
    dtype = parts.u.dtype
    key, x = _same_dtype(key, dtype), _same_dtype(x, dtype)
    orders = orders or Orders(ascending(key), ascending(x))
    u, scale, score, first, second = (None if a is None else a.detach().contiguous() for a in parts)
    rows, length, dim = u.shape
    sums = (torch.empty_like(u), torch.empty_like(u), torch.empty_like(score), torch.empty_like(score))
    arrays = (key, orders.key, x, orders.x)
    pointers = [native.pointer(a) for a in arrays]
    parts_pointers = [None if a is None else native.pointer(a) for a in (u, scale, score, first, second)]
    tail = [native.pointer(a) for a in sums] + [length, dim, _block(chunk)]

    threads = native.threads_for(rows, rows * length * dim)
    found["pair_sums"](*pointers, int(strict), int(transpose), *parts_pointers, *tail, 0, rows, threads)
    return sums, orders


def tied_pairs(found, x, key, budget: int, orders: Orders | None = None):
    """``causal.tied_pairs`` of thresholds ``x`` and keys ``key`` (N, T) in one merged walk per row
    over their radix-sorted orders (``orders``, where a dominance sum took them already): the flat
    indices ``(n·T + i, n·T + j)`` of the pairs ``j <= i`` with ``x_i == key_j``, or None when the
    equal runs hold more than ``budget`` pairs."""
    x, key = x.detach().contiguous(), key.detach().to(x.dtype).contiguous()
    orders = orders or Orders(ascending(key), ascending(x))
    sorted_rows = (key, orders.key, x, orders.x)
    counts = torch.empty(x.shape[0], dtype=torch.int64)
    native.call_rows(found["tied_pairs"], (*sorted_rows, counts, None, None, None), (*x.shape, 1))
    total = int(counts.sum())
    if total > budget:
        return None
    offsets = counts.cumsum(0) - counts
    query, key_index = torch.full((2, total), -1, dtype=torch.int64).unbind(0)
    native.call_rows(found["tied_pairs"], (*sorted_rows, None, offsets, query, key_index), (*x.shape, 1))
    kept = query >= 0  # the pairs j > i left their slots as they were
    return query[kept], key_index[kept]


def combined(
    found,
    key,
    table,
    thresholds,
    combos,
    width: int,
    chunk: int,
    raw=None,
    shifted: bool = False,
    later: bool = False,
) -> list[torch.Tensor]:
    """``combined_sums``: for every combination of terms ``Σ coef_i · (the sums at one threshold, one
    column block of width ``width``)``, ``(N, T, width)`` each; with ``raw (N, T, E)`` also the plain
    sums of its columns at every threshold, ``(thresholds, N, T, E)``, last in the list. ``shifted``:
    the thresholds are the first one plus a constant per row (a window c − b, c, c + b), so its order
    sorts them all (rounding is monotone): one sort instead of one per threshold. ``later``: the sums
    over ``j >= i`` (the tree's blocks counted from the end)."""
    dtype = table.dtype
    key = _same_dtype(key, dtype)
    xs = [_same_dtype(x, dtype) for x, _ in thresholds]
    orders = [ascending(xs[0])] * len(xs) if shifted else [ascending(x) for x in xs]
    walks = _Walks(key, ascending(key), xs, orders, [side == "left" for _, side in thresholds])
    terms = [(o, term.query, term.block, term.coef) for o, combo in enumerate(combos) for term in combo]
    outs = _combined_call(found, walks, table, width, terms, len(combos), chunk, later)
    if raw is None:
        return outs
    plain = [(h, h, 0, None) for h in range(len(xs))]
    return [
        *outs,
        torch.stack(_combined_call(found, walks, raw, raw.shape[-1], plain, len(xs), chunk, later)),
    ]


class _Walks(NamedTuple):
    """The keys and every threshold row, in the table's dtype, with their ascending orders."""

    key: torch.Tensor
    key_order: torch.Tensor
    xs: list[torch.Tensor]
    x_orders: list[torch.Tensor]
    strict: list[bool]


def _combined_call(
    found, walks: _Walks, table, width: int, terms, n_outs: int, chunk: int, later: bool = False
) -> list[torch.Tensor]:
    """One ``combined_sums`` kernel call; ``terms`` are ``(output, threshold, column block, coef (N, T)
    or None for one)``."""
    rows, length, table_width = table.shape
    table = table.contiguous()
    coefs = [None if c is None else c.detach().double().expand(rows, length).contiguous() for *_, c in terms]
    columns = [torch.tensor([term[k] for term in terms], dtype=torch.int64) for k in range(3)]
    strict = torch.tensor(walks.strict, dtype=torch.int64)
    outs = [table.new_empty(rows, length, width) for _ in range(n_outs)]
    keep = (walks, coefs, columns, strict, outs, table)  # alive while the kernel reads their pointers
    args = (
        native.pointer(walks.key),
        native.pointer(walks.key_order),
        len(walks.xs),
        _pointer_array(walks.xs),
        _pointer_array(walks.x_orders),
        native.pointer(strict),
        native.pointer(table),
        table_width,
        width,
        len(terms),
        *[native.pointer(c) for c in columns],
        _pointer_array(coefs),
        n_outs,
        _pointer_array(outs),
        length,
        _block(chunk),
        int(later),
    )
    work = rows * length * table_width * len(walks.xs)
    found["combined_sums"](*args, 0, rows, native.threads_for(rows, work))
    del keep
    return outs


def _pointer_array(tensors: list[torch.Tensor | None]):
    """A C array of the tensors' data pointers, null for None (the caller keeps the tensors alive)."""
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])
