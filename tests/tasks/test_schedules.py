import math

import pytest
import torch

from attnlab.tasks.schedules import warmup_decay, warmup_decay_factor


def test_warmup_then_cosine_to_floor():
    f = lambda s: warmup_decay_factor(s, warmup_steps=10, total_steps=110, decay="cosine", min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_linear_and_constant():
    assert warmup_decay_factor(55, 0, 100, "linear") == pytest.approx(0.45)
    assert warmup_decay_factor(55, 0, 100, "constant") == 1.0
    with pytest.raises(ValueError, match="decay='step'.*cosine, linear, constant"):
        warmup_decay_factor(1, 0, 10, "step")


def test_scheduler_drives_the_optimizer():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = warmup_decay(opt, total_steps=4, warmup_steps=2, decay="linear")
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 1.0])
