"""The sliced layers fold Π's first linear map into the q/k projection (`fold_scores` without RoPE,
`fold_rotated_scores` with it, once per position): the same function of the same parameters as slicing
the projected (and rotated) q and k, in outputs and in every parameter's gradient, for every shape of Π
and of the projection."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.attention.sliced_common.layer import SlicedAttentionLayer

CASES = [
    ("sliced_relu", {}),
    ("sliced_relu", {"projection": "linear"}),
    ("sliced_relu", {"projection_hidden": 24, "qkv_bias": False}),
    ("sliced_relu", {"qkv_dim": 12, "causal": True}),
    ("sliced_relu", {"dropout_site": "projection", "dropout": 0.3}),
    ("sliced_relu_bump", {}),
    ("sliced_relu_bump", {"qkv_bias": False, "causal": True}),
    ("sliced_relu_bump", {"qkv_dim": 12, "normaliser": "mass", "causal": True}),
    ("sliced_relu_bump", {"rope": True}),
    ("sliced_relu_bump", {"rope": True, "qkv_bias": False, "causal": True, "qkv_dim": 12}),
    ("sliced_relu", {"rope": True, "projection": "linear"}),
    ("sliced_relu", {"rope": True, "projection_hidden": 2, "causal": True}),
]


def _unfolded(layer, x, mask):
    """The layer's forward the long way: q, k, v from the fused projection, then Π on q and k."""
    q, k, v = layer.heads(x)
    return layer.out_proj(layer.merge(layer.attend(q, k, v, mask)))


@pytest.mark.parametrize(("backend", "options"), CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_the_folded_forward_is_the_same_function(backend, options, padded):
    torch.manual_seed(0)
    layer = build_attention(backend, dim=16, num_heads=2, **options).double().eval()
    assert isinstance(layer, SlicedAttentionLayer)
    x = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    assert layer.fold(3) == ("rotated" if options.get("rope") else "plain")
    mask = None
    if padded:
        mask = torch.ones(3, 11, dtype=torch.bool)
        mask[1, 7:] = False
        mask[2, :3] = bool(options.get("causal"))  # causal rows start real
        mask[2, 9:] = False
    folded = layer(x, mask)
    plain = _unfolded(layer, x, mask)
    torch.testing.assert_close(folded, plain, rtol=1e-10, atol=1e-12)
    grad = torch.randn_like(folded)
    g_folded = torch.autograd.grad(folded, [x, *layer.parameters()], grad, allow_unused=True)
    g_plain = torch.autograd.grad(plain, [x, *layer.parameters()], grad, allow_unused=True)
    for (name, _), a, b in zip([("x", x), *layer.named_parameters()], g_folded, g_plain, strict=True):
        if b is None:
            assert a is None or not a.abs().any(), name
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_rope_layers_fold_only_batches_larger_than_the_first_map(monkeypatch):
    """With RoPE the folded map is a (T, out, dim) table: worth it only when B > out."""
    import attnlab.attention.sliced_common.layer as layers

    layer = build_attention("sliced_relu_bump", dim=16, num_heads=2, rope=True).double()
    real = layers.fold_rotated_scores
    calls = []
    monkeypatch.setattr(layers, "fold_rotated_scores", lambda *a: (calls.append(1), real(*a))[1])
    for batch, folds in ((2, False), (3, True)):
        x = torch.randn(batch, 9, 16, dtype=torch.float64)
        calls.clear()
        torch.testing.assert_close(layer(x), _unfolded(layer, x, None))
        assert bool(calls) is folds


def test_the_fold_does_fewer_multiply_adds():
    """ReLU-bump at width 64, two heads: q/k work per token 2·64·2 instead of 2·64·64 + 2·64·2."""
    from torch.utils.flop_counter import FlopCounterMode

    layer = build_attention("sliced_relu_bump", dim=64, num_heads=2).eval()
    x = torch.randn(4, 32, 64)
    counts = []
    for run in (lambda: layer(x), lambda: _unfolded(layer, x, None)):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            run()
        counts.append(counter.get_total_flops())
    tokens = 4 * 32
    saved = 2 * (2 * 64 * 64 * tokens) - 2 * (2 * 64 * 2 * 64)  # minus the fold's own products
    assert counts[1] - counts[0] == saved
