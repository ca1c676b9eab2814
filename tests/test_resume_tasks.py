"""Exact resume beyond ListOps: the EMA saved where the step happens, augmentations replayed whatever the
number of loader workers, Mixup replayed; and the kill -9 acceptance runs of issue 27 (digits ViT with
EMA and Mixup, shapes, ListOps, each with 2 workers).

`test_resume.py` holds the machinery (kill -9 of a real ``train.py``, SLURM requeue); the runs here reuse it
with other tasks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.pipeline import train
from tiny_runs import QUIET

TINY_DIGITS = [
    "task=digits_vit",
    *QUIET,
    "logger=none",
    "task.model.stem_channels=[8]",
    "task.model.dim=16",
    "task.model.depth=1",
    "task.model.num_heads=2",
    "task.model.mlp_dim=32",
    "task.data.batch_size=16",
    "task.data.eval_batch_size=128",
    "callbacks.throughput.warmup_steps=1",
    "trainer.deterministic=true",
]


def _state(path: Path) -> tuple[dict, dict]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint["state_dict"], checkpoint["optimizer_states"][0]["state"]


def assert_same_state(path_a: Path, path_b: Path, where: str) -> None:
    """Bit-identical weights (the EMA's included: it is a submodule) and optimizer state."""
    weights_a, optim_a = _state(path_a)
    weights_b, optim_b = _state(path_b)
    assert weights_a.keys() == weights_b.keys()
    differ = [name for name in weights_a if not torch.equal(weights_a[name], weights_b[name])]
    assert not differ, f"{len(differ)}/{len(weights_a)} tensors differ after {where}: {differ[:4]}"
    for index, state in optim_a.items():
        for key, value in state.items():
            assert torch.equal(value, optim_b[index][key]), f"optimizer state {index}.{key} differs ({where})"


def test_ema_in_a_step_checkpoint_is_the_ema_of_that_step(train_config, tmp_path):
    """A checkpoint written at a step boundary (here the periodic one, at step 2) holds the EMA updated by
    that step: a run resumed from it ends with the EMA of the uninterrupted run."""
    steps = [*TINY_DIGITS, "task.module.ema_decay=0.9", "trainer.max_steps=4", "task.val_check_interval=4"]
    steps += ["callbacks.periodic_checkpoint.every_n_train_steps=2", "test=false"]
    train(train_config(*steps, f"paths.run_dir={tmp_path / 'a'}"))
    step2 = tmp_path / "a" / "checkpoints" / "step2.ckpt"
    assert any(k.startswith("ema.") for k in _state(step2)[0])
    train(train_config(*steps, f"paths.run_dir={tmp_path / 'b'}", f"ckpt_path={step2}"))
    assert_same_state(
        tmp_path / "a" / "checkpoints" / "last.ckpt",
        tmp_path / "b" / "checkpoints" / "last.ckpt",
        "resuming at step 2",
    )
