"""Real jobs on the CI cluster: the documented sweep through ``hydra/launcher=slurm_local`` as one job
array, a sweep with a pre-empted run that SLURM requeues, and ``slurm/multinode.sbatch`` as a 2-process CPU
DDP run.

The sweeps run ``python train.py -m ...`` exactly as slurm/README.md shows it, plus the data-size overrides
of ``tests/tiny_runs.py``, with the temporary directory as the working directory: the default sweep dir
(``outputs/multirun/<time>``) and data dir (``data/``) are below it, and each job generates its tiny
ListOps set there.

Without a reachable scheduler the tests skip, except in CI (``CI=true``), where that is a failure. The jobs
run under a deadline and are cancelled (by job id) when a test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tiny_runs import TINY_LISTOPS, pause_at, with_tiny_runs_importable

pytestmark = pytest.mark.xdist_group("slurm")  # jobs on one cluster of 2 CPUs: one test at a time

REPO_ROOT = Path(__file__).resolve().parents[2]
SWEEP_DEADLINE_S = 300  # 4 tiny runs, 2 at a time on the 2-core CI node: ~40 s when the machine is idle
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
# slurm/README.md ("Run the CI cluster locally"); with trainer=cpu (the default) in slurm_local.yaml
DOCUMENTED_SWEEP = "hydra/launcher=slurm_local task=listops attn=softmax,sliced_relu seed=0,1"
TINY = [*TINY_LISTOPS, "trainer.max_steps=3", "task.val_check_interval=3"]
# The multinode run on the fixture files of write_listops_fixture: small batches, 3 steps.
TINY_FIXTURE = [
    "task.data.batch_size=4",
    "task.data.eval_batch_size=8",
    "task.data.num_workers=0",
    "task.model.dim=16",
    "task.model.mlp_dim=32",
    "trainer.max_steps=3",
    "task.val_check_interval=3",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "logger=csv",
]


def write_listops_fixture(data_dir: Path) -> None:
    """Small ListOps TSV files where the task's config looks (lra_release/listops-short), made with the
    project's generator in this process, so the job only reads them."""
    from attnlab.data.lra.sources import ListOpsSource

    ListOpsSource(
        data_dir,
        subdir="listops-short",
        sizes={"train": 96, "val": 16, "test": 16},
        min_length=10,
        max_length=60,
    ).prepare()


def _job_states(job_id: str) -> dict[str, tuple[str, int]]:
    """``{"<array job>_<index>": (state, restarts)}`` (``{"<job>": ...}`` for a plain job) from the
    controller (finished jobs stay for MinJobAge)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=20
    ).stdout
    states = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        array = fields.get("ArrayJobId")  # a sweep of one run is a plain job
        key = f"{array}_{fields.get('ArrayTaskId')}" if array else fields.get("JobId", "")
        states[key] = (fields.get("JobState", ""), int(fields.get("Restarts", "0")))
    return states


class Sweep:
    """``python train.py -m <args>`` started in ``cwd``, its output in ``cwd/sweep.log``."""

    def __init__(self, cwd: Path, args: list[str]) -> None:
        self.cwd, self.log = cwd, cwd / "sweep.log"
        # the jobs inherit this environment (sbatch --export=ALL): tiny_runs importable for `pause_at`
        env = with_tiny_runs_importable(dict(os.environ))
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "train.py"), "-m", *args],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )

    @property
    def sweep_dir(self) -> Path | None:
        dirs = sorted((self.cwd / "outputs" / "multirun").glob("*"))
        return dirs[-1] if dirs else None

    def job_dirs(self) -> list[str]:
        """submitit's folder per job: ``.submitit/<array job id>_<index>`` (``<job id>`` for a sweep of
        one run)."""
        if self.sweep_dir is None:
            return []
        names = sorted(p.name for p in (self.sweep_dir / ".submitit").glob("*") if p.is_dir())
        tasks = [name for name in names if "_" in name]  # an array also has a folder of its own id
        return tasks or names

    def output(self) -> str:
        return self.log.read_text()

    def job_logs(self) -> str:
        """The tails of the jobs' submitit logs, for a failure message."""
        if self.sweep_dir is None:
            return "(no sweep dir)"
        parts = []
        for log in sorted(self.sweep_dir.glob(".submitit/*/*_log.*")):
            tail = "\n".join(log.read_text().splitlines()[-15:])
            parts.append(f"--- {log.relative_to(self.sweep_dir)}\n{tail}")
        return "\n".join(parts) or "(no job logs)"

    def cancel(self) -> None:
        """Leave nothing queued or running (the jobs of a sweep that failed, or returned too early)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for array_id in {name.split("_")[0] for name in self.job_dirs()}:
            subprocess.run(["scancel", array_id], capture_output=True, timeout=20)

    def wait(self, timeout: float = SWEEP_DEADLINE_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            queue = subprocess.run(["squeue"], capture_output=True, text=True, timeout=20).stdout
            self.cancel()
            pytest.fail(f"the sweep did not finish within {timeout}s; squeue:\n{queue}\n{self.job_logs()}")


@pytest.fixture
def sweep_in(tmp_path: Path):
    """Starts sweeps in ``tmp_path`` (same machine: tmp is visible to the jobs); cancels what a failed
    test leaves behind."""
    started: list[Sweep] = []

    def start(*args: str) -> Sweep:
        started.append(Sweep(tmp_path, list(args)))
        return started[-1]

    yield start
    for sweep in started:  # after a passing test every job has left the queue: nothing to cancel
        sweep.cancel()


def _summaries(sweep_dir: Path) -> dict[tuple[str, int], dict]:
    runs = {}
    for path in sweep_dir.glob("listops/*/seed*_*/summary.json"):
        summary = json.loads(path.read_text())
        assert summary["task"] == "listops" and summary["attn"] == path.parts[-3], path
        runs[summary["attn"], summary["seed"]] = summary
    return runs


def _table_row(output: str, run: str) -> list[str]:
    """The row of the launcher's closing table for a run dir (relative to the sweep dir)."""
    rows = [line.split() for line in output.splitlines() if line.split()[:1] == [run]]
    assert len(rows) == 1, f"no single table row for {run} in:\n{output[-3000:]}"
    return rows[0]


@pytest.mark.slow
def test_documented_sweep_runs_as_one_job_array(slurm_cluster: None, sweep_in) -> None:
    sweep = sweep_in(*DOCUMENTED_SWEEP.split(), *TINY)
    rc = sweep.wait()
    assert rc == 0, f"{sweep.output()[-3000:]}\n{sweep.job_logs()}"
    job_dirs = sweep.job_dirs()
    assert len(job_dirs) == 4 and len({name.split("_")[0] for name in job_dirs}) == 1, (
        f"expected one array of 4 jobs, got {job_dirs}"
    )
    # the launcher returns once every job has left the queue
    states = _job_states(job_dirs[0].split("_")[0])
    assert states == dict.fromkeys(job_dirs, ("COMPLETED", 0)), states

    # every (backend, seed) wrote its own summary, from data generated in ./data, after the 3 steps asked for
    summaries = _summaries(sweep.sweep_dir)
    assert sorted(summaries) == [(a, s) for a in ("sliced_relu", "softmax") for s in (0, 1)], sorted(
        summaries
    )
    for summary in summaries.values():
        assert summary["steps"] == 3 and summary["world_size"] == 1, summary
        assert str(sweep.cwd / "data") in summary["data_source"], summary["data_source"]
    output = sweep.output()
    assert "4 of 4 runs completed, 0 failed, 0 requeued" in output, output[-3000:]
    assert _table_row(output, "listops/softmax/seed1_1")[2:] == ["COMPLETED", "1", "0"]


def test_a_preempted_run_is_awaited_until_its_requeued_attempt_wrote_the_summary(
    slurm_cluster: None, sweep_in, tmp_path: Path
) -> None:
    """The run is held at step 4 (`PauseAt`) and gets the time-limit warning there (SIGUSR1, what
    ``--signal=USR1@<signal_delay_s>`` sends): it saves ``hpc_ckpt_1.ckpt``, requeues itself and returns
    from its first attempt without a summary. The stock submitit launcher ended the sweep there, with
    status 0; ``-m`` must return after the requeued attempt (~5 s later on this cluster: cred_expire in
    .ci/slurm) has resumed from step 5 and written the summary."""
    steps, marker = 12, tmp_path / "paused"
    sweep = sweep_in(
        *["hydra/launcher=slurm_local", "trainer=cpu", "task=listops", "attn=softmax", "seed=0"],
        *TINY,
        f"trainer.max_steps={steps}",
        "task.val_check_interval=6",
        *pause_at(4, marker),  # the requeued attempt starts at step 5: it is not held again
    )
    deadline = time.monotonic() + SWEEP_DEADLINE_S
    while time.monotonic() < deadline and sweep.process.poll() is None and not marker.exists():
        time.sleep(0.1)
    if not marker.exists():
        sweep.cancel()
        pytest.fail(f"run #0 never reached step 4:\n{sweep.output()[-3000:]}\n{sweep.job_logs()}")
    (job_id,) = sweep.job_dirs()
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=20)

    rc = sweep.wait(max(deadline - time.monotonic(), 1))
    summaries = _summaries(sweep.sweep_dir)  # looked at as soon as -m returned
    output = sweep.output()
    assert rc == 0, f"{output[-3000:]}\n{sweep.job_logs()}"
    assert sorted(summaries) == [("softmax", 0)], f"{output[-3000:]}\n{sweep.job_logs()}"
    run_dir = sweep.sweep_dir / "listops" / "softmax" / "seed0_0"
    assert (run_dir / "hpc_ckpt_1.ckpt").is_file(), "run #0 was not pre-empted"
    assert summaries["softmax", 0]["steps"] == steps, summaries["softmax", 0]
    assert f"run #0 listops/softmax/seed0_0 (job {job_id}) was requeued (1 requeue so far)" in output
    assert _table_row(output, "listops/softmax/seed0_0") == [
        "listops/softmax/seed0_0",
        job_id,
        "COMPLETED",
        "2",
        "1",
    ]
    assert "1 of 1 runs completed, 0 failed, 1 requeued" in output
    assert _job_states(job_id)[job_id] == ("COMPLETED", 1)
    # the requeued attempt resumed from the checkpoint the first one saved, at the step after the hold
    job_log = (sweep.sweep_dir / ".submitit" / job_id / f"{job_id}_0_log.out").read_text()
    assert f"Restored all states from the checkpoint at {run_dir / 'hpc_ckpt_1.ckpt'}" in job_log
    assert _checkpoint_step(run_dir / "hpc_ckpt_1.ckpt") == 5


def _checkpoint_step(checkpoint: Path) -> int:
    """The training step a Lightning checkpoint was saved at."""
    import torch

    return torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]


@pytest.mark.slow
def test_multinode_sbatch_script_runs_cpu_ddp_over_two_tasks(slurm_cluster: None, tmp_path: Path) -> None:
    """The script as the README shows it, with the GPUs swapped for CPUs on the command line: srun starts
    2 tasks, the trainer gets devices/num_nodes from SLURM and Lightning runs DDP (gloo) over them."""
    data_dir, run_dir = tmp_path / "data", tmp_path / "run"
    write_listops_fixture(data_dir)
    job_name = f"attnlab-test-{uuid.uuid4().hex[:8]}"
    command = [
        "sbatch",
        "--parsable",
        f"--job-name={job_name}",
        f"--output={tmp_path / 'job.out'}",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--mem=4G",
        "--time=5",
        str(REPO_ROOT / "slurm" / "multinode.sbatch"),
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        *TINY_FIXTURE,
        f"paths.data_dir={data_dir}",
        f"hydra.run.dir={run_dir}",  # after the script's own hydra.run.dir, so it wins
    ]
    # the script runs from the submit directory (the repository, for train.py) in $ATTNLAB_VENV
    env = {**os.environ, "ATTNLAB_VENV": sys.prefix}
    submitted = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    # polled here, not with `sbatch --wait`, whose sleeps between looks grow to half a minute
    deadline, state = time.monotonic() + SWEEP_DEADLINE_S, ""
    while time.monotonic() < deadline:
        state = _job_states(job_id).get(job_id, ("", 0))[0]
        if state in TERMINAL_STATES:
            break
        time.sleep(0.25)
    else:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=20)
        pytest.fail(f"the sbatch job did not finish within {SWEEP_DEADLINE_S}s (state {state!r})")
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else "(no job log)"
    assert state == "COMPLETED", f"job {job_id} {state}:\n{log[-4000:]}"
    assert "1 nodes x 2 tasks" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3, summary
