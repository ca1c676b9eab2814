"""Checkpoints a run can resume from exactly: ``last.ckpt``, random states, atomic writes.

- `LastCheckpoint` keeps ``last.ckpt`` really the last state: every N steps, after every validation
  and at the end. Lightning's ``ModelCheckpoint(save_last=True)`` refreshes ``last.ckpt`` only when
  it also saves a top-k checkpoint, so a run whose accuracy stopped improving would resume from a
  stale step.
- `RandomState` puts the torch (CPU and CUDA), numpy and Python random states of every rank into
  each checkpoint; Lightning saves none, so without it a resumed run draws other dropout masks.
- `AtomicCheckpointIO` writes each checkpoint to a temporary file beside the target, fsyncs it and
  renames it over the target. Lightning's own writer (``_atomic_save``, an fsspec transaction)
  stages the file in the system temp directory and *moves* it: a rename only when that directory
  is on the run dir's filesystem; on a cluster (node-local ``/tmp``, shared run dir) it is a copy,
  and a kill during the copy leaves a truncated ``last.ckpt``.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO


class LastCheckpoint(Checkpoint):
    """Owns ``<dirpath>/last.ckpt``.

    A `Checkpoint` subclass so that Lightning runs it after the other callbacks (checkpoint
    callbacks go last, in config order): after a validation, the best-model tracking of the
    ``ModelCheckpoint`` listed before it is already updated when ``last.ckpt`` is written.
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 100, filename: str = "last.ckpt"):
        if every_n_train_steps < 0:
            raise ValueError(
                f"every_n_train_steps must be >= 0 (0 = only at validation and the end), "
                f"got {every_n_train_steps}"
            )
        self.path = Path(dirpath) / filename
        self.every_n_train_steps = every_n_train_steps
        self._saved_step = -1

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        trainer.save_checkpoint(self.path)
        self._saved_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.every_n_train_steps or trainer.global_step % self.every_n_train_steps:
            return
        # A validation right after this step saves anyway, and a checkpoint from before it would
        # resume without that validation (Lightning does not repeat it): skip this one.
        if not _validation_follows(trainer):
            self._save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":
            self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._saved_step:
            self._save(trainer)


def _validation_follows(trainer: L.Trainer) -> bool:
    """Whether the training loop validates after the current batch (asked from ``on_train_batch_end``)."""
    loop = trainer.fit_loop
    try:  # private Lightning API (2.x); without it we save twice, which is merely slower
        return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))
    except AttributeError:
        return False


# ---- random states -------------------------------------------------------------------------------------
def collect_rng_states() -> dict[str, Any]:
    """This process's random states: torch CPU, every CUDA device (when initialised), numpy, Python.

    Only tensors and plain Python values, so a checkpoint still loads with ``weights_only=True``
    (what Lightning uses to resume).
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    numpy_state = states["numpy"]
    keys = numpy_state["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (numpy_state["kind"], keys, numpy_state["pos"], numpy_state["has_gauss"], numpy_state["gauss"])
    )
    python_state = states["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RandomState(L.Callback):
    """Saves every rank's random states in each checkpoint; restores them when training resumes.

    Restored in ``on_train_start``, right before the first resumed step: nothing between the
    save (end of a step or of a validation) and the next step draws from the global generators
    (the datamodule's loaders draw their seeds from their own generators), so the resumed run
    continues the very same random stream.
    """

    def __init__(self) -> None:
        self._to_restore: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        states = collect_rng_states()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, states)  # every rank builds the checkpoint; rank 0 writes it
            return {"per_rank": gathered}
        return {"per_rank": [states]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict["per_rank"]

    def on_train_start(self, trainer, pl_module) -> None:
        if self._to_restore is None:
            return
        states = self._to_restore
        # a run resumed on another number of ranks: ranks beyond the saved ones reuse rank 0's states
        set_rng_states(states[trainer.global_rank] if trainer.global_rank < len(states) else states[0])
        self._to_restore = None


# ---- atomic writes ---------------------------------------------------------------------------------------
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``.<name>.<random>.tmp`` in the target's directory, fsync, then rename.

    A crash or kill at any point leaves either the previous file or the new one, never a partial
    file (a stale ``.tmp`` may remain after a kill). Remote paths (``s3://`` ...) keep Lightning's
    fsspec writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 would hide it from collaborators
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
            raise
        directory = os.open(path.parent, os.O_RDONLY)
        try:  # make the rename itself durable
            os.fsync(directory)
        finally:
            os.close(directory)
