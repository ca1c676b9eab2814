"""Two CPU processes (gloo DDP) through the real entry point: sharding, metrics, throughput, summary.

Lightning's subprocess launcher re-runs ``train.py`` for rank 1, so the run goes through
``python train.py trainer=ddp_cpu`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from attnlab.data.datamodule import SequenceDataModule
from tiny_runs import TINY_LISTOPS

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = 8  # 192 examples / batch 16 = 12 global batches = 6 per rank: the run crosses an epoch boundary
TINY = [
    *TINY_LISTOPS,
    # 64 evaluation examples, 32 per rank, in batches of 13: ragged last batches on both ranks
    "task.data.eval_batch_size=13",
    "logger=none",
    "callbacks.throughput.warmup_steps=2",
    f"trainer.max_steps={STEPS}",
    f"task.val_check_interval={STEPS}",
]


def _evaluate_in_one_process(cfg, ckpt: str) -> tuple[float, float]:
    datamodule = instantiate(cfg.task.data)
    datamodule.prepare_data()
    datamodule.setup()
    model = instantiate(
        cfg.task.model, vocab_size=datamodule.source.vocab_size, attention=instantiate(cfg.attn)
    )
    module = instantiate(cfg.task.module, model=model)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    val = trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)[0]["val/acc"]
    test = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)[0]["test/acc"]
    return val, test


@pytest.mark.xdist_group("processes")  # several processes at once: never two such tests together
def test_two_process_run_shards_data_and_reduces_metrics_across_ranks(train_config, tmp_path):
    run = tmp_path / "run"
    command = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        *TINY,
        "trainer=ddp_cpu",
        f"paths.data_dir={tmp_path / 'data'}",
        f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    per_device, total = summary["train_samples_per_sec"], summary["train_samples_per_sec_total"]
    assert per_device > 0 and total > 0
    assert total != 2 * per_device  # summed over ranks (each timed its own steps), not extrapolated
    assert "over 2 devices" in done.stdout
    said = done.stdout + done.stderr
    assert said.count("CPU threads: ") == 1 and said.count("summary: ") == 1, said[-4000:]  # rank 0 alone
    assert "[Gloo] Rank 1" not in said  # rank 1's standard output, Gloo's lines included, is rank 0's again

    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    loader_state = last["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["num_replicas"] == 2
    # 6 batches per rank and epoch: after 8 steps the run is 2 batches into its second epoch
    assert last["epoch"] == 1 and (loader_state["epoch"], loader_state["next_batch"]) == (1, 2)

    # the checkpoint evaluated by one process gives exactly what the two ranks reduced together
    best = summary["best_checkpoint"]
    val_acc, test_acc = _evaluate_in_one_process(train_config(*TINY), best)
    assert summary["val_acc"] == val_acc
    assert summary["test_acc"] == test_acc


class _FakeTrainer:
    def __init__(self, world_size: int, rank: int):
        self.world_size, self.global_rank, self.current_epoch = world_size, rank, 0


def test_datamodule_shards_every_split_disjointly_across_ranks(train_config):
    cfg = train_config(*TINY)
    datamodule: SequenceDataModule = instantiate(cfg.task.data)
    datamodule.prepare_data()
    datamodule.setup()
    seen: dict[str, list[list[int]]] = {"train": [], "val": [], "test": []}
    for rank in (0, 1):
        datamodule.trainer = _FakeTrainer(2, rank)
        seen["train"].append([i for b in datamodule.train_dataloader().batch_sampler for i in b])
        seen["val"].append([i for b in datamodule.val_dataloader().batch_sampler for i in b])
        seen["test"].append([i for b in datamodule.test_dataloader().batch_sampler for i in b])
    for split, (rank0, rank1) in seen.items():
        assert not set(rank0) & set(rank1), split
    assert len(seen["train"][0]) == len(seen["train"][1]) == 96  # equal step counts, half the data each
    for split in ("val", "test"):  # evaluation covers the whole split, every example once
        assert sorted(seen[split][0] + seen[split][1]) == list(range(64)), split
    assert np.all(np.isin(seen["train"][0] + seen["train"][1], np.arange(192)))
