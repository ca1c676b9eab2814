"""A run's metric rows across attempts: `HistoryCSVLogger`, the logger ``logger=csv`` builds.

A run interrupted and resumed (``ckpt_path=...``, ``auto``, a SLURM requeue) is one run, but
Lightning's ``CSVLogger`` deletes ``metrics.csv`` when its folder exists. `HistoryCSVLogger` writes its
rows to disk as they come (Lightning's buffers 100 steps, lost in a kill), keeps the earlier attempts'
rows up to the step the run resumes from (rows logged after that checkpoint are logged again by the
resumed attempt) and appends the new ones (the wall time of every attempt: `attnlab.run.attempt_clock`).
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger

log = logging.getLogger(__name__)


class HistoryCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` survives a resume: see the module docstring.

    The pipeline calls `resume_from_step` with the checkpoint's step before anything is logged;
    without that call (a fresh run) an old file is replaced, as Lightning does.
    """

    def __init__(self, *args: Any, flush_logs_every_n_steps: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, flush_logs_every_n_steps=flush_logs_every_n_steps, **kwargs)
        self._earlier_rows: list[dict[str, str]] = []
        self._earlier_keys: list[str] = []
        path = Path(self.log_dir) / "metrics.csv"
        if path.is_file():  # read now: Lightning deletes it when the writer is created
            with path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                self._earlier_rows, self._earlier_keys = list(reader), list(reader.fieldnames or [])
        self._resume_step: int | None = None

    def resume_from_step(self, step: int) -> None:
        """Keep the earlier attempts' rows of the ``step`` optimizer steps the checkpoint holds.

        Lightning logs a row with the number of steps taken *before* its batch (and a validation
        after N steps at N - 1): rows of steps < N are the checkpoint's, the rest is redone.
        """
        self._resume_step = step

    @property
    def experiment(self):
        created = self._experiment is None
        writer = super().experiment
        if created and self._resume_step is not None and self._earlier_rows:
            kept = [row for row in self._earlier_rows if _row_step(row) < self._resume_step]
            with open(writer.metrics_file_path, "w", newline="") as handle:
                out = csv.DictWriter(handle, fieldnames=self._earlier_keys)
                out.writeheader()
                out.writerows(kept)
            writer.metrics_keys = list(self._earlier_keys)
            log.info(
                "csv: kept %d metric rows of earlier attempts (the %d steps resumed from) in %s",
                len(kept),
                self._resume_step,
                writer.metrics_file_path,
            )
        return writer


def _row_step(row: dict[str, str]) -> int:
    try:
        return int(float(row.get("step") or 0))
    except ValueError:
        return 0
