"""The tiny-ViT paper presets match the sliced ReLU paper's Fig. 2 setting: every backend at about 4.54 M
parameters with sliced ReLU's linear slicing projection (the `_mlp` presets: the nonlinear one, hidden
width d), the authors' attention-dropout placement, training on the whole training set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from attnlab.attention import build_attention

REPO_ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("softmax", "sliced_relu", "sliced_relu_bump")
SIZES = {"cifar10": (32, 10), "tinyimagenet": (64, 200)}


def _model(cfg, preset):
    size, classes = SIZES[preset]
    return instantiate(cfg.task.model, attention=instantiate(cfg.attn), num_classes=classes, img_size=size)


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _documented_counts() -> dict[tuple[str, str], int]:
    """docs/vision.md's table: (preset, row label) -> count."""
    text = (REPO_ROOT / "docs" / "vision.md").read_text()
    header = "| attention | `experiment=vit/cifar10` | `experiment=vit/tinyimagenet` |"
    rows = text[text.index(header) :].split("\n\n")[0].splitlines()[2:]
    counts = {}
    for row in rows:
        label, *cells = (c.strip() for c in row.strip("|").split("|"))
        for preset, cell in zip(("cifar10", "tinyimagenet"), cells, strict=True):
            counts[preset, label] = int(re.match(r"[\d,]+", cell).group().replace(",", ""))
    return counts


@pytest.mark.parametrize("preset", ["cifar10", "tinyimagenet"])
def test_every_backend_has_the_papers_parameter_count(train_config, preset):
    """All three backends within 1.5 % of the paper's 4.54 M (sliced ReLU: the linear projection), the
    `_mlp` preset's sliced ReLU 0.46 M more, and docs/vision.md shows each count."""
    documented = _documented_counts()
    rows = {
        "softmax": ("`softmax`", preset),
        "sliced_relu": ("`sliced_relu` (linear projection)", preset),
        "sliced_relu_bump": ("`sliced_relu_bump`", preset),
    }
    counts = {}
    for backend, (label, experiment) in rows.items():
        counts[backend] = _params(
            _model(train_config(f"experiment=vit/{experiment}", f"attn={backend}"), preset)
        )
        assert abs(counts[backend] / 4.54e6 - 1) <= 0.015, (
            f"{preset} {backend}: {counts[backend]:,} parameters"
        )
        assert documented[preset, label] == counts[backend], (preset, label)
    if preset == "cifar10":
        assert counts["sliced_relu"] == 4_514_726
    mlp = _params(_model(train_config(f"experiment=vit/{preset}_mlp", "attn=sliced_relu"), preset))
    label = "`sliced_relu` in `vit/<dataset>_mlp` (nonlinear projection, hidden width 256)"
    assert documented[preset, label] == mlp
    assert mlp - counts["sliced_relu"] == 7 * (256 * 256 + 256)  # a hidden Linear(256, 256) per block
    for backend in ("softmax", "sliced_relu_bump"):  # the other backends are the twin preset's
        assert (
            _params(_model(train_config(f"experiment=vit/{preset}_mlp", f"attn={backend}"), preset))
            == counts[backend]
        )


def test_the_slicing_mlp_width_is_an_option_and_defaults_to_the_heads_width():
    default = build_attention("sliced_relu", dim=64, num_heads=4)
    narrow = build_attention("sliced_relu", dim=64, num_heads=4, projection_hidden=8)
    assert default.slicer[0].out_features == 64 and narrow.slicer[0].out_features == 8
    assert narrow.slicer[2].in_features == 8 and narrow.slicer[2].out_features == 4
    assert isinstance(
        build_attention("sliced_relu", 64, 4, projection="linear", projection_hidden=8).slicer,
        torch.nn.Linear,
    )
    with pytest.raises(ValueError, match="projection_hidden must be an integer >= 1"):
        build_attention("sliced_relu", dim=64, num_heads=4, projection_hidden=0)


def _train_vs_eval(layer, x):
    torch.manual_seed(0)
    train = layer.train()(x)
    return train, layer.eval()(x)


@pytest.mark.parametrize("projection", ["mlp", "linear"])
def test_projection_site_drops_half_inside_the_slicing_mlp_and_never_the_output(projection):
    x = torch.randn(2, 9, 32)
    kwargs = dict(dim=32, num_heads=4, dropout=0.4, projection=projection)
    authors = build_attention("sliced_relu", **kwargs, dropout_site="projection")
    ours = build_attention("sliced_relu", **kwargs)
    drops = [m.p for m in authors.slicer.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops == ([0.2] if projection == "mlp" else [])
    assert set(authors.state_dict()) == set(ours.state_dict())  # the same checkpoint keys either way
    if projection == "mlp":  # the slicer's dropout is its only one: without it, train == eval
        for m in authors.slicer.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    train, evaluated = _train_vs_eval(authors, x)
    torch.testing.assert_close(train, evaluated)
    train, evaluated = _train_vs_eval(ours, x)  # attnlab's site: the output is dropped
    assert not torch.allclose(train, evaluated)


def test_bump_has_no_dropout_at_the_authors_site():
    x = torch.randn(2, 9, 32)
    authors = build_attention("sliced_relu_bump", dim=32, num_heads=4, dropout=0.5, dropout_site="projection")
    torch.testing.assert_close(*_train_vs_eval(authors, x))
    ours = build_attention("sliced_relu_bump", dim=32, num_heads=4, dropout=0.5)
    assert not torch.allclose(*_train_vs_eval(ours, x))
    with pytest.raises(ValueError, match="dropout_site must be one of output, projection; got 'inside'"):
        build_attention("sliced_relu_bump", dim=32, num_heads=4, dropout_site="inside")


@pytest.mark.parametrize("preset", ["cifar10", "tinyimagenet"])
def test_paper_presets_drop_where_the_authors_do_and_keep_ours_as_an_option(train_config, preset):
    layer = lambda *o: _model(train_config(f"experiment=vit/{preset}", *o), preset).blocks[0].attn  # noqa: E731
    sliced = layer("attn=sliced_relu")
    assert sliced.dropout_site == "projection" and sliced.dropout == 0.1 and sliced.projection == "linear"
    assert not [m for m in sliced.slicer.modules() if isinstance(m, torch.nn.Dropout)]  # no slot for it
    mlp = _model(train_config(f"experiment=vit/{preset}_mlp", "attn=sliced_relu"), preset).blocks[0].attn
    assert mlp.dropout_site == "projection" and mlp.slicer[0].out_features == 256
    assert [m.p for m in mlp.slicer.modules() if isinstance(m, torch.nn.Dropout)] == [0.05]
    assert layer("attn=sliced_relu_bump").dropout_site == "projection"
    assert layer("attn=softmax").dropout == 0.1  # softmax drops attention weights, as before
    assert layer("attn=sliced_relu", "+attn.dropout_site=output").dropout_site == "output"
    narrow = layer("attn=sliced_relu", "attn.projection=mlp", "+attn.projection_hidden=16")  # an override
    assert narrow.slicer[0].out_features == 16
    # presets other than the paper's keep the registry's defaults
    plain = _model(train_config("task=cifar10_vit", "attn=sliced_relu"), "cifar10").blocks[0].attn
    assert plain.dropout_site == "output" and plain.slicer[0].out_features == 256


def test_val_per_class_zero_trains_on_every_training_image_and_validates_on_test(tmp_path):
    from attnlab.data.vision import VAL_IS_TEST, Cifar10Source
    from attnlab.errors import ConfigError
    from data.test_vision import write_cifar

    write_cifar(tmp_path)  # 5 x 20 training images, 20 test images
    whole = Cifar10Source(tmp_path, val_per_class=0)
    splits = whole.load()
    assert len(splits["train"]) == 100 and splits["val"] is splits["test"] and len(splits["test"]) == 20
    assert VAL_IS_TEST in whole.description and "train = all 100" in whole.description
    held = Cifar10Source(tmp_path, val_per_class=2).load()
    assert (len(held["train"]), len(held["val"])) == (80, 20)
    with pytest.raises(ConfigError, match=r"val_per_class=-1 must be an integer >= 0"):
        Cifar10Source(tmp_path, val_per_class=-1).load()


@pytest.mark.parametrize("preset", ["cifar10", "tinyimagenet"])
def test_paper_presets_train_on_the_whole_training_set_and_test_the_final_weights(train_config, preset):
    cfg = train_config(f"experiment=vit/{preset}")
    assert cfg.task.data.source.val_per_class == 0 and cfg.callbacks.model_checkpoint is None
    images = {"cifar10": 50_000, "tinyimagenet": 100_000}[preset]
    assert cfg.task.val_check_interval == images // cfg.task.data.batch_size


def test_the_paper_preset_reports_the_test_curve(train_config, tmp_path):
    """experiment=vit/cifar10 on the official pickles: val/acc is the test curve, no checkpoint is chosen
    on it, and the test scores the final weights."""
    import csv

    from attnlab.data.vision import VAL_IS_TEST
    from attnlab.pipeline import train
    from data.test_vision import write_cifar
    from tasks.test_vision_tasks import QUICK

    write_cifar(tmp_path / "data")
    cfg = train_config(
        "experiment=vit/cifar10", "attn=sliced_relu", *QUICK, f"paths.data_dir={tmp_path / 'data'}"
    )
    summary = train(cfg)
    assert VAL_IS_TEST in summary["data_source"] and summary["val_acc"] is None
    assert summary["best_checkpoint"] is None and 0.0 <= summary["test_acc"] <= 1.0
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    curve = [float(r["val/acc"]) for r in rows if r.get("val/acc")]
    final_test = [float(r["test/acc"]) for r in rows if r.get("test/acc")]
    assert len(curve) == 2 and final_test == [summary["test_acc"]]
    assert curve[-1] == pytest.approx(summary["test_acc"])  # the last point of the curve: the same images


GRIDS = {"cifar10": "vit/grid", "tinyimagenet": "vit/grid_tinyimagenet"}


@pytest.mark.parametrize("preset", ["cifar10", "tinyimagenet"])
def test_the_grid_selects_on_a_hold_out_with_the_paper_presets_recipe(train_config, preset):
    from omegaconf import OmegaConf

    grid, paper = train_config(f"experiment={GRIDS[preset]}"), train_config(f"experiment=vit/{preset}")
    held_out = {"cifar10": 500, "tinyimagenet": 50}[preset]
    assert grid.task.data.source.val_per_class == held_out  # 5,000 / 10,000 images for selection
    per_epoch = {"cifar10": 45_000, "tinyimagenet": 90_000}[preset] // 128
    assert (grid.task.max_steps, grid.task.val_check_interval) == (300 * per_epoch, per_epoch)
    assert grid.task.module.scheduler.warmup_steps == 10 * per_epoch
    # everything else is the paper preset's
    for key in ("task.model", "task.data.randaugment", "task.module.mixup", "task.module.optimizer._target_"):
        assert OmegaConf.select(grid, key) == OmegaConf.select(paper, key), key
    params = OmegaConf.load(REPO_ROOT / "conf" / "experiment" / f"{GRIDS[preset]}.yaml").hydra.sweeper.params
    assert params.attn.split(",") == list(BACKENDS)
    assert dict(params) == dict(
        OmegaConf.load(REPO_ROOT / "conf" / "experiment" / "vit" / "grid.yaml").hydra.sweeper.params
    )  # one grid for both datasets


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["cifar10", "tinyimagenet"])
def test_the_grid_end_to_end_selects_then_reports_the_median_of_four_seeds(tmp_path, preset):
    """experiment=vit/grid (36 runs) -> attnlab report -> its 3 printed commands (4 seeds each) -> attnlab
    report: the chosen configuration per backend and the median test curve, on tiny official-format data."""
    import csv
    import shlex
    import subprocess
    import sys

    from attnlab.cli.main import main
    from data.test_vision import write_cifar, write_tiny_imagenet
    from tasks.test_vision_tasks import TINY_VIT

    data = tmp_path / "data"
    (write_cifar if preset == "cifar10" else write_tiny_imagenet)(data)
    tiny = [
        *TINY_VIT, "trainer.max_steps=2", "task.val_check_interval=1", "task.data.batch_size=8",
        "task.data.eval_batch_size=200", "task.data.num_workers=0", "trainer.enable_progress_bar=false",
        f"paths.data_dir={data}",
    ]  # fmt: skip

    def train(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "train.py", *args, *tiny],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert done.returncode == 0, done.stderr[-3000:]

    grid = tmp_path / "grid"
    train("-m", f"experiment={GRIDS[preset]}", "task.data.source.val_per_class=1", f"hydra.sweep.dir={grid}")
    assert len(list(grid.rglob("summary.json"))) == 36
    assert main(["report", str(grid), "--out-dir", str(tmp_path / "selection")]) == 0
    text = (tmp_path / "selection" / "vit_grid.md").read_text()
    commands = [line for line in text.splitlines() if line.startswith("python train.py -m ")]
    assert [shlex.split(c)[4] for c in commands] == [f"attn={b}" for b in BACKENDS]
    for backend, command in zip(BACKENDS, commands, strict=True):
        train(*shlex.split(command)[2:], f"hydra.sweep.dir={tmp_path / 'final' / backend}")
    out = tmp_path / "report"
    assert main(["report", str(grid), str(tmp_path / "final"), "--out-dir", str(out)]) == 0
    text = (out / "vit_grid.md").read_text()
    task = f"{preset}_vit"
    for backend in BACKENDS:
        rows = [line for line in text.splitlines() if line.startswith(f"| {task} | {backend} |")]
        assert len(rows) == 2 and "| yes | 4 |" in rows[1], rows  # selection, then the chosen one's curve
    curves = list(csv.DictReader((out / "vit_curves.csv").open()))
    assert {(r["backend"], r["seeds"]) for r in curves} == {(b, "4") for b in BACKENDS}
    assert sorted({r["step"] for r in curves}) == ["0", "1"]  # two validations, steps as metrics.csv has them


VIT_TEXTS = [
    "docs/vision.md",
    "conf/experiment/vit/cifar10.yaml",
    "conf/experiment/vit/tinyimagenet.yaml",
    "conf/task/cifar10_vit.yaml",
    "conf/task/tinyimagenet_vit.yaml",
]


def test_docs_claim_what_the_paper_says_and_no_more():
    """4.54 M is the paper's figure for its sliced models; CCT is our recipe's source, not a model the
    paper compares with; the paper states per-setup selection and linear and nonlinear projections."""
    for name in VIT_TEXTS:
        text = " ".join((REPO_ROOT / name).read_text().split())
        assert "anchor" not in text.lower(), f"{name}: CCT is our recipe's source, not the paper's anchor"
        assert not re.search(r"softmax[^.]*the paper's ~?4\.54", text), (
            f"{name}: 4.54 M is not softmax's figure"
        )
    for name in ("docs/vision.md", "conf/experiment/vit/cifar10.yaml"):
        text = " ".join((REPO_ROOT / name).read_text().split()).replace("# ", "")
        assert re.search(r"sliced ReLU and ReLU-bump (tiny )?ViTs of about 4\.54 M", text), name
        assert "selected per setup" in text and "linear or nonlinear" in text, name
        assert "our recipe's source" in text, name
