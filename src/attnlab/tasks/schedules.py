"""Learning-rate schedules: linear warm-up followed by a decay, as a LambdaLR factor."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

DECAYS = ("cosine", "linear", "constant")


def warmup_decay_factor(
    step: int, warmup_steps: int, total_steps: int, decay: str = "cosine", min_lr_ratio: float = 0.0
) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based)."""
    if decay not in DECAYS:
        raise ValueError(f"decay={decay!r} is not supported; choose one of {', '.join(DECAYS)}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_decay(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int = 0,
    decay: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    return LambdaLR(
        optimizer, lambda step: warmup_decay_factor(step, warmup_steps, total_steps, decay, min_lr_ratio)
    )
