"""attnlab.run.slurm_sweep without a cluster: the documented sweep commands get as far as ``sbatch`` (or
run, for a local sweep) with no ``hydra.*`` override, and the wait for requeued runs decides each run from
the queue and its ``summary.json``, against a scripted queue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus

from attnlab.run.slurm_sweep import (
    Run,
    SlurmJobState,
    SweepWaiter,
    parse_scontrol_jobs,
)
from tiny_runs import TINY_LISTOPS, train_main

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- the documented commands, with no hydra.sweep.dir ------------------------------------------------------
@pytest.fixture
def fake_sbatch(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ``sbatch`` records its script and fails, so nothing is submitted even where a
    cluster runs (and a dummy ``srun``, which submitit looks for)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch_calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncat "$1" >> "{calls}"\necho "fake sbatch" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, calls


@pytest.mark.parametrize(
    "command",
    [
        # README.md / slurm/README.md / conf/hydra/launcher/slurm.yaml
        "hydra/launcher=slurm trainer=gpu task=listops,text attn=softmax,sliced_relu seed=0,1,2",
        # conf/hydra/launcher/slurm_local.yaml
        "hydra/launcher=slurm_local trainer=cpu task=listops attn=softmax,sliced_relu seed=0,1",
        # slurm/README.md "Run the CI cluster locally" (test_slurm_sweep.py runs it on the cluster)
        "hydra/launcher=slurm_local task=listops attn=softmax,sliced_relu seed=0,1",
    ],
)
def test_documented_slurm_sweeps_reach_sbatch_without_a_sweep_dir(tmp_path, fake_sbatch, command):
    """They failed in 0.4 s with "HydraConfig was not set": the sweep dir goes through
    ${hydra:runtime.cwd}, which Hydra could not resolve while building the launcher."""
    env, calls = fake_sbatch
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "-m", *command.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "HydraConfig was not set" not in done.stderr, done.stderr[-2000:]
    assert calls.exists(), f"sbatch was not called:\n{done.stderr[-2000:]}"
    script = calls.read_text()
    # the array, in the default sweep dir under the directory the command ran in
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").iterdir()
    assert f"#SBATCH --output={sweep_dir}/.submitit/%A_%a/" in script, script
    signal_delay = 120 if "hydra/launcher=slurm " in command + " " else 30
    assert f"#SBATCH --signal=USR1@{signal_delay}" in script, script


def test_documented_local_sweep_runs_without_a_sweep_dir(tmp_path):
    """README's Sweeps line (the basic launcher, runs one after the other) failed the same way."""
    command = ["task=listops", "attn=softmax,sliced_relu", "seed=0,1,2"]
    done = train_main("-m", *command, *TINY_LISTOPS, "trainer.max_steps=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = sorted(tmp_path.glob("outputs/multirun/*/listops/*/seed*/summary.json"))
    runs = {(p.parts[-3], json.loads(p.read_text())["seed"]) for p in summaries}
    assert runs == {(attn, seed) for attn in ("softmax", "sliced_relu") for seed in (0, 1, 2)}, summaries


# ---- the queue as scontrol shows it ----------------------------------------------------------------------
SCONTROL = """\
JobId=15 ArrayJobId=15 ArrayTaskId=2-3%2 ArrayTaskThrottle=2 JobName=train UserId=root(0) JobState=PENDING \
Reason=JobArrayTaskLimit Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1
JobId=17 ArrayJobId=15 ArrayTaskId=1 JobName=train UserId=root(0) JobState=RUNNING Reason=None Restarts=0
JobId=16 ArrayJobId=15 ArrayTaskId=0 JobName=my job UserId=root(0) JobState=PENDING Reason=BeginTime \
Restarts=1 Comment=Reason=None
JobId=20 JobName=train JobState=COMPLETED Reason=None Restarts=2
"""


def test_scontrol_records_become_submitit_job_ids():
    jobs = parse_scontrol_jobs(SCONTROL)
    assert jobs == {
        "15_2": SlurmJobState("PENDING", "JobArrayTaskLimit", 0),
        "15_3": SlurmJobState("PENDING", "JobArrayTaskLimit", 0),
        "15_1": SlurmJobState("RUNNING", "None", 0),
        # requeued and waiting to restart: still in the queue
        "15_0": SlurmJobState("PENDING", "BeginTime", 1),
        "20": SlurmJobState("COMPLETED", "None", 2),  # a sweep of one run is a plain job
    }
    assert set(parse_scontrol_jobs("JobId=30 ArrayJobId=30 ArrayTaskId=0-6:3 JobState=PENDING")) == {
        "30_0",
        "30_3",
        "30_6",
    }


# ---- waiting for requeued runs ----------------------------------------------------------------------------
class ScriptedQueue:
    """``query`` answers with the next scripted step; each step may also run an action (a job writing its
    summary, say). Past the script the last step repeats; a step of None is a controller that did not
    answer."""

    def __init__(self, steps):
        self.steps, self.calls = list(steps), 0

    def __call__(self, job_ids):
        step = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        if step is None:
            return None
        states, action = step if isinstance(step, tuple) else (step, None)
        if action is not None:
            action()
        return {job: SlurmJobState(*state) for job, state in states.items()}


def _waiter(tmp_path, queue, runs, results=None) -> SweepWaiter:
    results = results or {}
    return SweepWaiter(
        runs,
        tmp_path,
        query=queue,
        read_result=lambda run: results.get(run.job_id, (None, None)),
        sleep=lambda s: None,
    )


def _summary(run: Run):
    def write():
        run.run_dir.mkdir(parents=True, exist_ok=True)
        run.summary.write_text("{}")

    return write


def test_a_requeued_run_is_waited_for_until_its_summary_exists(tmp_path, caplog):
    requeued, plain = Run(0, "7_0", tmp_path / "a"), Run(1, "7_1", tmp_path / "b")
    queue = ScriptedQueue(
        [
            {"7_0": ("RUNNING", "None", 0), "7_1": ("RUNNING", "None", 0)},
            # the first attempt of 7_0 returned (pre-empted, no summary) and SLURM requeued it; 7_1 is done
            ({"7_0": ("COMPLETING", "None", 1), "7_1": ("COMPLETED", "None", 0)}, _summary(plain)),
            {"7_0": ("PENDING", "BeginTime", 1), "7_1": ("COMPLETED", "None", 0)},
            {"7_0": ("RUNNING", "None", 1)},
            ({"7_0": ("COMPLETED", "None", 1)}, _summary(requeued)),
        ]
    )
    waiter = _waiter(tmp_path, queue, [requeued, plain])
    with caplog.at_level("INFO", logger="attnlab.run.slurm_sweep"):
        waiter.wait()
    assert queue.calls == 5  # it returned at the first look that found 7_0 finished, not before
    assert (requeued.outcome, requeued.requeues, plain.outcome, plain.requeues) == (
        "COMPLETED",
        1,
        "COMPLETED",
        0,
    )
    assert "run #0 a (job 7_0) was requeued (1 requeue so far)" in caplog.text
    assert "run #0 a (job 7_0): attempt 2 started" in caplog.text
    assert "run #0 a (job 7_0) finished after 1 requeue" in caplog.text
    table = waiter.table().splitlines()
    assert table[0] == f"sweep {tmp_path}: 2 of 2 runs completed, 0 failed, 1 requeued"
    assert table[1].split() == ["run", "job", "state", "attempts", "requeues"]
    assert table[2].split() == ["a", "7_0", "COMPLETED", "2", "1"]
    assert table[3].split() == ["b", "7_1", "COMPLETED", "1", "0"]


def test_a_job_that_leaves_the_queue_without_a_summary_failed(tmp_path):
    """Pre-empted (its checkpoint is there) but not requeued: it left the queue, so nothing more will come."""
    run = Run(0, "8", tmp_path / "r", log_file="/logs/8_0_log.err")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "hpc_ckpt_1.ckpt").write_text("")
    queue = ScriptedQueue([{"8": ("RUNNING", "None", 0)}, {"8": ("COMPLETED", "None", 0)}])
    waiter = _waiter(tmp_path, queue, [run])
    waiter.wait()
    assert queue.calls == 3  # the final state is confirmed by a second look before the run is failed
    assert run.outcome == "FAILED"
    assert run.detail == (
        "the job left the queue (in state COMPLETED) without writing r/summary.json; it was pre-empted "
        "and not requeued (r/hpc_ckpt_1.ckpt exists: rerun it with ckpt_path=auto to resume); "
        "log: /logs/8_0_log.err"
    )
    assert waiter.table().splitlines()[2].split()[:3] == ["r", "8", "FAILED"]


def test_a_job_forgotten_by_the_controller_or_timed_out_failed(tmp_path):
    gone, timeout = Run(0, "9_0", tmp_path / "g"), Run(1, "9_1", tmp_path / "t")
    queue = ScriptedQueue(
        [{"9_0": ("RUNNING", "None", 0), "9_1": ("RUNNING", "None", 0)}, {"9_1": ("TIMEOUT", "TimeLimit", 0)}]
    )
    waiter = _waiter(tmp_path, queue, [gone, timeout])
    waiter.wait()
    assert (gone.outcome, gone.state, timeout.outcome, timeout.state) == (
        "FAILED",
        "GONE",
        "FAILED",
        "TIMEOUT",
    )
    assert "it is no longer known to SLURM" in gone.detail
    assert "(in state TIMEOUT) without writing t/summary.json" in timeout.detail
    assert [line.split()[2:4] for line in waiter.table().splitlines()[2:4]] == [
        ["FAILED", "(GONE)"],
        ["FAILED", "(TIMEOUT)"],
    ]


def test_a_final_state_seen_once_or_a_silent_controller_does_not_fail_a_run(tmp_path):
    run = Run(0, "5_0", tmp_path / "r")
    queue = ScriptedQueue(
        [
            {"5_0": ("RUNNING", "None", 0)},
            {"5_0": ("PREEMPTED", "None", 0)},  # in passing: the scheduler requeues it
            None,  # scontrol did not answer
            {"5_0": ("PENDING", "BeginTime", 1)},
            ({"5_0": ("COMPLETED", "None", 1)}, _summary(run)),
        ]
    )
    _waiter(tmp_path, queue, [run]).wait()
    assert (run.outcome, run.requeues, queue.calls) == ("COMPLETED", 1, 5)


def test_a_run_whose_last_attempt_raised_failed_with_its_error(tmp_path):
    run = Run(0, "6", tmp_path / "r")
    error = JobReturn(status=JobStatus.FAILED, _return_value=ValueError("bad task.data.batch_size=-1"))
    queue = ScriptedQueue([{"6": ("FAILED", "NonZeroExitCode", 0)}])
    _waiter(tmp_path, queue, [run], results={"6": (error, "ValueError: bad task.data.batch_size=-1")}).wait()
    assert (run.outcome, run.detail, run.job_return) == (
        "FAILED",
        "ValueError: bad task.data.batch_size=-1",
        error,
    )
