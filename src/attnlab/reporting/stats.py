"""Mean, sample standard deviation and median over seeds: the one statistic every table and plot shows."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stat:
    """Mean, sample standard deviation (0 when n == 1) and median of n values."""

    mean: float
    std: float
    n: int
    median: float | None = None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat | None:
        """None when no value is present: nulls are ignored (a run that did not report the field)."""
        present = [float(v) for v in values if v is not None]
        if not present:
            return None
        std = statistics.stdev(present) if len(present) > 1 else 0.0
        return cls(statistics.fmean(present), std, len(present), statistics.median(present))
