"""ClassificationTask: label smoothing applies to the training loss only."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from attnlab.errors import ConfigError
from attnlab.tasks.classification import ClassificationTask


class _Fixed(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, mask=None):
        return self.logits


def test_label_smoothing_smooths_the_training_loss_only():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0]])
    labels = torch.tensor([0, 1])
    task = ClassificationTask(_Fixed(logits), 3, partial(torch.optim.SGD, lr=0.1), label_smoothing=0.2)
    task.log = lambda *a, **k: None
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels}
    assert task._step(batch, "train") == pytest.approx(F.cross_entropy(logits, labels, label_smoothing=0.2))
    assert task._step(batch, "val") == pytest.approx(F.cross_entropy(logits, labels))
    with pytest.raises(ConfigError, match=r"task.module.label_smoothing=1.0 must be in \[0, 1\)"):
        ClassificationTask(_Fixed(logits), 3, None, label_smoothing=1.0)
