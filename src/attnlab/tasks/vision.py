"""Image classification with the timm recipe: Mixup/CutMix, label smoothing, EMA, top-1 and top-5.

Training follows timm's train script (and CCT/ViT-Lite on CIFAR): timm's `Mixup` mixes each batch by
mixup or cutmix (``switch_prob`` picks between them) and smooths the labels; the loss is timm's
`SoftTargetCrossEntropy` on those soft targets, or cross-entropy with ``label_smoothing`` when mixup is
off. ``train/acc`` is measured against the dominant class of each mixed target. Evaluation is plain
cross-entropy and accuracy (``val/acc``, ``test/acc``; ``val/top5``, ``test/top5`` with ``top5``). With
``ema_decay``, timm's `ModelEmaV3` keeps an exponential moving average of the weights, and validation
and test use it (the average is saved in every checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from attnlab.errors import ConfigError
from attnlab.tasks.classification import ClassificationTask

MIXUP_KEYS = ("mixup_alpha", "cutmix_alpha", "cutmix_minmax", "prob", "switch_prob", "mode", "correct_lam")


class ImageClassificationTask(ClassificationTask):
    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        mixup: Mapping | None = None,
        label_smoothing: float = 0.0,
        top5: bool = False,
        ema_decay: float | None = None,
        weight_decay_exclude_norm_bias: bool = True,
    ):
        super().__init__(
            model,
            num_classes,
            optimizer,
            scheduler,
            weight_decay_exclude_norm_bias,
            label_smoothing=label_smoothing,
        )  # checks and keeps label_smoothing
        self.mixup = None
        if mixup is not None:
            unknown = sorted(set(mixup) - set(MIXUP_KEYS))
            if unknown:
                raise ConfigError(
                    f"unknown task.module.mixup key(s) {', '.join(unknown)}; accepted: "
                    f"{', '.join(MIXUP_KEYS)} (label smoothing is task.module.label_smoothing)"
                )
            self.mixup = Mixup(**dict(mixup), label_smoothing=label_smoothing, num_classes=num_classes)
        self.soft_loss = SoftTargetCrossEntropy()
        if top5:
            for stage in ("val", "test"):
                self.metrics[f"{stage}_top5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro")
        self.ema = None
        if ema_decay is not None:
            if not 0.0 < ema_decay < 1.0:
                raise ConfigError(
                    f"task.module.ema_decay={ema_decay!r} must be in (0, 1), or null for no EMA"
                )
            self.ema = ModelEmaV3(model, decay=ema_decay)
            self.ema.requires_grad_(False)  # updated by averaging, never by the optimizer
        # throughput counts tokens as images x patches (attnlab.callbacks.throughput)
        patch_embed = getattr(model, "patch_embed", None)
        self.tokens_per_sample = getattr(patch_embed, "num_patches", None)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["images"])

    def training_step(self, batch, batch_idx):
        images, labels = batch["images"], batch["labels"]
        if self.mixup is not None:
            if len(labels) % 2:
                raise ConfigError(
                    f"mixup pairs the images of a batch: task.data.batch_size must be even, got {len(labels)}"
                )
            images, targets = self.mixup(images, labels)
            logits = self.model(images)
            loss = self.soft_loss(logits.float(), targets)
            labels = targets.argmax(dim=-1)  # the dominant class of each mixed image
        else:
            logits = self.model(images)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        self._log_step("train", loss, logits, labels)
        return loss

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        """The optimizer step, then the EMA update of that step.

        Here rather than in ``on_train_batch_end``: Lightning calls the callbacks' ``on_train_batch_end``
        (``last.ckpt``, the requeue and interrupt checkpoints) before the module's, so an EMA updated
        there would be saved one update behind and every resume would lose that update. Called once per
        optimizer step (after the accumulated batches), with ``global_step`` already counting it.
        """
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.ema is not None:
            self.ema.update(self.model, step=self.global_step)

    def _evaluate(self, batch, stage: str) -> None:
        model = self.ema.module if self.ema is not None else self.model
        logits = model(batch["images"])
        self._log_step(stage, F.cross_entropy(logits.float(), batch["labels"]), logits, batch["labels"])

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")
