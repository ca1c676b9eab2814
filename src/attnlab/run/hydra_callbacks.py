"""The Hydra callbacks of every ``train.py`` process: refuse a bad resume before Hydra writes, and let
sweeps resolve their dir.

- :class:`ResumeCheckBeforeRun`. Hydra writes ``.hydra/`` and appends to ``train.log`` in the run dir
  before attnlab's code runs; a resume into a finished run's dir under a config that changes its model
  is refused here first, so the refused command changes nothing of that run.
- :class:`MultirunHydraConfig`. Hydra 1.3 sets ``HydraConfig`` for each job of a multirun but not for
  the multirun itself, so ``hydra.sweep.dir`` (ours goes through ``${hydra:runtime.cwd}``) cannot be
  resolved when the sweeper and launcher are built: ``python train.py -m`` failed with "HydraConfig was
  not set" unless ``hydra.sweep.dir`` was given explicitly.

Only the standard library, omegaconf and hydra are imported at module level: the callbacks are built in
every ``train.py`` process.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict


class MultirunHydraConfig(Callback):
    """Hydra callback: make ``${hydra:...}`` resolvable while a multirun builds its sweeper and launcher.

    Registered under ``hydra.callbacks.multirun_hydra_config`` (conf/train.yaml and the SLURM launcher
    configs). Jobs still get their own ``HydraConfig`` from Hydra; this one only covers the time before.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not HydraConfig.initialized():
            # a copy: set_config makes the node it is given read-only
            HydraConfig.instance().set_config(copy.deepcopy(config))


class ResumeCheckBeforeRun(Callback):
    """Hydra callback: refuse ``ckpt_path=<run>/...`` before Hydra writes into ``<run>`` when the
    checkpoint is missing or unreadable, or when the command changes the run's model or recipe
    (`attnlab.run.resume.check_resume_config`, which the pipeline runs again for every other way in).
    Registered under ``hydra.callbacks.resume_check`` (conf/train.yaml).

    Single runs only: Hydra calls no hook before it writes a multirun job's ``.hydra/``, so a sweep's
    job is refused by the pipeline, after Hydra's record of it is written. A config that does not
    resolve is left to the pipeline too, which names the problem in one line.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from attnlab.errors import CheckpointError
        from attnlab.run.resume import check_resume_config

        if config.get("ckpt_path") in (None, "", "null"):
            return
        try:
            job, ckpt_path = _job_and_checkpoint(config)
            if ckpt_path is not None:
                check_resume_config(ckpt_path, job)
        except CheckpointError as err:  # a missing, unreadable or mismatched checkpoint: one line
            raise SystemExit(f"error: {err}") from None
        except Exception:  # Hydra would only warn; the pipeline names the problem in one line
            return


def _job_and_checkpoint(config: DictConfig) -> tuple[DictConfig, str | None]:
    """The job's config as the pipeline will see it (``${paths.run_dir}`` resolving to the run dir
    Hydra is about to make) and the checkpoint it resumes from."""
    from attnlab.run.resume import resolve_ckpt_path

    job = copy.deepcopy(config)
    HydraConfig.instance().set_config(copy.deepcopy(job))  # hydra.run.dir reads ${hydra:runtime.cwd}
    with open_dict(job.hydra.runtime):  # as Hydra's run_job will set it
        job.hydra.runtime.output_dir = os.path.abspath(str(job.hydra.run.dir))
    HydraConfig.instance().set_config(copy.deepcopy(job))
    with open_dict(job):
        del job["hydra"]
    return job, resolve_ckpt_path(job.ckpt_path, Path(job.paths.run_dir))
