"""Smoke tests of the SLURM cluster that `.ci/slurm/setup.sh` starts (or any cluster this machine submits to).

They check that the scheduler accepts and completes a batch job and that submitit (what the Hydra SLURM
launcher uses) runs a Python function on it. Without a reachable scheduler they skip, except in CI
(`CI=true`), where the cluster is part of the test environment and its absence is a failure.

Job files go to pytest's ``tmp_path``: right for the one-node cluster on localhost; on a real cluster, run
with ``--basetemp`` on a filesystem the compute nodes share.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("slurm")  # jobs on one cluster of 2 CPUs: one test at a time

JOB_DEADLINE_S = 120  # queueing + run of a trivial job; generous for a loaded 2-core CI machine
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
# A trivial job needs next to nothing; small requests keep it from waiting behind other work.
SMALL_JOB = ["--ntasks=1", "--cpus-per-task=1", "--mem=200M", "--time=2"]


def _job_state(job_id: str) -> str:
    """The job's state from the controller (finished jobs stay listed for MinJobAge seconds)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=20
    ).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.removeprefix("JobState=")
    return "UNKNOWN"


def _why_pending(job_id: str) -> str:
    return subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id, "--format=%T %r"],
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout.strip()


def test_sbatch_wrap_job_completes(slurm_cluster: None, tmp_path: Path) -> None:
    out_file = tmp_path / "job.out"
    submitted = subprocess.run(
        ["sbatch", "--parsable", *SMALL_JOB, f"--output={out_file}", "--wrap", "echo attnlab-$SLURM_JOB_ID"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert submitted.returncode == 0, f"sbatch rejected the job: {submitted.stderr.strip()}"
    job_id = submitted.stdout.strip().split(";")[0]  # --parsable prints "<id>" or "<id>;<cluster>"
    assert job_id.isdigit(), f"unexpected sbatch output {submitted.stdout!r}"

    deadline = time.monotonic() + JOB_DEADLINE_S
    state = _job_state(job_id)
    while state not in TERMINAL_STATES and time.monotonic() < deadline:
        time.sleep(0.5)
        state = _job_state(job_id)
    if state not in TERMINAL_STATES:
        reason = _why_pending(job_id)
        subprocess.run(["scancel", job_id], timeout=20)
        pytest.fail(f"job {job_id} did not finish within {JOB_DEADLINE_S}s (squeue: {reason!r})")
    assert state == "COMPLETED", f"job {job_id} ended in state {state}"
    # The job ran the command itself, on a node of the cluster, with the scheduler's environment.
    assert out_file.read_text().strip() == f"attnlab-{job_id}"


def _inside_job(x: int) -> tuple[int, str | None]:
    """Runs on the compute node: returns a value computed there and the job id SLURM gave it."""
    return x * x, os.environ.get("SLURM_JOB_ID")


def test_submitit_runs_a_function(slurm_cluster: None, tmp_path: Path) -> None:
    if os.environ.get("CI") == "true":
        import submitit  # in CI a missing submitit is an error, not a skip
    else:
        submitit = pytest.importorskip("submitit", reason="submitit is not installed")

    executor = submitit.SlurmExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(ntasks_per_node=1, cpus_per_task=1, mem="200M", time=2)
    job = executor.submit(_inside_job, 7)

    deadline = time.monotonic() + JOB_DEADLINE_S
    # Polling done() rather than blocking in result(): without slurmdbd, submitit cannot read job states
    # (sacct is disabled) and would wait forever for a job that died without writing its result.
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.5)
    if not job.done():
        reason = _why_pending(job.job_id)
        job.cancel(check=False)
        pytest.fail(f"submitit job {job.job_id} did not finish within {JOB_DEADLINE_S}s (squeue: {reason!r})")
    assert job.result() == (49, job.job_id)
