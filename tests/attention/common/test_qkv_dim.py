"""`qkv_dim`: the width of q, k and v may differ from the model width (LRA Image: 128 wide, qkv 64)."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import UnsupportedAttentionError, available_backends, build_attention

DIM, QKV, HEADS = 12, 8, 2


def make(name: str, **options):
    torch.manual_seed(0)
    if name == "performer":
        options.setdefault("redraw_interval", None)
    return build_attention(name, DIM, HEADS, qkv_dim=QKV, **options).double().eval()


@pytest.mark.parametrize("name", available_backends())
def test_projections_use_qkv_dim_and_output_keeps_model_width(name):
    layer = make(name)
    assert (layer.qkv_dim, layer.head_dim) == (QKV, QKV // HEADS)
    assert layer.qkv.weight.shape == (3 * QKV, DIM)
    assert layer.out_proj.weight.shape == (DIM, QKV)
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    mask = torch.arange(7)[None, :] < torch.tensor([[7], [4]])
    y = layer(x, key_padding_mask=mask)
    assert y.shape == x.shape and torch.isfinite(y).all()
    # padded keys still have no influence at valid positions
    x2 = x.clone()
    x2[1, 4:] = torch.randn(3, DIM, dtype=torch.float64)
    torch.testing.assert_close(layer(x2, key_padding_mask=mask)[1, :4], y[1, :4], rtol=0, atol=1e-10)
    y.sum().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", available_backends())
def test_qkv_dim_changes_the_parameter_count_as_expected(name):
    narrow, full = make(name), build_attention(name, DIM, HEADS)
    # fused q/k/v (weights + bias) and the output projection's input side shrink from DIM to QKV
    saved = 3 * (DIM - QKV) * DIM + 3 * (DIM - QKV) + DIM * (DIM - QKV)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    slicer = {"sliced_relu": (DIM + 1) * DIM - (QKV + 1) * QKV + (DIM - QKV) * HEADS}
    slicer["sliced_relu_bump"] = (DIM - QKV) * HEADS
    assert count(full) - count(narrow) == saved + slicer.get(name, 0)


@pytest.mark.parametrize("name", available_backends())
def test_default_qkv_dim_is_the_model_width(name):
    layer = build_attention(name, DIM, HEADS)
    assert layer.qkv_dim == DIM and layer.qkv.weight.shape == (3 * DIM, DIM)


def test_model_width_need_not_split_into_heads_when_qkv_dim_does():
    layer = build_attention("softmax", 10, 4, qkv_dim=8)  # 10 % 4 != 0, but 8 % 4 == 0
    assert layer(torch.randn(1, 3, 10)).shape == (1, 3, 10)


@pytest.mark.parametrize("bad", [0, -4, 7, 2.0, True])
def test_bad_qkv_dim_is_named(bad):
    with pytest.raises(ValueError, match=f"qkv_dim={bad!r}"):
        build_attention("softmax", DIM, HEADS, qkv_dim=bad)


def test_causal_linear_step_matches_forward_with_narrow_qkv():
    layer = make("linear", causal=True)
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    full = layer(x)
    state, rows = None, []
    for i in range(5):
        y, state = layer.step(x[:, i], state)
        rows.append(y)
    torch.testing.assert_close(torch.stack(rows, 1), full, rtol=1e-9, atol=1e-9)


def test_rope_uses_the_qkv_head_dim():
    layer = make("softmax", rope=True)
    assert layer.rotary.head_dim == QKV // HEADS
    with pytest.raises((ValueError, UnsupportedAttentionError), match="head_dim=3"):
        build_attention("softmax", DIM, HEADS, qkv_dim=6, rope=True)
