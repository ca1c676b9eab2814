"""``padded_queries="lra"``: softmax computes the official LRA encoder's function for padded queries.

LRA (lra_benchmarks/models/transformer, flax's attention) gives a (query, key) pair a −1e10 bias when
either is padding; in float32 a padded query's logits round to exactly −1e10, so its weights are
uniform over all T positions, and JAX back-propagates the softmax's Jacobian at that point. The
reference below is that rule written out directly (the rounding made explicit), in float64.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.attention.softmax.ops import softmax_attention

F64 = torch.float64
# black pixels anywhere, as in an image: a real sequence, one with gaps, one almost all padding
MASK = torch.tensor(
    [[True] * 9, [True, False, True, True, False, False, True, True, False], [False] * 8 + [True]]
)


def lra_attention(q, k, v, mask):
    """flax's dot_product_attention with LRA's mask: bias −1e10 where query or key is padding; the
    biased logits of those pairs rounded to float32 as LRA computes them (|score| < 512 vanishes)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    pair = mask[:, None, :, None] & mask[:, None, None, :]
    biased = scores - 1e10
    rounded = biased + (biased.float().to(F64) - biased).detach()  # float32's value, d/dscore = 1 (JAX's)
    logits = torch.where(pair, scores, rounded)
    return logits.softmax(dim=-1) @ v


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 2, 9, 4, generator=gen, dtype=F64, requires_grad=True) for _ in range(3)]


def test_outputs_and_gradients_are_lras():
    q, k, v = inputs()
    got, want = softmax_attention(q, k, v, MASK, padded_queries="lra"), lra_attention(q, k, v, MASK)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    padded = ~MASK[:, None, :].expand(-1, 2, -1)
    torch.testing.assert_close(got[padded], v.mean(dim=2, keepdim=True).expand_as(v)[padded])  # v̄ of all T
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    for mine, theirs in zip(
        torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-11)


def test_padded_rows_still_back_propagate_into_q_and_k():
    """As in JAX: the rows are uniform, but their gradient is not zero (attend/zero give other ones)."""
    q, k, v = inputs(2)
    only_padded = torch.zeros(3, 2, 9, 4, dtype=F64)
    only_padded[~MASK[:, None, :].expand(-1, 2, -1)] = 1.0
    dq, dk = torch.autograd.grad(softmax_attention(q, k, v, MASK, padded_queries="lra"), (q, k), only_padded)
    assert dq[~MASK[:, None, :].expand(-1, 2, -1)].abs().sum() > 0 and dk.abs().sum() > 0


def test_lra_is_softmaxs_alone_and_bidirectional():
    with pytest.raises(ValueError, match=r"'sliced_relu'.*got 'lra' \('lra' is softmax's alone\)"):
        build_attention("sliced_relu", 16, 2, padded_queries="lra")
    with pytest.raises(ValueError, match="padded_queries='lra' is for bidirectional"):
        build_attention("softmax", 16, 2, causal=True, padded_queries="lra")
    layer = build_attention("softmax", 16, 2, padded_queries="lra").double().eval()
    x = torch.randn(3, 9, 16, dtype=F64)
    assert torch.isfinite(layer(x, key_padding_mask=MASK)).all()


def legacy_flax_softmax(x):
    """``flax.nn.softmax`` of the leaderboard-era LRA code (``from flax import nn``, before 2022-04):
    ``exp(x − logsumexp(x))``, logsumexp as jax.scipy's, max + log Σ exp(x − max) (its max carries no
    gradient: the max's own terms cancel, 1 − Σ softmax = 0, with or without JAX's stop_gradient)."""
    top = x.amax(dim=-1, keepdim=True).detach()
    return torch.exp(x - (top + torch.log(torch.exp(x - top).sum(dim=-1, keepdim=True))))


def lra2020_attention(q, k, v, mask):
    """Legacy flax's dot_product_attention under LRA's mask, in float32 as LRA runs it: the −1e10 bias
    added to the logits of every pair with a padded side, then `legacy_flax_softmax`."""
    assert q.dtype == torch.float32
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    pair = mask[:, None, :, None] & mask[:, None, None, :]
    logits = scores + torch.where(pair, 0.0, -1e10)  # float32 rounds −1e10 + score to −1e10
    return legacy_flax_softmax(logits) @ v


def test_lra2020_is_legacy_flaxs_softmax_in_float32():
    """Every weight of a padded row is exactly 1 in float32: the row is the sum of V, and the outputs
    and gradients of ``padded_queries="lra2020"`` are those of legacy flax's rule."""
    q, k, v = (x.detach().float().requires_grad_(True) for x in inputs(3))
    logits = torch.full((9,), -1e10) + torch.randn(9)  # a padded query's row
    assert torch.equal(legacy_flax_softmax(logits), torch.ones(9))
    got, want = softmax_attention(q, k, v, MASK, padded_queries="lra2020"), lra2020_attention(q, k, v, MASK)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    padded = ~MASK[:, None, :].expand(-1, 2, -1)
    torch.testing.assert_close(got[padded], v.sum(dim=2, keepdim=True).expand_as(v)[padded])  # Σ V, all T
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    for name, mine, theirs in zip(
        "qkv",
        torch.autograd.grad(got, (q, k, v), grad),
        torch.autograd.grad(want, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5, msg=name)


def test_lra2020_is_t_times_lra_on_padded_rows_value_and_gradient():
    q, k, v = inputs(5)
    only_padded = torch.zeros(3, 2, 9, 4, dtype=F64)
    padded = ~MASK[:, None, :].expand(-1, 2, -1)
    only_padded[padded] = torch.randn(int(padded.sum()), 4, dtype=F64)
    new = softmax_attention(q, k, v, MASK, padded_queries="lra2020")
    old = softmax_attention(q, k, v, MASK, padded_queries="lra")
    torch.testing.assert_close(new[padded], 9 * old[padded], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new[~padded], old[~padded], rtol=0, atol=0)  # real rows: the same softmax
    for a, b in zip(
        torch.autograd.grad(new, (q, k, v), only_padded),
        torch.autograd.grad(old, (q, k, v), only_padded),
        strict=True,
    ):
        torch.testing.assert_close(a, 9 * b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"got 'lra2020' \('lra2020' is softmax's alone\)"):
        build_attention("linear", 16, 2, padded_queries="lra2020")
    with pytest.raises(ValueError, match="padded_queries='lra2020' is for bidirectional"):
        build_attention("softmax", 16, 2, causal=True, padded_queries="lra2020")
