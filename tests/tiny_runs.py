"""Overrides that shrink a training run to seconds, shared by the tests that train (tiny ListOps), and
`run_train_py`, the command line as a user types it."""

from __future__ import annotations

import os
import subprocess
import sys
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
