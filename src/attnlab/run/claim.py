"""Who may write a run dir: one run at a time, and a fresh run never over an earlier one's results.

A fresh run (no checkpoint to resume) started in a dir that holds a finished or interrupted run used
to replace its ``summary.json``, ``last.ckpt`` and metrics without a word; two runs started together
in one dir wrote over each other. `run_dir_lock` lets one process at a time write a run dir, and
`claim_for_fresh_run` refuses a dir that holds a run unless ``overwrite=true``, which moves the old
run aside into ``<run_dir>.replaced-<time>`` first.

A run resumed from a checkpoint in its own dir (``ckpt_path=auto``) continues the run it finds; what
it may change is `attnlab.run.resume.check_resume_config`'s.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from attnlab.errors import UserError

#: the lock file a running run holds in its run dir
LOCK_NAME = ".attnlab-run.lock"


class RunDirError(UserError):
    """A run dir that this run may not write (another run's results, or another run writing it now)."""


def previous_run(run_dir: str | Path) -> str | None:
    """What of an earlier run ``run_dir`` holds, in words, or None when it holds no run's results."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    summary = run_dir / "summary.json"
    if summary.is_file():
        text = summary.read_text(errors="replace")
        if '"interrupted": true' in text:
            return "an interrupted run (summary.json marked interrupted, checkpoints/last.ckpt)"
        return "a finished run (summary.json)"
    checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt")) + sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
    if checkpoints:
        return f"a run's checkpoints ({checkpoints[0].relative_to(run_dir)})"
    metrics = run_dir / "csv" / "metrics.csv"
    if metrics.is_file() and metrics.stat().st_size:
        return "a run's metrics (csv/metrics.csv)"
    return None


def claim_for_fresh_run(run_dir: str | Path, overwrite: bool, resume_hint: str) -> Path | None:
    """Refuse to start a fresh run in a dir holding an earlier run, or, with ``overwrite``, move that
    run aside; returns where it went (None when there was nothing to move).

    ``resume_hint`` is the command that would continue the run found instead.
    """
    run_dir = Path(run_dir)
    found = previous_run(run_dir)
    if found is None:
        return None
    if not overwrite:
        raise RunDirError(
            f"{run_dir} already holds {found}; starting a fresh run there would replace it. Resume it "
            f"({resume_hint}), choose another hydra.run.dir, or pass overwrite=true to move the old run "
            f"aside into {run_dir.name}.replaced-<time>"
        )
    return move_aside(run_dir)


def move_aside(run_dir: Path) -> Path:
    """Move an earlier run's files into ``<run_dir>.replaced-<time>`` beside it.

    Hydra has already written this run's ``.hydra/`` and opened its log when attnlab's code runs:
    those stay (the old log is copied, since this run appends to the same file).
    """
    base = f"{run_dir.name}.replaced-{time.strftime('%Y-%m-%d_%H-%M-%S')}"
    aside, suffix = run_dir.with_name(base), 1
    while aside.exists():
        aside, suffix = run_dir.with_name(f"{base}-{suffix}"), suffix + 1
    aside.mkdir(parents=True)
    for entry in sorted(run_dir.iterdir()):
        if entry.name in (".hydra", LOCK_NAME):
            continue
        if entry.suffix == ".log" and entry.is_file():
            shutil.copy2(entry, aside / entry.name)
            continue
        shutil.move(os.fspath(entry), os.fspath(aside / entry.name))
    return aside


@contextmanager
def run_dir_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold ``<run_dir>/.attnlab-run.lock`` for the block; refuse at once when another process holds it.

    The lock (``flock``) goes with the process: a run killed with ``kill -9`` leaves no stale lock.
    """
    path = Path(run_dir) / LOCK_NAME
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise RunDirError(
                f"another run (process {holder}) is writing {run_dir} right now; wait for it to end or "
                f"choose another hydra.run.dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        _HELD.add(handle)
        try:
            yield
        finally:
            _HELD.discard(handle)
            fcntl.flock(handle, fcntl.LOCK_UN)


#: the lock files this process holds open
_HELD: set = set()


def _close_in_child() -> None:
    """A forked child (a loader worker) shares the lock's open file: closing its copy leaves the lock
    to the parent alone, so a run killed with ``kill -9`` frees its dir when it dies, not when its
    last worker notices."""
    for handle in list(_HELD):
        with suppress(OSError):
            handle.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def locked_by_another(run_dir: str | Path) -> bool:
    """Whether a live process holds ``run_dir``'s lock (the dir is then never cleaned up by another)."""
    path = Path(run_dir) / LOCK_NAME
    if not path.is_file():
        return False
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False
