"""Exact resume beyond ListOps: the EMA saved where the step happens, augmentations replayed whatever the
number of loader workers, Mixup replayed; and the kill -9 runs (digits ViT with
EMA and Mixup, shapes, ListOps, each with 2 workers).

`test_resume.py` holds the machinery (kill -9 of a real ``train.py``, SLURM requeue); the runs here reuse it
with other tasks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.data.loaders import SampleDraw, sample_seed
from attnlab.pipeline import train
from data.test_vision import write_cifar
from run.test_resume import TINY, _kill, _start, _step, _wait_until_paused
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


# ---- kill -9 at an arbitrary step, resume with ckpt_path=auto, 2 loader workers -------------------------
# 72 steps: the kill lands on a step past 14 only if this process sees the checkpoint before the run
# ends, and a tiny run replaces last.ckpt every few milliseconds; with 36 steps a loaded machine once
# let the run finish first (the folded sliced layers made the digits ViT's steps faster)
STEPS, KILL_AFTER = 72, 14
RESUMABLE = {
    # RandAugment (Python random + numpy), crop, flip and erasing (torch) per image; Mixup/CutMix per batch
    "digits_vit with EMA and Mixup": [
        *TINY_DIGITS,
        "task.data.batch_size=64",  # 19 steps an epoch: the run crosses an epoch boundary
        "task.data.crop_padding=1",
        "task.data.hflip=0.5",
        "task.data.randaugment=rand-m9-mstd0.5-inc1",
        "task.data.random_erasing=0.25",
        "task.module.ema_decay=0.99",
        "task.module.mixup={mixup_alpha:0.8,cutmix_alpha:1.0,switch_prob:0.5}",
        "task.model.dropout=0.1",
    ],
    # resampled points, rotation, scaling, translation and point dropout per cloud
    "shapes": [
        "task=shapes",
        *QUIET,
        "logger=none",
        "task.data.source.train_per_class=16",
        "task.data.source.test_per_class=4",
        "task.data.source.sample_points=64",
        "task.data.num_points=32",
        "task.data.resample=true",
        "task.data.batch_size=16",  # 7 steps an epoch
        "task.model.dim=16",
        "task.model.depth=1",
        "task.model.num_heads=2",
        "task.model.mlp_dim=32",
        "task.model.head_dims=[32]",
        "callbacks.throughput.warmup_steps=1",
        "trainer.deterministic=true",
    ],
    "listops": list(TINY),
}
# no augmentation: what workers could break is the loader's position (covered with 0 workers in
# test_resume.py), so this one is the slow variant
# the preset as users run it: 4 workers, random-resized crop, flip, RandAugment, Mixup/CutMix, label
# smoothing (on fake CIFAR pickles: 190 training images, 11 steps an epoch); EMA added
RESUMABLE["cifar10_vit as configured"] = [
    "task=cifar10_vit",
    *[o for o in TINY_DIGITS[1:] if not o.startswith("task.model.stem_channels=")],
    "task.model.stem_channels=[8,16]",  # stride 4, as the preset's patch size says
    "task.data.source.val_per_class=1",
    "task.module.ema_decay=0.99",
]
PREPARE = {"cifar10_vit as configured": lambda data_dir: write_cifar(data_dir, per_batch=40)}
WORKERS = {"cifar10_vit as configured": 4}  # the preset's; 2 for the others


@pytest.mark.slow  # make test-all: the in-process resume tests run its lines (coverage checked)
@pytest.mark.parametrize("task", RESUMABLE)
def test_killed_run_with_loader_workers_resumes_bit_identical(train_config, tmp_path, task):
    """The kill -9 runs: kill -9 while held after step 14, ``ckpt_path=auto`` in the same
    run dir; weights, EMA, optimizer state, validation and test accuracy equal the uninterrupted run's."""
    run = [
        *RESUMABLE[task],
        f"task.data.num_workers={WORKERS.get(task, 2)}",
        f"trainer.max_steps={STEPS}",
        "task.val_check_interval=10",
        "callbacks.last_checkpoint.every_n_train_steps=1",
    ]
    if task in PREPARE:
        PREPARE[task](tmp_path / "data")
    uninterrupted = train(train_config(*run, f"paths.run_dir={tmp_path / 'uninterrupted'}"))

    process = _start(tmp_path, base=run)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    _wait_until_paused(process, tmp_path)
    _kill(process)
    killed_at = _step(last)
    assert killed_at == KILL_AFTER, f"killed while held after step {KILL_AFTER}, last.ckpt at {killed_at}"

    resumed = train(train_config(*run, "ckpt_path=auto"))
    assert resumed["steps"] == uninterrupted["steps"] == STEPS
    assert_same_state(
        tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt", last, f"a kill at step {killed_at}"
    )
    assert resumed["val_acc"] == uninterrupted["val_acc"]
    assert resumed["test_acc"] == uninterrupted["test_acc"]


# ---- the seeded draws themselves (fast) -----------------------------------------------------------------
def _datamodule(train_config, *overrides: str):
    from hydra.utils import instantiate

    datamodule = instantiate(train_config(*overrides).task.data)
    datamodule.prepare_data()
    datamodule.setup()
    return datamodule


AUGMENTED = {
    "digits_vit": [
        *TINY_DIGITS,
        "task.data.crop_padding=1",
        "task.data.hflip=0.5",
        "task.data.randaugment=rand-m9-mstd0.5-inc1",
        "task.data.random_erasing=0.25",
    ],
    "shapes": RESUMABLE["shapes"],
}


@pytest.mark.parametrize("task", list(AUGMENTED))
def test_augmentations_depend_on_seed_epoch_and_index_only(train_config, tmp_path, task, loader_workers):
    """The same training batches with 0 and 2 workers, and from a loader resumed mid-epoch; the training
    process's random streams (dropout's) do not move while the loader augments in it (0 workers)."""
    batches = {}
    for workers in (0, 2):
        datamodule = _datamodule(train_config, *AUGMENTED[task], f"task.data.num_workers={workers}")
        loader = datamodule.train_dataloader()
        torch.manual_seed(1)
        before = torch.get_rng_state()
        batches[workers] = [next(iter_) for iter_ in [iter(loader)] for _ in range(3)]
        assert torch.equal(torch.get_rng_state(), before), "augmenting moved the global torch stream"
        resumed = datamodule.train_dataloader()
        resumed.load_state_dict(loader.batch_sampler.position_state(0, 2))
        batches[f"{workers} resumed"] = next(iter(resumed))
    key = "images" if task == "digits_vit" else "points"
    for first, second in zip(batches[0], batches[2], strict=True):
        assert torch.equal(first[key], second[key]) and torch.equal(first["labels"], second["labels"])
    assert torch.equal(batches["0 resumed"][key], batches[0][2][key])
    assert torch.equal(batches["2 resumed"][key], batches[0][2][key])
    # and the draws are random: the same image or cloud differs between epochs
    dataset, example = datamodule.datasets["train"], "image" if task == "digits_vit" else "points"
    draws = [dataset[SampleDraw(3, sample_seed(0, epoch, 3))][example] for epoch in (0, 1, 0)]
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])
