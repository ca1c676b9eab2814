"""``padded_queries="attend"``: padded positions are masked as keys only and still query the real
keys (LRA's black pixels), in every op, the Triton paths and the layers; and ``mean_all`` pooling.

Each op is checked against the float64 reference (outputs and gradients) and the reference itself
against the defining property: in bidirectional attention a query's output depends only on that
query and the real keys, so a padded query's output is what a real position would output if it
carried the same query.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.attention import reference as ref
from attnlab.attention.ops import (
    linear_attention,
    sliced_relu_attention,
    sliced_relu_bump_attention,
    softmax_attention,
)
from attnlab.attention.performer.ops import performer_attention
from attnlab.models.classifier import SequenceClassifier

F64 = torch.float64
MASK = torch.tensor([[True] * 9, [True] * 5 + [False] * 4, [True] + [False] * 8])


def qkv(seed=0, batch=3, heads=2, length=9, dim=4):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=gen, dtype=F64) for _ in range(3)]


def scores(seed=0, batch=3, heads=2, length=9, dim=4):
    gen = torch.Generator().manual_seed(seed)
    s, t = (torch.randn(batch, heads, length, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(batch, heads, length, dim, generator=gen, dtype=F64)
    return s, t, v, torch.rand(heads, generator=gen, dtype=F64) + 0.3


# (fast op, reference, builds its inputs)
OPS = {
    "softmax": (softmax_attention, ref.softmax_attention, qkv),
    "linear": (linear_attention, ref.linear_attention, qkv),
    "relu": (sliced_relu_attention, ref.sliced_relu_attention, lambda seed: scores(seed)[:3]),
    "bump": (sliced_relu_bump_attention, ref.sliced_relu_bump_attention, scores),
}


def outputs_and_grads(op, args, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in args]
    out = op(*leaves, key_padding_mask=MASK, padded_queries="attend", **kw)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return out, torch.autograd.grad(out, leaves, grad_out)


@pytest.mark.parametrize(
    "name, path",
    [(n, None) for n in OPS if n not in ("relu", "bump")]
    + [(n, p) for n in ("relu", "bump") for p in ("sorted", "dense")],
)
def test_op_matches_reference_outputs_and_gradients(name, path):
    fast, naive, make = OPS[name]
    args = make(1)
    out, grads = outputs_and_grads(fast, args, **({} if path is None else {"path": path}))
    want, want_grads = outputs_and_grads(naive, args)
    assert (out - want).abs().max() <= 1e-9
    assert out[1, :, 5:].abs().amax() > 0, "padded queries must attend, not output zeros"
    for got, expected in zip(grads, want_grads, strict=True):
        assert (got - expected).abs().max() <= 1e-7
    # the padded queries' scores (or vectors) receive a gradient: they are real queries now
    assert grads[0][1, :, 5:].abs().amax() > 0


@pytest.mark.parametrize("name", OPS)
def test_padded_query_outputs_what_a_real_position_with_its_query_would(name):
    """Row 1 has real positions 0..4: put the query of padded position 7 at real position 2."""
    _, naive, make = OPS[name]
    args = list(make(2))
    attend = naive(*args, key_padding_mask=MASK, padded_queries="attend")
    moved = args[0].clone()
    moved[1, :, 2] = args[0][1, :, 7]
    zero = naive(moved, *args[1:], key_padding_mask=MASK)
    assert torch.allclose(attend[1, :, 7], zero[1, :, 2], atol=1e-12)
    assert torch.equal(attend[:, :, :5][1], naive(*args, key_padding_mask=MASK)[1, :, :5])


@pytest.mark.parametrize("name", ["relu", "bump"])
def test_triton_path_matches_torch_path(name, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fast, _, make = OPS[name]
    args = [x.to(torch.float32) for x in make(4)]
    out, grads = outputs_and_grads(lambda *a, **k: fast(*a, **k, impl="triton"), args)
    want, want_grads = outputs_and_grads(lambda *a, **k: fast(*a, **k, impl="torch"), args)
    assert (out - want).abs().max() <= 1e-5
    for got, expected in zip(grads, want_grads, strict=True):
        assert (got - expected).abs().max() <= 1e-4


def test_performer_keeps_real_rows_and_fills_padded_ones():
    q, k, v = qkv(5)
    projection = torch.randn(16, q.shape[-1], generator=torch.Generator().manual_seed(6), dtype=F64)
    zero = performer_attention(q, k, v, projection, MASK)
    attend = performer_attention(q, k, v, projection, MASK, padded_queries="attend")
    assert torch.equal(attend[MASK[:, None, :].expand(-1, 2, -1)], zero[MASK[:, None, :].expand(-1, 2, -1)])
    moved = q.clone()
    moved[1, :, 2] = q[1, :, 7]
    assert torch.allclose(attend[1, :, 7], performer_attention(moved, k, v, projection, MASK)[1, :, 2])


@pytest.mark.parametrize("op", [softmax_attention, linear_attention])
def test_causal_ops_refuse_attend_by_name(op):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="padded_queries='attend' is for bidirectional"):
        op(q, k, v, MASK, causal=True, padded_queries="attend")
    with pytest.raises(
        ValueError, match="padded_queries must be one of 'zero', 'attend'(, 'lra', 'lra2020')?, got 'keys'"
    ):
        op(q, k, v, MASK, padded_queries="keys")


@pytest.mark.parametrize("backend", ["softmax", "linear", "performer", "sliced_relu", "sliced_relu_bump"])
def test_layers_attend_at_padded_positions_only(backend):
    torch.manual_seed(0)
    zero = build_attention(backend, 16, 2).double().eval()
    attend = build_attention(backend, 16, 2, padded_queries="attend").double().eval()
    attend.load_state_dict(zero.state_dict())
    x = torch.randn(3, 9, 16, dtype=F64)
    a, z = attend(x, key_padding_mask=MASK), zero(x, key_padding_mask=MASK)
    assert torch.allclose(a[MASK], z[MASK], atol=1e-12)
    assert not torch.allclose(a[~MASK], z[~MASK])


def test_layer_options_are_checked_and_out_bias_can_go():
    with pytest.raises(ValueError, match="padded_queries must be one of"):
        build_attention("sliced_relu", 16, 2, padded_queries="keys_only")
    with pytest.raises(ValueError, match="padded_queries='attend' is for bidirectional"):
        build_attention("softmax", 16, 2, causal=True, padded_queries="attend")
    with pytest.raises(ValueError, match="out_bias must be true or false"):
        build_attention("softmax", 16, 2, out_bias="false")
    assert build_attention("softmax", 16, 2, out_bias=False).out_proj.bias is None


def test_mean_all_pooling_averages_every_position():
    torch.manual_seed(0)
    model = SequenceClassifier(
        vocab_size=11, num_classes=2, attention="softmax", dim=8, depth=1, num_heads=2, max_len=9,
        pooling="mean_all",
    ).eval()  # fmt: skip
    ids = torch.randint(1, 11, (3, 9))
    captured = {}
    model.encoder.register_forward_hook(lambda _m, _i, out: captured.update(x=out))
    pooled = model.encode(ids, MASK)
    assert torch.allclose(pooled, captured["x"].mean(dim=1))
    with pytest.raises(ValueError, match="mean_all"):
        SequenceClassifier(vocab_size=11, num_classes=2, attention="softmax", dim=8, pooling="avg")
