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
from attnlab.attention.softmax import softmax_attention

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
