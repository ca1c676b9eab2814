"""Real jobs on the CI cluster: a sweep through the project's SLURM launcher config (2 tasks x 2 backends
as one job array), and ``slurm/multinode.sbatch`` as a 2-process CPU DDP run.

``python train.py -m hydra/launcher=slurm_local task=listops,pathfinder attn=softmax,sliced_relu ...`` runs
as a subprocess against the cluster that `.ci/slurm/setup.sh` starts; every array task must complete and
write its run's ``summary.json``. The data are fixtures in the official layouts (tiny ListOps TSV files,
a tiny Pathfinder set as in ``lra_release``), so nothing is downloaded or generated inside the jobs.

Without a reachable scheduler the tests skip, except in CI (``CI=true``), where that is a failure. The
cluster has no accounting, so submitit cannot see a job that SLURM killed and would wait forever: the
jobs run under a deadline and are cancelled by name when a test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[2]
SWEEP_DEADLINE_S = 300  # 4 tiny runs, 2 at a time on the 2-core CI node: ~1 min when the machine is idle
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
TASKS = ("listops", "pathfinder")
ATTNS = ("softmax", "sliced_relu")
# Keys both tasks have, so one set of overrides shrinks every run of the cartesian sweep.
TINY = [
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
    project's generator in this process, so the concurrent jobs only read them."""
    from attnlab.data.lra.sources import ListOpsSource

    ListOpsSource(
        data_dir,
        subdir="listops-short",
        sizes={"train": 96, "val": 16, "test": 16},
        min_length=10,
        max_length=60,
    ).prepare()


def write_pathfinder_fixture(data_dir: Path, count: int = 30) -> None:
    """A tiny set in the release layout (pathfinder32/curv_contour_length_14/{imgs/0,metadata/0.npy}),
    which the task reads as found: 32x32 greyscale PNGs and 11-column text metadata rows."""
    directory = data_dir / "lra_release" / "pathfinder32" / "curv_contour_length_14"
    (directory / "imgs" / "0").mkdir(parents=True)
    (directory / "metadata").mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(count):
        pixels = (rng.random((32, 32)) < 0.2).astype(np.uint8) * 255
        pixels[0, 0] = 255  # never a blank image (the loader skips those)
        Image.fromarray(pixels, "L").save(directory / "imgs" / "0" / f"sample_{i}.png")
        rows.append(f"imgs/0 sample_{i}.png {i} {i % 2} 1.0 14 4 2 0.5 1 1\n")
    (directory / "metadata" / "0.npy").write_text("".join(rows))


def _array_task_states(job_id: str) -> dict[str, str]:
    """``{"<array job>_<index>": state}`` from the controller (finished jobs stay for MinJobAge)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=20
    ).stdout
    states = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        states[f"{fields.get('ArrayJobId')}_{fields.get('ArrayTaskId')}"] = fields.get("JobState", "")
    return states


def _job_logs(sweep_dir: Path) -> str:
    """The tails of the jobs' submitit logs, for a failure message."""
    parts = []
    for log in sorted(sweep_dir.glob(".submitit/*/*_log.*")):
        parts.append(f"--- {log.relative_to(sweep_dir)}\n" + "\n".join(log.read_text().splitlines()[-15:]))
    return "\n".join(parts) or "(no job logs)"


def _run_sweep(command: list[str], sweep_dir: Path, job_name: str) -> tuple[list[str], dict[str, str]]:
    """Run the multirun under the deadline; return its array tasks and their final SLURM states."""
    try:
        done = subprocess.run(
            command, cwd=sweep_dir.parent, capture_output=True, text=True, timeout=SWEEP_DEADLINE_S
        )
    except subprocess.TimeoutExpired:
        queue = subprocess.run(
            ["squeue", "--noheader", f"--name={job_name}", "--format=%i %T %r"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        pytest.fail(
            f"the sweep did not finish within {SWEEP_DEADLINE_S}s; squeue:\n{queue}\n{_job_logs(sweep_dir)}"
        )
    assert done.returncode == 0, f"{done.stderr[-3000:]}\n{_job_logs(sweep_dir)}"
    # submitit keeps each array task's files in .submitit/<array job id>_<index>
    job_dirs = sorted(p.name for p in (sweep_dir / ".submitit").glob("*_*") if p.is_dir())
    assert job_dirs, f"no job folders in {sweep_dir / '.submitit'}: was anything submitted?"
    array_id = job_dirs[0].split("_")[0]
    # submitit returns once every result file is written; SLURM may still be closing the jobs (COMPLETING)
    deadline = time.monotonic() + 60
    states = _array_task_states(array_id)
    while set(states.values()) - TERMINAL_STATES and time.monotonic() < deadline:
        time.sleep(1)
        states = _array_task_states(array_id)
    return job_dirs, states


def test_sweep_of_two_tasks_and_two_backends_runs_as_a_job_array(slurm_cluster: None, tmp_path: Path) -> None:
    data_dir, sweep_dir = tmp_path / "data", tmp_path / "sweep"  # same machine: tmp is visible to the jobs
    write_listops_fixture(data_dir)
    write_pathfinder_fixture(data_dir)
    job_name = f"attnlab-test-{uuid.uuid4().hex[:8]}"
    command = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        "-m",
        "hydra/launcher=slurm_local",
        f"task={','.join(TASKS)}",
        f"attn={','.join(ATTNS)}",
        *TINY,
        f"paths.data_dir={data_dir}",
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra.launcher.name={job_name}",
        "hydra.launcher.timeout_min=5",
    ]
    try:
        job_dirs, states = _run_sweep(command, sweep_dir, job_name)
    except BaseException:
        # a failed or timed-out sweep leaves nothing queued or running (only then: cancelling a job that is
        # still COMPLETING would record it as CANCELLED)
        subprocess.run(["scancel", f"--name={job_name}"], capture_output=True, timeout=20)
        raise
    assert len(job_dirs) == 4 and len({name.split("_")[0] for name in job_dirs}) == 1, (
        f"expected one array of 4 jobs, got {job_dirs}"
    )
    assert states == dict.fromkeys(job_dirs, "COMPLETED"), states

    # Every (task, backend) wrote its own summary, from the fixture data, after the 3 steps asked for.
    summaries = {}
    for path in sweep_dir.glob("*/*/seed0_*/summary.json"):
        summary = json.loads(path.read_text())
        task, attn = path.parts[-4], path.parts[-3]
        assert (summary["task"], summary["attn"]) == (task, attn), path
        assert summary["steps"] == 3 and summary["world_size"] == 1, summary
        assert str(data_dir) in summary["data_source"], summary["data_source"]
        summaries[task, attn] = summary
    assert sorted(summaries) == sorted((t, a) for t in TASKS for a in ATTNS), sorted(summaries)


def test_multinode_sbatch_script_runs_cpu_ddp_over_two_tasks(slurm_cluster: None, tmp_path: Path) -> None:
    """The script as the README shows it, with the GPUs swapped for CPUs on the command line: srun starts
    2 tasks, the trainer gets devices/num_nodes from SLURM and Lightning runs DDP (gloo) over them."""
    data_dir, run_dir = tmp_path / "data", tmp_path / "run"
    write_listops_fixture(data_dir)
    job_name = f"attnlab-test-{uuid.uuid4().hex[:8]}"
    command = [
        "sbatch",
        "--wait",
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
        *TINY,
        f"paths.data_dir={data_dir}",
        f"hydra.run.dir={run_dir}",  # after the script's own hydra.run.dir, so it wins
    ]
    try:
        # the script runs from the submit directory (the repository, for train.py) in $ATTNLAB_VENV
        env = {**os.environ, "ATTNLAB_VENV": sys.prefix}
        done = subprocess.run(
            command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=SWEEP_DEADLINE_S
        )
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={job_name}"], capture_output=True, timeout=20)
        pytest.fail(f"the sbatch job did not finish within {SWEEP_DEADLINE_S}s")
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else "(no job log)"
    assert done.returncode == 0, f"{done.stderr}\n{log[-4000:]}"
    assert "1 nodes x 2 tasks" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3, summary
