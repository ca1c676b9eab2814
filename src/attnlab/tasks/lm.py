"""The causal language-model LightningModule: next-token cross-entropy, perplexity per token and per byte.

Batches come from `attnlab.data.lm.LMDataModule`: ``labels`` are the next ids (-100 at pads). Evaluation
sums over *tokens*, not batches: ``val/loss`` and ``test/loss`` are the mean cross-entropy (nats) of every
target of the split, ``*/perplexity`` = exp(loss), ``*/bits_per_byte`` the total in bits over the UTF-8
bytes those targets spell (`attnlab.data.lm.token_bytes`) and ``*/byte_perplexity`` = 2^bits_per_byte;
``*/acc`` is next-token accuracy. summary.json gets them as ``test_loss``, ``test_perplexity``, ... beside
the unigram baseline (``baseline_loss``, ...), and the throughput callback's tokens/s.

Each checkpoint carries ``attnlab_lm``: the tokenizer's vocabulary and merges as plain strings (the file
still loads with ``weights_only``), so ``attnlab generate`` decodes with the tokenizer the model learned.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.aggregation import SumMetric

from attnlab.attention import PackedLayout
from attnlab.data.lm import IGNORE_INDEX
from attnlab.tasks.language import LanguageModelTask

CHECKPOINT_KEY = "attnlab_lm"
_SUMS = ("nats", "tokens", "bytes", "correct")


class CausalLMTask(LanguageModelTask):
    def __init__(self, *args, **kwargs):
        """The arguments of `LanguageModelTask` (model, optimizer, scheduler, weight decay rule)."""
        super().__init__(*args, **kwargs)
        self.sums = nn.ModuleDict(
            {f"{stage}_{name}": SumMetric() for stage in ("val", "test") for name in _SUMS}
        )
        self.token_bytes: torch.Tensor | None = None  # from the datamodule at setup

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        sizes = getattr(datamodule, "token_bytes", None)
        self.token_bytes = sizes.to(self.device) if sizes is not None else None

    def _scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-position cross-entropy (B·T) in nats, the targets, and which positions are scored."""
        layout = PackedLayout.from_batch(batch)  # task.data.packing: each document attends within itself
        logits = self.model(batch["input_ids"], batch.get("mask"), packing=layout).float()
        targets = batch["labels"].flatten()
        nats = F.cross_entropy(logits.flatten(0, 1), targets, ignore_index=IGNORE_INDEX, reduction="none")
        return nats, logits.flatten(0, 1), targets

    def training_step(self, batch, batch_idx):
        nats, logits, targets = self._scores(batch)
        scored = targets != IGNORE_INDEX
        count = scored.sum().clamp_min(1)
        loss = nats.sum() / count
        acc = (logits.argmax(-1)[scored] == targets[scored]).float().sum() / count
        size = batch["labels"].shape[0]
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=size)
        self.log("train/acc", acc, on_step=True, on_epoch=False, batch_size=size)
        return loss

    def _eval_step(self, batch, stage: str) -> None:
        nats, logits, targets = self._scores(batch)
        scored = targets != IGNORE_INDEX
        picked = targets[scored]
        nbytes = self.token_bytes[picked].sum() if self.token_bytes is not None else torch.zeros(())
        values = {
            "nats": nats[scored].sum(),
            "tokens": scored.sum(),
            "bytes": nbytes,
            "correct": (logits.argmax(-1)[scored] == picked).sum(),
        }
        for name, value in values.items():
            self.sums[f"{stage}_{name}"].update(value.detach().double())

    def _eval_epoch_end(self, stage: str) -> None:
        metrics = {name: self.sums[f"{stage}_{name}"] for name in _SUMS}
        if metrics["tokens"].update_count == 0:
            return
        total = {name: metric.compute() for name, metric in metrics.items()}  # summed over ranks
        tokens = total["tokens"].clamp_min(1)
        loss = total["nats"] / tokens
        cap = math.log(1e30)  # an untrained model's exp() stays finite in the logs
        self.log(f"{stage}/loss", loss.float(), prog_bar=True)
        self.log(f"{stage}/acc", (total["correct"] / tokens).float(), prog_bar=True)
        self.log(f"{stage}/perplexity", torch.exp(loss.clamp(max=cap)).float())
        if total["bytes"] > 0:
            bits = total["nats"] / total["bytes"] / math.log(2.0)
            self.log(f"{stage}/bits_per_byte", bits.float())
            self.log(f"{stage}/byte_perplexity", torch.exp2(bits.clamp(max=cap / math.log(2.0))).float())
        for metric in metrics.values():
            metric.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = {"tokenizer": self._tokenizer_files()}
