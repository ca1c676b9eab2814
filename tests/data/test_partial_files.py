"""Nothing half-written survives: a failed or interrupted writer removes its files, and what a
kill -9 left behind is removed by the next run (only when its writer is gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from attnlab.data.pointcloud import shapes
from attnlab.files import remove_orphans, removed_on_failure
from tiny_runs import REPO_ROOT


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_removed_on_failure_removes_files_and_folders_and_reraises(tmp_path):
    folder, file = tmp_path / "set.tmp-1", tmp_path / "train.bin.partial"
    with pytest.raises(KeyboardInterrupt), removed_on_failure(folder, file):
        (folder / "a").mkdir(parents=True)
        file.write_bytes(b"half")
        raise KeyboardInterrupt
    assert not folder.exists() and not file.exists()
    with removed_on_failure(file):  # a block that finishes keeps what it wrote
        file.write_bytes(b"whole")
    assert file.read_bytes() == b"whole"


def test_orphans_of_dead_writers_go_and_live_writers_keep_theirs(tmp_path):
    dead, alive = tmp_path / f"shapes.tmp-{_dead_pid()}", tmp_path / f"shapes.tmp-{os.getpid()}"
    for folder in (dead, alive):
        (folder / "x").mkdir(parents=True)
    (tmp_path / "shapes.tmp-notapid").mkdir()
    assert remove_orphans(tmp_path, r"shapes\.tmp-(?P<pid>\d+)") == [dead]
    assert alive.exists() and (tmp_path / "shapes.tmp-notapid").exists()


def test_generation_interrupted_leaves_nothing_and_killed_leftovers_are_cleared(tmp_path, monkeypatch):
    root = tmp_path / "shapes"
    leftover = tmp_path / f"shapes.tmp-{_dead_pid()}"
    (leftover / "cube").mkdir(parents=True)  # what a kill -9 of an earlier generator left
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = shapes.random_solid
    monkeypatch.setattr(shapes, "random_solid", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shapes.generate_shapes(root, train_per_class=2, test_per_class=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no set, no temporary folder, no leftover"
    monkeypatch.setattr(shapes, "random_solid", real)
    shapes.generate_shapes(root, train_per_class=2, test_per_class=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"]


def test_ctrl_c_during_data_preparation_is_one_line_and_leaves_nothing(tmp_path, terminal_signals):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, str(REPO_ROOT / "train.py"), "task=shapes", "logger=none",
        "task.data.source.train_per_class=400",  # long enough to be interrupted while writing
        f"paths.data_dir={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    log = tmp_path / "stderr.txt"  # a file, not a pipe: a full pipe would stall the run
    with open(log, "w") as stderr_file:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr_file, text=True)
        shapes_dir, deadline = tmp_path / "data" / "shapes", time.monotonic() + 120
        while not list(shapes_dir.glob("*.tmp-*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the generator never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    stderr = log.read_text()
    assert proc.returncode == 130, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted (Ctrl-C); nothing half-written was kept, the next run starts clean"]
    assert "Traceback" not in stderr
    assert not list(shapes_dir.iterdir()), "the half-written set was removed"
