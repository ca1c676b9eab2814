"""CPU threads that behave on a shared machine: a cap set before torch loads, then the free CPUs.

PyTorch's CPU ops run on an OpenMP pool (GNU libgomp in the pip wheels) whose idle threads *spin*
before they sleep. When other processes keep the cores busy (a login node, a laptop, a 2-core CI
runner) the spinning threads steal the very cores that the thread they wait for needs, and a
training step can take several times longer than with one thread (docs/configuration.md, "CPU threads"
has the figures). Three measures, each only where the user has not chosen:

- **A cap** (``OMP_NUM_THREADS``): the CPUs this process may really use, its CPU affinity
  (``taskset``, SLURM's CPU binding) capped by its cgroup's CPU quota (a container's ``--cpus``)
  and, in a SLURM job, by the CPUs it asked per task (``SLURM_CPUS_PER_TASK``: a cluster that does
  not bind tasks to CPUs still gave each task only those), where ``os.cpu_count()`` counts every
  core of the host.
- **A short spin** (``GOMP_SPINCOUNT=10000``, libgomp's default is 300,000): idle threads sleep
  after a few microseconds, so a burst of load costs little before the governor reacts, while a quiet
  machine keeps its speed. A fully passive policy (``OMP_WAIT_POLICY=PASSIVE``) was measured too: it
  wakes threads for every small op and made a quiet machine's steps markedly slower.
- **A governor** (``ThreadGovernor``, driven by ``attnlab.callbacks.threads``): at most once a
  second it reads how much of this process's CPUs *other* processes used (``/proc/stat`` minus this
  process's own time) and sets torch's thread count to the CPUs left free, between 1 and the cap.
  It stays off where the thread count must not move: the user's own ``OMP_NUM_THREADS``, and
  deterministic runs (a different thread count can change float sums in the last bit).

The first two are environment variables that libgomp reads once, when torch loads it: ``configure()``
is the first thing ``train.py`` and the ``attnlab`` command do. The user's own ``OMP_NUM_THREADS``,
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` win, and ``ATTNLAB_THREADS=off`` leaves everything as torch
would have it. Stdlib only: importing this module must not load torch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: set to "off" to keep torch's own thread defaults (libgomp's long spin, every CPU, no governor)
SWITCH = "ATTNLAB_THREADS"
#: the variables attnlab set itself ("KEY=VALUE ..."), so that children can tell them from the user's
MARKER = "ATTNLAB_THREADS_SET"
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SPIN_COUNT = "10000"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass
class ThreadSettings:
    """What ``configure`` decided, for the run's log: each value and who chose it."""

    off: bool = False
    cap: int | None = None
    wait: str | None = None
    chosen_by: dict[str, str] = field(default_factory=dict)

    @property
    def adaptive(self) -> bool:
        """Whether the governor may move the thread count (not when the user fixed it)."""
        return not self.off and self.chosen_by.get("threads") == "attnlab"

    def describe(self, governed: bool = True) -> str:
        """``governed``: whether this run lets the governor move the count (a run with
        ``callbacks.cpu_threads=null``, in deterministic mode or on a GPU does not)."""
        if self.off:
            return f"CPU threads: torch's defaults ({SWITCH}=off)"
        threads = f"{self.cap} threads ({self.chosen_by['threads']}"
        threads += ", following the CPUs other processes leave free)" if self.adaptive and governed else ")"
        return (
            f"CPU threads: {threads}, OpenMP waiting {self.wait} ({self.chosen_by['wait']}); "
            f"set OMP_NUM_THREADS / OMP_WAIT_POLICY to choose, {SWITCH}=off for torch's defaults"
        )


_applied: ThreadSettings | None = None


def configure(environ: dict | None = None) -> ThreadSettings:
    """Put attnlab's CPU thread defaults into the environment, where the user has not set their own.

    Call it before torch is imported (entry points only: a library must not change its host's
    threads). The values it sets are listed in ``ATTNLAB_THREADS_SET``, so that a process that
    inherits them (a DataLoader worker, a SLURM job submitted from a 2-core login node) decides
    afresh instead of taking them for the user's. The first call in a process decides.
    """
    global _applied
    if _applied is not None and environ is None:
        return _applied
    env = os.environ if environ is None else environ
    ours = dict(item.split("=", 1) for item in env.get(MARKER, "").split() if "=" in item)
    for key, value in ours.items():  # inherited from an attnlab parent: not the user's choice
        if env.get(key) == value:
            del env[key]
    env.pop(MARKER, None)
    settings = ThreadSettings(off=env.get(SWITCH, "").strip().lower() in {"off", "0", "false", "no"})
    if not settings.off:
        chosen = {}
        if env.get("OMP_NUM_THREADS"):
            settings.cap = _first_int(env["OMP_NUM_THREADS"])
            settings.chosen_by["threads"] = "yours"
        else:
            settings.cap = usable_cpus(environ=env)
            chosen["OMP_NUM_THREADS"] = str(settings.cap)
            settings.chosen_by["threads"] = "attnlab"
        if any(env.get(key) for key in WAIT_KEYS):
            settings.wait = ", ".join(f"{key}={env[key]}" for key in WAIT_KEYS if env.get(key))
            settings.chosen_by["wait"] = "yours"
        else:
            chosen["GOMP_SPINCOUNT"] = SPIN_COUNT
            settings.wait = f"GOMP_SPINCOUNT={SPIN_COUNT}"
            settings.chosen_by["wait"] = "attnlab"
        env.update(chosen)
        env[MARKER] = " ".join(f"{key}={value}" for key, value in chosen.items())
    if environ is None:
        _applied = settings
    return settings


def applied() -> ThreadSettings | None:
    """What ``configure`` decided in this process (None when no entry point called it)."""
    return _applied


def usable_cpus(
    cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP, environ: dict | None = None
) -> int:
    """CPUs this process can keep busy: its affinity mask, capped by its cgroup's CPU quota and by
    a SLURM job's CPUs per task."""
    count = len(affinity())
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    per_task = slurm_cpus_per_task(os.environ if environ is None else environ)
    if per_task is not None:
        count = min(count, per_task)
    return max(1, count)


def slurm_cpus_per_task(environ: dict) -> int | None:
    """The CPUs a SLURM job gave each of its tasks (``--cpus-per-task``), None outside a job or
    when it did not say. With ``TaskPlugin=task/none`` nothing binds the tasks, so without this cap
    two tasks on a 2-CPU allocation would each start a thread per CPU of the node."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    value = _first_int(environ.get("SLURM_CPUS_PER_TASK", ""))
    return value if value and value > 0 else None


def affinity() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota (in CPUs) of this process's cgroup and its parents, v2 or v1; None when unlimited.

    A container started with ``--cpus=1.5`` shows every host core to ``os.cpu_count()`` and to its
    affinity mask; only the quota says that 1.5 CPUs' worth of time is all it gets.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy; cpu.max holds "<quota> <period>" or "max <period>"
            quotas += _walk_up(cgroup_root, path, "cpu.max", _read_v2)
        elif "cpu" in controllers.split(","):  # v1: cpu.cfs_quota_us (-1: none) / cpu.cfs_period_us
            base = cgroup_root / controllers
            quotas += _walk_up(
                base if base.is_dir() else cgroup_root / "cpu", path, "cpu.cfs_quota_us", _read_v1
            )
    return min(quotas) if quotas else None


def _walk_up(base: Path, path: str, filename: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas set on the cgroup ``path`` under ``base`` and on each of its parents."""
    parts = [p for p in path.strip("/").split("/") if p]
    found = (read(base.joinpath(*parts[:depth], filename)) for depth in range(len(parts), -1, -1))
    return [quota for quota in found if quota is not None]


def _read_v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _read_v1(path: Path) -> float | None:
    try:
        quota = int(path.read_text())
        period = int((path.parent / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _first_int(text: str) -> int | None:
    try:
        return int(text.split(",")[0])
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------
# The governor: how many CPUs do the other processes leave us?
# --------------------------------------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds_used(cpus: set[int], proc_stat: Path = Path("/proc/stat")) -> float | None:
    """Busy CPU-seconds since boot summed over ``cpus`` (everything but idle and I/O wait)."""
    try:
        lines = proc_stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *ticks = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in ticks[:8])
            busy += user + nice + system + irq + softirq + steal
    return busy / CLOCK_TICKS


def own_cpu_seconds() -> float:
    """CPU-seconds this process (all its threads) has used."""
    times = os.times()
    return times.user + times.system


class ThreadGovernor:
    """Keeps torch's thread count at the CPUs that other processes leave free, between 1 and ``cap``.

    ``tick()`` is cheap (two small reads at most once per ``interval_s``) and is meant to be called at
    every training or evaluation step. The count drops as soon as one window shows the CPUs taken,
    and rises again only after ``windows_up`` windows in a row show them free, so a passing lull does
    not make it flap.
    """

    def __init__(
        self,
        cap: int,
        set_threads: Callable[[int], None],
        interval_s: float = 1.0,
        windows_up: int = 3,
        cpus: set[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        total_busy: Callable[[], float | None] | None = None,
        own_busy: Callable[[], float] = own_cpu_seconds,
    ):
        self.cap, self.set_threads, self.interval_s, self.clock = max(1, cap), set_threads, interval_s, clock
        cpus = cpus if cpus is not None else affinity()
        self.width = len(cpus)
        self.total_busy = total_busy or (lambda: cpu_seconds_used(cpus))
        self.own_busy = own_busy
        self.windows_up = windows_up
        self.threads, self.calm = self.cap, 0
        self.changes = 0
        self.time_at: dict[int, float] = {}
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self.clock(), self.total_busy(), self.own_busy()

    def free_cpus(self, previous: tuple, now: tuple) -> float | None:
        """CPUs the other processes left idle between two samples."""
        (t0, total0, own0), (t1, total1, own1) = previous, now
        if total0 is None or total1 is None or t1 <= t0:
            return None
        others = max(0.0, (total1 - total0) - (own1 - own0)) / (t1 - t0)
        return self.width - others

    def tick(self) -> int | None:
        """Re-read the load when a window has passed; return the new thread count when it changed.

        Down at once, up slowly: a thread too many beside busy processes costs several times the
        step (its OpenMP partner waits for a core), a thread too few costs at most the second core.
        """
        now = self._sample()
        elapsed = now[0] - self._last[0]
        if elapsed < self.interval_s:
            return None
        self.time_at[self.threads] = self.time_at.get(self.threads, 0.0) + elapsed
        free = self.free_cpus(self._last, now)
        self._last = now
        if free is None:
            return None
        wanted = min(self.cap, max(1, round(free)))
        if wanted >= self.threads:
            self.calm = self.calm + 1 if wanted > self.threads else 0
            if self.calm < self.windows_up:
                return None
        self.threads, self.calm = wanted, 0
        self.changes += 1
        self.set_threads(wanted)
        return wanted

    def report(self) -> str:
        """One line on what the governor did over the run."""
        total = sum(self.time_at.values())
        if not total:
            return f"CPU threads: {self.threads} throughout"
        shares = ", ".join(f"{n} for {100 * t / total:.0f}%" for n, t in sorted(self.time_at.items()))
        return f"CPU threads followed the load: {shares} of the time ({self.changes} changes)"
