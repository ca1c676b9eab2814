"""The Triton helpers every kernel family shares, and the device probe. Loaded through
``runtime.kernels()`` (never imported directly): the families' kernel files (``sliced_relu``,
``sliced_relu_bump``, ``linear``: each ``triton_kernels.py``) are executed into this module after it,
and take ``_add``, ``_max``, ``_two_sum``, ``_program_block`` and ``_packed_segment`` from it.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Only triton's builtins are used, plus the jit functions of this file: triton.language's own jit
# helpers (tl.sum, tl.cumsum, tl.cdiv, tl.zeros) are decorated when triton is first imported, for
# the mode then in force, and would break the interpreter if triton was imported without it.
# Sums go through tl.reduce / tl.associative_scan with triton's own sum combiner, which the
# interpreter recognises by identity and runs as one numpy call (any other combiner is called
# element by element in Python: minutes instead of seconds).


@triton.jit
def _plus(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


_add = getattr(tl.standard, "_sum_combine", _plus)
_max = getattr(tl.standard, "_elementwise_max", _larger)


@triton.jit
def _two_sum(total, err, part):
    """``total + err`` += ``part`` with the rounding error of the big add kept in ``err`` (Knuth's
    TwoSum: additions only, exact in IEEE arithmetic, so the same on a GPU and in the interpreter)."""
    new = total + part
    back = new - total
    err += (total - (new - back)) + (part - back)
    return new, err


@triton.jit
def probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """Adds 1 to ``x[:n]``: built and launched once per device to learn whether Triton runs there."""
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n, other=0.0) + 1.0, mask=i < n)


@triton.jit
def _program_block(D, BD: tl.constexpr):
    """This program's row, chunk, block of D columns ``d`` and its mask: every stream kernel is
    launched on a (rows, chunks, D blocks) grid."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    dblk = tl.program_id(2)
    d = dblk * BD + tl.arange(0, BD)
    return row, chunk, dblk, d, d < D


@triton.jit
def _packed_segment(seg_ptr, prog, T, HAS_SEGMENTS: tl.constexpr):
    """``(row, start, size)`` of what program ``prog`` reads: the whole row ``prog`` of T positions,
    or with ``HAS_SEGMENTS`` segment ``prog`` of a packed row (``seg (S, 3)`` int64, each segment's
    row, first position and size: ``sliced_common.segments.segment_table``). Sorted by (segment,
    score), a segment's keys and queries hold the positions its tokens hold, so the sliced ops'
    kernels walk a segment as a row of its own; every per-row array is then indexed by ``prog``."""
    row = prog
    start = prog * 0
    size = start + T
    if HAS_SEGMENTS:
        row = tl.load(seg_ptr + prog * 3)
        start = tl.load(seg_ptr + prog * 3 + 1)
        size = tl.load(seg_ptr + prog * 3 + 2)
    return row, start, size
