"""A run's wall time across attempts: `AttemptClock`.

A run interrupted and resumed (``ckpt_path=...``, ``auto``, a SLURM requeue) is one run, but a fresh
process knows only its own clock. `AttemptClock` carries the wall time of the earlier attempts and
their count in every checkpoint, so ``summary.json`` reports the run's whole ``wall_time_s`` and its
``attempts``. Time an attempt spent after its last checkpoint is lost work and is not counted (the
metric rows of every attempt: `attnlab.run.csv_history`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


class AttemptClock(L.Callback):
    """Wall time and number of attempts of a run, carried in each checkpoint."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.time() if started is None else started  # when this attempt's process began
        self.earlier_wall_time_s = 0.0  # of the attempts before this one, up to their last checkpoint
        self.attempt = 1

    def wall_time_s(self) -> float:
        return self.earlier_wall_time_s + (time.time() - self.started)

    def state_dict(self) -> dict[str, Any]:
        return {"wall_time_s": self.wall_time_s(), "attempt": self.attempt}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.earlier_wall_time_s = float(state_dict["wall_time_s"])
        self.attempt = int(state_dict["attempt"]) + 1
        log.info(
            "attempt %d of this run (%.0f s of wall time before it)", self.attempt, self.earlier_wall_time_s
        )
