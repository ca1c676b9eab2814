"""Every LRA task trains by name on data in its official format (tiny fixtures written here)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from attnlab.data.common import MissingDataError
from attnlab.pipeline import train

QUICK = [
    "trainer.max_steps=2",
    "task.val_check_interval=2",
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
    "task.data.num_workers=0",
    "task.data.batch_size=4",
    "task.data.eval_batch_size=8",
    "task.model.dim=16",
    "task.model.mlp_dim=32",
]


def write_imdb(root, per_class=6):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            folder = root / "aclImdb" / split / label
            folder.mkdir(parents=True)
            for i in range(per_class):
                words = " ".join(rng.choice(["good", "bad", "film", "plot", "très", "bien"], size=12))
                (folder / f"{i}_{7 if label == 'pos' else 2}.txt").write_text(
                    words + "<br />", encoding="utf-8"
                )


def write_aan(root, rows=12):
    folder = root / "lra_release" / "tsv_data"
    folder.mkdir(parents=True)
    for split in ("train", "eval", "test"):
        lines = [
            f"{float(i % 2)}\tpaper{i}\tpaper{i + 1}\tabstract number {i}\tcited text {i * 7}"
            for i in range(rows)
        ]
        (folder / f"new_aan_pairs.{split}.tsv").write_text("\n".join(lines) + "\n")


def write_cifar(root, per_batch=20):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [int(x) for x in rng.integers(0, 10, per_batch)],
            b"batch_label": name.encode(),
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


@pytest.fixture(scope="module")
def lra_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lra")
    write_imdb(root)
    write_aan(root)
    write_cifar(root)
    return root


@pytest.mark.parametrize("attn", ["softmax", "sliced_relu"])
@pytest.mark.parametrize("task", ["text", "retrieval", "image", "pathfinder"])
def test_lra_task_trains_on_official_format_data(train_config, lra_data, task, attn):
    extra = {
        "text": ["task.data.source.max_length=64"],
        "retrieval": ["task.data.source.max_length=48"],
        "image": [],
        "pathfinder": ["task.data.source.num_images=40", "task.data.source.workers=1"],
    }[task]
    cfg = train_config(f"task={task}", f"attn={attn}", *QUICK, *extra, f"paths.data_dir={lra_data}")
    summary = train(cfg)
    assert summary["task"] == task and summary["attn"] == attn and summary["steps"] == 2
    assert 0.0 <= summary["test_acc"] <= 1.0
    assert str(lra_data) in summary["data_source"]


def test_pathx_builds_at_16k_tokens(train_config, tmp_path):
    from hydra.utils import instantiate

    cfg = train_config("task=pathx", "attn=sliced_relu")
    assert cfg.task.model.max_len == 16384 and cfg.task.data.source.resolution == 128
    source = instantiate(cfg.task.data.source)
    assert source.name == "pathx" and "pathfinder128" in source.status()["splits"]["train"]["path"]


@pytest.mark.parametrize("task", ["text", "retrieval", "image"])
def test_missing_dataset_names_path_and_remedy(train_config, tmp_path, task):
    cfg = train_config(f"task={task}", *QUICK)
    with pytest.raises(MissingDataError, match=str(tmp_path / "data")):
        train(cfg)
