"""The point-cloud transformer: a set function (permutation-invariant) with every backend."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.pointcloud import PointCloudClassifier

BACKENDS = ["softmax", "sliced_relu", "sliced_relu_bump", "linear", "performer"]


def model(attn: str, **kwargs) -> PointCloudClassifier:
    torch.manual_seed(0)
    options = dict(dim=32, depth=2, num_heads=2, mlp_dim=64, dropout=0.1)
    return PointCloudClassifier(5, attn, **{**options, **kwargs}).double().eval()


@pytest.mark.parametrize("pooling", ["mean", "max_mean"])
@pytest.mark.parametrize("attn", BACKENDS)
def test_logits_do_not_depend_on_the_order_of_the_points(attn, pooling):
    net = model(attn, pooling=pooling, features="concat" if pooling == "max_mean" else "last")
    g = torch.Generator().manual_seed(1)
    points = torch.randn(3, 64, 3, generator=g, dtype=torch.float64)
    order = torch.randperm(64, generator=g)
    with torch.no_grad():
        logits = net(points)
        shuffled = net(points[:, order])
    torch.testing.assert_close(shuffled, logits, rtol=1e-9, atol=1e-9)
    # the points matter: moving one of them changes the logits
    moved = points.clone()
    moved[:, 0] += 1.0
    with torch.no_grad():
        assert not torch.allclose(net(moved), logits)


@pytest.mark.parametrize("attn", BACKENDS)
def test_attention_has_no_positions(attn):
    """No positional table and RoPE off in every block: nothing could tell the points apart by index."""
    net = model(attn)
    assert not any("pos" in name for name, _ in net.named_parameters())
    assert all(block.attn.rotary is None for block in net.encoder.blocks)


@pytest.mark.parametrize("attn", BACKENDS)
def test_trains_and_every_gradient_is_finite(attn):
    net = model(attn).float().train()
    points, labels = torch.randn(4, 32, 3), torch.tensor([0, 1, 2, 3])
    loss = torch.nn.functional.cross_entropy(net(points), labels)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in net.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_normals_widen_the_input():
    net = model("softmax", in_channels=6)
    assert net(torch.randn(2, 16, 6, dtype=torch.float64)).shape == (2, 5)
    with pytest.raises(ValueError, match=r"points must be \(batch, num_points, 6\).*got \(2, 16, 3\)"):
        net(torch.randn(2, 16, 3, dtype=torch.float64))


def test_votes_average_the_logits_of_each_version():
    net = model("sliced_relu_bump")
    versions = torch.randn(2, 3, 16, 3, dtype=torch.float64)
    with torch.no_grad():
        voted = net(versions)
        each = torch.stack([net(versions[:, v]) for v in range(3)], dim=1)
    torch.testing.assert_close(voted, each.mean(1))


def test_a_mask_leaves_padded_points_out():
    """A padded cloud gives what the cloud alone gives (mean and max pooling over real points)."""
    net = model("softmax", pooling="max_mean")
    cloud = torch.randn(1, 10, 3, dtype=torch.float64)
    padded = torch.cat([cloud, torch.full((1, 6, 3), 50.0, dtype=torch.float64)], dim=1)
    mask = torch.arange(16)[None] < 10
    with torch.no_grad():
        torch.testing.assert_close(net(padded, mask), net(cloud))


def test_widths_of_the_options():
    base = model("softmax")
    assert base.head[1].in_features == 32 and base.head[1].out_features == 128  # dim → 4·dim
    pct = model("softmax", features="concat", pooling="max_mean", head_dims=[64, 32])
    assert pct.head[1].in_features == 2 * 2 * 32  # depth × dim, max and mean
    assert pct(torch.randn(2, 8, 3, dtype=torch.float64)).shape == (2, 5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pooling": "sum"}, "pooling='sum' is not supported; choose one of mean, max, max_mean"),
        ({"features": "all"}, "features='all' is not supported"),
        ({"head_dims": [0]}, r"head_dims=\[0\] must be positive"),
        ({"in_channels": 0}, "in_channels must be >= 1"),
    ],
)
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PointCloudClassifier(5, "softmax", **kwargs)


def test_the_modelnet40_preset_builds_the_authors_blocks(train_config):
    """No dropout inside the FFN, LayerNorm eps 1e-12, RoBERTa's normal(0, 0.02) init (their code)."""
    from hydra.utils import instantiate

    cfg = train_config("task=modelnet40")
    model = instantiate(cfg.task.model, attention=instantiate(cfg.attn), in_channels=3)
    block = model.encoder.blocks[0]
    assert all(m.p == 0 for m in block.mlp if isinstance(m, torch.nn.Dropout))
    assert block.drop.p == cfg.task.model.dropout > 0  # the residual dropout stays
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(m.eps == 1e-12 for m in norms)
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, torch.nn.Linear)])
    assert abs(weights.std().item() - 0.02) < 0.002 and abs(weights.mean().item()) < 0.002
    assert all(
        (m.bias == 0).all() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None
    )
    assert cfg.task.module.label_smoothing == 0.2 and cfg.task.data.val_fraction == 0
