"""GLUE fine-tuning: a `task=mlm` checkpoint's encoder under a fresh head, scored by GLUE's metrics.

The checkpoint (``task.pretrained``) is read by `attnlab.data.pretrained.read_pretrained`; it
carries the model's shape and the tokenizer as plain values (``attnlab_mlm``, `attnlab.tasks.mlm`), so
the fine-tuned model is built with the pretrained shape and reads text exactly as pretraining did.

Metrics (torchmetrics, over the whole split): accuracy for every classification task, with CoLA's
Matthews correlation and MRPC's and QQP's F1 (of the positive class: equivalent, duplicate) beside it,
where GLUE defines them; STS-B Pearson and Spearman; MNLI's test split is both dev sets, logged as
``<name>`` (matched) and ``<name>_mismatched``. ``val/acc`` and ``test/acc`` are each task's main
metric, the one the best checkpoint is chosen by: the sliced ReLU paper's Table 4 metric, Spearman
for STS-B and accuracy for its other tasks (matched accuracy for MNLI); CoLA, which Table 4 does not
list, takes accuracy too (ours; its Matthews correlation is logged beside it).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryF1Score, MatthewsCorrCoef, MulticlassAccuracy
from torchmetrics.regression import PearsonCorrCoef, SpearmanCorrCoef

from attnlab.attention import PackedLayout
from attnlab.data.glue import glue_spec
from attnlab.data.pretrained import Pretrained, read_pretrained
from attnlab.errors import CheckpointError, ConfigError
from attnlab.tasks.classification import ClassificationTask

MAIN_METRIC = {"stsb": "spearman"}  # every other task: accuracy, as Table 4 (CoLA: ours)


def _metrics(glue_task: str) -> nn.ModuleDict:
    spec = glue_spec(glue_task)
    if spec.labels is None:
        return nn.ModuleDict({"pearson": PearsonCorrCoef(), "spearman": SpearmanCorrCoef()})
    metrics = {"accuracy": MulticlassAccuracy(len(spec.labels), average="micro")}
    if glue_task == "cola":
        metrics["mcc"] = MatthewsCorrCoef(task="binary")
    if glue_task in ("mrpc", "qqp"):
        metrics["f1"] = BinaryF1Score()
    return nn.ModuleDict(metrics)


class GlueTask(L.LightningModule):
    """Fine-tunes ``model`` (a `SentenceClassifier`) on one GLUE task from the ``pretrained`` encoder."""

    def __init__(
        self,
        model: nn.Module,
        glue_task: str,
        pretrained: str | None,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        weight_decay_exclude_norm_bias: bool = True,
    ):
        super().__init__()
        self.spec = glue_spec(glue_task)
        self.model = model
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.exclude_norm_bias = weight_decay_exclude_norm_bias
        self.regression = self.spec.labels is None
        self.main = MAIN_METRIC.get(glue_task, "accuracy")
        subsets = {"val": 1, "test": len(self.spec.dev)}
        self.metrics = nn.ModuleDict(
            {f"{stage}_{i}": _metrics(glue_task) for stage, n in subsets.items() for i in range(n)}
        )
        self.losses = nn.ModuleDict({stage: MeanMetric() for stage in subsets})
        if pretrained is not None:
            self.load_pretrained(read_pretrained(pretrained))

    def load_pretrained(self, pretrained: Pretrained) -> None:
        """The checkpoint's encoder weights into ``model.backbone``; the attention must be the same kind."""
        mine = getattr(self.model, "config", {}).get("attention")
        theirs = pretrained.shape.get("attention")
        if mine != theirs:
            raise ConfigError(
                f"attn: the model uses {mine} but task.pretrained {pretrained.path} was pretrained with "
                f"{theirs}; choose the attn= of the pretraining run"
            )
        try:
            self.model.backbone.load_state_dict(pretrained.backbone(), strict=True)
        except RuntimeError as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(
                f"task.pretrained {pretrained.path}: its encoder weights do not fit the model ({first})"
            ) from err

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        layout = PackedLayout.from_batch(batch)  # a packed batch (task.data.packing): its layout is its mask
        if layout is not None:
            return self.model(batch["input_ids"], packing=layout)
        return self.model(batch["input_ids"], batch["mask"])

    def _loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.regression:
            return F.mse_loss(outputs.float().squeeze(-1), labels.float())
        return F.cross_entropy(outputs.float(), labels)

    def _predictions(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs.float().squeeze(-1) if self.regression else outputs.argmax(-1)

    def training_step(self, batch, batch_idx):
        loss = self._loss(self(batch), batch["labels"])
        self.log(
            "train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=len(batch["labels"])
        )
        return loss

    def _eval_step(self, batch, stage: str) -> None:
        outputs = self(batch)
        labels = batch["labels"]
        self.losses[stage].update(self._loss(outputs, labels).detach(), len(labels))
        predictions = self._predictions(outputs)
        for subset in batch["subset"].unique().tolist():
            chosen = batch["subset"] == subset
            for metric in self.metrics[f"{stage}_{subset}"].values():
                metric.update(predictions[chosen], labels[chosen])

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def _eval_epoch_end(self, stage: str) -> None:
        if self.losses[stage].update_count == 0:
            return
        self.log(f"{stage}/loss", self.losses[stage].compute())
        self.losses[stage].reset()
        subsets = sorted(k for k in self.metrics if k.startswith(f"{stage}_"))
        for key in subsets:
            suffix = "" if key.endswith("_0") else "_mismatched"
            for name, metric in self.metrics[key].items():
                if metric.update_count == 0:
                    continue
                value = metric.compute().float()
                # a constant prediction has no correlation: torchmetrics gives NaN, which counts as 0 here
                value = torch.nan_to_num(value, nan=0.0)
                self.log(f"{stage}/{name}{suffix}", value)
                if name == self.main and not suffix:
                    self.log(f"{stage}/acc", value, prog_bar=True)
                metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    _param_groups = ClassificationTask._param_groups
    configure_optimizers = ClassificationTask.configure_optimizers


def main_metric(glue_task: str) -> str:
    """The name of ``glue_task``'s main metric (what ``val/acc`` and ``test/acc`` hold)."""
    return MAIN_METRIC.get(glue_spec(glue_task).name, "accuracy")
