"""The classification LightningModule: cross-entropy, accuracy, AdamW + warm-up/decay.

The model is any ``nn.Module`` taking the batch's ``input_ids``/``mask`` (and ``input_ids2``/``mask2``
for two-sequence tasks) and returning logits; the optimizer and scheduler arrive as partials from
config, so nothing here knows which task or attention backend it trains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from attnlab.attention import PackedLayout
from attnlab.errors import ConfigError

MODEL_INPUTS = ("input_ids", "mask", "input_ids2", "mask2")
SMOOTHING_RULES = ("torch", "pct")


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, eps: float, rule: str) -> torch.Tensor:
    """Cross-entropy against smoothed targets, in float32. ``rule="torch"`` is PyTorch's (and timm's):
    the true class gets 1 − eps + eps/n, every class eps/n (0.805 at eps 0.2 over 40 classes).
    ``"pct"`` is PCT's ``cal_loss`` (and DGCNN's): the true class 1 − eps, each other eps/(n − 1) (0.8)."""
    logits = logits.float()
    if rule == "torch" or eps == 0.0:
        return F.cross_entropy(logits, labels, label_smoothing=eps)
    n = logits.shape[-1]
    target = torch.full_like(logits, eps / (n - 1)).scatter_(-1, labels[:, None], 1.0 - eps)
    return -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()


class ClassificationTask(L.LightningModule):
    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        weight_decay_exclude_norm_bias: bool = True,
        inputs: Sequence[str] | None = None,
        mean_class_acc: bool = False,
        label_smoothing: float = 0.0,
        label_smoothing_rule: str = "torch",
    ):
        """``inputs``: the batch keys passed to the model (default `MODEL_INPUTS`, those present);
        ``mean_class_acc``: also log ``val/mean_class_acc`` and ``test/mean_class_acc`` (the mean of
        per-class accuracies, ModelNet's usual second metric); ``label_smoothing``: of the training
        loss only (PCT uses 0.2), so val/test losses stay comparable across settings;
        ``label_smoothing_rule``: how eps is spread, ``torch`` or ``pct`` (`smoothed_cross_entropy`)."""
        super().__init__()
        if not 0.0 <= label_smoothing < 1.0:
            raise ConfigError(f"task.module.label_smoothing={label_smoothing!r} must be in [0, 1)")
        if label_smoothing_rule not in SMOOTHING_RULES:
            raise ConfigError(
                f"task.module.label_smoothing_rule={label_smoothing_rule!r}: expected one of "
                f"{', '.join(SMOOTHING_RULES)}"
            )
        self.label_smoothing = label_smoothing
        self.label_smoothing_rule = label_smoothing_rule
        self.model = model
        self.inputs = tuple(inputs) if inputs is not None else MODEL_INPUTS
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.exclude_norm_bias = weight_decay_exclude_norm_bias
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_acc": MulticlassAccuracy(num_classes, average="micro")
                for stage in ("train", "val", "test")
            }
        )
        if mean_class_acc:
            for stage in ("val", "test"):
                self.metrics[f"{stage}_mean_class_acc"] = MulticlassAccuracy(num_classes, average="macro")

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: batch[k] for k in self.inputs if k in batch}
        for suffix in ("", "2"):  # a packed batch (task.data.packing): its layout is its mask
            layout = PackedLayout.from_batch(batch, suffix)
            if layout is not None:
                inputs.pop("mask" + suffix, None)
                inputs["packing" + suffix] = layout
        return self.model(**inputs)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch)
        smoothing = self.label_smoothing if stage == "train" else 0.0
        loss = smoothed_cross_entropy(logits, batch["labels"], smoothing, self.label_smoothing_rule)
        self._log_step(stage, loss, logits, batch["labels"])
        return loss

    def _log_step(
        self,
        stage: str,
        loss: torch.Tensor,
        logits: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int | None = None,
    ) -> None:
        """The loss and every metric this task has for ``stage`` (acc, and top5 or mean_class_acc where
        built): training per step, evaluation per epoch, one name each (train/loss, val/acc, ...)."""
        train = stage == "train"
        size = labels.shape[0] if batch_size is None else batch_size
        self.log(
            f"{stage}/loss",
            loss,
            on_step=train,
            on_epoch=not train,
            prog_bar=True,
            batch_size=size,
            sync_dist=not train,
        )
        for name in ("acc", "top5", "mean_class_acc"):
            key = f"{stage}_{name}"
            if key not in self.metrics:
                continue
            metric = self.metrics[key]
            metric(logits.detach(), labels)
            self.log(
                f"{stage}/{name}",
                metric,
                on_step=train,
                on_epoch=not train,
                prog_bar=name == "acc",
                batch_size=size,
            )

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")

    def _param_groups(self) -> list[dict]:
        """No weight decay on biases and norm weights (the 1-D parameters), the usual AdamW rule, nor on
        what the model names in ``no_weight_decay()`` (timm's ViT: positions, class token)."""
        if not self.exclude_norm_bias:
            return [{"params": [p for p in self.parameters() if p.requires_grad]}]
        skip = getattr(self.model, "no_weight_decay", set)()
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or name.removeprefix("model.") in skip else decay).append(p)
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self._param_groups())
        if self.scheduler_factory is None:
            return optimizer
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = self.scheduler_factory(optimizer, total_steps=total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
