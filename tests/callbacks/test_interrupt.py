"""SIGTERM and SIGINT outside a SLURM requeue (`attnlab.callbacks.checkpoint.Interrupt`): ``last.ckpt`` saved
at the step reached, summary marked interrupted, exit 143 / 130, one line that says how to resume, and the
resumed run ends as an uninterrupted one. A signal that arrives while the checkpoint is written waits."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

from attnlab.pipeline import train
from attnlab.reporting.runs import load_runs
from attnlab.run.summary import exit_status
from run.test_resume import (
    KILL_AFTER,
    REPO_ROOT,
    STEPS,
    TINY,
    _assert_same_training,
    _start,
    _step,
    _wait_for_step,
    _wait_until_paused,
)
from tiny_runs import with_tiny_runs_importable


class SignalAt(L.Callback):
    """Sends ``signum`` to this process at the end of the given steps (before `Interrupt` looks)."""

    def __init__(self, steps: list[int], signum: str = "SIGTERM"):
        self.steps, self.signum = set(steps), signal.Signals[signum]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            os.kill(os.getpid(), self.signum)


def _signal_at(steps: str, signum: str) -> list[str]:
    return [
        "+callbacks.signal_at._target_=callbacks.test_interrupt.SignalAt",
        f"+callbacks.signal_at.steps={steps}",
        f"+callbacks.signal_at.signum={signum}",
    ]


def test_sigterm_then_sigint_in_process_save_at_the_step_reached_and_resume_exactly(
    train_config, tmp_path, monkeypatch, uninterrupted
):
    """SIGTERM at step 13 (last.ckpt otherwise saved at validations only: step 10), a SIGINT while that
    checkpoint is written, then SIGINT at step 20 (validated: saved after the validation); the third
    attempt ends as the uninterrupted run."""
    uninterrupted, uninterrupted_dir = uninterrupted
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    run, only_at_validation = tmp_path / "run", "callbacks.last_checkpoint.every_n_train_steps=0"
    last = run / "checkpoints" / "last.ckpt"

    real_save, sent = torch.save, []

    def save_with_a_second_signal(obj, handle, *args, **kwargs):
        if obj.get("global_step") == 13 and not sent:  # the interrupt's checkpoint, being written
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_with_a_second_signal)
    first = train(train_config(*TINY, only_at_validation, *_signal_at("[13]", "SIGTERM")))
    monkeypatch.undo()
    assert sent, "the checkpoint at step 13 was never written"
    assert first["interrupted"] and first["signal"] == "SIGTERM" and first["steps"] == 13
    assert first["test_acc"] is None and exit_status(first) == 143
    assert _step(last) == 13
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["signal"] == "SIGTERM" and summary["steps"] == 13
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers

    second = train(train_config(*TINY, only_at_validation, *_signal_at("[20]", "SIGINT"), "ckpt_path=auto"))
    assert second["signal"] == "SIGINT" and second["steps"] == 20 and exit_status(second) == 130
    assert _step(last) == 20 and second["attempts"] == 2
    third = train(train_config(*TINY, only_at_validation, "ckpt_path=auto"))
    assert not third.get("interrupted") and third["steps"] == STEPS and third["attempts"] == 3
    assert "interrupted" not in json.loads((run / "summary.json").read_text())
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers

    _assert_same_training(uninterrupted_dir, run, "a SIGTERM at step 13 and a SIGINT at step 20")
    assert third["val_acc"] == uninterrupted["val_acc"]
    assert third["test_acc"] == uninterrupted["test_acc"]


@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_signal_to_a_local_run_exits_nonzero_and_the_printed_command_resumes_it(
    tmp_path, signum, terminal_signals, uninterrupted
):
    """``kill <pid>`` (or Ctrl-C) on ``python train.py``: last.ckpt at the step reached and nothing saved
    after it, exit 128 + signal, summary marked interrupted; the printed command, run as printed, ends
    as the uninterrupted run."""
    uninterrupted, uninterrupted_dir = uninterrupted
    run, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    # SIGINT as Ctrl-C sends it, to the whole process group: the loader workers ignore it
    process = _start(tmp_path, "task.data.num_workers=2", new_session=True)
    _wait_until_paused(process, tmp_path)
    if signum == "SIGINT":
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGTERM)  # `kill <pid>`
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.Signals[signum], output[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == signum and summary["test_acc"] is None
    assert summary["steps"] == _step(last) == KILL_AFTER + 1  # signalled while held after KILL_AFTER
    (hint,) = [line for line in output.splitlines() if "resume with" in line]
    assert hint.startswith(f"{signum} at step {summary['steps']}: resume with python train.py ")
    command = shlex.split(hint.split("resume with ", 1)[1])
    assert command[-2:] == ["ckpt_path=auto", f"hydra.run.dir={run}"]

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # the printed command names the pause callback:
    env = with_tiny_runs_importable(env)
    resumed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), *command[2:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["attempts"] == 2 and "interrupted" not in summary
    _assert_same_training(uninterrupted_dir, run, f"a {signum} at step {_step(last)}")
    assert summary["val_acc"] == uninterrupted["val_acc"]
    assert summary["test_acc"] == uninterrupted["test_acc"]


def test_report_skips_interrupted_runs(tmp_path):
    fields = {"task": "listops", "attn": "softmax", "seed": 0, "val_acc": 0.5, "test_acc": None, "steps": 13}
    for name, extra in (("done", {"test_acc": 0.4, "steps": 36}), ("stopped", {"interrupted": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({**fields, **extra, "signal": "SIGTERM"}))
    result = load_runs([tmp_path])
    assert [run.path.parent.name for run in result.runs] == ["done"]
    ((path, reason),) = result.skipped
    assert path.parent.name == "stopped" and "interrupted (SIGTERM at step 13)" in reason


class _SignalProbe(torch.utils.data.Dataset):
    """Says, from the process that reads it, whether SIGINT and SIGTERM are ignored there."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> list[bool]:
        return [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)]


def test_loader_workers_leave_sigint_and_sigterm_to_the_training_process(terminal_signals):
    """Ctrl-C reaches every process of the group: a worker it ended would fail the batches still to come
    (a validation after the stop, the next fetch of a long step) before the checkpoint is saved."""
    from attnlab.data.loaders import ShardedDataModule

    class Probe(ShardedDataModule):
        datasets, eval_batch_size, num_workers, seed = {"val": _SignalProbe()}, 1, 1, 0

        def _collate(self, examples):
            return examples[0]

    assert [batch for batch in Probe().val_dataloader()] == [[True, True]] * 2
    assert signal.getsignal(signal.SIGINT) != signal.SIG_IGN  # the training process keeps its handlers


class SigtermInTest(L.Callback):
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_in_the_test_stage_marks_the_run_interrupted(train_config, tmp_path):
    """Training is over and saved; a SIGTERM while testing (Lightning's own handler there: it ended the
    run with status 0 and no summary) leaves the summary marked interrupted; resuming only tests."""
    run = [*TINY, "trainer.max_steps=4", "task.data.eval_batch_size=16"]
    summary = train(train_config(*run, "+callbacks.sigterm._target_=callbacks.test_interrupt.SigtermInTest"))
    assert summary["interrupted"] and summary["signal"] == "SIGTERM" and summary["steps"] == 4
    assert summary["test_acc"] is None and exit_status(summary) == 143
    resumed = train(train_config(*run, "ckpt_path=auto"))
    assert resumed["steps"] == 4 and resumed["test_acc"] is not None and "interrupted" not in resumed


class SigtermInSanityCheck(L.Callback):
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_before_the_first_step_marks_the_run_interrupted(train_config, tmp_path):
    """In the sanity check, before `Interrupt` takes over: nothing trained, nothing to save; the run still
    exits 143 with its summary marked interrupted (Lightning ended it with status 0 and no summary)."""
    run = [*TINY, "trainer.max_steps=4", "trainer.num_sanity_val_steps=2", "task.data.eval_batch_size=16"]
    sigterm = "+callbacks.sigterm._target_=callbacks.test_interrupt.SigtermInSanityCheck"
    summary = train(train_config(*run, sigterm))
    assert summary["interrupted"] and summary["steps"] == 0 and exit_status(summary) == 143
    assert summary["test_acc"] is None


@pytest.mark.slow
def test_sigterm_to_rank_0_of_a_ddp_run_stops_every_rank_alike(tmp_path):
    """Two gloo processes; the signal reaches rank 0 only. Every rank saves at the same step, skips the
    test stage and exits 143 (rank 1 used to go on testing alone and die when rank 0 left)."""
    run, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    process = _start(tmp_path, "trainer=ddp_cpu", "trainer.max_steps=3000", pause=False)
    _wait_for_step(process, last, KILL_AFTER, timeout=180)
    children = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(process.pid)], capture_output=True, text=True
    )
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["world_size"] == 2 and summary["steps"] == _step(last)
    for pid in children.stdout.split():  # rank 1, started by Lightning's launcher, has exited too
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), f"rank 1 (pid {pid}) still runs"
