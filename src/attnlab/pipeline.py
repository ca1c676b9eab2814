"""The training pipeline behind ``python train.py``: data, model, trainer, fit, test, summary.

Readable top to bottom, like lightning-hydra-template's ``train.py``. Everything is built from the
composed Hydra config with ``hydra.utils.instantiate``; this function adds only what needs two
objects at once (the data's vocabulary for the model, the trainer's results for the summary).

What a task's datamodule (``task.data``) provides besides Lightning's hooks: ``model_kwargs()`` (what
the model takes from the data, e.g. ``vocab_size``), ``max_length(split)`` (tokens per example, for
the summary's ``seq_len``), ``majority_baseline(split)`` (or ``baselines(split)``, a dict of summary
fields, for tasks whose trivial baseline is not a majority class) and ``source.description`` (which
data fed the run, for the log and ``summary.json``). Every ``test/<name>`` metric the module logs
lands in the summary as ``test_<name>``.
"""

from __future__ import annotations

import logging
import re
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from attnlab.allocator import applied as malloc_settings
from attnlab.attention.common.gpu_check import check_gpus
from attnlab.callbacks.checkpoint import Interrupt, SlurmRequeue
from attnlab.callbacks.divergence import TrainingDiverged
from attnlab.callbacks.threads import CpuThreads
from attnlab.callbacks.throughput import ThroughputMonitor
from attnlab.config.validation import check_config
from attnlab.errors import ConfigError
from attnlab.files import file_lock, sigterm_raises
from attnlab.run.attempt_clock import AttemptClock
from attnlab.run.claim import LOCK_NAME, claim_for_fresh_run, locked_by_another, run_dir_lock
from attnlab.run.compilation import CompileLog, compile_model
from attnlab.run.csv_history import HistoryCSVLogger
from attnlab.run.resume import (
    best_checkpoint_in_run,
    check_checkpoint_fits,
    check_resume_config,
    checkpoint_step,
    checkpoint_weights,
    resolve_ckpt_path,
    resume_command,
    run_description,
    saved_run,
)
from attnlab.run.slurm_layout import check_slurm_layout, job_local_triton_cache
from attnlab.run.summary import closing_lines, fields_from_test, run_summary, write_summary
from attnlab.threads import applied as thread_settings

log = logging.getLogger(__name__)


def _find(callbacks: list, kind: type):
    return next((c for c in callbacks if isinstance(c, kind) and getattr(c, "monitor", True)), None)


def hyperparameters(cfg: DictConfig, params: int, seq_len: int) -> dict[str, Any]:
    """What a dashboard needs to set runs side by side."""
    model = cfg.task.model
    return {
        "task": cfg.task.name,
        "attn": cfg.attn.name,
        "seed": cfg.seed,
        "params": params,
        "seq_len": seq_len,
        "dim": model.get("dim"),
        "depth": model.get("depth"),
        "num_heads": model.get("num_heads"),
        "batch_size": cfg.task.data.batch_size,
        "lr": cfg.task.module.optimizer.get("lr"),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


#: Lightning's console lines that a user cannot act on: adverts for its cloud products, a note that
#: ``srun`` exists on a machine with SLURM installed (shown on every local run there), and a
#: deprecation inside Lightning itself
NOISE = (
    "💡 Tip:",
    "command is available on your system but is not used",
    "isinstance(treespec, LeafSpec)",
    # Lightning logs by global step, so an epoch shorter than the interval loses no training log
    "is smaller than the logging interval",
    # a resumed run's metrics.csv keeps its earlier rows (`HistoryCSVLogger`), whatever Lightning says
    "Previous log files in this directory will be deleted",
)


def _route_lightning_logs_to_root() -> None:
    """Lightning installs its own console handlers (on ``lightning`` and its two packages); under
    Hydra's root handler every line came twice. Its adverts and warnings nobody can act on go."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
    for text in NOISE:
        warnings.filterwarnings("ignore", message=f".*{re.escape(text)}")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in NOISE)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit, test the best checkpoint, write ``summary.json``; return the summary.

    A fit stopped by SLURM's requeue signal (`SlurmRequeue`) returns right after it, with
    ``preempted: True``: the requeued job resumes, tests and writes the summary. A fit stopped by
    SIGTERM or SIGINT (`Interrupt`, ``last.ckpt`` saved at the step reached) is not tested: its summary
    is marked ``interrupted`` and the closing lines say how to resume (``train.py`` exits 143 or 130).
    """
    clock = AttemptClock(started=time.time())
    if rank_zero_only.rank != 0:  # a DDP run's other ranks: their info lines would repeat rank 0's
        logging.getLogger().setLevel(logging.WARNING)
    check_config(cfg)  # wrong-typed overrides are named before any work
    check_slurm_layout(cfg)  # inside a SLURM job: does the allocation fit the trainer? fail before any work
    triton_cache = job_local_triton_cache()  # before any kernel compiles
    if triton_cache:
        log.info("Triton kernel cache of this SLURM job: %s (TRITON_CACHE_DIR)", triton_cache)
    check_gpus(cfg.trainer)  # GPUs that this torch build and Triton can run on? fail before any work
    _route_lightning_logs_to_root()
    _log_cpu_threads(cfg)
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank_zero_only.rank != 0:  # rank 0 holds the run dir's lock for every rank
        return _train(cfg, clock, run_dir)
    with run_dir_lock(run_dir):  # a second run started in this dir meanwhile is refused
        return _train(cfg, clock, run_dir)


def _train(cfg: DictConfig, clock: AttemptClock, run_dir: Path) -> dict[str, Any]:
    # a bad checkpoint, or a fresh run in an earlier run's dir, fails before any work
    ckpt_path, saved = _claim_run_dir(cfg, run_dir)
    # before the data: a logger that cannot start (no tracking server) fails before any work
    loggers = [instantiate(lg) for lg in cfg.get("logger", {}).values() if lg is not None]
    L.seed_everything(cfg.seed, workers=True)
    datamodule, model, module = _build(cfg, ckpt_path, saved, run_dir)
    trainer = _trainer(cfg, loggers, clock, ckpt_path)
    params, seq_len = sum(p.numel() for p in model.parameters()), datamodule.max_length("train")
    for logger in trainer.loggers:
        logger.log_hyperparams(hyperparameters(cfg, params, seq_len))
    log.info(
        "model: %s attention, %s parameters; longest training sequence %d",
        cfg.attn.name,
        f"{params:,}",
        seq_len,
    )

    signum, diverged = _fit(trainer, module, datamodule, ckpt_path)
    requeue = _find(trainer.callbacks, SlurmRequeue)
    if requeue is not None and requeue.preempted:
        log.info(
            "pre-empted at step %d: no test and no summary until the requeued job ends", trainer.global_step
        )
        _finish_wandb(trainer)
        return {"preempted": True, "steps": trainer.global_step, "checkpoint": requeue.checkpoint_path,
                "val_acc": None, "test_acc": None}  # fmt: skip
    interrupt = _find(trainer.callbacks, Interrupt)
    signum = interrupt.received if interrupt is not None and interrupt.received else signum
    # the run's own figures, before the test stage adds its batches to the evaluation counters
    throughput = _find(trainer.callbacks, ThroughputMonitor)
    perf = throughput.results(module.device) if throughput else {}
    checkpoint = _find(trainer.callbacks, ModelCheckpoint)
    best_path = best_checkpoint_in_run(checkpoint.best_model_path if checkpoint else "", run_dir)
    best_val = checkpoint.best_model_score if checkpoint else None
    test_metrics: dict[str, float] = {}  # test/acc -> test_acc, test/top5 -> test_top5, ...
    if cfg.get("test", True) and signum is None and diverged is None:
        test_metrics, signum = _test(trainer, module, datamodule, best_path)

    summary = run_summary(
        cfg, trainer, datamodule, perf=perf, best_val=best_val,
        best_path=best_path, test_metrics=test_metrics, params=params, seq_len=seq_len,
        wall_time_s=clock.wall_time_s(), attempts=clock.attempt, signum=signum,
        diverged_at=diverged.step if diverged is not None else None,
    )  # fmt: skip
    if trainer.is_global_zero:
        path = write_summary(run_dir, summary)
        if diverged is None:
            print(closing_lines(summary, path))
            if signum is not None:
                resume = _resume_command(run_dir)
                print(f"{summary['signal']} at step {summary['steps']}: resume with {resume}")
    _finish_wandb(trainer)
    if diverged is not None:
        raise diverged  # not tested: the summary says so, the report skips it, train.py prints it
    return summary


def _claim_run_dir(cfg: DictConfig, run_dir: Path) -> tuple[str | None, dict[str, Any]]:
    """The checkpoint the run continues from (None: a fresh run, which may not replace an earlier one's
    results) and what that checkpoint saved of its run; the run's ``config.yaml`` written from the start."""
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), run_dir)
    if ckpt_path is None and rank_zero_only.rank == 0:
        aside = claim_for_fresh_run(run_dir, bool(cfg.get("overwrite", False)), _resume_command(run_dir))
        if aside is not None:
            log.info("overwrite=true: the earlier run in %s was moved to %s", run_dir, aside)
    if ckpt_path is not None:  # the model, task and recipe of the run it continues: before any work
        check_resume_config(ckpt_path, cfg)
    saved = saved_run(ckpt_path) if ckpt_path is not None else {}  # before this run's config.yaml replaces it
    if ckpt_path is None and rank_zero_only.rank == 0:
        # from the start: an interrupted or failed run dir still says what it ran (a resumed run's
        # config.yaml is replaced only once its checkpoint has been found to fit)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    return ckpt_path, saved


def _build(cfg: DictConfig, ckpt_path: str | None, saved: dict[str, Any], run_dir: Path):
    """(datamodule, model, LightningModule), the data prepared and set up, the model checked against the
    data's lengths and against the checkpoint it resumes from."""
    datamodule = instantiate(cfg.task.data)
    # Every process (all DDP ranks, started together by srun) needs the data before the model can be
    # built, and no process group exists yet: a file lock makes them take turns, so the data is
    # generated once and the others find it complete.
    with file_lock(Path(cfg.paths.data_dir) / ".attnlab-prepare.lock"), sigterm_raises():
        datamodule.prepare_data()  # a SIGTERM here leaves no half-written file (train.py says so)
    datamodule.setup()
    model = instantiate(cfg.task.model, attention=instantiate(cfg.attn), **datamodule.model_kwargs())
    module = instantiate(cfg.task.module, model=model)
    _check_lengths_fit(model, datamodule)  # before the fit, not at the first batch that is too long
    _check_packable(model, datamodule)
    if cfg.get("compile", False):  # in place: the state_dict keys, checkpoints and resumes stay eager's
        compile_model(model, cfg.get("compile_mode", "default"))
    if ckpt_path is not None:  # another task's or size's checkpoint: one line, not a state_dict traceback
        check_checkpoint_fits(ckpt_path, module.state_dict(), run_description(cfg), saved)
        if rank_zero_only.rank == 0:
            OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    return datamodule, model, module


def _trainer(cfg: DictConfig, loggers: list, clock: AttemptClock, ckpt_path: str | None) -> L.Trainer:
    """The trainer with the configured callbacks and the run's clock; a resumed run's CSV keeps its rows."""
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values() if c is not None] + [clock]
    if cfg.get("compile", False):
        callbacks.append(CompileLog())
        for threads in (c for c in callbacks if isinstance(c, CpuThreads)):
            threads.hold("compile=true: a compiled graph is specialised to the thread count")
    if ckpt_path is not None:  # one run across attempts: keep the metric rows up to the checkpoint
        for logger in loggers:
            if isinstance(logger, HistoryCSVLogger):
                logger.resume_from_step(checkpoint_step(ckpt_path))
    if not loggers:  # `logger=none`: Lightning refuses a LearningRateMonitor without a logger
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    return instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)


def _fit(trainer: L.Trainer, module, datamodule, ckpt_path: str | None):
    """Fit; (a SIGTERM Lightning's handler took before `Interrupt` took over, the divergence that
    stopped training), each None when it did not happen."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:  # in the sanity check: nothing trained since the checkpoint it resumed from
        return signal.SIGTERM, None
    except TrainingDiverged as err:  # no test of NaN weights: the summary says so and the report skips it
        return None, err
    return None, None


def _test(trainer: L.Trainer, module, datamodule, best_path: str) -> tuple[dict[str, float], int | None]:
    """The test metrics of the best checkpoint (``test/acc`` -> ``test_acc``), and SIGTERM if one came."""
    if best_path:  # the weights only: restoring the whole checkpoint would rewind the callbacks too
        module.load_state_dict(checkpoint_weights(best_path, "best checkpoint"))
    try:
        return fields_from_test(trainer.test(module, datamodule=datamodule)), None
    except SIGTERMException:  # training is over and saved
        return {}, signal.SIGTERM


#: what a run dir holds before any training: Hydra's log and config copies, attnlab's config, loggers' dirs
_STARTUP_FILES = {"train.log", ".hydra", "config.yaml", "csv", "tensorboard", "wandb", LOCK_NAME}


def discard_unstarted_run_dir(run_dir: str | Path, output_dir: str | Path | None = None) -> bool:
    """Remove the dir of a run that failed before it produced anything (no checkpoint, no summary).

    Bad commands used to leave a folder holding only ``train.log`` behind each time, and folders of
    runs that never ran pile up beside the real ones. Only a dir holding nothing but the files a run
    writes as it starts is removed, so a resumed run's dir, or any dir with other files, stays; then
    its parents, up to ``output_dir``, when that left them empty (``outputs/<task>/<attn>/``).
    """
    import shutil

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or any(entry.name not in _STARTUP_FILES for entry in run_dir.iterdir()):
        return False
    if locked_by_another(run_dir):
        return False  # another run is starting in it: the refused one must not remove its files
    if any(
        path.is_file() and path.stat().st_size
        for sub in ("csv", "tensorboard")
        for path in (run_dir / sub).rglob("*")
    ):
        return False  # metrics were logged: something ran
    shutil.rmtree(run_dir, ignore_errors=True)
    if output_dir is not None:
        top, parent = Path(output_dir).resolve(), run_dir.resolve().parent
        while parent != top and parent.is_relative_to(top) and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    return True


def _check_packable(model, datamodule) -> None:
    """A packed run (``task.data.packing=true``) with a part that cannot read packed batches (its
    ``packing_refusal()`` says why), refused when the model is built, not at the first batch."""
    if not (getattr(datamodule, "packing", False) or getattr(datamodule, "documents_apart", False)):
        return
    for module in model.modules():
        refusal = getattr(module, "packing_refusal", None)
        reason = refusal() if refusal is not None else None
        if reason:
            raise ConfigError(f"task.data.packing=true: {reason}; set task.data.packing=false")


def _check_lengths_fit(model, datamodule) -> None:
    """A model whose ``max_len`` is shorter than the data's longest sequence, named before training."""
    limit = getattr(model, "max_len", None)
    if not isinstance(limit, int) or getattr(model, "dual", False):  # pairs: each side is checked alone
        return
    for split in ("train", "val", "test"):
        try:
            longest = datamodule.max_length(split)
        except (KeyError, NotImplementedError, AttributeError, TypeError):
            continue
        if longest > limit:
            raise ConfigError(
                f"task.model.max_len={limit}: the {split} split holds sequences of up to {longest} tokens; "
                f"set task.model.max_len to at least {longest}, or truncate the data"
            )


def _log_cpu_threads(cfg: DictConfig) -> None:
    """Which thread settings this run uses and who chose them (`attnlab.threads`), and whether the
    governor moves the count (the `CpuThreads` callback: not when configured off, deterministic or on
    a GPU)."""
    settings = thread_settings()
    governed = (
        (cfg.get("callbacks") or {}).get("cpu_threads") is not None
        and not cfg.trainer.get("deterministic")
        and _trains_on_cpu(str(cfg.trainer.get("accelerator", "cpu")))
    )
    chosen = settings.describe(governed) if settings else "CPU threads: as the calling program set them"
    log.info("%s; torch uses %d intra-op threads", chosen, torch.get_num_threads())
    malloc = malloc_settings()  # `attnlab.allocator`, set by train.py before torch loaded
    log.info("%s", malloc.describe() if malloc else "memory: malloc as the calling program set it")


def _trains_on_cpu(accelerator: str) -> bool:
    """Whether Lightning's ``accelerator`` choice lands on the CPU (``auto`` does without a GPU), as
    `CpuThreads` finds from the trainer's device once it exists."""
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def _resume_command(run_dir: Path) -> str:
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return resume_command(run_dir, overrides)


def _finish_wandb(trainer: L.Trainer) -> None:
    """Lightning leaves a wandb run open: the next job of a ``-m`` sweep would reuse it."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
