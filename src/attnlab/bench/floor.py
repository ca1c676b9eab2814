"""The memory floor `attnlab bench attention` prints under its table on the CPU.

An op that reads each of its inputs and writes each of its outputs (and, forward + backward, each
gradient) exactly once cannot be faster than those bytes at the machine's copy bandwidth. For the
sliced ops (inputs s, t (B, H, T) and v (B, H, T, D)): forward, v and s, t in and o out; forward +
backward, also dO in and dv, ds, dt out. The bandwidth is measured in the same run, by one copy of a
large buffer with torch's threads, so the floor moves with the machine and its load like the cells.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

#: bytes of the bandwidth measurement's source (the copy reads and writes this much)
COPY_BYTES = 256 * 2**20


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes per second read plus written by ``dst.copy_(src)`` of ``nbytes`` (median of ``repeats``,
    after one warm-up copy that faults the pages in)."""
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def has_floor(backend: str) -> bool:
    """The sliced ops on (s, t, v) and their causal, sorted, dense and packed-rows forms."""
    return backend.startswith("sliced_relu") and not backend.endswith(("_concat", "_decode"))


def floor_bytes(cell) -> int:
    """Bytes the op of ``cell`` must move at least: each input, output and gradient once."""
    size = torch.empty(0, dtype=getattr(torch, cell.dtype)).element_size()
    values, scores = cell.batch * cell.heads * cell.seq_len * cell.dim, cell.batch * cell.heads * cell.seq_len
    passes = 2 if cell.mode == "fwd" else 4  # v, o (+ dO, dv)
    return size * (passes * values + passes * scores)  # s, t (+ ds, dt)


def floor_lines(cells: Iterable, threads: int, measure=copy_bandwidth) -> list[str]:
    """``time / floor`` of every measured sliced cell, under a line with the bandwidth (``measure()``,
    taken only when there is such a cell); empty without one."""
    measured = [c for c in cells if c.status == "ok" and has_floor(c.backend)]
    if not measured:
        return []
    bandwidth = measure()
    lines = [
        f"memory floor: copy bandwidth {bandwidth / 1e9:.1f} GB/s (a {COPY_BYTES // 2**20} MiB copy, "
        f"{threads} threads); each input, output and gradient read or written once"
    ]
    for cell in measured:
        floor_ms = 1e3 * floor_bytes(cell) / bandwidth
        lines.append(
            f"{cell.backend:<32} {cell.mode:<7} {cell.seq_len:>7} {cell.time_ms / floor_ms:>7.1f}x the floor "
            f"({floor_ms:.2f} ms, {floor_bytes(cell) / 1e6:.1f} MB)"
        )
    return lines
