"""``last.ckpt`` that is really the last state: after every validation, every N steps and at the end.

Lightning's ``ModelCheckpoint(save_last=True)`` refreshes ``last.ckpt`` only when it also saves a
top-k checkpoint, so a run whose accuracy stopped improving would resume from a stale step. This
callback keeps the best/periodic checkpoints to ModelCheckpoint and owns ``last.ckpt`` alone.
Writes go through ``trainer.save_checkpoint``, whose file IO is atomic (temporary file, then
rename), so a kill during a write leaves the previous ``last.ckpt`` intact.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L


class LastCheckpoint(L.Callback):
    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 100, filename: str = "last.ckpt"):
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0 (0 = only at validation and the end), "
                             f"got {every_n_train_steps}")
        self.path = Path(dirpath) / filename
        self.every_n_train_steps = every_n_train_steps
        self._saved_step = -1

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.global_step == self._saved_step:
            return
        trainer.save_checkpoint(self.path)
        self._saved_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0:
            self._save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer)
