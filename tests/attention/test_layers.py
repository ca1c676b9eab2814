"""Attention layers of every backend: equivariance, padding, training, Π construction, RoPE, decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.attention import available_backends, backend_capabilities, build_attention
from attnlab.attention.common.rope import RotaryEmbedding
from attnlab.attention.linear.layer import LinearAttention
from attnlab.attention.sliced_common.scores import slice_tokens, standardise_scores
from attnlab.attention.sliced_relu.layer import SlicedReLUAttention
from attnlab.attention.sliced_relu_bump.layer import SlicedReLUBumpAttention

DIM, HEADS = 12, 3


def make_layer(name: str, dtype=torch.float64, **options) -> nn.Module:
    torch.manual_seed(0)
    if name == "performer":
        options.setdefault("redraw_interval", None)  # a fixed projection: the properties must hold exactly
    return build_attention(name, DIM, HEADS, **options).to(dtype).eval()


def lengths_mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("name", available_backends())
def test_permutation_equivariant(name):
    layer = make_layer(name)
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    perm = torch.randperm(9)
    torch.testing.assert_close(layer(x[:, perm]), layer(x)[:, perm], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", available_backends())
def test_padding_invariant(name):
    layer = make_layer(name)
    lengths, t = [8, 5, 1], 8
    x = torch.randn(3, t, DIM, dtype=torch.float64)
    mask = lengths_mask(lengths, t)
    x = x.masked_fill(~mask[..., None], 100.0)  # padded slots hold garbage
    out = layer(x, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out[i : i + 1, :n], layer(x[i : i + 1, :n]), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", available_backends())
@pytest.mark.parametrize("rope", [False, True])
def test_trains_one_step_in_a_tiny_model(name, rope):
    torch.manual_seed(0)
    embed = nn.Embedding(10, DIM)
    attn = build_attention(name, DIM, HEADS, rope=rope, dropout=0.1)
    head = nn.Linear(DIM, 2)
    params = [*embed.parameters(), *attn.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    tokens = torch.randint(0, 10, (4, 7))
    mask = lengths_mask([7, 6, 4, 2], 7)
    labels = torch.tensor([0, 1, 0, 1])

    def loss_fn():
        h = attn(embed(tokens), key_padding_mask=mask)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return nn.functional.cross_entropy(head(pooled), labels)

    attn.eval()  # dropout off for a clean before/after comparison
    before = loss_fn()
    attn.train()
    opt.zero_grad()
    loss_fn().backward()
    for pname, p in attn.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, f"{name}: zero gradient for {pname}"
    opt.step()
    attn.eval()
    assert loss_fn() < before


@pytest.mark.parametrize("name", available_backends())
def test_every_declared_dtype_runs(name):
    for dtype in backend_capabilities(name).dtypes:
        layer = make_layer(name, dtype=dtype)
        x = torch.randn(2, 6, DIM).to(dtype)
        out = layer(x, key_padding_mask=lengths_mask([6, 3], 6))
        assert out.dtype == dtype and torch.isfinite(out).all(), dtype


@pytest.mark.parametrize("name", available_backends())
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_an_empty_batch_passes_forward_and_backward(name, causal):
    """B = 0 (a filtered batch, an empty shard) gives an empty output instead of a reshape error."""
    if causal and not backend_capabilities(name).causal:
        pytest.skip(f"{name} has no causal form")
    layer = build_attention(name, dim=DIM, num_heads=2, causal=causal, rope=True)
    x = torch.randn(0, 7, DIM, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 7, DIM) and x.grad.shape == x.shape


def test_slice_tokens_concatenates_heads_of_one_token():
    b, h, t, d = 2, 3, 5, 4
    slicer = nn.Linear(h * d, h)
    x = torch.randn(b, h, t, d, dtype=torch.float64)
    slicer = slicer.double()
    scores = slice_tokens(slicer, x)
    assert scores.shape == (b, h, t)
    for i in range(t):  # token i's score = Π(concat over heads of token i)
        by_hand = slicer(torch.cat([x[:, head, i] for head in range(h)], dim=-1))
        torch.testing.assert_close(scores[:, :, i], by_hand)
    # Changing token 2 changes only token 2's scores; permuting heads changes what Π sees.
    y = x.clone()
    y[:, :, 2] += 1.0
    changed = (slice_tokens(slicer, y) - scores).abs().amax(dim=(0, 1)) > 0
    assert changed.tolist() == [False, False, True, False, False]
    assert not torch.allclose(slice_tokens(slicer, x[:, [1, 0, 2]]), scores)


@pytest.mark.parametrize("cls", [SlicedReLUAttention, SlicedReLUBumpAttention])
def test_sliced_score_of_a_token_depends_only_on_that_token(cls):
    layer = cls(DIM, HEADS).double()
    x = torch.randn(1, 6, DIM, dtype=torch.float64, requires_grad=True)
    q, _, _ = layer.heads(x)
    s = slice_tokens(layer.slicer, q)
    for i in range(6):
        (grad,) = torch.autograd.grad(s[0, :, i].sum(), x, retain_graph=True)
        others = torch.ones(6, dtype=torch.bool)
        others[i] = False
        assert torch.all(grad[0, others] == 0) and grad[0, i].abs().sum() > 0


def test_sliced_projection_options_and_bump_parameters():
    mlp = SlicedReLUAttention(DIM, HEADS, projection="mlp")
    lin = SlicedReLUAttention(DIM, HEADS, projection="linear")
    assert [m.out_features for m in mlp.slicer if isinstance(m, nn.Linear)] == [DIM, HEADS]
    assert isinstance(mlp.slicer[1], nn.GELU)
    assert isinstance(lin.slicer, nn.Linear) and lin.slicer.out_features == HEADS
    with pytest.raises(ValueError, match="'mlp' or 'linear'"):
        SlicedReLUAttention(DIM, HEADS, projection="conv")
    bump = SlicedReLUBumpAttention(DIM, HEADS)
    assert bump.slicer.bias is None and bump.slicer.in_features == DIM and bump.slicer.out_features == HEADS
    torch.testing.assert_close(bump.bandwidth, torch.full((HEADS,), 0.6931471805599453 + 1e-4))


def test_standardised_scores_share_mean_and_std_over_valid_tokens():
    s = torch.randn(2, 3, 7, dtype=torch.float64) * 5 + 2
    t = torch.randn(2, 3, 7, dtype=torch.float64) * 3 - 1
    mask = lengths_mask([7, 4], 7)
    s2, t2 = standardise_scores(s, t, mask)
    for i, n in enumerate([7, 4]):
        pooled = torch.cat([s2[i, :, :n], t2[i, :, :n]], dim=-1)
        torch.testing.assert_close(pooled.mean(-1), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(
            pooled.var(-1, unbiased=False), torch.ones(3, dtype=torch.float64), atol=1e-6, rtol=0
        )
        # the affine map is shared: differences s - t keep their order
        raw = torch.cat([s[i, :, :n], t[i, :, :n]], dim=-1)
        torch.testing.assert_close(pooled.argsort(-1), raw.argsort(-1))


def test_rope_tables_first_built_under_inference_mode_train_afterwards():
    """A validation step under ``torch.inference_mode`` may be the first to ask for the tables (the
    sanity check, another model of the same head dim): training then reuses them, so they are normal
    tensors."""
    rope = RotaryEmbedding(6, base=321.0)  # a head dim and base no other test caches
    with torch.inference_mode():
        rope(torch.randn(1, 1, 9, 6), torch.randn(1, 1, 9, 6))
    q = torch.randn(1, 1, 9, 6, requires_grad=True)
    rotated, _ = rope(q, torch.randn(1, 1, 9, 6))
    rotated.sum().backward()
    assert q.grad is not None


def test_rope_is_relative_and_rejects_odd_head_dim():
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64).expand(1, 1, 10, 8)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64).expand(1, 1, 10, 8)
    rq, rk = rope(q, k)
    dots = rq[0, 0] @ rk[0, 0].T  # same content at every position: depends on i - j only
    for shift in range(-3, 4):
        diag = torch.diagonal(dots, offset=shift)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), atol=1e-12, rtol=0)
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :])  # position 0 is not rotated
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    shifted, _ = rope(q[:, :, 3:], k[:, :, 3:], offset=3)
    torch.testing.assert_close(shifted, rq[:, :, 3:])
    with pytest.raises(ValueError, match="even head dimension"):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match="even head dimension"):
        build_attention("softmax", 15, 3, rope=True)


@pytest.mark.parametrize("rope", [False, True])
def test_linear_layer_step_matches_causal_forward(rope):
    torch.manual_seed(0)
    layer = LinearAttention(DIM, HEADS, causal=True, rope=rope, chunk_size=4).double().eval()
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    full = layer(x)
    state, outs = None, []
    for i in range(x.shape[1]):
        y, state = layer.step(x[:, i], state)
        outs.append(y)
    torch.testing.assert_close(torch.stack(outs, dim=1), full, rtol=0, atol=1e-12)
    assert state.S.shape == (2, HEADS, DIM // HEADS, DIM // HEADS) and state.position == 11
    with pytest.raises(ValueError, match="causal=True"):
        LinearAttention(DIM, HEADS).step(x[:, 0].float())


CAUSAL_BACKENDS = [name for name in available_backends() if backend_capabilities(name).causal]


def test_every_causal_backend_is_checked_for_leaks():
    assert set(CAUSAL_BACKENDS) >= {"softmax", "linear", "performer"}


@pytest.mark.parametrize("name", CAUSAL_BACKENDS)
@pytest.mark.parametrize("scale", [1.0, 10.0])  # large future tokens dominate any shared statistic
def test_causal_layers_ignore_the_future(name, scale):
    layer = make_layer(name, causal=True, rope=True)
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    mask = lengths_mask([9, 7], 9)
    y = x.clone()
    y[:, 6:] = scale * torch.randn(2, 3, DIM, dtype=torch.float64)
    for kpm in (None, mask):
        torch.testing.assert_close(layer(y, kpm)[:, :6], layer(x, kpm)[:, :6], rtol=0, atol=1e-12)


def test_layer_input_checks():
    layer = make_layer("softmax")
    with pytest.raises(ValueError, match=r"\(B, T, dim=12\)"):
        layer(torch.randn(2, 5, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(torch.randn(2, 5, DIM, dtype=torch.float64), key_padding_mask=torch.ones(2, 5))


@pytest.mark.parametrize("name", list(dict.fromkeys(["softmax", *available_backends()])))
def test_rope_and_left_padding(name):
    """docs/attention.md: with RoPE only softmax sees relative positions alone; the other backends see
    absolute positions, so left padding (which moves every real token) changes their outputs."""
    layer = make_layer(name, rope=True)
    x = torch.randn(2, 6, DIM, dtype=torch.float64)
    padded = torch.cat([torch.zeros(2, 3, DIM, dtype=torch.float64), x], dim=1)
    mask = torch.arange(9)[None, :].expand(2, -1) >= 3
    same = torch.allclose(layer(padded, key_padding_mask=mask)[:, 3:], layer(x), rtol=0, atol=1e-10)
    assert same == (name == "softmax")
    right = torch.cat([x, torch.zeros(2, 3, DIM, dtype=torch.float64)], dim=1)  # right padding is safe
    out_right = layer(right, key_padding_mask=mask.flip(1))[:, :6]
    torch.testing.assert_close(out_right, layer(x), rtol=0, atol=1e-10)
