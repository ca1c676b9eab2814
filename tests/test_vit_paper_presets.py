"""The tiny-ViT paper presets match the sliced ReLU paper's Fig. 2 setting (issue 32): every backend at
about 4.54 M parameters, the authors' attention-dropout placement, training on the whole training set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from attnlab.attention import build_attention

REPO_ROOT = Path(__file__).resolve().parents[1]
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
    """All three backends within 1.5 % of the paper's 4.54 M, and docs/vision.md shows each count."""
    documented = _documented_counts()
    rows = {
        "softmax": ("`softmax`", []),
        "sliced_relu": ("`sliced_relu` (MLP projection)", []),
        "sliced_relu_bump": ("`sliced_relu_bump`", []),
        "linear": ("`sliced_relu` with `attn.projection=linear`", ["attn.projection=linear"]),
    }
    for backend, (label, extra) in rows.items():
        attn = "sliced_relu" if backend == "linear" else backend
        count = _params(_model(train_config(f"experiment=vit/{preset}", f"attn={attn}", *extra), preset))
        assert abs(count / 4.54e6 - 1) <= 0.015, f"{preset} {backend}: {count:,} parameters"
        assert documented[preset, label] == count, (preset, label)


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
    assert sliced.dropout_site == "projection" and sliced.dropout == 0.1
    assert [m.p for m in sliced.slicer.modules() if isinstance(m, torch.nn.Dropout)] == [0.05]
    assert layer("attn=sliced_relu_bump").dropout_site == "projection"
    assert layer("attn=softmax").dropout == 0.1  # softmax drops attention weights, as before
    assert layer("attn=sliced_relu", "+attn.dropout_site=output").dropout_site == "output"
    assert layer("attn=sliced_relu", "+attn.projection_hidden=256").slicer[0].out_features == 256
    # presets other than the paper's keep the registry's defaults
    plain = _model(train_config("task=cifar10_vit", "attn=sliced_relu"), "cifar10").blocks[0].attn
    assert plain.dropout_site == "output" and plain.slicer[0].out_features == 256
