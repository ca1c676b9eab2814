"""Performer / FAVOR+: feature properties, approximation of softmax, padding, redraw schedule."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import reference
from attnlab.attention.performer.ops import (
    PerformerFeatureMap,
    favor_features,
    orthogonal_gaussian_projection,
    performer_attention,
)


def lengths_mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def small_qkv(shape, seed=0, scale=0.5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(*shape, generator=g, dtype=dtype) for _ in range(3)]


def test_projection_blocks_are_orthogonal():
    d, m = 8, 20
    w = orthogonal_gaussian_projection(m, d, torch.Generator().manual_seed(0))
    assert w.shape == (m, d)
    directions = w / w.norm(dim=1, keepdim=True)
    for start in range(0, m, d):
        block = directions[start : start + d]
        torch.testing.assert_close(
            block @ block.T, torch.eye(block.shape[0], dtype=w.dtype), atol=1e-12, rtol=0
        )


def test_features_estimate_the_softmax_kernel():
    d, m = 4, 20000
    g = torch.Generator().manual_seed(0)
    q, k = 0.5 * torch.randn(2, 1, 1, 3, d, generator=g, dtype=torch.float64)
    w = orthogonal_gaussian_projection(m, d, g)
    # No stabiliser shift for a single query/key pair, so the product estimates exp(q·k/√d) itself.
    phi_q = favor_features(q, w, is_query=False, stabilizer_eps=0.0)
    phi_k = favor_features(k, w, is_query=False, stabilizer_eps=0.0)
    shift_q = (torch.einsum("bhtd,md->bhtm", q * d**-0.25, w)).amax(dim=(-1, -2), keepdim=True)
    shift_k = (torch.einsum("bhtd,md->bhtm", k * d**-0.25, w)).amax(dim=(-1, -2), keepdim=True)
    estimate = (phi_q * phi_k).sum(-1) * torch.exp(shift_q + shift_k)[..., 0]
    exact = torch.exp((q * k).sum(-1) / d**0.5)
    torch.testing.assert_close(estimate, exact, rtol=0.05, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_approximates_softmax_attention_and_improves_with_more_features(causal):
    q, k, v = small_qkv((2, 2, 12, 8))
    exact = reference.softmax_attention(q, k, v, causal=causal)
    errors = []
    for m in (16, 4096):
        w = orthogonal_gaussian_projection(m, 8, torch.Generator().manual_seed(3))
        out = performer_attention(q, k, v, w, causal=causal, chunk_size=5)
        errors.append(((out - exact).norm() / exact.norm()).item())
    assert errors[1] < 0.05, errors
    assert errors[1] < errors[0], errors


@pytest.mark.parametrize("causal", [False, True])
def test_padding_is_invisible_and_gradients_flow(causal):
    lengths, t = [7, 3], 7
    q, k, v = small_qkv((2, 2, t, 4))
    mask = lengths_mask(lengths, t)
    garbage = ~mask[:, None, :, None]
    q, k, v = (x.masked_fill(garbage, 30.0).requires_grad_() for x in (q, k, v))
    w = orthogonal_gaussian_projection(64, 4, torch.Generator().manual_seed(0))
    out = performer_attention(q, k, v, w, mask, causal=causal, chunk_size=3)
    for i, n in enumerate(lengths):
        sl = (slice(i, i + 1), slice(None), slice(0, n))
        alone = performer_attention(q[sl], k[sl], v[sl], w, causal=causal)
        torch.testing.assert_close(out[sl], alone, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_half_precision_input_keeps_dtype():
    q, k, v = small_qkv((1, 2, 10, 8), dtype=torch.float32)
    w = orthogonal_gaussian_projection(32, 8, torch.Generator().manual_seed(0)).float()
    out32 = performer_attention(q, k, v, w)
    out16 = performer_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), w)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, rtol=0.05, atol=0.05)


def test_feature_map_redraws_on_schedule_and_is_seeded():
    fmap = PerformerFeatureMap(head_dim=4, num_features=8, redraw_interval=3, seed=7)
    seen = [fmap().clone() for _ in range(7)]  # training mode by default
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:], strict=False)]
    assert changed == [False, False, True, False, False, True]  # new draws at calls 4 and 7
    assert fmap.draws == 2 and fmap.calls == 7

    fmap.eval()
    frozen = fmap().clone()
    for _ in range(5):
        assert torch.equal(fmap(), frozen)  # evaluation never redraws nor counts
    assert fmap.calls == 7

    twin = PerformerFeatureMap(head_dim=4, num_features=8, redraw_interval=3, seed=7)
    assert torch.equal(twin(), seen[0])
    other = PerformerFeatureMap(head_dim=4, num_features=8, redraw_interval=3, seed=8)
    assert not torch.equal(other(), seen[0])

    resumed = PerformerFeatureMap(head_dim=4, num_features=8, redraw_interval=3, seed=0)
    resumed.load_state_dict(fmap.state_dict())
    assert resumed.calls == 7 and resumed.draws == 2 and torch.equal(resumed.projection, frozen)
    fmap.train()
    resumed.train()
    for _ in range(4):
        assert torch.equal(resumed(), fmap())


def test_feature_map_without_redraw_and_seed_from_global_rng():
    fmap = PerformerFeatureMap(head_dim=4, num_features=8, redraw_interval=None)
    first = fmap().clone()
    for _ in range(10):
        assert torch.equal(fmap(), first)
    torch.manual_seed(123)
    a = PerformerFeatureMap(head_dim=4, num_features=8)
    torch.manual_seed(123)
    b = PerformerFeatureMap(head_dim=4, num_features=8)
    assert a.seed == b.seed and torch.equal(a.projection, b.projection)
    with pytest.raises(ValueError, match="redraw_interval"):
        PerformerFeatureMap(head_dim=4, num_features=8, redraw_interval=-1)


def test_causal_output_is_the_non_causal_output_of_the_prefix():
    """Position i sees exactly what a non-causal layer sees on tokens 0..i, key stabiliser included."""
    t = 11
    q, k, v = small_qkv((2, 2, t, 4), scale=1.5)
    w = orthogonal_gaussian_projection(32, 4, torch.Generator().manual_seed(0))
    mask = lengths_mask([11, 8], t)
    causal = performer_attention(q, k, v, w, mask, causal=True, chunk_size=3)
    for i in range(t):
        cut = slice(0, i + 1)
        prefix = performer_attention(q[:, :, cut], k[:, :, cut], v[:, :, cut], w, mask[:, cut])
        torch.testing.assert_close(causal[:, :, i], prefix[:, :, i], rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_causal_future_keys_do_not_move_the_past(chunk_size):
    """Future keys with the largest logits used to move the shared key stabiliser (up to 1.5)."""
    t, cut = 12, 7
    q, k, v = small_qkv((1, 2, t, 4))
    w = orthogonal_gaussian_projection(16, 4, torch.Generator().manual_seed(1))
    before = performer_attention(q, k, v, w, causal=True, chunk_size=chunk_size)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, cut:] = 4.0 * w[0] / w[0].norm() * 4**0.25 * 3  # aligned with a feature: huge logits
    v2[:, :, cut:] = 100.0
    after = performer_attention(q, k2, v2, w, causal=True, chunk_size=chunk_size)
    torch.testing.assert_close(after[:, :, :cut], before[:, :, :cut], rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_are_the_gradients_of_the_forward(causal):
    q, k, v = small_qkv((1, 2, 6, 3), scale=1.0)
    w = orthogonal_gaussian_projection(8, 3, torch.Generator().manual_seed(2))
    mask = torch.tensor([[True] * 5 + [False]])
    inputs = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: performer_attention(a, b, c, w, mask, causal=causal, chunk_size=4), inputs
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_the_op_is_exactly_the_estimator_it_documents(causal, padded):
    """Exact, not "within 5 % of softmax": the same random features give the same output, and the
    gradients are those of the written-out estimator (chunked causal form across several chunks)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, 2, 11, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    w = orthogonal_gaussian_projection(6, 4, torch.Generator().manual_seed(4))
    mask = lengths_mask([11, 7], 11) if padded else None
    got = performer_attention(q, k, v, w, mask, causal=causal, chunk_size=4)
    want = reference.performer_attention(q, k, v, w, mask, causal=causal)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(got, (q, k, v), grad)
    theirs = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_features_are_the_documented_map():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64)
    w = orthogonal_gaussian_projection(7, 4, torch.Generator().manual_seed(6))
    xs = x[0, 0] * 4**-0.25
    logits = xs @ w.T
    want_q = (
        torch.exp(logits - (xs * xs).sum(-1, keepdim=True) / 2 - logits.amax(-1, keepdim=True)) + 1e-4
    ) / 7**0.5
    want_k = (torch.exp(logits - (xs * xs).sum(-1, keepdim=True) / 2 - logits.max()) + 1e-4) / 7**0.5
    torch.testing.assert_close(favor_features(x, w, is_query=True)[0, 0], want_q, rtol=1e-12, atol=0)
    torch.testing.assert_close(favor_features(x, w, is_query=False)[0, 0], want_k, rtol=1e-12, atol=0)
