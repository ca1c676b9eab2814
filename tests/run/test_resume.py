"""Exact resume after a kill, SLURM requeue on SIGUSR1, and which checkpoint a restart picks.

The interrupted runs are real `python train.py` processes: one is SIGKILLed mid-epoch while
`tiny_runs.PauseAt` holds it after step ``KILL_AFTER``; the other gets SIGUSR1 with SLURM's variables set
(so Lightning uses its SLURMEnvironment and attnlab's `SlurmRequeue` takes the signal) and a fake
``scontrol`` on PATH. In-process runs raise the signal at chosen steps, on and off a validation step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

from attnlab.callbacks.checkpoint import AtomicCheckpointIO, SlurmRequeue, requeue_slurm_job
from attnlab.pipeline import resolve_ckpt_path, train
from attnlab.run.claim import RunDirError
from tiny_runs import KILL_AFTER, STEPS, pause_at, train_main, wait_until_paused, with_tiny_runs_importable
from tiny_runs import TINY_RESUMABLE as TINY

REPO_ROOT = Path(__file__).resolve().parents[2]


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", mmap=True, weights_only=True)["global_step"])


def _start(
    tmp_path: Path,
    *overrides: str,
    env: dict | None = None,
    base: list[str] = TINY,
    new_session: bool = False,
    pause: bool = True,
) -> subprocess.Popen:
    """``python train.py`` on the tiny config (or ``base``); one thread, as in the in-process runs (same
    float sums). ``new_session``: its own process group, to signal it with its loader workers (Ctrl-C).
    ``pause``: held after step ``KILL_AFTER`` until a signal comes (`_wait_until_paused`)."""
    command = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        *base,
        *overrides,
        *(pause_at(KILL_AFTER, tmp_path / "paused") if pause else []),
        f"paths.data_dir={tmp_path / 'data'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    full_env = with_tiny_runs_importable(full_env)
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def _wait_until_paused(process: subprocess.Popen, tmp_path: Path, timeout: float = 300) -> None:
    """Until the run `_start` began in ``tmp_path`` is held after step ``KILL_AFTER``."""
    wait_until_paused(process, tmp_path / "paused", timeout)


def _wait_for_step(process: subprocess.Popen, ckpt: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(
                f"train.py ended (rc {process.returncode}) before step {step}:\n"
                f"{process.stdout.read()[-3000:]}"
            )
        try:
            if ckpt.is_file() and _step(ckpt) >= step:
                return
        except (RuntimeError, EOFError, OSError):  # replaced while we read it: look again
            pass
        time.sleep(0.01)
    process.kill()
    pytest.fail(f"no checkpoint at step >= {step} in {ckpt} after {timeout} s")


def _kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    process.stdout.close()


def _weights_and_optimizer(path: Path) -> tuple[dict, dict]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt["state_dict"], ckpt["optimizer_states"][0]["state"]


@pytest.mark.slow
def test_run_killed_mid_epoch_resumes_to_the_same_weights_and_metrics(train_config, tmp_path, uninterrupted):
    uninterrupted, uninterrupted_dir = uninterrupted

    process = _start(tmp_path)  # same config, in its own process, killed without warning
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    _wait_until_paused(process, tmp_path)
    _kill(process)
    killed_at = _step(last)
    assert killed_at == KILL_AFTER, f"killed while held after step {KILL_AFTER}, last.ckpt at {killed_at}"

    resumed = train(train_config(*TINY, f"ckpt_path={last}"))
    assert resumed["steps"] == uninterrupted["steps"] == STEPS

    weights_a, optim_a = _weights_and_optimizer(uninterrupted_dir / "checkpoints" / "last.ckpt")
    weights_b, optim_b = _weights_and_optimizer(last)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), f"{name} differs after resuming at {killed_at}"
    for index, state in optim_a.items():
        for key, value in state.items():
            assert torch.equal(value, optim_b[index][key]), f"optimizer state {index}.{key} differs"
    assert resumed["val_acc"] == uninterrupted["val_acc"]
    assert resumed["test_acc"] == uninterrupted["test_acc"]


def _fake_slurm(tmp_path: Path) -> tuple[dict, Path]:
    """SLURM's variables for one task (Lightning then uses SLURMEnvironment, auto-requeue on) and a
    ``scontrol`` on PATH that records its arguments instead of requeueing."""
    bin_dir, record = tmp_path / "fake-bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\n')
    scontrol.chmod(0o755)
    env = {
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "attnlab-test",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    env_clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env_clean, **env}, record


def _assert_same_training(run_a: Path, run_b: Path, where: str) -> None:
    """Same weights and optimizer state in both runs' ``last.ckpt``."""
    weights_a, optim_a = _weights_and_optimizer(run_a / "checkpoints" / "last.ckpt")
    weights_b, optim_b = _weights_and_optimizer(run_b / "checkpoints" / "last.ckpt")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), f"{name} differs after {where}"
    for index, state in optim_a.items():
        for key, value in state.items():
            assert torch.equal(value, optim_b[index][key]), f"optimizer state {index}.{key} differs"


def _loops(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["loops"]


@pytest.mark.slow
def test_sigusr1_under_slurm_checkpoints_at_a_step_boundary_requeues_and_the_restart_matches(
    tmp_path, uninterrupted
):
    uninterrupted, uninterrupted_dir = uninterrupted
    env, record = _fake_slurm(tmp_path)
    run = tmp_path / "run"
    last, hpc = run / "checkpoints" / "last.ckpt", run / "hpc_ckpt_1.ckpt"

    process = _start(tmp_path, env=env)
    _wait_until_paused(process, tmp_path)
    process.send_signal(signal.SIGUSR1)  # what SLURM sends 90 s before the time limit
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert record.read_text().split() == ["requeue", "4242"]
    saved = _step(hpc)
    assert saved == KILL_AFTER + 1  # the signal came while held after KILL_AFTER: the next boundary
    # nothing trained, validated or saved after the hpc checkpoint: last.ckpt holds the same state
    assert _step(last) == saved and _loops(last) == _loops(hpc)
    assert not (run / "summary.json").exists()

    # the requeued job: same command, same run dir, ckpt_path null: Lightning picks hpc_ckpt_1.ckpt
    restarted = _start(tmp_path, env=env, pause=False)
    output, _ = restarted.communicate(timeout=120)
    assert restarted.returncode == 0, output[-3000:]
    assert f"Restoring states from the checkpoint path at {hpc}" in output
    assert record.read_text().split() == ["requeue", "4242"]  # requeued once
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == uninterrupted["steps"] == STEPS
    _assert_same_training(uninterrupted_dir, run, f"a requeue at step {saved}")
    assert summary["val_acc"] == uninterrupted["val_acc"]
    assert summary["test_acc"] == uninterrupted["test_acc"]


class SignalAt(L.Callback):
    """Raises SIGUSR1 in this process at the end of the given steps (before `SlurmRequeue` looks)."""

    def __init__(self, steps: list[int]):
        self.steps = set(steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_requeue_signal_on_and_off_a_validation_step_resumes_exactly(
    train_config, tmp_path, monkeypatch, uninterrupted
):
    """Step 15: saved right after the step; step 20 (validated): saved after that validation, which the
    resumed run must not repeat. Two requeues, then the run ends as an uninterrupted one does."""
    uninterrupted, uninterrupted_dir = uninterrupted
    env, record = _fake_slurm(tmp_path)
    for key, value in env.items():
        if key.startswith("SLURM_") or key == "PATH":
            monkeypatch.setenv(key, value)
    handler = signal.getsignal(signal.SIGUSR1)
    run = tmp_path / "run"
    signal_at = [
        "+callbacks.signal_at._target_=run.test_resume.SignalAt",
        "+callbacks.signal_at.steps=[15,20]",
        "callbacks.last_checkpoint.every_n_train_steps=0",
    ]

    first = train(train_config(*TINY, *signal_at))
    assert first["preempted"] and first["steps"] == 15 and _step(run / "hpc_ckpt_1.ckpt") == 15
    # last.ckpt is written at validations only here: still step 10's, so nothing was saved after the
    # hpc checkpoint (neither a validation that should_stop would start nor the end-of-training save)
    assert _step(run / "checkpoints" / "last.ckpt") == 10
    second = train(train_config(*TINY, *signal_at))  # Lightning's rule: resumes from hpc_ckpt_1
    assert second["preempted"] and _step(run / "hpc_ckpt_2.ckpt") == 20
    assert _loops(run / "hpc_ckpt_2.ckpt") == _loops(run / "checkpoints" / "last.ckpt")
    assert not (run / "summary.json").exists()
    third = train(train_config(*TINY, *signal_at, "ckpt_path=auto"))  # the sbatch script's setting
    assert not third.get("preempted") and third["steps"] == STEPS
    assert record.read_text().split() == ["requeue", "4242"] * 2
    assert signal.getsignal(signal.SIGUSR1) == handler  # restored after each fit

    _assert_same_training(uninterrupted_dir, run, "requeues at steps 15 and 20")
    assert third["val_acc"] == uninterrupted["val_acc"]
    assert third["test_acc"] == uninterrupted["test_acc"]


def test_an_array_task_requeues_itself_by_its_array_id(tmp_path, monkeypatch):
    """A sweep's runs are tasks of one job array: ``scontrol requeue <array job>_<task>`` requeues the
    task, where its own SLURM_JOB_ID would name a job the controller may have folded into the array."""
    env, record = _fake_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("SLURM_JOB_ID", "4250")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue_slurm_job() is True
    assert record.read_text().split() == ["requeue", "4242_3"]


def test_failed_requeue_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "Invalid job id specified" >&2\nexit 1\n')
    scontrol.chmod(0o755)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.ERROR):
        assert requeue_slurm_job() is False
    assert "exit status 1: Invalid job id specified" in caplog.text
    scontrol.unlink()
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert requeue_slurm_job() is False  # no scontrol at all
    assert "scontrol requeue 4242" in caplog.text
    monkeypatch.setenv("SLURM_JOB_ID", "4242; rm -rf /")
    assert requeue_slurm_job() is False


@pytest.mark.parametrize("where", ["outside SLURM", "auto_requeue=False", "SLURM"])
def test_requeue_handler_only_under_slurm_with_auto_requeue(where, tmp_path, monkeypatch):
    """Outside SLURM (or with Lightning's auto-requeue turned off) SIGUSR1 keeps its handler."""
    env, _ = _fake_slurm(tmp_path)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    if where != "outside SLURM":
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    plugins = [SLURMEnvironment(auto_requeue=False)] if where == "auto_requeue=False" else None
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, plugins=plugins, default_root_dir=tmp_path
    )
    before = signal.getsignal(signal.SIGUSR1)
    requeue = SlurmRequeue()
    requeue.setup(trainer, None, "fit")
    installed = signal.getsignal(signal.SIGUSR1)
    requeue.teardown(trainer, None, "fit")
    assert (installed == requeue._handle) == (where == "SLURM")
    assert signal.getsignal(signal.SIGUSR1) == before


def _fake_checkpoint(path: Path, step: int, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "state_dict": {}}, path)
    os.utime(path, (mtime, mtime))


def test_auto_picks_the_newest_of_hpc_and_last_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert resolve_ckpt_path("auto", run) is None  # nothing yet: start fresh
    _fake_checkpoint(run / "checkpoints" / "last.ckpt", step=50, mtime=1000)
    assert resolve_ckpt_path("auto", run) == str(run / "checkpoints" / "last.ckpt")
    _fake_checkpoint(run / "hpc_ckpt_1.ckpt", step=40, mtime=2000)  # written later, but an older step
    assert resolve_ckpt_path("auto", run) == str(run / "checkpoints" / "last.ckpt")
    _fake_checkpoint(run / "hpc_ckpt_2.ckpt", step=60, mtime=500)
    assert resolve_ckpt_path("auto", run) == str(run / "hpc_ckpt_2.ckpt")
    _fake_checkpoint(run / "checkpoints" / "last.ckpt", step=60, mtime=3000)  # same step: the later file
    assert resolve_ckpt_path("auto", run) == str(run / "checkpoints" / "last.ckpt")
    assert resolve_ckpt_path(None, run) is None and resolve_ckpt_path("null", run) is None


def test_auto_names_an_unreadable_checkpoint(tmp_path):
    from attnlab.errors import CheckpointError

    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match=r"hpc_ckpt_1\.ckpt is corrupt"):
        resolve_ckpt_path("auto", tmp_path)


def test_null_resumes_from_hpc_checkpoint_only_under_slurm(train_config, tmp_path, monkeypatch, caplog):
    """Lightning's own rule, which `ckpt_path: null` relies on after a requeue."""
    train(train_config(*TINY, "trainer.max_steps=4", "test=false"))
    hpc = tmp_path / "run" / "hpc_ckpt_1.ckpt"
    (tmp_path / "run" / "checkpoints" / "last.ckpt").rename(hpc)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    with caplog.at_level(logging.INFO), pytest.raises(RunDirError, match="already holds a finished run"):
        train(train_config(*TINY, "trainer.max_steps=6", "test=false"))
    assert str(hpc) not in caplog.text  # not on SLURM: a fresh start, refused over the earlier run

    env, _ = _fake_slurm(tmp_path)
    for key, value in env.items():
        if key.startswith("SLURM_"):
            monkeypatch.setenv(key, value)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        resumed = train(train_config(*TINY, "trainer.max_steps=6", "test=false"))
    assert f"Restoring states from the checkpoint path at {hpc}" in caplog.text
    assert resumed["steps"] == 6


def test_failed_checkpoint_write_leaves_the_previous_last_ckpt_loadable(train_config, tmp_path, monkeypatch):
    """A write that dies half-way (here: torch.save raises after some bytes) never replaces last.ckpt."""
    cfg = train_config(*TINY, "trainer.max_steps=3", "test=false")
    assert cfg.trainer.plugins[0]._target_ == "attnlab.callbacks.checkpoint.AtomicCheckpointIO"
    train(cfg)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()

    def dies_half_way(obj, handle, *args, **kwargs):
        handle.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        AtomicCheckpointIO().save_checkpoint({"global_step": 99}, last)
    assert last.read_bytes() == before and _step(last) == 3
    assert not list(last.parent.glob(".*.tmp"))  # the temporary file is removed
    monkeypatch.undo()

    AtomicCheckpointIO().save_checkpoint({"global_step": 7}, last)  # a complete write replaces it
    assert _step(last) == 7 and oct(last.stat().st_mode & 0o777) != "0o600"


def test_stale_temporary_file_does_not_renumber_hpc_checkpoints(tmp_path, monkeypatch):
    """A write killed half-way leaves its .tmp; Lightning counts every name containing ``hpc_ckpt_``."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    def dies_half_way(obj, handle, *args, **kwargs):
        raise OSError("killed")

    monkeypatch.setattr(torch, "save", dies_half_way)
    monkeypatch.setattr(os, "remove", lambda path: None)  # as if killed before the clean-up
    with pytest.raises(OSError, match="killed"):
        AtomicCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "hpc_ckpt_1.ckpt")
    monkeypatch.undo()
    assert [p.name.startswith(".hpc-ckpt-1.ckpt.") for p in tmp_path.iterdir()] == [True]
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_1.ckpt")


# ---- resume as the README writes it; history across attempts ---------------------------------------------
def _readme_run(tmp_path: Path, *overrides: str, pause: bool = False) -> subprocess.Popen:
    """``python train.py [overrides]`` in ``tmp_path`` with nothing but the tiny sizes: no run dir given.
    ``pause``: held after step ``KILL_AFTER`` until a signal comes (`_wait_until_paused`)."""
    held = pause_at(KILL_AFTER, tmp_path / "paused") if pause else []
    command = [sys.executable, str(REPO_ROOT / "train.py"), *TINY, *overrides, *held]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    env = with_tiny_runs_importable(env)
    return subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _metric_steps(run_dir: Path, column: str) -> list[int]:
    import csv

    with (run_dir / "csv" / "metrics.csv").open(newline="") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get(column)]


@pytest.mark.slow
def test_resume_as_the_readme_writes_it_continues_the_same_run(tmp_path):
    """``ckpt_path=<run>/checkpoints/last.ckpt``, no ``hydra.run.dir``: same run dir, best-checkpoint
    tracking restored, metric rows and wall time of the killed attempt kept, attempts counted."""
    process = _readme_run(tmp_path, "logger=csv", "trainer.log_every_n_steps=1", pause=True)
    runs = tmp_path / "outputs" / "listops" / "sliced_relu"
    _wait_until_paused(process, tmp_path)
    found = list(runs.glob("*/checkpoints/last.ckpt"))
    assert len(found) == 1, f"expected one run's last.ckpt, found {found}"
    (last,) = found
    _kill(process)
    run_dir, killed_at = last.parent.parent, _step(last)
    assert killed_at == KILL_AFTER
    first_attempt_s = torch.load(last, weights_only=True)["callbacks"]["AttemptClock"]["wall_time_s"]

    relative = last.relative_to(tmp_path)  # typed as a user would, from where they ran the first command
    resumed = _readme_run(tmp_path, "logger=csv", "trainer.log_every_n_steps=1", f"ckpt_path={relative}")
    output, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, output[-3000:]
    assert [p.parent.parent for p in runs.glob("*/checkpoints/last.ckpt")] == [run_dir]  # no new run dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["attempts"] == 2
    assert summary["val_acc"] is not None  # best-checkpoint tracking came back with the checkpoint
    assert Path(summary["best_checkpoint"]).parent == run_dir / "checkpoints"
    assert summary["wall_time_s"] > first_attempt_s
    train_steps = _metric_steps(run_dir, "train/loss")
    assert train_steps == sorted(set(train_steps)), "a step logged twice"
    assert train_steps == list(range(STEPS)), "rows of the killed attempt lost, or a step logged twice"
    assert _metric_steps(run_dir, "val/acc") == [9, 19, 29]


# ---- checkpoints are never unpickled unsafely ------------------------------------------------------------
class _RunsCode:
    """Unpickling this object runs a shell command (what a planted checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": 999, "state_dict": {}, "payload": _RunsCode(marker)}, path)


def test_planted_hpc_checkpoint_is_refused_not_run(train_config, tmp_path):
    from attnlab.errors import CheckpointError

    train(train_config(*TINY, "trainer.max_steps=4", "test=false"))
    marker = tmp_path / "code-ran"
    _plant(tmp_path / "run" / "hpc_ckpt_9.ckpt", marker)
    with pytest.raises(CheckpointError, match=r"hpc_ckpt_9\.ckpt holds objects other than tensors"):
        train(train_config(*TINY, "trainer.max_steps=6", "ckpt_path=auto"))
    assert not marker.exists()


@pytest.mark.parametrize("where", ["outside the run dir", "inside the run dir"])
def test_best_checkpoint_path_from_a_resumed_state_is_checked(train_config, tmp_path, where):
    """A ``last.ckpt`` that loads safely can still name any file as the best checkpoint to test."""
    from attnlab.errors import CheckpointError

    train(train_config(*TINY, "trainer.max_steps=10", "test=false"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    marker = tmp_path / "code-ran"
    planted = (tmp_path / "elsewhere" if where == "outside the run dir" else last.parent) / "best-evil.ckpt"
    _plant(planted, marker)
    checkpoint = torch.load(last, weights_only=True)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("ModelCheckpoint") and "'val/acc'" in k]
    checkpoint["callbacks"][key]["best_model_path"] = str(planted)
    torch.save(checkpoint, last)

    expected = "lies outside the run dir" if where == "outside the run dir" else "objects other than tensors"
    with pytest.raises(CheckpointError, match=expected):
        train(train_config(*TINY, "trainer.max_steps=10", f"ckpt_path={last}"))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is an empty file"),
        (b"garbage, not a checkpoint", "is corrupt or not a PyTorch checkpoint"),
        ({"weights": torch.zeros(2)}, "is not a Lightning checkpoint"),
    ],
)
def test_bad_ckpt_path_files_are_named_on_the_command_line(tmp_path, content, message):
    bad = tmp_path / "bad.ckpt"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        torch.save(content, bad)
    done = train_main(*TINY, f"ckpt_path={bad}", cwd=tmp_path)
    assert done.returncode == 1
    assert f"error: ckpt_path {bad} {message}" in done.stderr
    assert "Traceback" not in done.stderr
