"""Check the typed keys of a composed config before any work is done.

Hydra takes ``task.max_steps=abc`` or ``task.data.batch_size=1.5`` as given (our configs have no
schema), and the bad value then fails deep inside Lightning or a data loader with a traceback that
names neither the key nor what was expected. `check_config` names both, for the keys users override
most; keys a config does not have are skipped (every task has its own model and data options).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from attnlab.errors import ConfigError

Check = Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def integer(minimum: int | None = None, also: tuple = ()) -> tuple[Check, str]:
    text = "an integer" + (f" >= {minimum}" if minimum is not None else "")
    if also:
        text += " or " + " or ".join(repr(a) if not isinstance(a, str) else a for a in also)
    return (lambda v: v in also if not _is_int(v) else (minimum is None or v >= minimum or v in also)), text


def number(
    low: float,
    high: float | None = None,
    low_open: bool = False,
    nullable: bool = False,
    high_open: bool = False,
):
    def check(v: Any) -> bool:
        if v is None:
            return nullable
        if not _is_number(v):
            return False
        below = high is None or (v < high if high_open else v <= high)
        return (v > low if low_open else v >= low) and below

    bound = f"> {low}" if low_open else f">= {low}"
    text = f"a number {bound}" + (f" and {'<' if high_open else '<='} {high}" if high is not None else "")
    return check, text + (" or null" if nullable else "")


def batches_limit() -> tuple[Check, str]:
    """Lightning's limit_*_batches / overfit_batches: a fraction (float in [0, 1]) or a count (int >= 0)."""
    return (
        lambda v: v is None or (_is_int(v) and v >= 0) or (isinstance(v, float) and 0.0 <= v <= 1.0),
        "null, a fraction in [0.0, 1.0] or a number of batches >= 0",
    )


POSITIVE = integer(minimum=1)
NON_NEGATIVE = integer(minimum=0)
FRACTION = number(0.0, 1.0)
CHECKS: dict[str, tuple[Check, str]] = {
    "seed": integer(),
    "task.max_steps": integer(minimum=1, also=(-1,)),
    "task.val_check_interval": (
        lambda v: (_is_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0),
        "a number of training steps >= 1 or a fraction of an epoch in (0.0, 1.0]",
    ),
    "task.data.batch_size": POSITIVE,
    "task.data.eval_batch_size": (lambda v: v is None or POSITIVE[0](v), "null or an integer >= 1"),
    "task.data.num_workers": NON_NEGATIVE,
    "task.model.dim": POSITIVE,
    "task.model.depth": POSITIVE,
    "task.model.num_heads": POSITIVE,
    "task.model.mlp_dim": POSITIVE,
    "task.model.max_len": POSITIVE,
    "task.model.patch_size": POSITIVE,
    "task.model.short_conv": (
        lambda v: _is_int(v) and (v == 0 or v >= 2),
        "0 (off) or a number of taps >= 2",
    ),
    "task.data.num_points": POSITIVE,
    "task.data.source.tokenizer.vocab_size": integer(minimum=261),  # 256 bytes + 5 specials (BPE)
    "task.module.ema_decay": number(0.0, 1.0, low_open=True, nullable=True, high_open=True),
    "task.module.label_smoothing": number(0.0, 1.0, high_open=True),
    "task.module.mixup": (
        lambda v: v is None or isinstance(v, DictConfig),
        "null or a mapping of timm Mixup options (mixup_alpha, cutmix_alpha, prob, switch_prob, ...)",
    ),
    "task.model.dropout": number(0.0, 1.0),
    "task.model.attn_dropout": number(0.0, 1.0),
    "task.module.optimizer.lr": number(0.0, low_open=True),
    "task.module.optimizer.weight_decay": number(0.0),
    "task.module.scheduler.warmup_steps": NON_NEGATIVE,
    "trainer.num_nodes": POSITIVE,
    "trainer.accumulate_grad_batches": POSITIVE,
    "trainer.log_every_n_steps": POSITIVE,
    "trainer.num_sanity_val_steps": integer(minimum=-1),
    "trainer.gradient_clip_val": number(0.0, nullable=True),
    "trainer.fast_dev_run": (
        lambda v: isinstance(v, bool) or (_is_int(v) and v >= 0),
        "true, false or a number of batches >= 0",
    ),
    "trainer.limit_train_batches": batches_limit(),
    "trainer.limit_val_batches": batches_limit(),
    "trainer.limit_test_batches": batches_limit(),
    "trainer.overfit_batches": batches_limit(),
    "callbacks.throughput.warmup_steps": NON_NEGATIVE,
    "test": (lambda v: isinstance(v, bool), "true or false"),
}


def check_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` naming every key whose value has the wrong type or range, or that cannot be
    resolved (a resolver such as ``${attnlab_accumulate:...}`` refusing its inputs)."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as err:
        where = f"{err.full_key}: " if getattr(err, "full_key", None) else ""
        raise ConfigError(f"{where}{str(err).splitlines()[0]}") from err
    problems = []
    for key, (ok, expected) in CHECKS.items():
        value = OmegaConf.select(cfg, key, default="__absent__", throw_on_missing=False)
        if isinstance(value, str) and value == "__absent__":
            continue
        if not ok(value):
            problems.append(f"{key}={value!r}: expected {expected}")
    problems += _missing_logger_packages(cfg)
    if len(problems) == 1:
        raise ConfigError(f"bad config value {problems[0]}")
    if problems:
        raise ConfigError("bad config values:\n  " + "\n  ".join(problems))


#: loggers whose package is an optional extra: (class name in ``_target_``, module, how to install)
OPTIONAL_LOGGERS = {"WandbLogger": ("wandb", ".venv/bin/pip install -e '.[wandb]'")}


def _missing_logger_packages(cfg: DictConfig) -> list[str]:
    """A logger chosen whose package is not installed, named before the run starts (not a traceback)."""
    import importlib.util

    problems = []
    for name, node in (cfg.get("logger") or {}).items():
        target = str(node.get("_target_", "")) if isinstance(node, DictConfig) else ""
        for cls, (module, install) in OPTIONAL_LOGGERS.items():
            if target.endswith(cls) and importlib.util.find_spec(module) is None:
                problems.append(
                    f"logger={name}: needs the {module} package, which is an optional extra: {install}"
                )
    return problems
