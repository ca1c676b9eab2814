"""Torch's CPU thread count follows the CPUs that other processes leave free (`attnlab.threads`)."""

from __future__ import annotations

import logging

import torch
from lightning.pytorch import Callback

from attnlab.threads import ThreadGovernor, applied

log = logging.getLogger(__name__)


class CpuThreads(Callback):
    """Ticks a `ThreadGovernor` at every batch of a CPU run; reports what it did at the end.

    Active only when an entry point applied attnlab's thread defaults with an adaptive count (not the
    user's ``OMP_NUM_THREADS``), on a CPU device, outside deterministic mode (a thread count that
    moves can change float sums in the last bit, and deterministic runs promise the same bits) and
    unless held (`hold`).
    """

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.governor: ThreadGovernor | None = None
        self._said_fixed = False  # setup runs for fit and again for test: say it once
        self._held: str | None = None

    def hold(self, reason: str) -> None:
        """Keep the thread count where it is for the whole run, for ``reason`` (said in the log)."""
        self._held = reason

    def setup(self, trainer, pl_module, stage: str) -> None:
        settings = applied()
        if self.governor is not None or settings is None or not settings.adaptive:
            return
        if trainer.strategy.root_device.type != "cpu":
            return
        held = "deterministic mode" if torch.are_deterministic_algorithms_enabled() else self._held
        if held is not None:
            if not self._said_fixed:
                log.info("CPU threads: fixed at %d (%s)", torch.get_num_threads(), held)
                self._said_fixed = True
            return
        self.governor = ThreadGovernor(settings.cap, torch.set_num_threads, self.interval_s)

    def _tick(self) -> None:
        if self.governor is not None:
            changed = self.governor.tick()
            if changed is not None:
                log.debug("CPU threads: now %d (other processes use the rest)", changed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._tick()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._tick()

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._tick()

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.governor is not None and trainer.is_global_zero:
            log.info(self.governor.report())
