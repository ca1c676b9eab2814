"""Which checkpoint a run continues from, read safely, and which run dir it continues in.

Every checkpoint attnlab opens is read with ``torch.load(weights_only=True)``: torch's restricted
unpickler accepts tensors and plain containers only, so a planted ``hpc_ckpt_9.ckpt`` or a doctored
``last.ckpt`` cannot run code. attnlab's checkpoints hold nothing else (see
`attnlab.callbacks.checkpoint.collect_rng_states`), and a file that needs more is refused by name.

Paths found rather than given (the newest checkpoint of a run dir, the best checkpoint that
``last.ckpt`` remembers) must lie inside the run dir; a path the user types (``ckpt_path=...``) is
trusted as given. ``resume_run_dir`` is the Hydra resolver that makes ``ckpt_path=<run>/checkpoints/
last.ckpt`` continue in ``<run>`` instead of a new timestamped dir.

Only pathlib at import time: ``train.py`` registers the resolver before Hydra starts.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from pathlib import Path
from typing import Any

from attnlab.errors import CheckpointError

log = logging.getLogger(__name__)

HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(\d+)\.ckpt")


def read_checkpoint(path: str | Path, what: str = "checkpoint") -> dict[str, Any]:
    """The checkpoint at ``path``, loaded safely and memory-mapped (tensors are read on use).

    Raises `CheckpointError` for a missing, empty, corrupt or non-Lightning file, and for one holding
    objects other than tensors and plain values (loading it would run arbitrary code).
    """
    import pickle
    import zipfile

    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist (give a .ckpt file, 'auto' or null)")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{what} {path} is an empty file, not a checkpoint")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            raise CheckpointError(
                f"{what} {path} holds objects other than tensors and plain values; refusing to load it, "
                f"since unpickling them could run code (attnlab's own checkpoints never need that)"
            ) from err
        raise CheckpointError(f"{what} {path} is not a PyTorch checkpoint ({err})") from err
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        raise CheckpointError(f"{what} {path} is corrupt or not a PyTorch checkpoint ({err})") from err
    if not isinstance(checkpoint, dict) or "global_step" not in checkpoint:
        keys = f" with keys {', '.join(map(str, checkpoint))}" if isinstance(checkpoint, dict) else ""
        raise CheckpointError(
            f"{what} {path} is not a Lightning checkpoint "
            f"(no 'global_step'; got {type(checkpoint).__name__}{keys})"
        )
    return checkpoint


def checkpoint_step(path: str | Path, what: str = "checkpoint") -> int:
    """The global step a checkpoint was saved at (the weights are not read: memory-mapped)."""
    step = read_checkpoint(path, what)["global_step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{what} {path} is damaged: its global_step is {step!r}, not an integer >= 0")
    return int(step)


def checkpoint_weights(path: str | Path, what: str = "ckpt_path") -> dict[str, Any]:
    """The checkpoint's ``state_dict`` (tensors by name), refused by name when it has none."""
    weights = read_checkpoint(path, what).get("state_dict")
    if not isinstance(weights, dict):
        found = "no state_dict" if weights is None else f"a state_dict of type {type(weights).__name__}"
        raise CheckpointError(f"{what} {path} holds {found}: it is not a model checkpoint attnlab can resume")
    return weights


def resume_candidates(run_dir: Path) -> list[Path]:
    """What a restarted run may continue from: Lightning's SLURM ``hpc_ckpt_<n>.ckpt``, ``last.ckpt``."""
    last = run_dir / "checkpoints" / "last.ckpt"
    hpc = [p for p in run_dir.glob("hpc_ckpt_*.ckpt") if HPC_CHECKPOINT.fullmatch(p.name)]
    return sorted(hpc) + ([last] if last.is_file() else [])


def newest_hpc_checkpoint(run_dir: Path) -> Path | None:
    """The ``hpc_ckpt_<n>.ckpt`` with the highest n: what Lightning resumes from under SLURM."""
    numbered = [
        (int(match.group(1)), path)
        for path in run_dir.glob("hpc_ckpt_*.ckpt")
        if (match := HPC_CHECKPOINT.fullmatch(path.name))
    ]
    return max(numbered)[1] if numbered else None


def _under_slurm() -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """The checkpoint this run resumes from, checked to be a readable Lightning checkpoint.

    ``null`` starts fresh, except under SLURM where a requeued job continues from the run dir's
    newest ``hpc_ckpt_<n>.ckpt`` (Lightning's own rule, made explicit here so the file is read safely
    and the run's history can be kept); ``auto`` resumes from the newest of ``hpc_ckpt_*.ckpt`` and
    ``checkpoints/last.ckpt`` (newest = highest global step, then latest mtime), or starts fresh when
    there is none; a path resumes from that file.
    """
    if ckpt_path in (None, "", "null"):
        newest = newest_hpc_checkpoint(run_dir) if _under_slurm() else None
        if newest is None:
            return None
        checkpoint_step(newest)
        log.info("requeued SLURM job: resuming from %s", newest)
        return str(newest)
    if ckpt_path == "auto":
        candidates = resume_candidates(run_dir)
        if not candidates:
            return None
        outside = [p for p in candidates if not is_inside(p, run_dir)]
        if outside:  # a link out of the run dir: what it would load is no checkpoint of this run
            raise CheckpointError(
                f"ckpt_path=auto: {outside[0]} leads to {outside[0].resolve()}, outside the run dir "
                f"{run_dir}; refusing to resume from it (give that file as ckpt_path=<path> if you mean it)"
            )
        newest = max(candidates, key=lambda p: (checkpoint_step(p), p.stat().st_mtime))
        checkpoint_weights(newest)
        log.info("ckpt_path=auto: resuming from %s (of %s)", newest, ", ".join(p.name for p in candidates))
        return str(newest)
    checkpoint_step(Path(ckpt_path), "ckpt_path")  # fails early, naming the file, when it is not a checkpoint
    checkpoint_weights(Path(ckpt_path))
    return str(ckpt_path)


def run_dir_of_checkpoint(ckpt_path: str | Path) -> Path | None:
    """The run dir a checkpoint belongs to: ``<run>/checkpoints/<name>.ckpt`` or ``<run>/hpc_ckpt_<n>.ckpt``.

    None for a file elsewhere (a checkpoint copied out of its run starts a new run dir).
    """
    path = Path(ckpt_path)
    if path.suffix != ".ckpt":
        return None
    if path.parent.name == "checkpoints":
        return path.parent.parent
    if HPC_CHECKPOINT.fullmatch(path.name):
        return path.parent
    return None


def resume_run_dir(ckpt_path: Any, default: str) -> str:
    """Hydra resolver behind ``hydra.run.dir``: a resumed run continues in its checkpoint's run dir.

    ``ckpt_path=outputs/listops/softmax/<time>/checkpoints/last.ckpt`` gives
    ``outputs/listops/softmax/<time>``; anything else (null, auto, a checkpoint outside a run dir)
    gives ``default``, the usual timestamped dir. An explicit ``hydra.run.dir=...`` still wins.
    """
    if ckpt_path in (None, "", "null", "auto"):
        return default
    run_dir = run_dir_of_checkpoint(str(ckpt_path))
    return os.fspath(run_dir) if run_dir is not None else default


def is_inside(path: str | Path, directory: str | Path) -> bool:
    """Whether ``path`` (symlinks resolved) lies inside ``directory``."""
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


def best_checkpoint_in_run(best_path: str | None, run_dir: Path) -> str | None:
    """The best checkpoint to test, refused when it lies outside this run's dir.

    ``best_path`` comes from the ``ModelCheckpoint`` state that a resumed ``last.ckpt`` restored, i.e.
    from a file: a doctored one could point anywhere. A run dir that was moved still finds its own
    file of the same name.
    """
    if not best_path:
        return None
    if is_inside(best_path, run_dir):
        return best_path
    moved = run_dir / "checkpoints" / Path(best_path).name
    if moved.is_file():
        log.info("best checkpoint %s is outside the run dir; using this run's copy %s", best_path, moved)
        return str(moved)
    raise CheckpointError(
        f"the best checkpoint recorded in this run's state, {best_path}, lies outside the run dir "
        f"{run_dir}; refusing to load it (if that file is this run's, copy it into {run_dir / 'checkpoints'})"
    )


def resume_command(run_dir: str | Path, overrides: list[str] | None = None) -> str:
    """The command that continues a stopped run in its run dir: the same overrides, ``ckpt_path=auto``
    and ``hydra.run.dir=<run_dir>`` (any earlier ``ckpt_path`` or ``hydra.run.dir`` replaced)."""
    kept = [o for o in overrides or [] if not o.lstrip("+~").startswith(("ckpt_path=", "hydra.run.dir="))]
    words = ["python", "train.py", *kept, "ckpt_path=auto", f"hydra.run.dir={os.fspath(run_dir)}"]
    return " ".join(shlex.quote(word) for word in words)


def check_checkpoint_fits(
    ckpt_path: str | Path, state_dict: dict[str, Any], expected: dict[str, Any], saved: dict[str, Any]
) -> None:
    """Refuse, in one line, a checkpoint whose weights do not fit this run's model.

    Lightning would stop with a state_dict traceback of every mismatched tensor. This names the
    first differences, what the checkpoint's run was (``saved``: `saved_run`, read before this run
    writes its own config.yaml) and what this run expects (``expected``: `run_description`).
    """
    held = checkpoint_weights(ckpt_path)
    import torch

    broken = next(
        (
            key
            for key, value in held.items()
            if isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and not torch.isfinite(value).all()
        ),
        None,
    )
    if broken is not None:
        raise CheckpointError(
            f"ckpt_path {ckpt_path} holds non-finite weights (NaN or inf, first in {broken}): the run that "
            f"saved it had diverged; resume from an earlier checkpoint or start a new run"
        )
    shapes = [
        f"{key}: checkpoint {tuple(held[key].shape)}, this run {tuple(value.shape)}"
        for key, value in state_dict.items()
        if key in held and tuple(held[key].shape) != tuple(value.shape)
    ]
    missing = [key for key in state_dict if key not in held]
    unexpected = [key for key in held if key not in state_dict]
    if not (shapes or missing or unexpected):
        return
    found = []
    if shapes:
        found.append(f"{len(shapes)} weight(s) of another shape (first {shapes[0]})")
    if missing:
        found.append(f"{len(missing)} missing (first {missing[0]})")
    if unexpected:
        found.append(f"{len(unexpected)} this model does not have (first {unexpected[0]})")
    describe = lambda run: ", ".join(f"{k}={v}" for k, v in run.items() if v is not None)  # noqa: E731
    raise CheckpointError(
        f"ckpt_path {ckpt_path} holds another model ({'; '.join(found)}): it was saved by "
        f"{describe(saved) or 'a run whose config.yaml is not beside it'}, this run is "
        f"{describe(expected)}"
    )


def saved_run(ckpt_path: str | Path) -> dict[str, Any]:
    """Task, backend and model size of the run that saved ``ckpt_path``, from its run dir's config."""
    run_dir = run_dir_of_checkpoint(ckpt_path)
    config = run_dir / "config.yaml" if run_dir is not None else None
    if config is None or not config.is_file():
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config)
    return run_description(cfg)


def run_description(cfg) -> dict[str, Any]:
    """What tells two runs' models apart, for messages: task, backend, width, depth, heads."""
    from omegaconf import OmegaConf

    pick = lambda key: OmegaConf.select(cfg, key, default=None)  # noqa: E731
    return {
        "task": pick("task.name"),
        "attn": pick("attn.name"),
        "dim": pick("task.model.dim"),
        "depth": pick("task.model.depth"),
        "num_heads": pick("task.model.num_heads"),
    }


#: keys a resumed run may set differently from the run it continues: budgets and limits, logging,
#: where files go, how many devices; everything else (task, data, model, backend and its options,
#: optimiser, precision, seed) would make the continued run another experiment. docs/resume.md lists them.
MAY_CHANGE_ON_RESUME = (
    "ckpt_path",
    "overwrite",
    "compile",
    "compile_mode",
    "test",
    "paths.",
    "logger.",
    "callbacks.",
    "task.max_steps",
    "task.max_epochs",
    "task.max_time",
    "task.val_check_interval",
    "task.check_val_every_n_epoch",
    "task.data.num_workers",
    "task.data.eval_batch_size",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.max_time",
    "trainer.min_steps",
    "trainer.min_epochs",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.limit_train_batches",
    "trainer.limit_val_batches",
    "trainer.limit_test_batches",
    "trainer.limit_predict_batches",
    "trainer.num_sanity_val_steps",
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.profiler",
    "trainer.default_root_dir",
    "trainer.accelerator",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.strategy",
)


def _may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE_ON_RESUME)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): node}


def changed_on_resume(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The keys, outside `MAY_CHANGE_ON_RESUME`, whose values differ between two resolved configs."""
    before, after = _flatten(saved), _flatten(current)
    return sorted(
        key
        for key in before.keys() | after.keys()
        if not _may_change(key) and before.get(key) != after.get(key)
    )


def check_resume_config(ckpt_path: str | Path, cfg) -> None:
    """Refuse to resume a checkpoint under a config that changes its model, task or training recipe.

    The run's ``config.yaml`` (beside its ``checkpoints/``) is compared with this command's resolved
    config; a softmax checkpoint resumed with ``attn=linear`` has weights of the same shapes and used
    to train on as another backend. A checkpoint without its run's config.yaml is checked by its
    weights alone (`check_checkpoint_fits`).
    """
    from omegaconf import OmegaConf

    run_dir = run_dir_of_checkpoint(ckpt_path)
    config = run_dir / "config.yaml" if run_dir is not None else None
    if config is None or not config.is_file():
        return
    try:
        saved = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
    except Exception as err:  # yaml's and OmegaConf's errors share no base class
        raise CheckpointError(
            f"{config} (the config of the run to resume) is not readable YAML: {err}"
        ) from err
    if not isinstance(saved, dict):
        raise CheckpointError(f"{config} (the config of the run to resume) is not a mapping of keys")
    changed = changed_on_resume(saved, OmegaConf.to_container(cfg, resolve=True))
    if not changed:
        return
    flat_saved, flat_now = _flatten(saved), _flatten(OmegaConf.to_container(cfg, resolve=True))
    shown = ", ".join(
        f"{key}: {flat_saved.get(key, '<absent>')!r} -> {flat_now.get(key, '<absent>')!r}"
        for key in changed[:6]
    )
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    raise CheckpointError(
        f"ckpt_path {ckpt_path}: this command changes {len(changed)} key(s) of the run it resumes that "
        f"change its model or training ({shown}{more}); resume with the run's own values (its config: "
        f"{config}), or start a new run in another dir. Keys that may change on resume: docs/resume.md"
    )
