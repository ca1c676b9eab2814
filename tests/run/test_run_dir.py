"""A run dir holds one run: a fresh run never replaces an earlier one, two runs never write one dir at
once, and a refused resume changes nothing in the run it was to continue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnlab.errors import CheckpointError
from attnlab.pipeline import discard_unstarted_run_dir, train
from attnlab.run.claim import RunDirError, run_dir_lock
from tiny_runs import TINY_LISTOPS, run_train_py, train_main

SHORT = [*TINY_LISTOPS, "trainer.max_steps=2", "test=false", "logger=csv"]


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run dir but Hydra's own (written by Hydra before attnlab's code runs) and the lock."""
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file()
        and ".hydra" not in path.parts
        and path.name not in ("train.log", ".attnlab-run.lock")
    }


@pytest.fixture
def finished_run(train_config):
    cfg = train_config(*SHORT)
    train(cfg)
    run_dir = Path(cfg.paths.run_dir)
    assert (run_dir / "summary.json").is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()
    return run_dir


def test_a_fresh_run_in_a_finished_runs_dir_is_refused_and_changes_nothing(train_config, finished_run):
    before = _files(finished_run)
    with pytest.raises(RunDirError) as caught:
        train(train_config(*SHORT, "seed=1"))
    message = str(caught.value)
    assert "\n" not in message
    assert f"{finished_run} already holds a finished run (summary.json)" in message
    assert "ckpt_path=auto" in message and "overwrite=true" in message and "another hydra.run.dir" in message
    assert _files(finished_run) == before
    assert not discard_unstarted_run_dir(finished_run)


def test_an_interrupted_run_is_named_as_such(train_config, finished_run):
    summary = finished_run / "summary.json"
    summary.write_text(
        json.dumps({**json.loads(summary.read_text()), "interrupted": True, "signal": "SIGTERM"})
    )
    with pytest.raises(RunDirError, match="already holds an interrupted run"):
        train(train_config(*SHORT))


def test_overwrite_moves_the_earlier_run_aside(train_config, finished_run):
    before = _files(finished_run)
    summary = train(train_config(*SHORT, "seed=1", "overwrite=true"))
    assert summary["seed"] == 1
    (aside,) = finished_run.parent.glob(f"{finished_run.name}.replaced-*")
    assert _files(aside) == before  # the earlier run, whole
    assert json.loads((finished_run / "summary.json").read_text())["seed"] == 1


def test_a_run_dir_another_run_is_writing_is_refused_and_kept(train_config, tmp_path):
    cfg = train_config(*SHORT)
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True)
    with run_dir_lock(run_dir):  # as another process's run holds it while it starts
        with pytest.raises(RunDirError, match=r"another run \(process \d+\) is writing .* right now"):
            train(cfg)
        assert not discard_unstarted_run_dir(run_dir), "the other run's dir must stay"
    assert not (run_dir / "config.yaml").exists()


def test_a_refused_resume_leaves_the_runs_config_as_it_was(train_config, finished_run):
    config = (finished_run / "config.yaml").read_bytes()
    last = finished_run / "checkpoints" / "last.ckpt"
    with pytest.raises(CheckpointError, match=r"task\.model\.dim: 16 -> 32"):
        train(train_config(*SHORT, "task.model.dim=32", f"ckpt_path={last}"))
    assert (finished_run / "config.yaml").read_bytes() == config


@pytest.mark.parametrize(
    ("checkpoint", "said"),
    [("last.ckpt", "task.model.dim: 16 -> 32"), ("lats.ckpt", "does not exist")],
    ids=["changes-the-model", "misspelt-checkpoint"],
)
def test_a_refused_resume_on_the_command_line_leaves_hydras_record_and_log_as_they_were(
    tmp_path, checkpoint, said
):
    """Hydra writes ``.hydra/`` and appends to ``train.log`` before attnlab's code runs: the refusal
    comes first (`attnlab.run.hydra_callbacks.ResumeCheckBeforeRun`), so nothing of the run changes."""
    run_dir = tmp_path / "run"
    first = train_main(*SHORT, "logger=none", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    resume = run_dir / "checkpoints" / checkpoint
    again = train_main(*SHORT, "logger=none", "task.model.dim=32", f"ckpt_path={resume}", cwd=tmp_path)
    assert again.returncode == 1
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
    after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


def test_resuming_with_another_backend_is_refused_naming_the_keys(train_config, tmp_path):
    cfg = train_config(*SHORT, "attn=softmax")
    train(cfg)
    run_dir = Path(cfg.paths.run_dir)
    before = _files(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    with pytest.raises(CheckpointError) as caught:
        train(train_config(*SHORT, "attn=linear", "trainer.max_steps=4", f"ckpt_path={last}"))
    message = str(caught.value)
    assert "attn.name: 'softmax' -> 'linear'" in message and "attn.eps: '<absent>' -> 1e-06" in message
    assert "trainer.max_steps" not in message  # a longer budget is what resuming is for
    assert "docs/resume.md" in message
    assert _files(run_dir) == before


def test_a_resume_may_raise_the_budget(train_config, finished_run):
    last = finished_run / "checkpoints" / "last.ckpt"
    summary = train(
        train_config(*SHORT, "trainer.max_steps=4", "trainer.log_every_n_steps=2", f"ckpt_path={last}")
    )
    assert summary["steps"] == 4


@pytest.mark.slow
def test_the_command_line_refuses_a_second_fresh_run_in_one_line(tmp_path):
    args = [*SHORT, "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    differs = [*args, "seed=3"]  # Hydra would record these overrides over the first run's
    first = run_train_py(*args, cwd=tmp_path, timeout=300, single_thread=True)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = (tmp_path / "run" / "summary.json").read_bytes()
    hydra_record = (tmp_path / "run" / ".hydra" / "overrides.yaml").read_bytes()
    again = run_train_py(*differs, cwd=tmp_path, timeout=300, single_thread=True)
    assert again.returncode == 1
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "already holds a finished run" in lines[0]
    assert (tmp_path / "run" / "summary.json").read_bytes() == summary
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").read_bytes() == hydra_record  # before Hydra


@pytest.mark.slow
def test_a_second_run_started_while_the_first_writes_the_dir_is_refused(tmp_path, terminal_signals):
    """Two runs started together in one dir raced: one crashed in the CSV logger, or both exited 0
    and one summary replaced the other. The second is refused; the first runs on, untouched."""
    import os
    import signal
    import subprocess
    import sys

    from tiny_runs import REPO_ROOT, pause_at, wait_until_paused, with_tiny_runs_importable

    run, marker = tmp_path / "run", tmp_path / "paused"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env = with_tiny_runs_importable({**env, "OMP_NUM_THREADS": "1"})
    command = [sys.executable, str(REPO_ROOT / "train.py"), *SHORT, "logger=none", f"hydra.run.dir={run}"]
    first = subprocess.Popen(
        [*command, *pause_at(0, marker)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_until_paused(first, marker)
        config = (run / "config.yaml").read_bytes()
        second = run_train_py(
            *SHORT, "logger=none", "seed=5", f"hydra.run.dir={run}", cwd=tmp_path, timeout=300
        )
        assert second.returncode == 1
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: another run (process ")
        assert f"is writing {run} right now" in lines[0]
        assert first.poll() is None and (run / "config.yaml").read_bytes() == config  # untouched, kept
        first.send_signal(signal.SIGTERM)  # the first run stops as it would: last.ckpt, summary
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143
    summary = json.loads((run / "summary.json").read_text())
    assert summary["seed"] == 0 and summary["interrupted"]
