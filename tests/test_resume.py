"""Exact resume after a kill, SLURM requeue on SIGUSR1, and which checkpoint a restart picks.

The killed runs are real `python train.py` processes: one is SIGKILLed mid-epoch once its
``last.ckpt`` reports a step past ``KILL_AFTER``; the other gets SIGUSR1 with SLURM's variables set
(so Lightning's SLURMEnvironment and its auto-requeue are active) and a fake ``scontrol`` on PATH.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnlab.callbacks.checkpoint import AtomicCheckpointIO
from attnlab.pipeline import resolve_ckpt_path, train
from tiny_runs import TINY_LISTOPS

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER, EPOCH = 36, 14, 12  # 192 training examples / batch 16 = 12 steps per epoch: 3 epochs
TINY = [
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


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["global_step"])


def _start(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """``python train.py`` on the tiny config; one thread, as in the in-process runs (same float sums)."""
    command = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        *TINY,
        *overrides,
        f"paths.data_dir={tmp_path / 'data'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        command, cwd=tmp_path, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


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
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return ckpt["state_dict"], ckpt["optimizer_states"][0]["state"]


def test_run_killed_mid_epoch_resumes_to_the_same_weights_and_metrics(train_config, tmp_path):
    uninterrupted = train(train_config(*TINY, f"paths.run_dir={tmp_path / 'uninterrupted'}"))

    process = _start(tmp_path)  # same config, in its own process, killed without warning
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    _wait_for_step(process, last, KILL_AFTER)
    _kill(process)
    killed_at = _step(last)
    assert KILL_AFTER <= killed_at < STEPS, f"train.py finished (step {killed_at}) before it was killed"

    resumed = train(train_config(*TINY, f"ckpt_path={last}"))
    assert resumed["steps"] == uninterrupted["steps"] == STEPS

    weights_a, optim_a = _weights_and_optimizer(tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt")
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


def test_sigusr1_under_slurm_saves_hpc_checkpoint_requeues_and_the_restart_resumes(train_config, tmp_path):
    train(train_config(*TINY, "trainer.max_steps=1", "test=false"))  # generate the data once, in-process
    env, record = _fake_slurm(tmp_path)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    last.unlink()

    process = _start(tmp_path, env=env)
    _wait_for_step(process, last, KILL_AFTER)
    process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while not record.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    _kill(process)  # what `scontrol requeue` does to the running job
    assert record.read_text().split() == ["requeue", "4242"]
    hpc = tmp_path / "run" / "hpc_ckpt_1.ckpt"
    saved = _step(hpc)
    assert KILL_AFTER <= saved < STEPS

    # the requeued job: same command, same run dir, ckpt_path null: Lightning picks hpc_ckpt_1.ckpt
    restarted = _start(tmp_path, env=env)
    output, _ = restarted.communicate(timeout=300)
    assert restarted.returncode == 0, output[-3000:]
    assert f"Restoring states from the checkpoint path at {hpc}" in output
    assert _step(last) == STEPS


def _fake_checkpoint(path: Path, step: int, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
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
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match="hpc_ckpt_1.ckpt"):
        resolve_ckpt_path("auto", tmp_path)


def test_null_resumes_from_hpc_checkpoint_only_under_slurm(train_config, tmp_path, monkeypatch, caplog):
    """Lightning's own rule, which `ckpt_path: null` relies on after a requeue."""
    train(train_config(*TINY, "trainer.max_steps=4", "test=false"))
    hpc = tmp_path / "run" / "hpc_ckpt_1.ckpt"
    (tmp_path / "run" / "checkpoints" / "last.ckpt").rename(hpc)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    with caplog.at_level(logging.INFO):
        train(train_config(*TINY, "trainer.max_steps=6", "test=false"))
    assert str(hpc) not in caplog.text  # not on SLURM: a fresh start

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
