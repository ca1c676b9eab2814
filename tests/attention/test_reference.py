"""The naive references against tiny cases worked out by hand (and against each other)."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import reference as ref

F64 = torch.float64


def col(*values: float) -> torch.Tensor:
    """Values as a (1, 1, T, 1) tensor: one batch, one head, D = 1."""
    return torch.tensor(values, dtype=F64).view(1, 1, -1, 1)


def scores(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64).view(1, 1, -1)


def test_softmax_equal_scores_average_values():
    q = k = torch.zeros(1, 1, 3, 2, dtype=F64)
    v = col(1.0, 2.0, 6.0)
    assert torch.allclose(ref.softmax_attention(q, k, v), torch.full((1, 1, 3, 1), 3.0, dtype=F64))
    causal = ref.softmax_attention(q, k, v, causal=True)
    assert torch.allclose(causal.flatten(), torch.tensor([1.0, 1.5, 3.0], dtype=F64))


def test_softmax_two_keys_by_hand():
    # q·k / sqrt(D) = [0, log 3] for D = 1: weights 1/4 and 3/4.
    q = col(1.0)
    k = col(0.0, float(torch.log(torch.tensor(3.0))))
    v = col(4.0, 8.0)
    assert ref.softmax_attention(q, k, v).item() == pytest.approx(0.25 * 4 + 0.75 * 8)


def test_softmax_mask_drops_keys_and_zeroes_padded_queries():
    q = k = torch.zeros(1, 1, 3, 1, dtype=F64)
    v = col(1.0, 3.0, 1000.0)
    mask = torch.tensor([[True, True, False]])
    out = ref.softmax_attention(q, k, v, key_padding_mask=mask).flatten()
    assert out.tolist() == pytest.approx([2.0, 2.0, 0.0])


def test_softmax_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=gen, dtype=F64) for _ in range(3))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    allowed = mask[:, None, None, :] & torch.ones(6, 6, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    got = ref.softmax_attention(q, k, v, key_padding_mask=mask, causal=True)
    assert torch.allclose(got[0], expected[0])
    assert torch.allclose(got[1, :, :4], expected[1, :, :4])
    assert torch.all(got[1, :, 4:] == 0)


def test_softmax_query_with_no_visible_key_is_zero_not_nan():
    # Left padding with causal: the first query sees only a padded key.
    q = k = torch.zeros(1, 1, 2, 1, dtype=F64)
    mask = torch.tensor([[False, True]])
    out = ref.softmax_attention(q, k, col(5.0, 7.0), key_padding_mask=mask, causal=True)
    assert out.flatten().tolist() == [0.0, 7.0]


def test_linear_attention_by_hand():
    # q = k = 0 → φ = elu(0) + 1 = 1: uniform weights, o_i = Σ v / (T + eps) or the causal prefix.
    q = k = torch.zeros(1, 1, 3, 2, dtype=F64)
    v = col(1.0, 2.0, 6.0)
    out = ref.linear_attention(q, k, v, eps=0.0).flatten()
    assert out.tolist() == pytest.approx([3.0, 3.0, 3.0])
    causal = ref.linear_attention(q, k, v, causal=True, eps=0.0).flatten()
    assert causal.tolist() == pytest.approx([1.0, 1.5, 3.0])
    # With D = 2, φ(q_i)·φ(k_j) = 2: o = 2·9 / (2·3 + eps).
    with_eps = ref.linear_attention(q, k, v, eps=1.0).flatten()
    assert with_eps.tolist() == pytest.approx([18.0 / 7] * 3)


def test_linear_attention_feature_map_and_mask():
    # q = 0 → φ(q) = 1; k = [0, -1] → φ(k) = [1, e^-1]; the third key is padded.
    q = torch.zeros(1, 1, 3, 1, dtype=F64)
    k = col(0.0, -1.0, 50.0)
    v = col(2.0, 4.0, 1e6)
    mask = torch.tensor([[True, True, False]])
    e = torch.exp(torch.tensor(-1.0, dtype=F64)).item()
    expected = (2.0 + e * 4.0) / (1.0 + e)
    out = ref.linear_attention(q, k, v, key_padding_mask=mask, eps=0.0).flatten()
    assert out[:2].tolist() == pytest.approx([expected, expected])
    assert out[2].item() == 0.0


def test_sliced_relu_by_hand():
    # vbar = 2, w = [-1, 1].  i=0 (s=1): num = 2·ReLU(1)·(-1) = -2, den = |1| + |0| = 1 → -2.
    # i=1 (s=0): no key below, num = 0, den = 0 + 1 → 0.
    out = ref.sliced_relu_attention(scores(1.0, 0.0), scores(0.0, 1.0), col(1.0, 3.0))
    assert out.flatten().tolist() == pytest.approx([-2.0, 0.0])


def test_sliced_relu_three_keys_by_hand():
    # t = [0, 1, 2], v = [0, 3, 9]: vbar = 4, w = [-4, -1, 5].  s = 1.5:
    # num = 2 (1.5·(-4) + 0.5·(-1)) = -13, den = 1.5 + 0.5 + 0.5 = 2.5 → -5.2.
    out = ref.sliced_relu_attention(scores(1.5, 1.5, 1.5), scores(0.0, 1.0, 2.0), col(0.0, 3.0, 9.0))
    assert out.flatten().tolist() == pytest.approx([-5.2] * 3)


def test_sliced_relu_eps_floor_when_all_scores_tie():
    out = ref.sliced_relu_attention(scores(0.5, 0.5), scores(0.5, 0.5), col(1.0, 3.0), eps=1e-4)
    assert out.flatten().tolist() == [0.0, 0.0]


def test_sliced_relu_mask_by_hand():
    # The padded key (huge score and value) must not enter the mean, the sums or the normaliser.
    mask = torch.tensor([[True, True, False]])
    out = ref.sliced_relu_attention(
        scores(1.0, 0.0, 3.0), scores(0.0, 1.0, 1e6), col(1.0, 3.0, 1e6), key_padding_mask=mask
    )
    assert out.flatten().tolist() == pytest.approx([-2.0, 0.0, 0.0])


def test_bump_by_hand():
    # b = 1, n = 2: o_0 = (hat(0)·2 + hat(-1)·4) / 2 = 1; o_1 = (0.5·2 + 0.5·4) / 2 = 1.5.
    out = ref.sliced_relu_bump_attention(
        scores(0.0, 0.5), scores(0.0, 1.0), col(2.0, 4.0), torch.tensor([1.0], dtype=F64)
    )
    assert out.flatten().tolist() == pytest.approx([1.0, 1.5])


def test_bump_mask_divides_by_real_count():
    mask = torch.tensor([[True, False, True]])
    out = ref.sliced_relu_bump_attention(
        scores(0.0, 7.0, 2.0),
        scores(0.0, 0.0, 10.0),
        col(2.0, 1e6, 4.0),
        torch.tensor([3.0], dtype=F64),
        key_padding_mask=mask,
    )
    # Real keys: t = 0 (v = 2) and t = 10 (v = 4); n = 2.  s = 0: hat(0)·2 / 2 = 1;
    # s = 2: hat(2) = 1/3 → (2/3) / 2.
    assert out.flatten().tolist() == pytest.approx([1.0, 0.0, 1.0 / 3])


def test_bump_bandwidth_per_head():
    s = torch.zeros(1, 2, 1, dtype=F64)
    t = torch.ones(1, 2, 1, dtype=F64)
    v = torch.ones(1, 2, 1, 1, dtype=F64)
    out = ref.sliced_relu_bump_attention(s, t, v, torch.tensor([2.0, 4.0], dtype=F64))
    assert out.flatten().tolist() == pytest.approx([0.5, 0.75])


@pytest.mark.parametrize("with_mask", [False, True])
def test_concat_formulation_matches_naive(with_mask):
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 3, 9, generator=gen, dtype=F64), torch.randn(2, 3, 9, generator=gen, dtype=F64)
    v = torch.randn(2, 3, 9, 4, generator=gen, dtype=F64)
    mask = torch.tensor([[True] * 9, [True] * 5 + [False] * 4]) if with_mask else None
    inputs = [x.clone().requires_grad_() for x in (s, t, v)]
    naive_inputs = [x.clone().requires_grad_() for x in (s, t, v)]
    got = ref.sliced_relu_attention_concat(*inputs, key_padding_mask=mask)
    expected = ref.sliced_relu_attention(*naive_inputs, key_padding_mask=mask)
    assert torch.allclose(got, expected, atol=1e-12)
    grad = torch.randn_like(got)
    for a, b in zip(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, naive_inputs, grad), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-10)
