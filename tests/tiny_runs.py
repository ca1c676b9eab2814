"""Overrides that shrink a training run to seconds, shared by the tests that train (tiny ListOps), and
`run_train_py`, the command line as a user types it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

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

    For the command line's checks and error messages; a run whose output comes from Lightning's own
    loggers, threads or signals needs ``run_train_py``. The logging set-up Hydra installs for the run
    is taken down again."""
    main = _train_script().main
    root = logging.getLogger()
    handlers, level, here = root.handlers[:], root.level, os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(list(args))
    finally:
        os.chdir(here)
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(["train.py", *args], status, out.getvalue(), err.getvalue())
