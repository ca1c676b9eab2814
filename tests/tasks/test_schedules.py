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


def test_rsqrt_hand_computed():
    """Linear warm-up, then sqrt(warmup / step): LRA's `linear_warmup * rsqrt_decay`, normalised to 1."""
    f = lambda s: warmup_decay_factor(s, warmup_steps=4, total_steps=10, decay="rsqrt")  # noqa: E731
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(math.sqrt(4 / 5))
    assert f(15) == pytest.approx(0.5)  # the 16th step: sqrt(4 / 16)
    assert f(99) == pytest.approx(0.2)  # past total_steps it keeps decaying: rsqrt has no end
    g = lambda s: warmup_decay_factor(s, 4, 10, decay="rsqrt", min_lr_ratio=0.1)  # noqa: E731
    assert g(99) == pytest.approx(0.1 + 0.9 * 0.2)


def test_rsqrt_equals_lra_schedule_with_peak_lr_base_over_sqrt_warmup():
    """LRA: lr(t) = 0.05 · min(1, t/W) / sqrt(max(t, W)); our step s is their t = s + 1."""
    base, warmup = 0.05, 1000
    peak = base / math.sqrt(warmup)
    for s in (0, 499, 999, 1000, 2500, 4999):
        t = s + 1
        lra = base * min(1.0, t / warmup) / math.sqrt(max(t, warmup))
        assert peak * warmup_decay_factor(s, warmup, 5000, decay="rsqrt") == pytest.approx(lra, rel=1e-12)


def test_rsqrt_needs_a_warmup():
    with pytest.raises(ValueError, match="decay='rsqrt' needs warmup_steps >= 1, got 0"):
        warmup_decay_factor(3, 0, 10, decay="rsqrt")
