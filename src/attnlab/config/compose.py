"""The training config composed outside ``train.py``, for commands that need a run's objects without
running it (``attnlab data prepare`` builds the data source a run would read).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def compose_task_source(task: str, overrides: list[str], data_dir: str | None, config_dir: Path):
    """The task's data source, built from the composed training config (as train.py would)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose("train", overrides=[f"task={task}", *overrides], return_hydra_config=True)
    # a run dir only so that the config resolves: preparing data writes nothing there, and it is
    # removed with its parent, so no empty dir is left in the temp folder per call
    with tempfile.TemporaryDirectory(prefix="attnlab-data-") as scratch:
        with open_dict(cfg):
            cfg.hydra.runtime.cwd = os.getcwd()
            cfg.hydra.runtime.output_dir = scratch
            if data_dir:
                cfg.paths.data_dir = str(Path(data_dir).resolve())
        HydraConfig.instance().set_config(cfg)
        return instantiate(cfg.task.data.source)
