"""Causal attention layers: no backend's layer sees the future, sliced layers' padding and decoding
steps, prefix standardisation, and the ReLU-bump's two normalisers (count against mass)."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import available_backends, backend_capabilities, build_attention
from attnlab.attention.ops import sliced_relu_bump_attention
from attnlab.attention.sliced_common.scores import standardise_scores_prefix
from attnlab.attention.sliced_relu.layer import SlicedReLUAttention
from attnlab.attention.sliced_relu_bump.decoding import sliced_relu_bump_attention_step

F64 = torch.float64


# ---- layers -----------------------------------------------------------------------------------

DIM, HEADS = 12, 3
CAUSAL_BACKENDS = [name for name in available_backends() if backend_capabilities(name).causal]


def causal_layer(name, **options):
    torch.manual_seed(0)
    if name == "performer":
        options.setdefault("redraw_interval", None)  # a fixed projection: the property must hold exactly
    return build_attention(name, DIM, HEADS, causal=True, **options).double().eval()


def test_every_backend_has_a_causal_form():
    assert available_backends() == CAUSAL_BACKENDS
    assert {"softmax", "linear", "performer", "sliced_relu", "sliced_relu_bump"} <= set(CAUSAL_BACKENDS)


@pytest.mark.parametrize("name", CAUSAL_BACKENDS)
@pytest.mark.parametrize("rope", [False, True])
def test_causal_layers_never_see_the_future(name, rope):
    layer = causal_layer(name, rope=rope)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, DIM, generator=gen, dtype=F64)
    out = layer(x)
    for cut in (0, 1, 17, 38):
        y = x.clone()
        y[:, cut + 1 :] = 10 * torch.randn(2, 39 - cut, DIM, generator=gen, dtype=F64)
        changed = layer(y)
        torch.testing.assert_close(changed[:, : cut + 1], out[:, : cut + 1], rtol=0, atol=1e-12)
        # and the tokens changed do reach the later outputs (a layer that ignored its input would pass)
        assert not torch.allclose(changed[:, cut + 1 :], out[:, cut + 1 :]), cut


@pytest.mark.parametrize(
    "name,options",
    [("sliced_relu", {}), ("sliced_relu_bump", {}), ("sliced_relu_bump", {"normaliser": "mass"})],
)
def test_causal_layer_padding_is_invisible(name, options):
    layer = causal_layer(name, **options)
    x = torch.randn(3, 9, DIM, dtype=F64)
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [5], [1]])
    out = layer(x.masked_fill(~mask[..., None], 100.0), key_padding_mask=mask)
    for i, n in enumerate([9, 5, 1]):
        torch.testing.assert_close(out[i : i + 1, :n], layer(x[i : i + 1, :n]), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "name,options",
    [
        ("sliced_relu", {}),
        ("sliced_relu", {"standardise": "none", "projection": "linear"}),
        ("sliced_relu", {"rope": True}),
        ("sliced_relu_bump", {}),
        ("sliced_relu_bump", {"rope": True}),
        ("sliced_relu_bump", {"normaliser": "mass"}),
    ],
)
def test_layer_step_matches_causal_forward(name, options, cpu_code):
    layer = causal_layer(name, **options)
    x = torch.randn(2, 37, DIM, dtype=F64)
    full = layer(x)
    state, outs = None, []
    with torch.no_grad():  # as generation runs (with gradients the steps run the torch code)
        for i in range(x.shape[1]):
            y, state = layer.step(x[:, i], state)
            outs.append(y)
    torch.testing.assert_close(torch.stack(outs, dim=1), full, rtol=0, atol=1e-10)
    assert state.position == 37 and state.op.count == 37
    with pytest.raises(ValueError, match="causal=True"):
        build_attention(name, DIM, HEADS).step(x[:, 0].float())
    with pytest.raises(ValueError, match=r"\(B, dim=12\)"):
        layer.step(x[:, :2])


def test_prefix_standardisation_uses_running_statistics_only():
    s = torch.randn(2, 3, 9, dtype=F64) * 4 + 7
    t = torch.randn(2, 3, 9, dtype=F64) * 2 - 1
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [6]])
    s2, t2 = standardise_scores_prefix(s, t, mask)
    for b, n in enumerate([9, 6]):
        for i in range(n):
            pooled = torch.cat([s[b, :, : i + 1], t[b, :, : i + 1]], dim=-1)
            mean, var = pooled.mean(-1), pooled.var(-1, unbiased=False)
            std = torch.sqrt(var + 1e-6)
            torch.testing.assert_close(s2[b, :, i], (s[b, :, i] - mean) / std, rtol=0, atol=1e-9)
            torch.testing.assert_close(t2[b, :, i], (t[b, :, i] - mean) / std, rtol=0, atol=1e-9)


def test_standardise_option_is_checked():
    assert SlicedReLUAttention(DIM, HEADS).standardise == "sequence"
    assert SlicedReLUAttention(DIM, HEADS, causal=True).standardise == "prefix"
    with pytest.raises(ValueError, match='standardise="sequence" reads .* future tokens'):
        build_attention("sliced_relu", DIM, HEADS, causal=True, standardise="sequence")
    with pytest.raises(ValueError, match="standardise must be one of auto, sequence, prefix, none; got 'z'"):
        build_attention("sliced_relu", DIM, HEADS, standardise="z")


# ---- the bump's normalisers ----------------------------------------------------------------------


def previous_token_lookup(length=48, dim=3):
    """Scores where query i sits exactly on key i − 1 and every other key lies outside the hat (b = 1):
    each output should be a copy of the previous token's value."""
    s = (2.0 * torch.arange(length, dtype=F64) - 2.0)[None, None, :]  # s_i = t_{i-1}
    t = (2.0 * torch.arange(length, dtype=F64))[None, None, :]  # keys 2 apart: one inside the window
    v = torch.randn(1, 1, length, dim, generator=torch.Generator().manual_seed(4), dtype=F64)
    return s, t, v, torch.ones(1, dtype=F64)


def test_count_normaliser_shrinks_a_copy_like_one_over_position_and_mass_does_not():
    s, t, v, bandwidth = previous_token_lookup()
    count = sliced_relu_bump_attention(s, t, v, bandwidth, causal=True)
    mass = sliced_relu_bump_attention(s, t, v, bandwidth, causal=True, normaliser="mass", mass_eps=1e-2)
    previous = v[:, :, :-1]
    positions = torch.arange(2, 49, dtype=F64)[None, None, :, None]  # n_i = i + 1 keys at query i >= 1
    torch.testing.assert_close(count[:, :, 1:], previous / positions, rtol=0, atol=1e-12)
    torch.testing.assert_close(mass[:, :, 1:], previous / 1.01, rtol=0, atol=1e-12)
    assert torch.all(mass[:, :, 0] == 0)  # nothing in the first query's window


def test_normaliser_options_are_checked():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(1, 2, 5, generator=gen, dtype=F64), torch.randn(1, 2, 5, generator=gen, dtype=F64)
    v, bandwidth = torch.randn(1, 2, 5, 3, generator=gen, dtype=F64), torch.ones(2, dtype=F64)
    with pytest.raises(ValueError, match="normaliser must be one of 'count', 'mass', got 'sum'"):
        sliced_relu_bump_attention(s, t, v, bandwidth, causal=True, normaliser="sum")
    with pytest.raises(ValueError, match="normaliser='mass' is implemented for causal=True only"):
        sliced_relu_bump_attention(s, t, v, bandwidth, normaliser="mass")
    with pytest.raises(ValueError, match="mass_eps must be a finite number > 0, got 0"):
        sliced_relu_bump_attention(s, t, v, bandwidth, causal=True, normaliser="mass", mass_eps=0)
    with pytest.raises(ValueError, match="normaliser='mass' is implemented for causal=True only"):
        build_attention("sliced_relu_bump", DIM, HEADS, normaliser="mass")
    with pytest.raises(ValueError, match="normaliser must be one of"):
        sliced_relu_bump_attention_step(s[..., 0], t[..., 0], v[..., 0, :], bandwidth, normaliser="n")
