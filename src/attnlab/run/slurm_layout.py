"""Check that a run's SLURM layout (nodes, tasks per node, GPUs) fits what its Lightning trainer starts.

Lightning DDP under SLURM runs one process per device and takes ranks from SLURM, so the job must ask for
exactly ``trainer.devices`` tasks on each of ``trainer.num_nodes`` nodes. A mismatch is otherwise found
only on the compute node, after the job waited in the queue (Lightning refuses to start, or a single-device
run is started once per task, several copies writing the same run dir). Two entry points:

- :class:`SlurmLayoutCheck`, a Hydra callback registered by ``conf/hydra/launcher/slurm*.yaml``: checks every
  run of a sweep against ``hydra.launcher`` before anything is submitted;
- :func:`check_slurm_layout`, for the pipeline inside a job: checks the trainer against the allocation the
  process runs in (the ``SLURM_*`` variables), so ``sbatch slurm/multinode.sbatch`` runs are checked too.

Only omegaconf and hydra are imported: the callback runs in the submitting process, which should stay light.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

log = logging.getLogger(__name__)

# hydra.launcher._target_ of a SLURM launcher ends with one of these: submitit's, or attnlab's subclass
# of it that waits for requeued runs (conf/hydra/launcher/slurm*.yaml)
SLURM_LAUNCHER_SUFFIXES = ("submitit_launcher.SlurmLauncher", "attnlab_slurm.RequeueAwareSlurmLauncher")
GPU_ACCELERATORS = ("gpu", "cuda")
# Sweeps over these change the trainer, so each of their values is composed and checked on its own.
LAYOUT_SWEEP_GROUPS = ("trainer", "experiment")


class SlurmLayoutError(ValueError):
    """The SLURM request or allocation does not fit the trainer's devices and nodes."""


class SweepRefused(SystemExit):
    """Ends ``python train.py -m`` before submission, printing the reason and exiting with status 1.

    A SystemExit because Hydra 1.3 runs callbacks under ``except Exception`` and turns what they raise into
    a warning (``hydra/_internal/callbacks.py``), after which the sweep would be submitted anyway.
    """


@dataclass(frozen=True)
class SlurmLayout:
    """Nodes, tasks (processes) per node and GPUs per node, with the names to quote them by in errors.

    ``gpus_per_node`` is None when unknown (an allocation that does not say), 0 when none were requested.
    """

    nodes: int
    tasks_per_node: int | None
    gpus_per_node: int | None
    nodes_name: str  # where each number comes from, as errors quote it
    tasks_name: str
    gpus_name: str
    tasks_option: str  # what a user changes to fix the tasks per node


def _gres_gpus(gres: str | None) -> int | None:
    """GPUs in a ``--gres`` string such as ``gpu:4`` or ``gpu:v100:4`` (None when it names no GPUs)."""
    for item in str(gres or "").split(","):
        match = re.fullmatch(r"gpu(?::[^:]+)?:(\d+)", item.strip())
        if match:
            return int(match.group(1))
    return None


def requested_layout(launcher: DictConfig) -> SlurmLayout:
    """What a ``hydra/launcher=slurm*`` config asks SLURM for, per run of the sweep."""
    tasks = int(launcher.get("tasks_per_node") or 1)
    gpus = launcher.get("gpus_per_node")
    gpus_name = "hydra.launcher.gpus_per_node"
    if gpus is None and _gres_gpus(launcher.get("gres")) is not None:
        gpus, gpus_name = _gres_gpus(launcher.get("gres")), "hydra.launcher.gres"
    elif gpus is None and launcher.get("gpus_per_task"):
        gpus, gpus_name = int(launcher.gpus_per_task) * tasks, "hydra.launcher.gpus_per_task x tasks_per_node"
    return SlurmLayout(
        nodes=int(launcher.get("nodes") or 1),
        tasks_per_node=tasks,
        gpus_per_node=int(gpus or 0),
        nodes_name="hydra.launcher.nodes",
        tasks_name="hydra.launcher.tasks_per_node",
        gpus_name=gpus_name,
        tasks_option="hydra.launcher.tasks_per_node",
    )


def allocated_layout(environ: Mapping[str, str]) -> SlurmLayout | None:
    """The layout of the SLURM job step this process runs in; None outside SLURM.

    Mirrors Lightning's SLURM detection: a process counts as launched by SLURM when ``SLURM_NTASKS`` is set,
    except in an interactive allocation (job name ``bash`` or ``interactive``), where Lightning ignores SLURM
    and starts its processes itself.
    """
    if "SLURM_NTASKS" not in environ or environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    tasks = environ.get("SLURM_NTASKS_PER_NODE")
    gpus = environ.get("SLURM_GPUS_ON_NODE")
    return SlurmLayout(
        nodes=int(environ.get("SLURM_NNODES", "1")),
        tasks_per_node=int(tasks) if tasks and tasks.isdigit() else None,
        gpus_per_node=int(gpus) if gpus and gpus.isdigit() else None,
        nodes_name="SLURM_NNODES (sbatch --nodes)",
        tasks_name="SLURM_NTASKS_PER_NODE (sbatch --ntasks-per-node)",
        gpus_name="SLURM_GPUS_ON_NODE (sbatch --gpus-per-node)",
        tasks_option="sbatch --ntasks-per-node",
    )


def _uses_gpus(trainer: DictConfig, layout: SlurmLayout) -> bool:
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    return accelerator in GPU_ACCELERATORS or (accelerator == "auto" and bool(layout.gpus_per_node))


def _processes_per_node(trainer: DictConfig, layout: SlurmLayout) -> int | None:
    """How many processes Lightning starts on each node for ``trainer.devices``; None when it depends on the
    machine in a way the layout does not tell (``devices=-1`` on CPUs, or on GPUs of unknown count)."""
    devices = trainer.get("devices", "auto")
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:  # "0,1" lists device indices
            return len([index for index in text.split(",") if index.strip()])
        if text == "auto":
            return layout.gpus_per_node if _uses_gpus(trainer, layout) else 1
        devices = int(text) if text.lstrip("-").isdigit() else devices
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices >= 1:
            return devices
        if devices == -1:  # every device of the node
            return layout.gpus_per_node if _uses_gpus(trainer, layout) else None
    raise SlurmLayoutError(
        f"trainer.devices={devices!r} is not a device count: use a positive integer, a list of device "
        "indices, 'auto' or -1"
    )


def layout_problems(trainer: DictConfig, layout: SlurmLayout) -> list[str]:
    """Every way the trainer disagrees with the layout, as sentences that say what to change."""
    problems = []
    num_nodes = int(trainer.get("num_nodes", 1))
    if num_nodes != layout.nodes:
        problems.append(
            f"trainer.num_nodes={num_nodes} but {layout.nodes_name}={layout.nodes}: Lightning needs the "
            f"number of nodes SLURM gives the job; set trainer.num_nodes={layout.nodes}"
        )
    processes = _processes_per_node(trainer, layout)
    if processes is not None and layout.tasks_per_node is not None and processes != layout.tasks_per_node:
        if processes == 1:
            why = (
                "a single-device run must be one task per node, or SLURM starts it "
                f"{layout.tasks_per_node} times in the same run dir"
            )
        else:
            why = f"Lightning DDP needs one SLURM task per device, {processes} per node"
        problems.append(
            f"trainer.devices={trainer.get('devices')!r} starts {processes} process(es) per node but "
            f"{layout.tasks_name}={layout.tasks_per_node}: {why}; set {layout.tasks_option}="
            f"{processes} or trainer.devices={layout.tasks_per_node}"
        )
    if (
        processes is not None
        and layout.gpus_per_node is not None
        and _uses_gpus(trainer, layout)
        and layout.gpus_per_node < processes
    ):
        problems.append(
            f"trainer.accelerator={trainer.get('accelerator')!r} uses {processes} GPU(s) per node but "
            f"{layout.gpus_name}={layout.gpus_per_node}: request at least {processes} GPUs per node "
            "(or use trainer=cpu)"
        )
    return problems


def _launcher_of(cfg: DictConfig) -> DictConfig | None:
    """``cfg.hydra.launcher`` when ``cfg`` carries Hydra's node and its launcher submits to SLURM."""
    launcher = OmegaConf.select(cfg, "hydra.launcher")
    if launcher is not None and str(launcher.get("_target_", "")).endswith(SLURM_LAUNCHER_SUFFIXES):
        return launcher
    return None


def check_slurm_layout(cfg: DictConfig, environ: Mapping[str, str] | None = None) -> SlurmLayout | None:
    """Raise :class:`SlurmLayoutError` when ``cfg.trainer`` does not fit the SLURM layout; return the layout.

    With Hydra's node in ``cfg`` and a SLURM launcher (``return_hydra_config=True``, what the callback sees)
    the layout is the launcher's request. Otherwise it is the allocation this process runs in, read from
    ``environ`` (default ``os.environ``); outside SLURM there is nothing to check and the result is None.
    """
    launcher = _launcher_of(cfg)
    if launcher is not None:
        layout = requested_layout(launcher)
    else:
        layout = allocated_layout(os.environ if environ is None else environ)
    if layout is None:
        return None
    problems = layout_problems(cfg.trainer, layout)
    if problems:
        raise SlurmLayoutError("the SLURM layout does not match the trainer:\n  - " + "\n  - ".join(problems))
    if launcher is not None and layout.gpus_per_node and not _uses_gpus(cfg.trainer, layout):
        log.warning(
            "%s=%d but trainer.accelerator=%r: the runs will not use the GPUs they reserve (trainer=gpu?)",
            layout.gpus_name,
            layout.gpus_per_node,
            cfg.trainer.get("accelerator"),
        )
    return layout


def _layout_variants(config: DictConfig) -> list[tuple[list[str], DictConfig]]:
    """The distinct trainer setups of a multirun: (the sweep choices, the composed config) for each.

    Hydra composes the multirun's config without its sweep overrides, so a sweep over the trainer (say
    ``trainer.devices=1,4``) is expanded here the way the sweeper and launcher will do it, with Hydra's own
    config loader; sweeps over anything else (task, attn, seed) cannot change the layout and are left out.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def changes_layout(override) -> bool:
        return override.is_sweep_override() and override.key_or_group.split(".")[0] in LAYOUT_SWEEP_GROUPS

    task_overrides = list(config.hydra.overrides.task)
    if not any(changes_layout(o) for o in OverridesParser.create().parse_overrides(task_overrides)):
        return [([], config)]  # the multirun's config is already every run's layout
    if not GlobalHydra.instance().is_initialized():
        raise RuntimeError(
            "expanding a sweep over the trainer needs Hydra initialised (call it from a Hydra app)"
        )
    loader = GlobalHydra.instance().config_loader()
    # with the loader, glob sweeps (trainer=glob(ddp*)) expand over the config group's options
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(task_overrides)
    kept = [o for o in parsed if not o.is_sweep_override() or changes_layout(o)]
    swept_keys = {o.get_key_element() for o in parsed if changes_layout(o)}
    variants = []
    for job in BasicSweeper.split_arguments(kept, max_batch_size=None)[0]:
        choices = [item for item in job if item.split("=", 1)[0] in swept_keys]
        variants.append((choices, loader.load_sweep_config(config, job)))
    return variants


class SlurmLayoutCheck(Callback):
    """Hydra callback: refuse a SLURM multirun whose trainer does not fit ``hydra.launcher``, pre-submission.

    Registered under ``hydra.callbacks`` by the SLURM launcher configs. Raises :class:`SweepRefused`, whose
    message names the bad values, so that the process stops before the launcher exists.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        for choices, job_config in _layout_variants(config):
            try:
                layout = check_slurm_layout(job_config)
            except SlurmLayoutError as err:
                where = f" (sweep runs with {' '.join(choices)})" if choices else ""
                raise SweepRefused(f"SlurmLayoutError: nothing was submitted{where}: {err}") from None
            if layout is not None:
                log.info(
                    "SLURM layout OK%s: %d node(s) x %s task(s), %s GPU(s) per node",
                    f" for {' '.join(choices)}" if choices else "",
                    layout.nodes,
                    layout.tasks_per_node,
                    layout.gpus_per_node,
                )


def job_local_triton_cache(environ: dict | None = None) -> str | None:
    """Inside a SLURM job, point Triton's kernel cache at a folder of this job on the node's local disk.

    Why: Triton caches compiled kernels under ``~/.triton/cache`` by default, which on a cluster is the
    shared (network) home: every job of a sweep then compiles into and reads from the same folder over
    the network, slowly, and concurrent jobs write the same entries. One folder per job on local disk
    (``$TMPDIR``, else ``/tmp``) keeps compilation local; a user's own ``TRITON_CACHE_DIR`` is kept.
    Returns the folder set, or None (not in a job, or set by the user).
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job or env.get("TRITON_CACHE_DIR"):
        return None
    task = env.get("SLURM_ARRAY_TASK_ID")
    name = f"attnlab-triton-{job}" + (f"_{task}" if task else "")
    env["TRITON_CACHE_DIR"] = os.path.join(env.get("TMPDIR") or "/tmp", name)
    return env["TRITON_CACHE_DIR"]
