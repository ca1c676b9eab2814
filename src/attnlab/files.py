"""Files that several processes write, or that a kill may cut short: a lock to take turns, SIGTERM
turned into an exception while writing, and the removal of what an interrupted writer left behind.

Stdlib only: the data loaders, the MLflow store and the pipeline all use it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


@contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the duration of the block.

    Several processes preparing the same dataset (DDP ranks started together by ``srun``) take
    turns: the first generates the files, the others then find them complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where files are being written (`sigterm_raises`) so that `removed_on_failure`
    removes them; a KeyboardInterrupt, so the entry points end it as they end a Ctrl-C."""

    signal_name = "SIGTERM"


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block SIGTERM raises `Terminated` instead of killing the process outright, which
    left half-written files (``.tmp``) in the data dir. Main thread only (where handlers run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def removed_on_failure(*paths: Path) -> Iterator[None]:
    """Files or folders being written: removed when the block does not finish (an error, Ctrl-C, a
    SIGTERM that raises), so the next run finds nothing half-written."""
    try:
        yield
    except BaseException:
        for path in paths:
            if Path(path).is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                Path(path).unlink(missing_ok=True)
        raise


def remove_orphans(folder: Path, pattern: str) -> list[Path]:
    """Remove the entries of ``folder`` matching ``pattern`` (a regex whose group ``pid`` is the
    writer's process id) whose writer is gone: what a kill -9 left behind. A live writer's are kept."""
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = re.fullmatch(pattern, entry.name)
        if match is None or _process_alive(int(match.group("pid"))):
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        log.info("removed %d leftover(s) of interrupted writers in %s", len(removed), folder)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
