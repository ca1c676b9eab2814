"""Overrides that shrink a training run to seconds, shared by the tests that train (tiny ListOps),
`run_train_py`, the command line as a user types it, and `PauseAt`, which holds a run for a signal."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import lightning as L

from attnlab.callbacks.checkpoint import StepBoundaryStop

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = Path(__file__).resolve().parent

TINY_LISTOPS_DATA = [
    "task.data.source.sizes.train=192",
    "task.data.source.sizes.val=64",
    "task.data.source.sizes.test=64",
    "task.data.source.min_length=10",
    "task.data.source.max_length=60",
    "task.data.batch_size=16",
]
TINY_MODEL = ["task.model.dim=16", "task.model.mlp_dim=32"]
QUIET = ["trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0"]
TINY_LISTOPS = [*TINY_LISTOPS_DATA, *TINY_MODEL, *QUIET]

# the runs that are killed, signalled and resumed (test_resume, test_interrupt, test_resume_tasks)
STEPS, KILL_AFTER = 36, 14  # 192 training examples / batch 16 = 12 steps per epoch: 3 epochs
TINY_RESUMABLE = [
    *TINY_LISTOPS,
    "logger=none",
    "callbacks.throughput.warmup_steps=2",
    # dropout on, so a resumed run matches only if the random states are restored too
    "task.model.dropout=0.1",
    "task.model.attn_dropout=0.1",
    "trainer.deterministic=true",
    f"trainer.max_steps={STEPS}",
    "task.val_check_interval=10",
    "callbacks.last_checkpoint.every_n_train_steps=1",
]


def run_train_py(
    *args: str, cwd: Path = REPO_ROOT, timeout: int = 600, single_thread: bool = False
) -> subprocess.CompletedProcess:
    """``python train.py <args>`` run in ``cwd`` (Hydra's ``outputs/`` lands there), output captured.

    ``single_thread``: one OpenMP/MKL thread and no ``SLURM_*`` variables, for runs that must not be
    slowed by oversubscription on a loaded 2-core machine or mistaken for a SLURM job step.
    """
    env = None
    if single_thread:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, str(REPO_ROOT / "train.py"), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@cache
def _train_script():
    """``train.py`` imported as the module ``train`` (Hydra names the run's log after it); its
    ``__main__`` block, the thread set-up, does not run."""
    spec = importlib.util.spec_from_file_location("train", REPO_ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_main(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python train.py <args>`` in ``cwd`` through ``train.main(argv)`` in this process: the exit
    status and what it printed, as ``run_train_py`` returns them, without starting an interpreter.

    For the command line's checks, messages and short runs; a test of exit by signal or of the thread
    set-up at start needs ``run_train_py``."""
    return _as_a_command(_train_script().main, ["train.py", *args], cwd)


def attnlab_main(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``attnlab <args>`` in ``cwd`` through ``attnlab.cli.main.main(argv)`` in this process."""
    from attnlab.cli.main import main

    return _as_a_command(main, ["attnlab", *args], cwd)


def _as_a_command(main, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``main(argv[1:])`` run in ``cwd`` with its output captured, as a command's; the logging set-up
    it installs (Hydra's, for a run) is taken down again."""
    root = logging.getLogger()
    handlers, level, here = root.handlers[:], root.level, os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv[1:])
    finally:
        os.chdir(here)
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


class PauseAt(L.Callback):
    """Holds training before the step after ``step`` (whose checkpoints are written by then), says so
    by creating ``marker``, and waits there until a signal arrives: a kill, or one that attnlab's
    handlers answer with a stop at the next step boundary. A test then signals a run at a known step,
    however fast or slow the machine, instead of racing the steps it polls for."""

    def __init__(self, step: int, marker: str, timeout: float = 300.0):
        self.step, self.marker, self.timeout, self.held = step, Path(marker), timeout, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.held or trainer.global_step != self.step:
            return
        self.held = True
        stops = [c for c in trainer.callbacks if isinstance(c, StepBoundaryStop)]
        self.marker.write_text(f"{trainer.global_step}\n")
        deadline = time.monotonic() + self.timeout
        while all(stop.received is None for stop in stops) and time.monotonic() < deadline:
            time.sleep(0.01)


def with_tiny_runs_importable(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``TESTS_DIR`` first on ``PYTHONPATH``: a process started with it can import
    ``tiny_runs`` (the `PauseAt` callback of `pause_at`)."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))}


def pause_at(step: int, marker: Path) -> list[str]:
    """The overrides that add `PauseAt` to a run (a subprocess needs `with_tiny_runs_importable`'s path)."""
    return [
        "+callbacks.pause_at._target_=tiny_runs.PauseAt",
        f"+callbacks.pause_at.step={step}",
        f"+callbacks.pause_at.marker={marker}",
    ]


def wait_until_paused(process: subprocess.Popen, marker: Path, timeout: float = 300) -> None:
    """Until the run started as ``process`` reports (``marker``) that `PauseAt` holds it."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if process.poll() is not None:
            output = process.stdout.read()[-3000:] if process.stdout else ""
            raise AssertionError(f"train.py ended (rc {process.returncode}) before it paused:\n{output}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"train.py did not pause (no {marker}) within {timeout} s")
        time.sleep(0.02)
