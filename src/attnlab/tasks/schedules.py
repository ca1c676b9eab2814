"""Learning-rate schedules: linear warm-up followed by a decay, as a LambdaLR factor.

`rsqrt` is the official LRA schedule (`constant * linear_warmup * rsqrt_decay` in
lra_benchmarks/utils/train_utils.py): LRA multiplies a base rate by min(1, t/W) / sqrt(max(t, W)), which
peaks at base / sqrt(W); here the optimizer's lr is that peak and the factor is normalised to 1 there.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

DECAYS = ("cosine", "linear", "constant", "rsqrt")


def warmup_decay_factor(
    step: int, warmup_steps: int, total_steps: int, decay: str = "cosine", min_lr_ratio: float = 0.0
) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based).

    Step s counts as the (s+1)-th update, so the first update does not run at lr 0: the warm-up is
    (s+1)/W and rsqrt's decay is sqrt(W/(s+1)), i.e. LRA's schedule at its step t = s + 1.
    """
    if decay not in DECAYS:
        raise ValueError(f"decay={decay!r} is not supported; choose one of {', '.join(DECAYS)}")
    if decay == "rsqrt" and warmup_steps < 1:
        raise ValueError(
            f"decay='rsqrt' needs warmup_steps >= 1, got {warmup_steps}: "
            "the decay sqrt(warmup_steps / step) is relative to the end of the warm-up"
        )
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    if decay == "rsqrt":  # no end point: total_steps does not enter
        shape = math.sqrt(warmup_steps / (step + 1))
    else:
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_decay(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int = 0,
    decay: str = "cosine",
    min_lr_ratio: float = 0.0,
    warmup_fraction: float | None = None,
) -> LambdaLR:
    """``warmup_fraction``: the warm-up as a share of the run's steps (RoBERTa's 6 %), for budgets in
    epochs whose step count depends on the data; it replaces ``warmup_steps``."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if warmup_fraction is not None:
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
        warmup_steps = round(warmup_fraction * total_steps)
    return LambdaLR(
        optimizer, lambda step: warmup_decay_factor(step, warmup_steps, total_steps, decay, min_lr_ratio)
    )
