"""The ratios `attnlab bench attention` prints under its table, each from two cells of one run.

- memory: peak memory of the official formulation of sliced ReLU (`sliced_relu_concat`, the public
  code's concatenate-and-sort) over the fast op's (`sliced_relu`): how many times less the op needs;
- time: causal over bidirectional (`sliced_relu_causal` / `sliced_relu`, `sliced_relu_bump_causal` /
  `sliced_relu_bump`, and the same with `_sorted`): what causality costs;
- time: packed rows over one sequence of the same T (`sliced_relu_rows` / `sliced_relu_sorted`, ...):
  what a slot costs on packed rows, against the sorted path the rows op replaces.

A ratio is printed for every sequence length and mode where both cells were measured (status ok).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# (numerator backend, denominator backend, Cell field, what the ratio says)
RATIOS: list[tuple[str, str, str, str]] = [
    ("sliced_relu_concat", "sliced_relu", "peak_mem_mb", "memory official / sliced_relu"),
    ("sliced_relu_causal", "sliced_relu", "time_ms", "time sliced_relu causal / bidir"),
    ("sliced_relu_bump_causal", "sliced_relu_bump", "time_ms", "time sliced_relu_bump causal / bidir"),
    ("sliced_relu_causal_sorted", "sliced_relu_sorted", "time_ms", "time sliced_relu_sorted causal / bidir"),
    (
        "sliced_relu_bump_causal_sorted",
        "sliced_relu_bump_sorted",
        "time_ms",
        "time sliced_relu_bump_sorted causal / bidir",
    ),
    *(
        (f"{name}_rows", f"{name}_sorted", "time_ms", f"time {name} rows / sorted")
        for name in ("sliced_relu", "sliced_relu_bump", "sliced_relu_causal", "sliced_relu_bump_causal")
    ),
]


def ratio_lines(cells: Iterable) -> list[str]:
    """The printed ratio table (header first), empty when no pair of cells was measured."""
    measured = {(c.backend, c.mode, c.seq_len): c for c in cells if c.status == "ok"}
    lines = []
    for top, bottom, field, label in RATIOS:
        for (backend, mode, length), cell in measured.items():
            other = measured.get((bottom, mode, length))
            if backend != top or other is None:
                continue
            num, den = getattr(cell, field), getattr(other, field)
            if not (den > 0 and math.isfinite(num) and math.isfinite(den)):
                continue
            lines.append(f"{label:<44} {mode:<7} {length:>7} {num / den:>8.2f}x")
    if not lines:
        return []
    return [f"{'ratio (same run, T and mode)':<44} {'mode':<7} {'T':>7} {'ratio':>9}", *lines]
