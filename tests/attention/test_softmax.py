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
