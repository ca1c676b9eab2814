"""CPU thread defaults (attnlab.threads): the cap, the user's choices, the governor, and their order."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab import threads
from attnlab.bench import threads as bench_threads
from attnlab.threads import MARKER, ThreadGovernor, cgroup_cpu_quota, configure, usable_cpus
from tiny_runs import REPO_ROOT, TINY_LISTOPS, attnlab_main


def test_defaults_fill_only_what_the_user_left_unset():
    env: dict[str, str] = {}
    settings = configure(env)
    assert env["OMP_NUM_THREADS"] == str(usable_cpus()) and env["GOMP_SPINCOUNT"] == threads.SPIN_COUNT
    assert settings.adaptive and settings.chosen_by == {"threads": "attnlab", "wait": "attnlab"}

    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    settings = configure(env)
    assert env["OMP_NUM_THREADS"] == "3" and "GOMP_SPINCOUNT" not in env
    assert settings.cap == 3 and not settings.adaptive
    assert "yours" in settings.describe() and "OMP_WAIT_POLICY=ACTIVE" in settings.describe()


def test_inherited_defaults_are_decided_afresh_not_taken_for_the_users():
    """A SLURM job submitted from a 2-core login node inherits OMP_NUM_THREADS=2: it is not the user's."""
    parent: dict[str, str] = {}
    configure(parent)
    child = {**parent, "OMP_NUM_THREADS": parent["OMP_NUM_THREADS"]}
    child[MARKER] = child[MARKER].replace(f"OMP_NUM_THREADS={usable_cpus()}", "OMP_NUM_THREADS=64")
    child["OMP_NUM_THREADS"] = "64"  # the login node's count, inherited
    settings = configure(child)
    assert settings.adaptive and child["OMP_NUM_THREADS"] == str(usable_cpus())

    user_changed = {**parent, "OMP_NUM_THREADS": "1"}  # set by the user after the parent's marker
    assert not configure(user_changed).adaptive and user_changed["OMP_NUM_THREADS"] == "1"


def test_off_switch_keeps_torchs_defaults_and_drops_inherited_ones():
    env = {"ATTNLAB_THREADS": "off"}
    configure(env)
    assert "OMP_NUM_THREADS" not in env and "GOMP_SPINCOUNT" not in env

    inherited: dict[str, str] = {}
    configure(inherited)
    inherited["ATTNLAB_THREADS"] = "off"
    settings = configure(inherited)
    assert settings.off and not settings.adaptive
    assert "OMP_NUM_THREADS" not in inherited and "GOMP_SPINCOUNT" not in inherited
    assert "torch's defaults" in settings.describe()


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_quota_caps_the_threads(tmp_path, version):
    """A container's --cpus=1.5 shows every host core to the affinity mask; only the quota tells."""
    proc = tmp_path / "cgroup"
    if version == "v2":
        proc.write_text("0::/job/step\n")
        (tmp_path / "job" / "step").mkdir(parents=True)
        (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")
        (tmp_path / "job" / "cpu.max").write_text("150000 100000\n")  # the parent's quota binds
    else:
        proc.write_text("4:memory:/x\n2:cpu,cpuacct:/job\n")
        (tmp_path / "cpu,cpuacct" / "job").mkdir(parents=True)
        (tmp_path / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("150000\n")
        (tmp_path / "cpu,cpuacct" / "job" / "cpu.cfs_period_us").write_text("100000\n")
        (tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
        (tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, proc) == pytest.approx(1.5)
    assert usable_cpus(tmp_path, proc, environ={}) == 1

    proc.write_text("0::/\n" if version == "v2" else "2:cpu,cpuacct:/\n")  # no quota at the root
    assert cgroup_cpu_quota(tmp_path, proc) is None
    assert usable_cpus(tmp_path, proc, environ={}) == len(os.sched_getaffinity(0))


def test_a_slurm_jobs_cpus_per_task_cap_the_threads(tmp_path):
    """Where SLURM does not bind tasks to CPUs, each task still gets only the CPUs it asked for."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    every = len(os.sched_getaffinity(0))
    job = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "1"}
    assert usable_cpus(tmp_path, proc, environ=job) == 1
    assert usable_cpus(tmp_path, proc, environ={**job, "SLURM_CPUS_PER_TASK": "512"}) == every
    assert usable_cpus(tmp_path, proc, environ={"SLURM_CPUS_PER_TASK": "1"}) == every  # not in a job
    assert usable_cpus(tmp_path, proc, environ={"SLURM_JOB_ID": "7"}) == every  # no per-task count
    env = dict(job)
    configure(env)
    assert env["OMP_NUM_THREADS"] == "1"


class FakeMachine:
    """A clock and CPU counters: ``run(seconds, others, own)`` advances them by that much use."""

    def __init__(self):
        self.now, self.total, self.own = 0.0, 0.0, 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.now += seconds
        self.total += seconds * (others + own)
        self.own += seconds * own


def test_governor_follows_the_cpus_other_processes_leave_free():
    machine, seen = FakeMachine(), []
    governor = ThreadGovernor(
        cap=2, set_threads=seen.append, interval_s=1.0, cpus={0, 1},
        clock=lambda: machine.now, total_busy=lambda: machine.total, own_busy=lambda: machine.own,
    )  # fmt: skip
    machine.run(1.5, others=0.05, own=1.9)  # quiet: stay at the cap
    assert governor.tick() is None and governor.threads == 2
    machine.run(0.5, others=1.3, own=0.7)  # a window shorter than the interval: not read yet
    assert governor.tick() is None
    machine.run(1.0, others=1.3, own=0.7)  # two busy processes take most of the machine: down at once
    assert governor.tick() == 1 and seen == [1]
    for _ in range(2):  # the load is gone: up only after three free windows in a row
        machine.run(1.0, others=0.1, own=1.0)
        assert governor.tick() is None
    machine.run(1.0, others=0.1, own=1.0)
    assert governor.tick() == 2 and seen == [1, 2]
    for _ in range(2):  # a lull of two windows between bursts does not bring the second thread back
        machine.run(1.0, others=1.5, own=0.5)
        assert governor.tick() in (None, 1)
        machine.run(1.0, others=0.2, own=0.8)
        machine.run(1.0, others=0.2, own=0.8)
        assert governor.tick() is None and governor.threads == 1
    assert seen == [1, 2, 1]
    assert "3 changes" in governor.report()


#: train.py as a user runs it, with an import hook that fails if torch loads before the defaults are set
GUARDED_TRAIN_PY = """
import builtins, os, runpy, sys
real_import = builtins.__import__
def guarded(name, *args, **kwargs):
    first = name.split(".")[0] == "torch" and "torch" not in sys.modules
    if first and "ATTNLAB_THREADS_SET" not in os.environ:
        raise SystemExit("torch was imported before attnlab.threads.configure()")
    return real_import(name, *args, **kwargs)
builtins.__import__ = guarded
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("user_threads", [None, pytest.param("1", marks=pytest.mark.slow)])
def test_train_py_sets_threads_before_torch_loads_and_the_users_win(tmp_path, user_threads):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", MARKER)}
    env.pop("OMP_WAIT_POLICY", None)
    if user_threads:
        env["OMP_NUM_THREADS"] = user_threads
    args = [
        *TINY_LISTOPS, "trainer.fast_dev_run=true", "logger=none", "test=false",
        f"paths.data_dir={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", GUARDED_TRAIN_PY, *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    line = next(line for line in log.splitlines() if "CPU threads:" in line)
    if user_threads:
        assert "1 threads (yours)" in line and "torch uses 1 intra-op threads" in line
    else:
        expected = usable_cpus()
        assert f"{expected} threads (attnlab" in line and f"GOMP_SPINCOUNT={threads.SPIN_COUNT}" in line
        assert f"torch uses {expected} intra-op threads" in line
    if platform.libc_ver()[0] == "glibc":  # and malloc keeps freed buffers (attnlab.allocator)
        assert "memory: glibc keeps freed buffers for reuse" in log


def test_each_setting_is_measured_with_its_own_thread_variables_only():
    caller = {"PATH": "/bin", "OMP_NUM_THREADS": "7", "GOMP_SPINCOUNT": "0", MARKER: "1"}
    assert bench_threads.setting_environment("attnlab", caller) == {"PATH": "/bin"}
    assert bench_threads.setting_environment("one-thread", caller) == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert bench_threads.setting_environment("torch", caller) == {"PATH": "/bin", "ATTNLAB_THREADS": "off"}


def test_a_measured_process_runs_the_training_steps_with_its_settings_threads(monkeypatch):
    """attnlab's setting in a fresh process: its own cap and the governor that ticks at every step,
    whatever thread count this process holds."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(usable_cpus() + 5))  # this process's: not the measured one's
    result = bench_threads.measure("attnlab", steps=1, warmup=0, max_seconds=60)
    assert 1 <= result["threads"] <= usable_cpus() and result["governor"] is not None
    assert result["steps"] == 1 and result["ms_per_step"] > 0


def test_bench_threads_tables_each_setting_quiet_and_busy_and_stops_its_busy_processes(tmp_path, monkeypatch):
    """The command with each measured process stood in for (the real one: the test above, and the
    whole command beside busy processes in ``make test-all``): every (condition, setting) is measured,
    tabled, written, and the busy processes it started are gone at the end."""
    busy_during: list[int] = []

    def stand_in(setting, steps, warmup, max_seconds):
        busy_during.append(len(_busy_children()))
        return {"ms_per_step": 10.0 if setting == "attnlab" else 20.0, "steps": steps, "threads": 2}

    monkeypatch.setattr(bench_threads, "measure", stand_in)
    out = _bench_threads_beside_one_busy_process(tmp_path)
    assert "busy x1: attnlab runs 2.00x as fast as one-thread" in out
    assert busy_during[:2] == [0, 0] and min(busy_during[2:]) >= 1  # quiet first, then beside one


def _bench_threads_beside_one_busy_process(tmp_path) -> str:
    """`attnlab bench threads` for two settings, quiet and beside one busy process, in this process;
    checks its JSON (four figures) and that the busy processes it started are gone; its output."""
    out_file = tmp_path / "threads.json"
    out = attnlab_main(
        "bench", "threads", "--busy", "1", "--steps", "2", "--warmup", "0", "--repeats", "1",
        "--settings", "attnlab", "one-thread", "--out", str(out_file), cwd=REPO_ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(json.loads(out_file.read_text())) == 4
    (pids,) = re.findall(r"busy processes ([\d, ]+) \(stopped at the end\)", out.stdout)
    assert not any("while True" in _cmdline(int(pid)) for pid in pids.split(", "))
    return out.stdout


def _busy_children() -> list[int]:
    """This process's children that run the bench's busy loop."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or gone
            continue
        if parent == os.getpid() and "while True" in _cmdline(int(entry.name)):
            children.append(int(entry.name))
    return children


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # gone
        return ""


@pytest.mark.slow
@pytest.mark.xdist_group("processes")  # several processes at once: never two such tests together
def test_bench_threads_runs_each_setting_beside_busy_processes(tmp_path):
    """Each setting's fresh process gets its own thread environment, whatever this one holds (the bench
    drops the thread variables before it starts them), so the command runs in this process."""
    out = _bench_threads_beside_one_busy_process(tmp_path)
    assert "busy x1: attnlab runs" in out and "as fast as one-thread" in out
