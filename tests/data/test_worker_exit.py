"""Loader workers ignore SIGTERM (the training process handles it), yet never keep a process alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from attnlab.data.loaders import _worker_init

FAILING_TEST = textwrap.dedent(
    """
    from functools import partial

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from attnlab.data.loaders import _worker_init


    def test_fails_while_its_loader_workers_run():
        loader = DataLoader(
            TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2,
            worker_init_fn=partial(_worker_init, rank=0),  # what ShardedDataModule's loaders pass
        )
        batches = iter(loader)
        next(batches)
        assert False, "fails on purpose, its traceback holding the live iterator"
    """
)


@pytest.mark.slow
def test_a_failing_test_holding_loader_workers_does_not_hang_pytest(tmp_path):
    """At exit multiprocessing sent the workers SIGTERM, which they ignore, and waited forever."""
    (tmp_path / "test_holds_workers.py").write_text(FAILING_TEST)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_holds_workers.py"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 failed" in done.stdout
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_worker_ends_when_its_parent_is_killed(tmp_path):
    """A parent killed with kill -9 runs no exit handler: each worker watches its parent itself."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from functools import partial
            import torch
            from torch.utils.data import DataLoader, Dataset
            from attnlab.data.loaders import _worker_init

            class Slow(Dataset):  # a worker busy in dataset code never looks at its queue
                def __len__(self):
                    return 8
                def __getitem__(self, i):
                    time.sleep(3600)

            loader = DataLoader(Slow(), num_workers=2, worker_init_fn=partial(_worker_init, rank=0))
            batches = iter(loader)
            print(" ".join(str(w.pid) for w in batches._workers), flush=True)
            time.sleep(3600)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2
        time.sleep(1.0)  # the workers run their init (and its watchdog)
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers), "workers outlived their killed parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _one_worker_loader() -> DataLoader:
    """Four batches from one worker set up as training's workers are (`_worker_init`)."""
    return DataLoader(
        TensorDataset(torch.arange(16.0)),
        batch_size=4,
        num_workers=1,
        worker_init_fn=partial(_worker_init, rank=0),
    )


def test_workers_still_ignore_sigterm_while_the_parent_lives(terminal_signals):
    batches = iter(_one_worker_loader())
    next(batches)
    (worker,) = batches._workers
    os.kill(worker.pid, 15)
    time.sleep(0.5)
    assert worker.is_alive()
    assert len(list(batches)) == 3  # the rest of the epoch still arrives
    batches._shutdown_workers()


def test_shutting_down_ends_the_workers_of_an_iterator_still_held():
    """What a failing test leaves: an iterator still referenced (by its traceback), its worker alive."""
    from conftest import shut_down_loader_workers

    held = iter(_one_worker_loader())
    next(held)
    (worker,) = held._workers
    shut_down_loader_workers()
    worker.join(timeout=10)
    assert not worker.is_alive() and held is not None


def test_the_exit_handler_kills_a_worker_that_ignores_sigterm_after_the_grace():
    """`_end_workers_at_exit` in the process itself: the worker ignores SIGTERM (`_worker_init`), so
    it lives through the grace and is then killed; nothing waits forever."""
    from attnlab.data.loaders import _end_workers_at_exit

    batches = iter(_one_worker_loader())
    next(batches)
    (worker,) = batches._workers
    sigchld = signal.getsignal(signal.SIGCHLD)  # the handler resets torch's, as at exit
    started = time.monotonic()
    try:
        _end_workers_at_exit(grace_s=0.5)
        assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
        assert time.monotonic() - started >= 0.5
    finally:
        signal.signal(signal.SIGCHLD, sigchld)
        batches._shutdown_workers()
