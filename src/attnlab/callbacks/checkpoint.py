"""Checkpoints a run can resume from exactly: ``last.ckpt``, random states, atomic writes.

- `LastCheckpoint` keeps ``last.ckpt`` really the last state: every N steps, after every validation
  and at the end. Lightning's ``ModelCheckpoint(save_last=True)`` refreshes ``last.ckpt`` only when
  it also saves a top-k checkpoint, so a run whose accuracy stopped improving would resume from a
  stale step.
- `RandomState` puts the torch (CPU and CUDA), numpy and Python random states of every rank into
  each checkpoint; Lightning saves none, so without it a resumed run draws other dropout masks.
- `SlurmRequeue` turns SLURM's warning signal (``SIGUSR1`` before the time limit) into an exact
  ``hpc_ckpt_<n>.ckpt``: Lightning's own auto-requeue saves inside the signal handler, i.e. at any
  point of a training step; this one saves at the next step boundary, requeues and stops.
- `AtomicCheckpointIO` writes each checkpoint to a temporary file beside the target, fsyncs it and
  renames it over the target. Lightning's own writer (``_atomic_save``, an fsspec transaction)
  stages the file in the system temp directory and *moves* it: a rename only when that directory
  is on the run dir's filesystem; on a cluster (node-local ``/tmp``, shared run dir) it is a copy,
  and a kill during the copy leaves a truncated ``last.ckpt``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import re
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

log = logging.getLogger(__name__)


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
        trainer.save_checkpoint(self.path, weights_only=False)  # a full, resumable state (and no log line)
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
        # After a stop on a signal the training loop has closed its epoch half-way: a checkpoint now would
        # resume at the next epoch. The next attempt continues from the checkpoint of that stop instead.
        if trainer.global_step != self._saved_step and not _stopped(trainer):
            self._save(trainer)


def _validation_follows(trainer: L.Trainer) -> bool:
    """Whether the training loop validates after the current batch (asked from ``on_train_batch_end``)."""
    loop = trainer.fit_loop
    try:  # private Lightning API (2.x); without it we save twice, which is merely slower
        return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))
    except AttributeError:
        return False


# ---- stopping on a signal at a step boundary ---------------------------------------------------------------
class StepBoundaryStop(Checkpoint):
    """The one mechanism behind `SlurmRequeue` and `Interrupt`: a signal handler that only records the
    signal, and a checkpoint saved and training stopped at the next step boundary.

    A checkpoint saved from inside a signal handler lands wherever in a training step the signal does:
    it can miss the batch in flight or hold an optimizer update without its step count, and the resumed
    run drifts from an uninterrupted one. Here, after each optimizer step, the ranks agree on the flag
    (one boolean all-reduce, so any rank's signal counts) and `_act` saves where ``last.ckpt`` would:
    after the step, or after the validation that follows it (a checkpoint from before that validation
    would resume without it). Signals that arrive while saving are only recorded again: they cannot cut
    the write short (and the write is atomic anyway, see `AtomicCheckpointIO`).

    Subclasses say which signals they take (`_signals`; none: inactive), when they install the handler
    (``setup``, or ``on_train_start`` to replace a handler Lightning registers in between) and what to do
    (`_act`). The handlers that were there at ``setup`` come back at ``teardown`` or on an exception.
    A `Checkpoint` subclass, so Lightning runs it after the other callbacks, like `LastCheckpoint`.
    """

    install_at = "setup"  # or "on_train_start"

    def __init__(self) -> None:
        self.stopped = False  # the pipeline reads it: the fit ended on a signal
        self.checkpoint_path: str | None = None
        self.received: int | None = None  # the first signal received; after a stop, the ranks' agreed one
        self._requested = False
        self._previous: dict[int, Any] = {}  # signal -> handler at setup
        self._signals_to_install: list[int] = []
        self._last_step = -1

    def _signals(self, trainer: L.Trainer) -> list[int]:
        raise NotImplementedError

    def _act(self, trainer: L.Trainer) -> None:
        raise NotImplementedError

    def _handle(self, signum: int, frame: Any) -> None:
        # only flags: the handler interrupts the step (or a checkpoint write) at an arbitrary point
        if self.received is None:
            self.received = signum
        self._requested = True

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; Lightning skips them too
        self._signals_to_install = self._signals(trainer)
        self.stopped, self.checkpoint_path, self.received, self._requested = False, None, None, False
        self._previous = {signum: signal.getsignal(signum) for signum in self._signals_to_install}
        if self.install_at == "setup":
            self._install()

    def _install(self) -> None:
        for signum in self._signals_to_install:
            signal.signal(signum, self._handle)

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step
        if self.install_at == "on_train_start" and self._previous:
            self._install()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._previous or trainer.global_step == self._last_step:
            return  # inactive, or gradients still accumulating: no optimizer step completed yet
        self._last_step = trainer.global_step
        if _validation_follows(trainer):
            return  # decided in on_validation_end, after that validation
        if self._agreed(trainer):
            # `should_stop` makes Lightning validate at once; an uninterrupted run would not, and that
            # validation would rewrite last.ckpt and the best checkpoint after this checkpoint
            trainer.fit_loop.epoch_loop._skip_next_val = True
            self._stop(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._previous or trainer.sanity_checking or self.stopped or trainer.state.fn != "fit":
            return
        if self._agreed(trainer):
            self._stop(trainer)

    def _agreed(self, trainer: L.Trainer) -> bool:
        """Whether any rank got the signal (every rank asks at the same points: the collectives match)."""
        if _stopped(trainer):
            return False  # another one already stopped this fit: its checkpoint is the one to resume from
        return bool(trainer.strategy.reduce_boolean_decision(self._requested, all=False))

    def _stop(self, trainer: L.Trainer) -> None:
        self.received = self._agreed_signal(trainer)
        self._act(trainer)
        self.stopped = True
        trainer.should_stop = True

    def _agreed_signal(self, trainer: L.Trainer) -> int | None:
        """The signal any rank received (the highest number), on every rank: a signal sent to one process
        (rank 0, say) must make every rank skip the test stage and exit alike."""
        received = torch.tensor(self.received or 0, device=trainer.strategy.root_device)
        return int(trainer.strategy.reduce(received, reduce_op="max")) or None

    def on_train_end(self, trainer, pl_module) -> None:
        if self._previous and not self.stopped:  # a signal after the last boundary: the ranks agree on it
            self.received = self._agreed_signal(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._restore_handlers()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


class SlurmRequeue(StepBoundaryStop):
    """On SLURM's requeue signal: save ``<default_root_dir>/hpc_ckpt_<n>.ckpt`` at the next step
    boundary, run ``scontrol requeue``, stop training (`StepBoundaryStop`).

    Active only in a fit under SLURM with Lightning's auto-requeue on (its default there). It
    installs its handler in ``setup``, before the trainer registers its own, and Lightning never
    replaces an existing handler of the requeue signal: only this one fires. Outside SLURM, or with
    ``SLURMEnvironment(auto_requeue=False)``, it does nothing. The requeued job resumes through
    Lightning's own rule (``ckpt_path`` null on SLURM: the newest ``hpc_ckpt_<n>.ckpt``, the very
    file name Lightning would have written) or ``ckpt_path=auto``.
    """

    @property
    def preempted(self) -> bool:  # the pipeline reads it: no test stage, no summary for this attempt
        return self.stopped

    def _signals(self, trainer: L.Trainer) -> list[int]:
        environment = trainer._accelerator_connector.cluster_environment  # what Lightning itself asks
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return []
        if not hasattr(trainer.fit_loop.epoch_loop, "_skip_next_val"):
            log.warning(
                "this Lightning version has no fit_loop.epoch_loop._skip_next_val (Lightning >= 2.5 does): "
                "leaving SIGUSR1 to Lightning's auto-requeue, whose checkpoint may resume inexactly"
            )
            return []
        return [environment.requeue_signal]

    def _act(self, trainer: L.Trainer) -> None:
        # rank 0 names the file: a rank that looked after rank 0 had written it would count one more
        path = trainer.strategy.broadcast(_CheckpointConnector.hpc_save_path(trainer.default_root_dir), src=0)
        trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank 0 writes
        self.checkpoint_path = str(path)
        if trainer.is_global_zero:
            log.info("requeue signal: saved %s at step %d", path, trainer.global_step)
            requeue_slurm_job()


class Interrupt(StepBoundaryStop):
    """On SIGTERM or SIGINT (``kill``, a container stop, ``scancel``, Ctrl-C): save ``last.ckpt`` at the
    next step boundary and stop training (`StepBoundaryStop`); the pipeline then writes the summary
    marked ``interrupted``, prints how to resume and exits 143 (SIGTERM) or 130 (SIGINT).

    Without it Lightning turns SIGTERM into a clean exit (status 0) at the end of the step, saving
    nothing, and Ctrl-C into a ``KeyboardInterrupt`` wherever it lands. The handlers are installed in
    ``on_train_start``, after Lightning registered its SIGTERM handler, which they replace for the fit.
    A signal after a SLURM requeue was decided is left alone: the hpc checkpoint is the one to resume.
    """

    install_at = "on_train_start"
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def _signals(self, trainer: L.Trainer) -> list[int]:
        return list(self.SIGNALS)

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        super()._handle(signum, frame)
        name = signal.Signals(signum).name
        message = (
            f"\n{name}: stopping at the end of this step; saving last.ckpt first\n"
            if first
            else f"\n{name}: already stopping; waiting for last.ckpt to be saved\n"
        )
        os.write(2, message.encode())  # async-signal-safe, unlike logging (its lock may be held here)

    def _act(self, trainer: L.Trainer) -> None:
        last = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), None)
        path = last.path if last is not None else Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank 0 writes
        if last is not None:
            last._saved_step = trainer.global_step
        self.checkpoint_path = str(path)
        if trainer.is_global_zero:
            name = signal.Signals(self.received).name if self.received else "signal"
            log.info("%s: saved %s at step %d", name, path, trainer.global_step)


def _stopped(trainer: L.Trainer) -> bool:
    """Whether a signal stopped this fit (its checkpoint saved; the epoch was closed half-way)."""
    return any(isinstance(c, StepBoundaryStop) and c.stopped for c in trainer.callbacks)


def requeue_slurm_job() -> bool:
    """``scontrol requeue`` this job (an array task as ``<array job>_<task>``); False, logged, on failure.

    A failure does not raise: the checkpoint is saved, and a crash here would only lose the clean
    exit; the job then ends at its time limit and can be resubmitted by hand.
    """
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job:
        job_id = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    else:
        job_id = os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        log.error("cannot requeue: %r is not a SLURM job id (from SLURM_JOB_ID / SLURM_ARRAY_*)", job_id)
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.error("`scontrol requeue %s` failed (%s): the job will not restart by itself", job_id, err)
        return False
    if result.returncode != 0:
        log.error(
            "`scontrol requeue %s` failed with exit status %d: %s; the job will not restart by itself",
            job_id,
            result.returncode,
            (result.stderr or result.stdout).strip(),
        )
        return False
    log.info("requeued SLURM job %s", job_id)
    return True


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
    fsspec writer. The temporary name of ``hpc_ckpt_<n>.ckpt`` reads ``hpc-ckpt-<n>``: Lightning takes
    any file whose name contains ``hpc_ckpt_`` for an HPC checkpoint, numbered by all the digits in
    its name, so a stale ``.hpc_ckpt_1.ckpt.x7q3.tmp`` would make a restart look for ``hpc_ckpt_173``.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = "." + path.name.replace("hpc_ckpt_", "hpc-ckpt-") + "."
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 would hide it from collaborators
            os.replace(temporary, path)
        except BaseException as err:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
            written = isinstance(err, RuntimeError) and "writ" in str(err)  # torch's "file write failed"
            if isinstance(err, OSError) or written:
                # a full disk, a quota, a read-only folder: one line naming the file (train.py)
                reason = (
                    err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
                )
                code = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
                raise OSError(
                    code, f"{reason}; {path.name} was not written, the previous one is intact", str(path)
                ) from err
            raise
        directory = os.open(path.parent, os.O_RDONLY)
        try:  # make the rename itself durable
            os.fsync(directory)
        finally:
            os.close(directory)
