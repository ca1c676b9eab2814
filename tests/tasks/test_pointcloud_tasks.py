"""Point-cloud tasks end to end: task=modelnet40 on the official layouts (fixtures), task=shapes learning
on a CPU, and the pipeline pieces they need (model inputs, mean class accuracy, throughput, report)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from attnlab.data.errors import DataError, MissingDataError
from attnlab.pipeline import train
from pointcloud_fixtures import write_modelnet_h5, write_modelnet_off
from tiny_runs import REPO_ROOT, run_train_py

QUICK = [
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
    "task.data.num_workers=0",
]
TINY = [
    "task.max_steps=2",
    "task.val_check_interval=2",
    "task.data.batch_size=4",
    "task.data.eval_batch_size=16",
    "task.data.num_points=32",
    "task.data.source.sample_points=32",
    "task.model.dim=16",
    "task.model.mlp_dim=32",
    "task.model.head_dims=[32]",
    "task.model.depth=1",
]


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def modelnet40_off(tmp_path_factory):
    return write_modelnet_off(tmp_path_factory.mktemp("mn") / "ModelNet40")


@pytest.fixture
def no_download(monkeypatch):
    """Anything reaching PyG's downloader fails the test."""
    import torch_geometric.datasets.modelnet as pyg_modelnet

    def refuse(*args, **kwargs):
        raise AssertionError(f"a download was attempted: {args}")

    monkeypatch.setattr(pyg_modelnet, "download_url", refuse)


@pytest.mark.parametrize("attn", ["sliced_relu_bump", "softmax"])
def test_modelnet40_trains_on_the_official_off_layout(
    train_config, modelnet40_off, tmp_path, no_download, attn
):
    data_dir = modelnet40_off.parent
    cfg = train_config(
        "task=modelnet40",
        f"attn={attn}",
        *QUICK,
        *TINY,
        f"paths.data_dir={data_dir}",
        "callbacks.throughput.warmup_steps=0",
        "trainer.log_every_n_steps=1",
    )
    summary = train(cfg)
    assert summary["task"] == "modelnet40" and summary["steps"] == 2 and 0 <= summary["test_acc"] <= 1
    assert summary["seq_len"] == 32 and summary["baseline_acc"] == pytest.approx(1 / 40)
    source = summary["data_source"]
    assert str(modelnet40_off) in source and "attnlab's OFF reader" in source and "SamplePoints" in source
    assert "40 classes, 80/40 train/test meshes" in source
    assert (data_dir / "ModelNet40_pyg").is_dir()  # processed once, cached beside the meshes
    rows = metrics(tmp_path / "run")
    assert any(r.get("test/mean_class_acc") for r in rows) and any(r.get("val/mean_class_acc") for r in rows)
    tokens = [float(r["perf/train_tokens_per_sec"]) for r in rows if r.get("perf/train_tokens_per_sec")]
    samples = [float(r["perf/train_samples_per_sec"]) for r in rows if r.get("perf/train_samples_per_sec")]
    assert tokens and tokens[-1] == pytest.approx(32 * samples[-1])  # every point is a token


def test_modelnet40_reads_the_hdf5_copy(train_config, tmp_path):
    write_modelnet_h5(
        tmp_path / "data" / "modelnet40_ply_hdf5_2048", sizes=(("train", 0, 40), ("test", 0, 8))
    )
    cfg_auto = train_config("task=modelnet40", "attn=sliced_relu", *QUICK, *TINY)
    summary = train(cfg_auto)  # auto: no meshes, so the HDF5 copy
    assert "pre-sampled HDF5" in summary["data_source"] and "40/8 train/test clouds" in summary["data_source"]
    with_normals = train_config(
        "task=modelnet40", "task.data.source.format=hdf5", "task.data.source.normals=true", *QUICK, *TINY
    )
    from hydra.utils import instantiate

    datamodule = instantiate(with_normals.task.data)
    datamodule.setup()
    assert datamodule.model_kwargs() == {"in_channels": 6}
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["points"].shape == (4, 32, 6)


def test_missing_modelnet40_names_both_layouts_and_creates_nothing(train_config, tmp_path, no_download):
    cfg = train_config("task=modelnet40", *QUICK, *TINY)
    with pytest.raises(MissingDataError) as info:
        train(cfg)
    message = str(info.value)
    assert str(tmp_path / "data" / "ModelNet40") in message and "modelnet40_ply_hdf5_2048" in message
    assert "modelnet.cs.princeton.edu" in message
    assert not (tmp_path / "data" / "ModelNet40").exists()
    off_only = train_config("task=modelnet40", "task.data.source.format=off", *QUICK, *TINY)
    with pytest.raises(MissingDataError, match=r"ModelNet40\. Download ModelNet40\.zip"):
        train(off_only)


def test_a_broken_mesh_stops_the_run_naming_it(train_config, tmp_path, no_download):
    root = write_modelnet_off(tmp_path / "data" / "ModelNet40")
    broken = root / "chair" / "train" / "chair_0002.off"
    broken.write_text(broken.read_text()[:60])
    cfg = train_config("task=modelnet40", *QUICK, *TINY)
    with pytest.raises(DataError, match=rf"{broken}:\d+: truncated"):
        train(cfg)


def test_a_class_without_test_meshes_is_named(train_config, tmp_path):
    root = write_modelnet_off(tmp_path / "data" / "ModelNet40")
    for path in (root / "xbox" / "test").iterdir():
        path.unlink()
    cfg = train_config("task=modelnet40", *QUICK, *TINY)
    with pytest.raises(DataError, match=r"ModelNet40/xbox/test: no xbox_\*\.off files"):
        train(cfg)


def test_modelnet10_needs_its_class_count(train_config, tmp_path):
    write_modelnet_off(tmp_path / "data" / "ModelNet40", classes=["bathtub", "bed", "chair"])
    cfg = train_config("task=modelnet40", *QUICK, *TINY)
    with pytest.raises(Exception, match=r"3 classes found, but task.num_classes=40; set task.num_classes=3"):
        train(cfg)


@pytest.mark.slow
def test_shapes_short_run_beats_chance(train_config, tmp_path):
    """`python train.py task=shapes attn=sliced_relu_bump` (README), with a smaller set and model."""
    cfg = train_config(
        "task=shapes",
        "attn=sliced_relu_bump",
        *QUICK,
        "task.data.source.train_per_class=24",
        "task.data.source.test_per_class=8",
        "task.data.source.sample_points=64",
        "task.data.num_points=64",
        "task.data.batch_size=16",
        "task.model.dim=32",
        "task.model.head_dims=[64]",
        "task.max_steps=150",
        "task.val_check_interval=150",
        "test=true",
    )
    summary = train(cfg)
    assert summary["baseline_acc"] == pytest.approx(1 / 8)
    assert summary["test_acc"] >= 0.35, summary  # chance is 12.5 %
    assert "GENERATED by attnlab" in summary["data_source"] and "seed 0" in summary["data_source"]


@pytest.mark.slow
def test_the_default_shapes_run_of_the_readme_learns(tmp_path):
    """Exactly `python train.py task=shapes attn=sliced_relu_bump`, data and runs in tmp dirs."""
    run = run_train_py(
        "task=shapes", "attn=sliced_relu_bump",
        f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'outputs'}", timeout=3600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(
        x for x in run.stdout.splitlines() if x.startswith("shapes / sliced_relu_bump: test accuracy")
    )
    accuracy = float(line.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 50.0, line


def test_point_cloud_runs_appear_in_the_report(train_config, tmp_path, modelnet40_off):
    from attnlab.cli.main import main

    cfg = train_config(
        "task=modelnet40", "attn=linear", *QUICK, *TINY, f"paths.data_dir={modelnet40_off.parent}"
    )
    train(cfg)
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "run"), "--out-dir", str(out)]) == 0
    table = (out / "accuracy.md").read_text()
    assert "modelnet40" in table and "linear" in table
    assert "modelnet40" in (out / "throughput.md").read_text()


def test_throughput_counts_every_point_of_a_maskless_batch():
    from attnlab.callbacks.throughput import _count

    batch = {"points": torch.zeros(4, 100, 3), "labels": torch.zeros(4, dtype=torch.long)}
    assert _count(batch) == (4, 400)
    padded = {**batch, "mask": torch.arange(100)[None].expand(4, -1) < 10}
    assert _count(padded) == (4, 40)  # with a mask only the real points count


def test_classification_task_passes_the_configured_inputs():
    from functools import partial

    from attnlab.models.pointcloud import PointCloudClassifier
    from attnlab.tasks.classification import ClassificationTask

    model = PointCloudClassifier(3, "softmax", dim=8, depth=1, num_heads=2, mlp_dim=16)
    task = ClassificationTask(
        model, 3, partial(torch.optim.AdamW), inputs=["points", "mask"], mean_class_acc=True
    )
    batch = {"points": torch.randn(2, 5, 3), "labels": torch.tensor([0, 2])}
    assert task(batch).shape == (2, 3)
    assert {"val_mean_class_acc", "test_mean_class_acc"} <= set(task.metrics)
    assert "train_mean_class_acc" not in task.metrics


DOC = REPO_ROOT / "docs" / "pointcloud.md"
# only the data's size and the run's length change: the commands run as typed otherwise
DATA_SIZE = {
    "shapes": [
        "task.data.source.train_per_class=3",
        "task.data.source.test_per_class=1",
        "task.data.source.sample_points=32",
    ],
    "modelnet40": ["task.data.source.sample_points=32"],
}
RUN_SIZE = ["task.data.num_points=32", "task.data.batch_size=4", "trainer.max_steps=2", *QUICK]


def doc_commands() -> list[str]:
    lines, inside = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside and line.startswith("python train.py"):
            lines.append(line.split("#")[0].strip())
    return lines


def test_the_doc_shows_the_commands_tested_here():
    assert doc_commands() == [
        "python train.py task=modelnet40 attn=sliced_relu_bump",
        "python train.py task=shapes attn=sliced_relu_bump",
        "python train.py task=modelnet40 task.data.source.format=hdf5 attn=softmax",
        "python train.py experiment=pointcloud/modelnet40_cpu attn=sliced_relu_bump",
        "python train.py experiment=pointcloud/pct_head task=shapes attn=sliced_relu",
    ]


@pytest.mark.parametrize("command", doc_commands())
def test_every_command_of_the_doc_runs(train_config, tmp_path, command):
    data_dir = tmp_path / "data"
    write_modelnet_off(data_dir / "ModelNet40")
    write_modelnet_h5(
        data_dir / "modelnet40_ply_hdf5_2048", sizes=(("train", 0, 40), ("test", 0, 8)), points=64
    )
    args = command.split()[2:]
    task = "shapes" if "task=shapes" in args else "modelnet40"
    summary = train(train_config(*args, *DATA_SIZE[task], *RUN_SIZE))
    assert summary["task"] == task and summary["steps"] == 2 and summary["test_acc"] is not None
    if task == "modelnet40":  # both copies are there: format=auto reads the HDF5 one, as the tables do
        assert "HDF5" in summary["data_source"]


def test_modelnet40_preset_values_name_their_source():
    """Every model, optimisation and budget value of the paper preset carries [P], [A], [A-seq] (the
    authors' sequence head: their repository has no point-cloud head), [PCT] or ours."""
    import re

    keys = {"dim", "depth", "num_heads", "mlp_dim", "dropout", "attn_dropout", "features", "pooling"}
    keys |= {"head_dims", "head_activation", "head_dropout", "lr", "momentum", "weight_decay", "decay"}
    keys |= {"warmup_steps", "min_lr_ratio", "batch_size", "num_points", "max_steps", "val_check_interval"}
    keys |= {"scale", "translate", "rotate_degrees", "point_dropout", "weight_decay_exclude_norm_bias"}
    tag = re.compile(r"\[P\]|\[A\]|\[A-seq\]|\[PCT\]|ours")
    lines = (REPO_ROOT / "conf" / "task" / "modelnet40.yaml").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        match = re.match(r"^\s+(\w+):\s*([^#\s][^#]*?)\s*(?:#\s*(.*))?$", line) or re.match(
            r"^(\w+):\s*(\S+)", line
        )
        if match and match.group(1) in keys:
            comment = line.split("#", 1)[1] if "#" in line else ""
            if not tag.search(comment) and not (
                lines[i - 1].lstrip().startswith("#") and tag.search(lines[i - 1])
            ):
                missing.append(line.strip())
    assert not missing


def test_modelnet40_preset_is_the_authors_model_with_pcts_schedule(train_config):
    cfg = train_config("task=modelnet40")
    model, module, data = cfg.task.model, cfg.task.module, cfg.task.data
    assert (model.features, model.pooling, model.head_activation) == ("last", "mean", "gelu")
    assert list(model.head_dims) == [4 * model.dim] and model.head_dropout == model.dropout
    assert (data.num_points, data.batch_size, module.optimizer._target_) == (1024, 32, "torch.optim.SGD")
    assert (module.optimizer.lr, module.optimizer.momentum, module.optimizer.weight_decay) == (
        0.01,
        0.9,
        5e-4,
    )
    assert module.scheduler.decay == "cosine" and module.scheduler.min_lr_ratio == 0.01
    assert cfg.task.max_steps == 250 * (9843 // 32)  # 250 epochs of full batches over all 9,843 clouds
