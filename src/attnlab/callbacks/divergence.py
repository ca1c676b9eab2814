"""A run whose training loss stops being finite ends there, and its summary says so.

A learning rate of 1e10 used to make the loss NaN and the run still wrote a summary with an accuracy
(chance, from weights of NaN) that ``attnlab report`` averaged with real results. `StopOnDivergence`
raises `TrainingDiverged` at the first non-finite loss, before any checkpoint of that step is written
(checkpoint callbacks run after the others), so ``last.ckpt`` keeps the last finite weights; the
pipeline marks the summary ``diverged`` and ``train.py`` prints one line naming the step.
``callbacks.divergence=null`` turns it off.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import Callback

from attnlab.errors import UserError


class TrainingDiverged(UserError):
    """The training loss became NaN or infinite; ``step`` is the training step that computed it."""

    def __init__(self, step: int, loss: float):
        self.step, self.loss = step, loss
        super().__init__(
            f"training diverged: the loss was {loss} at training step {step}; the run stopped there, its "
            f"summary.json is marked diverged (attnlab report leaves it out) and checkpoints/last.ckpt "
            f"keeps the weights saved before it. Lower task.module.optimizer.lr, or raise "
            f"task.module.scheduler.warmup_steps or clip gradients (trainer.gradient_clip_val)"
        )


class StopOnDivergence(Callback):
    """Stop at the first training step whose loss is not finite (on any rank)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.world_size > 1:  # every rank stops together, or the others would wait forever
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            value = float(loss.detach().float().reshape(-1)[0]) if loss.numel() else math.nan
            raise TrainingDiverged(trainer.global_step, value)
