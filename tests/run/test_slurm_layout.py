"""The SLURM layout check (attnlab.run.slurm_layout): composed launcher configs, allocations, and the Hydra
callback refusing a mismatched sweep before anything reaches ``sbatch``. No cluster is needed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from attnlab.run.slurm_layout import (
    SlurmLayout,
    SlurmLayoutCheck,
    SlurmLayoutError,
    SweepRefused,
    allocated_layout,
    check_slurm_layout,
    layout_problems,
    requested_layout,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
MULTINODE = [  # the multi-node request of slurm/README.md: 2 nodes x 4 GPUs, one DDP process per GPU
    "hydra/launcher=slurm",
    "hydra.launcher.nodes=2",
    "hydra.launcher.gpus_per_node=4",
    "hydra.launcher.tasks_per_node=4",
    "trainer=ddp_slurm",
    "trainer.devices=4",
    "trainer.num_nodes=2",
]


def compose_with_hydra(*overrides: str):
    """The composed train config with its ``hydra`` node, as the multirun callback receives it."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("launcher", ["slurm", "slurm_local"])
def test_launcher_configs_are_submitit_slurm_and_register_the_check(launcher):
    cfg = compose_with_hydra(f"hydra/launcher={launcher}")
    # submitit's SLURM launcher, subclassed to wait for requeued runs (attnlab.run.slurm_sweep)
    assert cfg.hydra.launcher._target_ == "hydra_plugins.attnlab_slurm.RequeueAwareSlurmLauncher"
    assert cfg.hydra.callbacks.slurm_layout._target_ == "attnlab.run.slurm_layout.SlurmLayoutCheck"
    assert (
        cfg.hydra.callbacks.multirun_hydra_config._target_
        == "attnlab.run.hydra_callbacks.MultirunHydraConfig"
    )
    assert cfg.hydra.launcher.additional_parameters.signal == f"USR1@{cfg.hydra.launcher.signal_delay_s}"


def test_local_cluster_launcher_passes_with_the_default_cpu_trainer():
    cfg = compose_with_hydra("hydra/launcher=slurm_local")
    layout = check_slurm_layout(cfg)
    assert (layout.nodes, layout.tasks_per_node, layout.gpus_per_node) == (1, 1, 0)
    assert cfg.hydra.launcher.cpus_per_task == 1 and cfg.hydra.launcher.partition == "debug"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer=ddp_cpu"],
            "trainer.devices=2 starts 2 process(es) per node but hydra.launcher.tasks_per_node=1",
        ),
        (["hydra.launcher.tasks_per_node=2"], "a single-device run must be one task per node"),
        (["trainer=gpu"], "hydra.launcher.gpus_per_node=0: request at least 1 GPUs per node"),
        (["hydra.launcher.nodes=2"], "trainer.num_nodes=1 but hydra.launcher.nodes=2"),
    ],
)
def test_mismatches_on_the_local_cluster_name_the_values(overrides, message):
    cfg = compose_with_hydra("hydra/launcher=slurm_local", *overrides)
    with pytest.raises(SlurmLayoutError, match="does not match the trainer") as info:
        check_slurm_layout(cfg)
    assert message in str(info.value)


def test_cpu_ddp_with_one_task_per_process_passes():
    cfg = compose_with_hydra(
        "hydra/launcher=slurm_local", "trainer=ddp_cpu", "hydra.launcher.tasks_per_node=2"
    )
    assert check_slurm_layout(cfg).tasks_per_node == 2


def test_gpu_launcher_with_a_cpu_trainer_warns_about_idle_gpus(caplog):
    cfg = compose_with_hydra("hydra/launcher=slurm")  # train.yaml's default trainer is cpu
    with caplog.at_level(logging.WARNING, logger="attnlab.run.slurm_layout"):
        assert check_slurm_layout(cfg).gpus_per_node == 1
    assert "will not use the GPUs they reserve" in caplog.text


# --- trainer=ddp_slurm, multi-node ---------------------------------------------------------------------


def test_ddp_slurm_multinode_request_composes_and_passes():
    assert (CONF_DIR / "trainer" / "ddp_slurm.yaml").is_file(), "conf/trainer/ddp_slurm.yaml is missing"
    cfg = compose_with_hydra(*MULTINODE)
    layout = check_slurm_layout(cfg)
    assert (layout.nodes, layout.tasks_per_node, layout.gpus_per_node) == (2, 4, 4)
    assert cfg.trainer.num_nodes == 2 and cfg.trainer.devices == 4
    assert cfg.trainer.accelerator in ("gpu", "cuda", "auto") and "ddp" in str(cfg.trainer.strategy)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.num_nodes=1", "trainer.num_nodes=1 but hydra.launcher.nodes=2"),
        (
            "hydra.launcher.tasks_per_node=1",
            "trainer.devices=4 starts 4 process(es) per node but hydra.launcher.tasks_per_node=1",
        ),
        ("hydra.launcher.gpus_per_node=2", "hydra.launcher.gpus_per_node=2: request at least 4 GPUs"),
    ],
)
def test_ddp_slurm_multinode_mismatch_fails_with_the_message(override, message):
    cfg = compose_with_hydra(*MULTINODE, override)
    with pytest.raises(SlurmLayoutError) as info:
        check_slurm_layout(cfg)
    assert message in str(info.value)


# --- how trainer.devices and the launcher's GPU options are read -----------------------------------------


def _launcher(**values) -> SlurmLayout:
    return requested_layout(
        OmegaConf.create({"nodes": 1, "tasks_per_node": 4, "gpus_per_node": None, **values})
    )


@pytest.mark.parametrize("devices", [4, "4", [0, 1, 2, 3], "0,1,2,3", "auto", -1, "-1"])
def test_every_spelling_of_four_gpus_matches_four_tasks(devices):
    trainer = OmegaConf.create({"accelerator": "gpu", "devices": devices})
    assert layout_problems(trainer, _launcher(gpus_per_node=4)) == []
    assert len(layout_problems(trainer, _launcher(gpus_per_node=4, tasks_per_node=2))) == 1


def test_gpus_from_gres_or_gpus_per_task():
    assert _launcher(gres="gpu:v100:4").gpus_per_node == 4
    assert _launcher(gres="gpu:2").gpus_per_node == 2
    assert _launcher(gpus_per_task=1).gpus_per_node == 4
    assert _launcher().gpus_per_node == 0


@pytest.mark.parametrize("devices", [0, -2, "two", True])
def test_a_devices_value_that_is_no_count_is_named(devices):
    trainer = OmegaConf.create({"accelerator": "cpu", "devices": devices})
    with pytest.raises(SlurmLayoutError, match=f"trainer.devices={devices!r} is not a device count"):
        layout_problems(trainer, _launcher())


# --- inside a job: the allocation from SLURM's variables --------------------------------------------------

STEP_ENV = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NAME": "attnlab",
    "SLURM_NTASKS": "8",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_GPUS_ON_NODE": "4",
}


def _job_cfg(**trainer):
    """A run's config as the pipeline sees it: no ``hydra`` node."""
    return OmegaConf.create({"trainer": {"accelerator": "gpu", "devices": 4, "num_nodes": 2, **trainer}})


def test_inside_a_job_the_allocation_is_checked():
    layout = check_slurm_layout(_job_cfg(), environ=STEP_ENV)
    assert (layout.nodes, layout.tasks_per_node, layout.gpus_per_node) == (2, 4, 4)
    with pytest.raises(SlurmLayoutError) as info:
        check_slurm_layout(_job_cfg(devices=2, num_nodes=1), environ=STEP_ENV)
    message = str(info.value)
    assert "trainer.num_nodes=1 but SLURM_NNODES (sbatch --nodes)=2" in message
    assert "SLURM_NTASKS_PER_NODE (sbatch --ntasks-per-node)=4" in message
    assert "set sbatch --ntasks-per-node=2 or trainer.devices=4" in message


def test_outside_slurm_or_in_an_interactive_allocation_nothing_is_checked():
    wrong = _job_cfg(devices=3, num_nodes=5)
    assert check_slurm_layout(wrong, environ={}) is None
    assert check_slurm_layout(wrong, environ={**STEP_ENV, "SLURM_JOB_NAME": "interactive"}) is None
    assert allocated_layout({**STEP_ENV, "SLURM_JOB_NAME": "bash"}) is None
    # a config with the basic launcher falls back to the (absent) allocation too
    assert check_slurm_layout(compose_with_hydra("trainer=ddp_cpu"), environ={}) is None


# --- the Hydra callback ----------------------------------------------------------------------------------


def test_callback_raises_for_a_mismatched_multirun_config():
    cfg = compose_with_hydra("hydra/launcher=slurm_local", "trainer=ddp_cpu")
    # a SystemExit, because Hydra turns the Exceptions of callbacks into warnings and carries on
    with pytest.raises(SweepRefused) as info:
        SlurmLayoutCheck().on_multirun_start(config=cfg, config_name="train")
    assert isinstance(info.value, SystemExit) and not isinstance(info.value, Exception)
    assert str(info.value.code).startswith(
        "SlurmLayoutError: nothing was submitted: the SLURM layout does not"
    )
    SlurmLayoutCheck().on_multirun_start(config=compose_with_hydra("hydra/launcher=slurm_local"))


@pytest.fixture
def fake_sbatch(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ``sbatch`` only records that it was called, and fails: nothing real is submitted
    even where a cluster is running. A dummy ``srun`` too, which submitit looks for before submitting."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch_calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\necho "fake sbatch" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, calls


def _multirun(tmp_path: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        "-m",
        "hydra/launcher=slurm_local",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *overrides,
    ]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_sweep_with_one_mismatched_run_is_refused_before_sbatch(tmp_path, fake_sbatch):
    env, calls = fake_sbatch
    done = _multirun(tmp_path, env, "trainer=ddp_cpu", "trainer.devices=1,2", "attn=softmax,sliced_relu")
    assert done.returncode == 1
    # the multirun's own config (trainer.devices=2 from ddp_cpu, without the sweep) is not what is checked:
    # each swept value is, and only devices=2 disagrees with one task per node
    assert "nothing was submitted (sweep runs with trainer.devices=2)" in done.stderr, done.stderr[-2000:]
    assert (
        "trainer.devices=2 starts 2 process(es) per node but hydra.launcher.tasks_per_node=1" in done.stderr
    )
    assert not calls.exists(), "sbatch was called"
    assert not (tmp_path / "sweep" / ".submitit").exists()


def test_a_matching_sweep_reaches_sbatch(tmp_path, fake_sbatch):
    env, calls = fake_sbatch
    done = _multirun(
        tmp_path, env, "trainer=ddp_cpu", "hydra.launcher.tasks_per_node=2", "attn=softmax,sliced_relu"
    )
    assert "does not match the trainer" not in done.stderr
    assert calls.exists() and "fake sbatch" in done.stderr, done.stderr[-2000:]
