"""softmax_attention (SDPA) against the naive float64 reference: outputs, gradients, padding."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import reference
from attnlab.attention.ops import softmax_attention

SHAPES = [(2, 3, 5, 4), (1, 1, 1, 1), (2, 2, 7, 1), (3, 2, 9, 3)]


def lengths_mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def random_qkv(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def masks_for(b: int, t: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(1)
    right = lengths_mask([max(1, t - i * 2) for i in range(b)], t)
    scattered = torch.rand(b, t, generator=g) > 0.4
    scattered[:, 0] = True
    return [None, right, scattered]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_outputs_and_gradients(shape, causal):
    b, _, t, _ = shape
    for mask in masks_for(b, t):
        q, k, v = random_qkv(shape)
        weight = torch.randn(shape, dtype=torch.float64)
        out = softmax_attention(q, k, v, mask, causal=causal)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        ref = reference.softmax_attention(q, k, v, mask, causal=causal)
        ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
        assert (out - ref).abs().max() <= 1e-9
        for g, rg in zip(grads, ref_grads, strict=True):
            assert (g - rg).abs().max() <= 1e-7


@pytest.mark.parametrize("causal", [False, True])
def test_valid_positions_equal_each_sequence_alone(causal):
    lengths, t = [6, 3, 1], 6
    q, k, v = (x.detach() for x in random_qkv((3, 2, t, 4)))
    mask = lengths_mask(lengths, t)
    garbage = ~mask[:, None, :, None]
    q, k, v = (x.masked_fill(garbage, 1e3) for x in (q, k, v))  # padded slots hold huge values
    out = softmax_attention(q, k, v, mask, causal=causal)
    for i, n in enumerate(lengths):
        alone = softmax_attention(
            q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n], causal=causal
        )
        torch.testing.assert_close(out[i : i + 1, :, :n], alone, rtol=0, atol=1e-12)
        assert torch.all(out[i, :, n:] == 0)


def test_rows_without_any_key_are_zero_not_nan():
    q, k, v = random_qkv((2, 2, 5, 3))
    mask = torch.tensor([[False] * 5, [False, False, True, True, True]])  # empty and left-padded
    for causal in (False, True):
        out = softmax_attention(q, k, v, mask, causal=causal)
        assert torch.isfinite(out).all()
        assert torch.all(out[0] == 0) and torch.all(out[1, :, :2] == 0)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


def test_causal_output_ignores_future_tokens():
    q, k, v = (x.detach() for x in random_qkv((1, 2, 8, 4)))
    out = softmax_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5:] += 3.0
    v2[:, :, 5:] -= 2.0
    torch.testing.assert_close(softmax_attention(q, k2, v2, causal=True)[:, :, :5], out[:, :, :5])


def test_float32_fast_path_and_dropout():
    q, k, v = (x.detach() for x in random_qkv((2, 4, 16, 8), dtype=torch.float32))
    ref = reference.softmax_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(softmax_attention(q, k, v), ref.float(), rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    dropped = softmax_attention(q, k, v, dropout_p=0.5)
    assert not torch.allclose(dropped, ref.float(), atol=1e-3)


def test_bad_inputs_name_expected_shapes():
    q, k, v = (x.detach() for x in random_qkv((2, 2, 5, 3)))
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        softmax_attention(q[0], k, v)
    with pytest.raises(ValueError, match="key_padding_mask must be a bool"):
        softmax_attention(q, k, v, torch.ones(2, 5))
    with pytest.raises(ValueError, match="key_padding_mask"):
        softmax_attention(q, k, v, torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize(
    ("where", "causal"), [("q", False), ("q", True), ("k", False), ("k", True), ("v", False)]
)
@pytest.mark.parametrize("masked", [False, True])
def test_non_finite_inputs_give_the_references_nan_pattern(where, masked, causal):
    """SDPA's fused kernels dropped a NaN in q (0 non-finite outputs against the reference's 4) and,
    with a mask and causal, spread a NaN key to the queries before it."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 7, 4, generator=gen) for _ in range(3))
    mask = torch.ones(2, 7, dtype=torch.bool)
    if masked:
        mask[1, 5:] = False
    x = {"q": q, "k": k, "v": v}
    x[where] = x[where].clone()
    x[where][1, 0, 3, 1] = float("nan")
    x[where][0, 1, 2, 0] = float("nan")
    key_mask = mask if masked else None
    got = softmax_attention(x["q"], x["k"], x["v"], key_mask, causal)
    expected = reference.softmax_attention(
        x["q"].double(), x["k"].double(), x["v"].double(), key_mask, causal
    )
    assert (~torch.isfinite(got)).any()
    assert torch.equal(torch.isnan(got), ~torch.isfinite(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite].double(), expected[finite], atol=1e-5, rtol=1e-5)


def test_a_padded_key_holding_nan_changes_nothing():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=gen) for _ in range(3))
    mask = torch.tensor([[True] * 4 + [False] * 2])
    clean = softmax_attention(q, k, v, mask)
    k, v = k.clone(), v.clone()
    k[0, :, 5], v[0, :, 4] = float("nan"), float("nan")
    assert torch.equal(softmax_attention(q, k, v, mask), clean)


def test_a_nan_value_reaches_no_query_before_it_when_causal():
    """The reference's ``probs @ v`` spreads a future key's NaN value through its zero weight; a
    causal query must not see the future at all."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=gen) for _ in range(3))
    clean = softmax_attention(q, k, v, causal=True)
    v = v.clone()
    v[0, 1, 3, 2] = float("nan")
    got = softmax_attention(q, k, v, causal=True)
    assert torch.equal(got[:, :, :3], clean[:, :, :3]) and torch.equal(got[:, 0], clean[:, 0])
    assert torch.isnan(got[0, 1, 3:, 2]).all() and not torch.isnan(got[0, 1, 3:, [0, 1, 3]]).any()
