"""The vision tasks train by name on official-format data, learn on real digits, and follow the recipe."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from attnlab.data.errors import MissingDataError
from attnlab.pipeline import train
from attnlab.reporting import make_report
from attnlab.tasks.vision import ImageClassificationTask
from data.test_vision import write_cifar, write_tiny_imagenet
from tiny_runs import QUIET

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_VIT = [
    "task.model.stem_channels=[8,16]",
    "task.model.dim=16",
    "task.model.depth=1",
    "task.model.num_heads=2",
    "task.model.mlp_dim=32",
]
QUICK = [
    *QUIET,
    *TINY_VIT,
    "trainer.max_steps=4",
    "task.val_check_interval=2",
    "logger=csv",
    "task.data.num_workers=0",
    "task.data.batch_size=8",
    "task.data.eval_batch_size=16",
    "callbacks.throughput.warmup_steps=1",
]


def _md_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.fixture(scope="module")
def vision_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    write_cifar(root)
    write_tiny_imagenet(root)
    return root


@pytest.mark.parametrize("attn", ["softmax", "sliced_relu", "sliced_relu_bump", "linear", "performer"])
def test_cifar10_vit_trains_on_the_official_layout(train_config, vision_data, attn):
    """`python train.py task=cifar10_vit attn=<backend>` with RandAugment and mixup on, on the pickles."""
    cfg = train_config(
        "task=cifar10_vit",
        f"attn={attn}",
        *QUICK,
        "task.data.source.val_per_class=2",
        f"paths.data_dir={vision_data}",
    )
    assert cfg.task.module.mixup is not None and cfg.task.data.randaugment
    summary = train(cfg)
    assert summary["task"] == "cifar10_vit" and summary["attn"] == attn and summary["steps"] == 4
    assert 0.0 <= summary["test_acc"] <= 1.0 and summary["seq_len"] == 64
    assert str(vision_data / "cifar-10-batches-py") in summary["data_source"]
    # throughput counts images, and tokens as images x patches
    assert summary["train_tokens_per_sec"] == pytest.approx(64 * summary["train_samples_per_sec"])


def test_tinyimagenet_vit_trains_and_reports_top5(train_config, vision_data, tmp_path):
    cfg = train_config(
        "task=tinyimagenet_vit",
        "attn=sliced_relu",
        *QUICK,
        "task.data.source.val_per_class=1",
        f"paths.data_dir={vision_data}",
    )
    summary = train(cfg)
    assert summary["seq_len"] == 256 and "official val split" in summary["data_source"]
    assert summary["baseline_acc"] == pytest.approx(1 / 200)
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    assert any(r.get("test/top5") for r in rows) and any(r.get("val/top5") for r in rows)


@pytest.mark.parametrize("task", ["cifar10_vit", "tinyimagenet_vit"])
def test_missing_image_dataset_stops_with_the_expected_path(train_config, tmp_path, task, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    cfg = train_config(f"task={task}", *QUICK)
    with pytest.raises(MissingDataError, match=str(tmp_path / "data")):
        train(cfg)


@pytest.mark.slow
def test_digits_vit_learns_in_seconds(train_config, tmp_path):
    """docs/vision.md's `python train.py task=digits_vit attn=sliced_relu`, cut to 100 steps: far above
    chance (10 %) on the real test images; `attnlab report` tables it beside an LRA run."""
    cfg = train_config("task=digits_vit", "attn=sliced_relu", "trainer.max_steps=100")
    summary = train(cfg)
    assert summary["baseline_acc"] == pytest.approx(0.1)
    assert summary["test_acc"] >= 0.6, summary
    assert summary["seq_len"] == 16 and "scikit-learn" in summary["data_source"]
    assert summary["train_tokens_per_sec"] == pytest.approx(16 * summary["train_samples_per_sec"])
    lra = tmp_path / "lra_run"
    lra.mkdir()
    (lra / "summary.json").write_text(json.dumps({**summary, "task": "listops", "seq_len": 2000}))
    report = make_report([tmp_path / "run", lra], tmp_path / "report")
    header = _md_rows(report.accuracy_md)[0]
    assert header[:3] == ["backend", "listops", "digits_vit"]
    assert any(row[0] == "digits_vit" and row[1] == "16" for row in _md_rows(report.throughput_md))
    assert (tmp_path / "report" / "acc_vs_throughput.png").stat().st_size > 0


@pytest.mark.parametrize(
    "task, attn",
    [
        ("cifar10_vit", "sliced_relu"),
        pytest.param("tinyimagenet_vit", "softmax", marks=pytest.mark.slow),  # 256 tokens, 4.6 M parameters
    ],
)
def test_documented_commands_run_on_the_official_layouts(train_config, vision_data, task, attn):
    """docs/vision.md's commands as typed (paper-size model, 4 loader workers), with data-size overrides."""
    cfg = train_config(
        f"task={task}",
        f"attn={attn}",
        "trainer.max_steps=2",
        "task.val_check_interval=2",
        "task.data.batch_size=8",
        "task.data.eval_batch_size=50",
        "task.data.source.val_per_class=1",
        f"paths.data_dir={vision_data}",
    )
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["test_acc"] is not None
    assert summary["params"] == {"cifar10_vit": 4_975_270, "tinyimagenet_vit": 4_605_512}[task]


def test_mixup_targets_sum_to_one_and_mix_two_labels():
    model = torch.nn.Linear(1, 1)  # the recipe does not depend on the model
    module = ImageClassificationTask(
        model,
        num_classes=10,
        optimizer=torch.optim.AdamW,
        label_smoothing=0.1,
        mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 0.5},
    )
    torch.manual_seed(0)
    for _ in range(20):  # both mixup and cutmix draws
        images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        mixed, targets = module.mixup(images, labels)
        assert mixed.shape == images.shape and targets.shape == (8, 10)
        torch.testing.assert_close(targets.sum(-1), torch.ones(8))
        assert (targets > 0.1 / 10 + 1e-6).sum(-1).le(2).all()  # at most two classes above the smoothing
    with pytest.raises(Exception, match="unknown task.module.mixup key.*label smoothing is task.module"):
        ImageClassificationTask(model, 10, torch.optim.AdamW, mixup={"label_smoothing": 0.1})


def test_ema_weights_are_what_evaluation_uses(train_config, tmp_path):
    cfg = train_config(
        "task=digits_vit",
        *QUIET,
        *TINY_VIT[1:],
        "task.model.stem_channels=[8]",
        "trainer.max_steps=3",
        "task.val_check_interval=3",
        "task.module.ema_decay=0.5",
        "logger=csv",
        "test=false",
    )
    datamodule = instantiate(cfg.task.data)
    datamodule.setup()
    model = instantiate(cfg.task.model, attention=instantiate(cfg.attn), **datamodule.model_kwargs())
    module = instantiate(cfg.task.module, model=model)
    assert all(not p.requires_grad for p in module.ema.parameters())
    opt_params = {id(p) for group in module._param_groups() for p in group["params"]}
    assert opt_params == {id(p) for p in model.parameters()}  # the optimizer never sees the average
    trainer = instantiate(cfg.trainer, callbacks=[], logger=False, enable_checkpointing=False)
    trainer.fit(module, datamodule=datamodule)
    first = next(iter(module.ema.module.parameters()))
    assert not torch.equal(first, next(iter(model.parameters())))
    seen = []
    module.ema.module.register_forward_hook(lambda *_: seen.append("ema"))
    model.register_forward_hook(lambda *_: seen.append("model"))
    trainer.validate(module, datamodule=datamodule, verbose=False)
    assert seen and set(seen) == {"ema"}


def test_pos_embed_and_class_token_get_no_weight_decay():
    from attnlab.models.vit import tiny_vit

    model = tiny_vit(
        "softmax", 10, pooling="cls", stem_channels=[8, 16], dim=16, depth=1, num_heads=2, mlp_dim=32
    )
    decay, no_decay = ImageClassificationTask(model, 10, torch.optim.AdamW)._param_groups()
    assert any(p is model.pos_embed for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert any(p is model.cls_token for p in no_decay["params"])
    assert any(p is model.blocks[0].attn.qkv.weight for p in decay["params"])


PRESETS = REPO_ROOT / "conf" / "experiment" / "vit"
TAG = re.compile(r"\[P\]|\[A\]|\[CCT\]|\bours\b")
VALUE_LINE = re.compile(r"^\s+(\w+):\s*([^#\s][^#]*?)\s*(?:#\s*(.*))?$")


@pytest.mark.parametrize("preset", ["cifar10", "tinyimagenet"])
def test_paper_scale_presets_name_the_source_of_every_value(train_config, preset):
    lines = (PRESETS / f"{preset}.yaml").read_text().splitlines()
    untagged = [
        line.strip()
        for line in lines
        if (m := VALUE_LINE.match(line)) and not TAG.search(m.group(3) or "") and m.group(1) != "max_time"
    ]
    assert not untagged, f"vit/{preset}.yaml: values without [P], [A], [CCT] or ours: {untagged}"
    cfg = train_config(f"experiment=vit/{preset}")
    steps_per_epoch = {"cifar10": 50_000, "tinyimagenet": 100_000}[preset] // cfg.task.data.batch_size
    assert cfg.task.max_steps == 300 * steps_per_epoch and cfg.task.val_check_interval == steps_per_epoch
    assert cfg.task.module.scheduler.warmup_steps == 10 * steps_per_epoch
    assert cfg.task.model.patch_size == 4 and cfg.task.module.optimizer._target_ == "torch.optim.AdamW"


@pytest.mark.parametrize("preset", ["vit/cifar10", "vit/tinyimagenet", "vit/cifar10_cpu"])
@pytest.mark.parametrize("attn", ["softmax", "sliced_relu"])
def test_every_vit_preset_builds_its_model(train_config, preset, attn):
    cfg = train_config(f"experiment={preset}", f"attn={attn}")
    size = 64 if "tiny" in preset else 32
    model = instantiate(
        cfg.task.model, attention=instantiate(cfg.attn), num_classes=cfg.task.num_classes, img_size=size
    ).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, size, size))
    assert out.shape == (2, cfg.task.num_classes) and torch.isfinite(out).all()


@pytest.mark.slow
def test_paper_protocol_sweep_and_its_median_report(vision_data, tmp_path):
    """docs/vision.md's sweep (3 backends x 4 seeds) and `attnlab report`, with data-size overrides."""
    import subprocess
    import sys

    from attnlab.cli.main import main

    sweep = tmp_path / "multirun"
    command = [
        sys.executable, "train.py", "-m", "experiment=vit/cifar10",
        "attn=softmax,sliced_relu,sliced_relu_bump", "seed=0,1,2,3",
        "trainer.max_steps=1", "task.val_check_interval=1", "task.data.batch_size=8",
        "task.data.eval_batch_size=50",
        f"paths.data_dir={vision_data}", f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["report", str(sweep), "--out-dir", str(tmp_path / "report")]) == 0
    rows = _md_rows((tmp_path / "report" / "accuracy.md").read_text())
    cells = {row[0]: row[1] for row in rows[1:]}
    for backend in ("softmax", "sliced_relu", "sliced_relu_bump"):
        assert ", median " in cells[backend] and cells[backend].endswith("(4)")
