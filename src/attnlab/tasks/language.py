"""What the masked-LM and causal-LM LightningModules share: construction, optimizers, stage routing.

Both train a token model on `attnlab.data.corpus_blocks` batches, score val/test over whole splits in
``_eval_step`` / ``_eval_epoch_end(stage)``, and save the datamodule's tokenizer into each checkpoint.
`LanguageModelTask` holds the parts that do not differ; the optimizer and scheduler arrive as partials
from config and are built the way `ClassificationTask` builds them (no weight decay on biases, norm
weights and what the model names in ``no_weight_decay()``).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import nn

from attnlab.tasks.classification import ClassificationTask


class LanguageModelTask(L.LightningModule):
    """Subclasses implement ``training_step``, ``_eval_step(batch, stage)`` and ``_eval_epoch_end(stage)``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        weight_decay_exclude_norm_bias: bool = True,
    ):
        super().__init__()
        self.model = model
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.exclude_norm_bias = weight_decay_exclude_norm_bias

    def _eval_step(self, batch, stage: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _eval_step()")

    def _eval_epoch_end(self, stage: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _eval_epoch_end()")

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def _tokenizer_files(self) -> dict | None:
        """The attached datamodule's tokenizer as plain strings (`BPETokenizer.files`), for a checkpoint;
        None without a trainer, a datamodule or a tokenizer."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        tokenizer = getattr(datamodule, "tokenizer", None)
        return tokenizer.files() if tokenizer is not None else None

    _param_groups = ClassificationTask._param_groups
    configure_optimizers = ClassificationTask.configure_optimizers
