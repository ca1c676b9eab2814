"""A SLURM sweep followed until every run is done, requeued runs included.

:func:`launch_and_wait`, the body of ``hydra_plugins.attnlab_slurm.RequeueAwareSlurmLauncher``: submits
the sweep as submitit's launcher does, then polls SLURM (``scontrol show job``) until each run either
wrote ``<run dir>/summary.json`` and left the queue, or left the queue without it (failed). A run
pre-empted before its time limit saves a checkpoint, requeues itself and returns from its first attempt
without a summary; submitit takes that return for the job's result, so waiting on submitit alone ended
the sweep while requeued runs were still to come.

Only the standard library, omegaconf and hydra are imported at module level: Hydra imports the launcher
plugin on every start.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"  # what attnlab.pipeline.train writes when a run has finished
POLL_S = 5.0  # between two looks at the queue; a requeued job waits far longer than this to restart
HEARTBEAT_S = 600.0  # log which runs are still awaited at least this often, even when nothing changed
# Job states after which SLURM does nothing more with a job (squeue no longer lists it). Any other state
# (PENDING, RUNNING, COMPLETING, REQUEUED, REQUEUE_HOLD, SPECIAL_EXIT, SUSPENDED, ...) means the job is
# still in the queue, possibly to run again.
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "REVOKED",
    }
)


class SweepFailed(SystemExit):
    """Ends ``python train.py -m`` with status 1 and the reasons, after the table of runs is printed."""


# ---- the state of the queue ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmJobState:
    """What the controller says about one job (an array task counts as a job)."""

    state: str  # JobState, e.g. PENDING, RUNNING, COMPLETED
    reason: str  # why it is pending, or "None"
    restarts: int  # times it was requeued


def _task_ids(spec: str) -> list[int]:
    """Array task indices of a pending array record: ``1-3%4`` (throttled), ``0,2,5-9:2``."""
    ids: list[int] = []
    for part in spec.split("%", 1)[0].split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part.strip())
        if match is None:
            continue
        first, last, step = match.groups()
        ids.extend(range(int(first), int(last or first) + 1, int(step or 1)))
    return ids


def parse_scontrol_jobs(text: str) -> dict[str, SlurmJobState]:
    """``{job id: state}`` from ``scontrol show job --oneliner``; array tasks as ``<array job>_<task>``,
    the id submitit uses. A record of several pending tasks (``ArrayTaskId=2-3``) gives each of them."""
    jobs: dict[str, SlurmJobState] = {}
    for line in text.splitlines():
        fields = dict(
            re.findall(r"(?:^|\s)(JobId|ArrayJobId|ArrayTaskId|JobState|Reason|Restarts)=(\S*)", line)
        )
        if "JobId" not in fields or "JobState" not in fields:
            continue
        restarts = fields.get("Restarts", "0")
        state = SlurmJobState(
            fields["JobState"], fields.get("Reason", ""), int(restarts) if restarts.isdigit() else 0
        )
        array_id, task_spec = fields.get("ArrayJobId"), fields.get("ArrayTaskId")
        if array_id and task_spec:
            for task in _task_ids(task_spec):
                jobs[f"{array_id}_{task}"] = state
        else:
            jobs[fields["JobId"]] = state
    return jobs


def query_slurm(job_ids: Iterable[str]) -> dict[str, SlurmJobState] | None:
    """The controller's view of these jobs (one ``scontrol`` call per array); a job it no longer knows is
    missing from the result. None when the controller could not be asked this time."""
    if shutil.which("scontrol") is None:
        raise RuntimeError(
            "`scontrol` is not on PATH: attnlab's SLURM launcher needs it to follow the sweep's jobs"
        )
    found: dict[str, SlurmJobState] = {}
    for base in sorted({job_id.split("_", 1)[0] for job_id in job_ids}):
        try:
            done = subprocess.run(
                ["scontrol", "show", "job", "--oneliner", base], capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            log.warning("`scontrol show job %s` did not answer within 60 s; asking again later", base)
            return None
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                continue  # purged: the controller forgets finished jobs after MinJobAge
            log.warning("`scontrol show job %s` failed (%s); asking again later", base, done.stderr.strip())
            return None
        found.update(parse_scontrol_jobs(done.stdout))
    return found


# ---- following the runs ----------------------------------------------------------------------------------
@dataclass
class Run:
    """One run of the sweep: its SLURM job and run dir, and what has been seen of it so far."""

    num: int  # hydra.job.num
    job_id: str  # submitit's id: "<array job>_<task>", or "<job>" for a sweep of one run
    run_dir: Path
    overrides: Sequence[str] = ()
    state: str = "SUBMITTED"  # the last SLURM state seen
    reason: str = ""
    requeues: int = 0
    outcome: str | None = None  # "COMPLETED" or "FAILED" once decided
    detail: str = ""  # why it failed
    job_return: JobReturn | None = None
    gone_polls: int = 0  # consecutive looks at the queue without the job in it
    log_file: str = ""  # the job's stderr, for failure messages

    @property
    def summary(self) -> Path:
        return self.run_dir / SUMMARY_FILE


# The result of a job's last attempt: (its JobReturn or None, why it failed or None)
ResultReader = Callable[[Run], "tuple[JobReturn | None, str | None]"]
SlurmQuery = Callable[[Iterable[str]], "Mapping[str, SlurmJobState] | None"]


@dataclass
class SweepWaiter:
    """Polls the queue until every run is decided (see :func:`launch_and_wait`).

    A run is COMPLETED when its job has left the queue and its ``summary.json`` exists, FAILED when its
    job left the queue without one or its last attempt raised. A job counts as gone after two looks in
    a row that find it in a final state or not at all, so a state seen in passing does not fail it.
    """

    runs: list[Run]
    sweep_dir: Path
    query: SlurmQuery = query_slurm
    read_result: ResultReader = field(default=lambda run: (None, None))
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    poll_s: float = POLL_S
    heartbeat_s: float = HEARTBEAT_S

    def wait(self) -> None:
        last_heartbeat = self.clock()
        while True:
            states = self.query([run.job_id for run in self.runs if run.outcome is None])
            if states is not None:
                for run in self.runs:
                    if run.outcome is None:
                        self._update(run, states.get(run.job_id))
            waiting = [run for run in self.runs if run.outcome is None]
            if not waiting:
                return
            if self.clock() - last_heartbeat >= self.heartbeat_s:
                last_heartbeat = self.clock()
                log.info(
                    "still waiting for %d of %d runs: %s",
                    len(waiting),
                    len(self.runs),
                    ", ".join(f"#{run.num} {self._describe(run)}" for run in waiting),
                )
            self.sleep(self.poll_s)

    def _name(self, run: Run) -> str:
        return f"#{run.num} {self._relative(run.run_dir)} (job {run.job_id})"

    def _relative(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.sweep_dir))
        except ValueError:
            return str(path)

    @staticmethod
    def _describe(run: Run) -> str:
        reason = f" ({run.reason})" if run.reason and run.reason != "None" else ""
        requeued = f", requeued {run.requeues}x" if run.requeues else ""
        return f"{run.state}{reason}{requeued}"

    def _update(self, run: Run, seen: SlurmJobState | None) -> None:
        if seen is not None:
            if seen.restarts > run.requeues:
                run.requeues = seen.restarts
                log.info(
                    "run %s was requeued (%d requeue%s so far): waiting for the next attempt",
                    self._name(run),
                    run.requeues,
                    "" if run.requeues == 1 else "s",
                )
            if (seen.state, seen.reason) != (run.state, run.reason):
                if seen.state == "RUNNING" and run.requeues:
                    log.info("run %s: attempt %d started", self._name(run), run.requeues + 1)
                run.state, run.reason = seen.state, seen.reason
                log.debug("run %s: %s", self._name(run), self._describe(run))
            if seen.state not in TERMINAL_STATES:
                run.gone_polls = 0
                return
        run.gone_polls += 1
        has_summary = run.summary.is_file()
        if not has_summary and run.gone_polls < 2:
            return  # look once more before calling it a failure
        if seen is None and run.state not in TERMINAL_STATES:
            run.state = "GONE"  # no longer known to the controller (purged after MinJobAge)
        job_return, error = self.read_result(run)
        run.job_return = job_return
        if error is not None:
            run.outcome, run.detail = "FAILED", error
        elif has_summary:
            run.outcome = "COMPLETED"
        else:
            run.outcome, run.detail = "FAILED", self._missing_summary(run)
        after = f" after {run.requeues} requeue{'' if run.requeues == 1 else 's'}" if run.requeues else ""
        if run.outcome == "COMPLETED":
            log.info("run %s finished%s", self._name(run), after)
        else:
            log.error("run %s failed%s: %s", self._name(run), after, run.detail)

    def _missing_summary(self, run: Run) -> str:
        state = "it is no longer known to SLURM" if run.state == "GONE" else f"in state {run.state}"
        text = f"the job left the queue ({state}) without writing {self._relative(run.summary)}"
        checkpoints = sorted(run.run_dir.glob("hpc_ckpt_*.ckpt"))
        if checkpoints:
            text += (
                f"; it was pre-empted and not requeued ({self._relative(checkpoints[-1])} exists: "
                "rerun it with ckpt_path=auto to resume)"
            )
        if run.log_file:
            text += f"; log: {run.log_file}"
        return text

    def table(self) -> str:
        """Every run with its outcome, attempts and requeues; the reasons of failed runs below."""
        rows = [("run", "job", "state", "attempts", "requeues")]
        for run in self.runs:
            state = run.outcome or "?"
            if run.outcome == "FAILED" and run.state not in ("COMPLETED", "SUBMITTED"):
                state += f" ({run.state})"
            rows.append(
                (self._relative(run.run_dir), run.job_id, state, str(run.requeues + 1), str(run.requeues))
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            for row in rows
        ]
        failed = [run for run in self.runs if run.outcome == "FAILED"]
        completed = sum(run.outcome == "COMPLETED" for run in self.runs)
        requeued = sum(run.requeues > 0 for run in self.runs)
        head = (
            f"sweep {self.sweep_dir}: {completed} of {len(self.runs)} runs completed, {len(failed)} failed, "
            f"{requeued} requeued"
        )
        tail = [f"  #{run.num} {self._relative(run.run_dir)}: {run.detail}" for run in failed]
        return "\n".join([head, *(line.rstrip() for line in lines), *tail])


# ---- the launcher -----------------------------------------------------------------------------------------
def _submitit_result(job: Any) -> Callable[[Run], tuple[JobReturn | None, str | None]]:
    """Reads the result file of a job's task 0 (the rank that runs Hydra's job and writes the summary)."""

    def read(run: Run) -> tuple[JobReturn | None, str | None]:
        task = job.task(0)
        if not task.paths.result_pickle.exists():
            return None, None
        try:
            job_return = task.result()
        except Exception as err:  # the job failed outside Hydra's job (submitit reports it with the log)
            lines = [line for line in str(err).splitlines() if line.strip()]
            return None, f"{type(err).__name__}: {lines[-1] if lines else ''}; log: {task.paths.stderr}"
        if isinstance(job_return, JobReturn) and job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            return job_return, f"{type(error).__name__}: {error}; log: {task.paths.stderr}"
        return job_return, None

    return read


def _run_dir(launcher: Any, overrides: Sequence[str], num: int, job_id: str) -> Path:
    """The run dir the job will use: the sweep dir and subdir of its config, resolved as Hydra's
    ``run_job`` does in the job (with ``hydra.job.num``/``id`` set as submitit's launcher sets them)."""
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
    with open_dict(config.hydra.job):
        config.hydra.job.id = job_id
        config.hydra.job.num = num
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        return Path(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir)).absolute()
    finally:
        HydraConfig.instance().cfg = previous


def _executor(launcher: Any) -> Any:
    """A submitit executor set up from ``hydra.launcher`` the way hydra-submitit-launcher does it: the
    folder and ``max_num_timeout`` go to the constructor, the keys of its common schema as they are, every
    other key with the cluster prefix (``slurm_partition``, ...)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    cluster = launcher._EXECUTOR
    params = dict(launcher.params)
    executor = submitit.AutoExecutor(
        cluster=cluster,
        folder=params.pop("submitit_folder"),
        **{f"{cluster}_max_num_timeout": params.pop("max_num_timeout")}
        if "max_num_timeout" in params
        else {},
    )
    common = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{key if key in common else f"{cluster}_{key}": v for key, v in params.items()}
    )
    return executor


def launch_and_wait(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
    """Submit the runs as one job array, wait until each has its summary or has failed, print a table of
    the runs; raise :class:`SweepFailed` when any failed, else return their ``JobReturn``s."""
    assert launcher.config is not None and len(job_overrides) > 0
    executor = _executor(launcher)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    log.info("Submitit '%s' sweep output dir : %s", launcher._EXECUTOR, sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in launcher.config.hydra.sweep:
        os.chmod(sweep_dir, mode=int(str(launcher.config.hydra.sweep.mode), 8))

    job_params = []
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
        job_params.append(
            (list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
        )
    jobs = executor.map_array(launcher, *zip(*job_params, strict=True))

    runs, readers = [], {}
    for (overrides, _, num, _, _), job in zip(job_params, jobs, strict=True):
        run = Run(num, job.job_id, _run_dir(launcher, overrides, num, job.job_id), overrides)
        run.log_file = str(job.task(0).paths.stderr)
        runs.append(run)
        readers[run.num] = _submitit_result(job)
    ids = sorted({run.job_id.split("_", 1)[0] for run in runs})
    log.info(
        "submitted %d runs as SLURM job %s; waiting until each has written its summary",
        len(runs),
        ", ".join(ids),
    )
    waiter = SweepWaiter(runs, sweep_dir, read_result=lambda run: readers[run.num](run))
    waiter.wait()
    log.info("%s", waiter.table())
    failed = [run for run in runs if run.outcome == "FAILED"]
    if failed:
        raise SweepFailed(
            f"SweepFailed: {len(failed)} of {len(runs)} runs failed:\n"
            + "\n".join(f"  #{run.num} {waiter._relative(run.run_dir)}: {run.detail}" for run in failed)
        )
    return [
        run.job_return or JobReturn(overrides=list(run.overrides), status=JobStatus.COMPLETED) for run in runs
    ]
