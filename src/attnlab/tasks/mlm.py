"""The masked-LM LightningModule: cross-entropy on the masked tokens only, accuracy, perplexity.

Batches arrive masked (`attnlab.data.text_corpus.MLMDataModule`): ``labels`` holds the original id where
a token is predicted and -100 elsewhere. Evaluation averages over *tokens*, not batches, so ``val/loss``
and ``test/loss`` are the mean cross-entropy (nats) of every masked token of the split, and
``test/perplexity`` = exp(test/loss) (``perplexity`` in the issue; ``test_perplexity`` in summary.json).

Each checkpoint also carries ``attnlab_mlm``: the model's shape and the tokenizer's vocabulary and merges
(plain strings: the file still loads with ``weights_only``), so a GLUE fine-tune rebuilds both from it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.aggregation import MeanMetric

from attnlab.attention import PackedLayout
from attnlab.data.pretrained import CHECKPOINT_KEY  # what a GLUE fine-tune reads back
from attnlab.tasks.language import LanguageModelTask


class MaskedLMTask(LanguageModelTask):
    def __init__(self, *args, **kwargs):
        """The arguments of `LanguageModelTask` (model, optimizer, scheduler, weight decay rule)."""
        super().__init__(*args, **kwargs)
        self.eval_metrics = nn.ModuleDict(
            {f"{stage}_{name}": MeanMetric() for stage in ("val", "test") for name in ("loss", "acc")}
        )

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(mean CE, accuracy, number) over the batch's masked tokens."""
        targets = batch["labels"]
        positions = targets != -100
        layout = PackedLayout.from_batch(batch)  # task.data.packing: each document attends within itself
        mask = batch["mask"] if layout is None else None
        logits = self.model(batch["input_ids"], mask, positions=positions, packing=layout).float()
        picked = targets[positions]
        count = int(picked.numel())
        loss = F.cross_entropy(logits, picked, reduction="sum") / max(count, 1)  # no NaN on a mask-free batch
        acc = (logits.argmax(-1) == picked).float().sum() / max(count, 1)
        return loss, acc, count

    def training_step(self, batch, batch_idx):
        loss, acc, _ = self._losses(batch)
        size = batch["labels"].shape[0]
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=size)
        self.log("train/acc", acc, on_step=True, on_epoch=False, prog_bar=True, batch_size=size)
        return loss

    def _eval_step(self, batch, stage: str) -> None:
        loss, acc, count = self._losses(batch)
        if count:
            self.eval_metrics[f"{stage}_loss"].update(loss.detach(), count)  # token-weighted means
            self.eval_metrics[f"{stage}_acc"].update(acc.detach(), count)

    def _eval_epoch_end(self, stage: str) -> None:
        loss_metric, acc_metric = self.eval_metrics[f"{stage}_loss"], self.eval_metrics[f"{stage}_acc"]
        if loss_metric.update_count == 0:
            return
        loss, acc = loss_metric.compute(), acc_metric.compute()  # reduced over ranks by torchmetrics
        self.log(f"{stage}/loss", loss, prog_bar=True)
        self.log(f"{stage}/acc", acc, prog_bar=True)
        self.log(f"{stage}/perplexity", torch.exp(loss.clamp(max=math.log(1e30))))
        loss_metric.reset()
        acc_metric.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "model": dict(getattr(self.model, "config", {})),
            "tokenizer": self._tokenizer_files(),
        }
