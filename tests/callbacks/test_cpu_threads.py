"""The thread governor ticks at every batch of a real fit and lowers torch's thread count under load."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import attnlab.callbacks.threads as cpu_threads
from attnlab.threads import ThreadGovernor, ThreadSettings


class BusyMachine(ThreadGovernor):
    """A governor on a fake machine whose two CPUs other processes keep busy; a second passes per tick."""

    ticks = 0

    def __init__(self, cap, set_threads, interval_s):
        self.now, self.others = 0.0, 0.0
        super().__init__(
            cap, set_threads, interval_s, cpus={0, 1},
            clock=lambda: self.now, total_busy=lambda: self.others, own_busy=lambda: 0.0,
        )  # fmt: skip

    def tick(self):
        BusyMachine.ticks += 1
        self.now += 1.0
        self.others += 2.0
        return super().tick()


def test_the_governor_ticks_every_training_batch_of_a_fit(monkeypatch, tmp_path):
    settings = ThreadSettings(
        cap=2, wait="GOMP_SPINCOUNT=10000", chosen_by={"threads": "attnlab", "wait": "attnlab"}
    )
    monkeypatch.setattr(cpu_threads, "applied", lambda: settings)
    monkeypatch.setattr(cpu_threads, "ThreadGovernor", BusyMachine)
    BusyMachine.ticks = 0
    torch.set_num_threads(2)
    callback = cpu_threads.CpuThreads(interval_s=1.0)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=5, limit_val_batches=0, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert isinstance(callback.governor, BusyMachine)
    assert BusyMachine.ticks == 5  # once per training batch
    assert torch.get_num_threads() == 1  # both CPUs taken by others: down to one thread
    assert callback.governor.changes >= 1
