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
from attnlab.run.compile_modes import COMPILE_MODES

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


def choice(*allowed: Any) -> tuple[Check, str]:
    return (lambda v: v in allowed), "one of " + ", ".join(dict.fromkeys(map(str, allowed)))


#: what Lightning's ``Trainer(precision=...)`` accepts
PRECISIONS = (
    *("64-true", "32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"),
    *("64", "32", "16", "bf16", 64, 32, 16, "transformer-engine", "transformer-engine-float16"),
)

POSITIVE = integer(minimum=1)
NON_NEGATIVE = integer(minimum=0)
FRACTION = number(0.0, 1.0)
CHECKS: dict[str, tuple[Check, str]] = {
    "seed": integer(),
    "compile": (lambda v: isinstance(v, bool), "true or false"),
    "compile_mode": choice(*COMPILE_MODES),
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
    "task.model.attn_dropout": number(0.0, 1.0, high_open=True),  # the attention layer's own bound
    "task.model.positions": choice("learned", "sinusoidal", "rope", "none"),  # models.classifier.POSITIONS
    "task.data.source.sizes.train": POSITIVE,
    "task.data.source.sizes.val": POSITIVE,
    "task.data.source.sizes.test": POSITIVE,
    "task.module.optimizer.lr": number(0.0, low_open=True),
    "task.module.optimizer.weight_decay": number(0.0),
    "task.module.scheduler.warmup_steps": NON_NEGATIVE,
    "trainer.num_nodes": POSITIVE,
    "trainer.max_steps": integer(minimum=1, also=(-1,)),
    "trainer.max_epochs": (
        lambda v: v is None or (_is_int(v) and v >= -1),
        "null or an integer >= -1 (-1: no limit in epochs)",
    ),
    "trainer.precision": choice(*PRECISIONS),
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
    "callbacks.last_checkpoint.every_n_train_steps": NON_NEGATIVE,
    "callbacks.periodic_checkpoint.every_n_train_steps": NON_NEGATIVE,
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
    problems += _wandb_login_problems(cfg)
    problems += _position_table_problems(cfg)
    problems += _unread_added_keys(cfg, _command_overrides())
    if not problems:
        problems += _attention_problems(cfg)
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


#: what the model passes to the attention layer it builds: set in ``task.model``, never in ``attn``
MODEL_SUPPLIED = {
    "dim": "task.model.dim",
    "num_heads": "task.model.num_heads",
    "rope": "task.model.positions=rope",
    "dropout": "task.model.attn_dropout",
    "qkv_dim": "task.model.qkv_dim",
}


def _attention_problems(cfg: DictConfig) -> list[str]:
    """The attention config's options, checked by building one layer as the model will.

    Every backend's constructor checks its own options (``attn.eps=0``, ``attn.projection=cubic``,
    ``attn.causal=maybe``, a width not divisible by the head count); building one layer here, at the
    model's width, turns what used to fail after the data was prepared, as Hydra's multi-line report,
    into one line before any work.
    """
    attn = cfg.get("attn")
    if not isinstance(attn, DictConfig) or "_target_" not in attn:
        return []
    supplied = [key for key in MODEL_SUPPLIED if key in attn]
    if supplied:
        key = supplied[0]
        return [f"attn.{key}: set by the model, not by the attention config; use {MODEL_SUPPLIED[key]}"]
    model = cfg.task.get("model") if isinstance(cfg.get("task"), DictConfig) else None
    model = model if isinstance(model, DictConfig) else DictConfig({})
    dim, heads = model.get("dim"), model.get("num_heads")
    if not (_is_int(dim) and _is_int(heads)):
        dim, heads = 16, 2  # a model that names its width otherwise: the options alone are checked
    width = {"qkv_dim": model.qkv_dim} if model.get("qkv_dim") is not None else {}
    causal = str(model.get("_target_", "")).endswith("CausalLM")  # decoders build causal layers
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        factory = instantiate(attn)
        extra = {"causal": True} if causal else {}
        factory(dim=dim, num_heads=heads, **width, **extra)
    except InstantiationException as err:
        return [f"attn ({attn.get('name')}): {err.__cause__ or err}"]
    except (ValueError, TypeError) as err:
        return [f"attention backend {attn.get('name')!r} with this config: {err}"]
    return []


#: the largest position table (learned or sinusoidal: max_len × dim floats) built without a word
POSITION_TABLE_LIMIT = 4 << 30


def _position_table_problems(cfg: DictConfig) -> list[str]:
    """A ``max_len`` whose position table would not fit: ``task.model.max_len=1000000000`` tried to
    allocate 64 GB before failing (RoPE builds no table: any max_len is fine there)."""
    model = OmegaConf.select(cfg, "task.model", default=None)
    if not isinstance(model, DictConfig):
        return []
    max_len, dim = model.get("max_len"), model.get("dim")
    if model.get("positions") not in ("learned", "sinusoidal") or not (_is_int(max_len) and _is_int(dim)):
        return []
    size = 4 * max_len * dim
    if size <= POSITION_TABLE_LIMIT:
        return []
    return [
        f"task.model.max_len={max_len}: its {model.positions} position table ({max_len:,} × {dim} floats) "
        f"would take {size / 2**30:,.1f} GiB; give the longest sequence the data holds, or "
        f"task.model.positions=rope (no table)"
    ]


def _wandb_login_problems(cfg: DictConfig) -> list[str]:
    """An online wandb logger with no credentials: wandb.init would end the run in a 30-line traceback
    after the run dir was made."""
    problems = []
    for name, node in (cfg.get("logger") or {}).items():
        if not isinstance(node, DictConfig) or not str(node.get("_target_", "")).endswith("WandbLogger"):
            continue
        if str(node.get("mode", "offline")) == "online" and not _wandb_logged_in():
            problems.append(
                f"logger={name}: wandb runs online (WANDB_MODE=online) but is not logged in here; run "
                f"`wandb login` (or set WANDB_API_KEY), or log offline with WANDB_MODE=offline and "
                f"upload later with `wandb sync`"
            )
    return problems


def _wandb_logged_in() -> bool:
    """Whether wandb has an API key: ``WANDB_API_KEY``, or ``wandb login``'s entry in ~/.netrc."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _command_overrides() -> list[str]:
    """The command line's overrides, as Hydra recorded them (none outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)


def _unread_added_keys(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """``+key=value`` overrides that add a key nothing reads, each with the closest existing key.

    Hydra adds any key it is given with ``+``: ``+task.modle.dim=32`` trained on without a word, and
    ``+task.model.dimm=64`` failed late in the model's constructor. A key is read when its node is
    built with ``_target_`` whose signature takes it (or any keyword), or when the config refers to
    it (``${oc.select:task.max_epochs,-1}``); a key that creates a new node or top-level key is read
    by nothing.
    """
    import difflib

    added = [o.split("=", 1)[0].lstrip("+") for o in overrides if o.startswith("+") and "=" in o]
    added = [key for key in added if key and not key.startswith(("hydra.", "attn."))]
    readers = [key for key in added if key.rpartition(".")[2].startswith("_")]  # _target_, _partial_
    added = [key for key in added if key not in readers]
    if not added:
        return []
    referenced = OmegaConf.to_yaml(cfg)  # unresolved: interpolations name the keys they read
    tree = OmegaConf.to_container(cfg, resolve=False)  # the structure only: nothing is resolved
    problems = []
    for key in added:
        if f"{key}," in referenced or f"{key}}}" in referenced:
            continue
        parent_key = key.rpartition(".")[0]
        parent = _lookup(tree, parent_key)
        if not isinstance(parent, dict):
            continue
        here = f"{parent_key}." if parent_key else ""
        existing = [f"{here}{k}" for k in parent if not _only_added(parent[k], f"{here}{k}", added)]
        if "_target_" in parent:
            accepted = _target_parameters(str(parent["_target_"]))
            if accepted is None or key.rpartition(".")[2] in accepted:
                continue
            name, candidates = key, sorted({f"{here}{a}" for a in accepted} | set(existing))
        elif existing and parent_key:
            continue  # a node of plain settings: code may read any key of it
        else:  # a node, or a top-level key, that only this override creates: compare where it starts
            node, prefix, name, candidates = tree, "", key, []
            for part in key.split("."):
                kids = [f"{prefix}{k}" for k in node if not _only_added(node[k], f"{prefix}{k}", added)]
                if f"{prefix}{part}" not in kids:
                    name, candidates = f"{prefix}{part}", kids
                    break
                node, prefix = node[part], f"{prefix}{part}."
        rest = key[len(name) :]  # a misspelt node: prefer the nodes that hold the rest of the key
        holding = [c for c in candidates if rest and _lookup(tree, c + rest) is not None]
        matches = difflib.get_close_matches(name, holding, n=1, cutoff=0.6)
        if matches:
            hint = f"; did you mean {matches[0]}{rest}?"
        else:
            matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
            hint = f"; did you mean {matches[0]}?" if matches else ""
        problems.append(f"+{key}: nothing reads this key{hint}")
    return problems


def _lookup(tree: Any, key: str) -> Any:
    """The value at dotted ``key`` of a plain nested dict, None when absent (``""``: the whole tree)."""
    for part in key.split(".") if key else []:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _only_added(node: Any, path: str, added: list[str]) -> bool:
    """Whether the config holds ``path`` only because ``+`` overrides put every key of it there."""
    if isinstance(node, dict):
        return all(_only_added(v, f"{path}.{k}", added) for k, v in node.items()) if node else False
    return path in added


def _target_parameters(target: str) -> list[str] | None:
    """The keyword parameters ``target`` takes; None when it takes any (``**kwargs``) or is unknown."""
    import inspect

    from hydra.utils import get_object

    try:
        obj = get_object(target)
        signature = inspect.signature(obj.__init__ if isinstance(obj, type) else obj)
    except Exception:  # not importable or no signature: leave it to the constructor
        return None
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.name != "self"]
