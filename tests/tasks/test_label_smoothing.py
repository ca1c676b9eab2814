"""`label_smoothing_rule`: PyTorch's spread (true class 1 − eps + eps/n) and PCT's `cal_loss`
(true class 1 − eps, others eps/(n − 1)), each against its targets written out in float64."""

from __future__ import annotations

import pytest
import torch

from attnlab.errors import ConfigError
from attnlab.tasks.classification import ClassificationTask, smoothed_cross_entropy


def _by_hand(logits, labels, true_weight, other_weight):
    target = torch.full_like(logits, other_weight)
    target[torch.arange(len(labels)), labels] = true_weight
    return -(target * logits.log_softmax(-1)).sum(-1).mean()


def test_pct_and_torch_rules_against_their_targets():
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 40, dtype=torch.float64), torch.randint(0, 40, (6,))
    pct = smoothed_cross_entropy(logits, labels, 0.2, "pct")
    ours = smoothed_cross_entropy(logits, labels, 0.2, "torch")
    torch.testing.assert_close(pct.double(), _by_hand(logits, labels, 0.8, 0.2 / 39), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.double(), _by_hand(logits, labels, 0.805, 0.005), rtol=1e-6, atol=1e-6)
    assert abs(pct.item() - ours.item()) > 1e-4  # the two rules differ
    plain = torch.nn.functional.cross_entropy(logits.float(), labels)
    torch.testing.assert_close(smoothed_cross_entropy(logits, labels, 0.0, "pct"), plain)


def test_the_modelnet40_task_uses_pcts_rule(train_config):
    assert train_config("task=modelnet40").task.module.label_smoothing_rule == "pct"
    with pytest.raises(ConfigError, match=r"label_smoothing_rule='dgcnn': expected one of torch, pct"):
        ClassificationTask(torch.nn.Identity(), 3, optimizer=None, label_smoothing_rule="dgcnn")
