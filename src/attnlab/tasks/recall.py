"""The LightningModule of per-position tasks (MQAR): loss and accuracy only where a label is given.

The model maps ``input_ids`` ``(B, T)`` to logits ``(B, T, V)``; ``labels`` ``(B, T)`` hold the target
token at the positions that count (MQAR's query positions) and `IGNORE_INDEX` elsewhere, so
``train/acc``, ``val/acc`` and ``test/acc`` are recall accuracies, not diluted by unscored positions.
Optimizer, scheduler and weight-decay groups are the classification task's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.data.mqar import IGNORE_INDEX
from attnlab.tasks.classification import ClassificationTask


class RecallTask(ClassificationTask):
    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        num_classes: int | None = None,
        weight_decay_exclude_norm_bias: bool = True,
    ):
        """``num_classes`` defaults to the model's ``vocab_size`` (the data decides it, not the config)."""
        if num_classes is None:
            num_classes = getattr(model, "vocab_size", None)
            if num_classes is None:
                raise ValueError("RecallTask needs num_classes, or a model with a vocab_size attribute")
        super().__init__(model, num_classes, optimizer, scheduler, weight_decay_exclude_norm_bias)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch)
        labels = batch["labels"]
        if logits.shape[:2] != labels.shape:
            raise ValueError(
                f"per-position labels {tuple(labels.shape)} do not match the logits {tuple(logits.shape)}"
            )
        scored = labels != IGNORE_INDEX
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        self._log_step(stage, loss, logits[scored], labels[scored], batch_size=labels.shape[0])
        return loss
