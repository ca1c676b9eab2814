"""`score_layout` and sliced ReLU's `padding_rule` against a transcription of the authors' layers
(`attnlab.attention.sliced_common.authors_reference`), in float64: outputs and gradients, with and
without RoPE, with padding, on both evaluation paths. `token` (the default) stays the paper's per-token Π."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.attention.sliced_common.authors_reference import (
    AuthorsSlicedReLU,
    AuthorsSlicedReLUBump,
    authors_rope,
    copy_into,
    even_first,
)
from attnlab.attention.sliced_common.scores import slice_tokens
from attnlab.attention.sliced_relu.authors import distance_sums, standardise_scores_authors

DIM, HEADS, T = 16, 4, 12


def _pair(backend, *, rope=False, fixed=False, projection="mlp", **options):
    """A transcription and the attnlab layer that should equal it (float64, eval, weights copied)."""
    if backend == "sliced_relu":
        ref = AuthorsSlicedReLU(DIM, HEADS, projection=projection, rope=rope, fixed=fixed)
        options = {"padding_rule": "authors", "projection": projection, **options}
    else:
        ref = AuthorsSlicedReLUBump(DIM, HEADS, rope=rope, fixed=fixed)
        with torch.no_grad():
            ref.log_bandwidth.uniform_(-1.0, 1.0)
    layout = "token" if fixed else "authors"
    layer = build_attention(
        backend, DIM, HEADS, rope=rope, score_layout=layout, padded_queries="attend", **options
    )
    ref, layer = ref.double().eval(), layer.double().eval()
    return ref, copy_into(layer, ref)


def _mask(padded: bool):
    if not padded:
        return None
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, 8:] = False
    mask[2, 5:] = False
    return mask


def _grads(out, x, params, grad):
    return torch.autograd.grad(out, [x, *params], grad)


def _mapped_grads(ref, layer, x, mask):
    """(attnlab's gradients, the transcription's) for x, q/k/v, Π and the bandwidth, matched up."""
    x = x.clone().requires_grad_(True)
    out_ref = ref(x, mask)
    out = layer(x, mask)
    grad = torch.randn_like(out)
    g_x, g_qkv_w, g_qkv_b, *g_slicer = _grads(
        out, x, [layer.qkv.weight, layer.qkv.bias, *layer.slicer.parameters()], grad
    )
    r_x, *r = _grads(
        out_ref,
        x,
        [ref.query.weight, ref.key.weight, ref.value.weight, ref.query.bias, ref.key.bias, ref.value.bias]
        + list(ref.slicer.parameters()),
        grad,
    )
    order = torch.arange(DIM)
    if ref.rope:
        order = (torch.arange(HEADS)[:, None] * (DIM // HEADS) + even_first(DIM // HEADS)).reshape(-1)
    ref_qkv_w = torch.cat([r[0][order], r[1][order], r[2]])
    ref_qkv_b = torch.cat([r[3][order], r[4][order], r[5]])
    ours = [g_x, g_qkv_w, g_qkv_b, *g_slicer]
    theirs = [r_x, ref_qkv_w, ref_qkv_b, *r[6:]]
    if hasattr(ref, "log_bandwidth"):
        ours.append(torch.autograd.grad(layer(x, mask), layer.bandwidth_logit, grad)[0])
        theirs.append(torch.autograd.grad(ref(x, mask), ref.log_bandwidth, grad)[0])
    return out, out_ref, ours, theirs


@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("path", ["dense", "sorted"])
def test_authors_layout_equals_the_authors_layer(backend, rope, padded, path):
    torch.manual_seed(0)
    ref, layer = _pair(backend, rope=rope, path=path)
    assert layer.fold(3) is None  # the in-place rows are not tokens: nothing to fold
    x = torch.randn(3, T, DIM, dtype=torch.float64)
    out, out_ref, ours, theirs = _mapped_grads(ref, layer, x, _mask(padded))
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"gradient {index}")


@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
def test_authors_layout_when_rows_straddle_two_heads(backend):
    """T = 10 with 4 heads: a row of the in-place reshape ends in one head and starts the next."""
    torch.manual_seed(7)
    ref, layer = _pair(backend, rope=True)
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    out, out_ref, ours, theirs = _mapped_grads(ref, layer, x, mask)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
@pytest.mark.parametrize("rope", [False, True])
def test_token_layout_equals_the_authors_layer_with_the_reshape_fixed(backend, rope):
    """The authors' layer with per-token rows is attnlab's default layout (the paper's Π)."""
    torch.manual_seed(1)
    ref, layer = _pair(backend, rope=rope, fixed=True, projection="linear")
    x = torch.randn(3, T, DIM, dtype=torch.float64)
    out, out_ref, ours, theirs = _mapped_grads(ref, layer, x, _mask(True))
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
def test_the_layouts_differ_and_token_is_per_token(backend):
    """`token` (default): a score depends on its own token only, and equals Π on that token's heads
    written out; `authors`: score 0 depends on token 1 (the rows mix neighbours)."""
    torch.manual_seed(2)
    token = build_attention(backend, DIM, HEADS).double()
    assert token.score_layout == "token"
    authors = build_attention(backend, DIM, HEADS, score_layout="authors").double()
    authors.load_state_dict(token.state_dict())
    x = torch.randn(1, T, DIM, dtype=torch.float64, requires_grad=True)
    for layer, leaks in ((token, False), (authors, True)):
        scores = slice_tokens(layer.slicer, layer.heads(x)[0], layer.score_layout)
        (grad,) = torch.autograd.grad(scores[0, :, 0].sum(), x)
        assert bool(grad[0, 1:].abs().max() > 1e-6) is leaks
    q = token.heads(x)[0].detach()
    by_hand = torch.stack([token.slicer(q[0, :, i].reshape(-1)) for i in range(T)], dim=-1)
    torch.testing.assert_close(slice_tokens(token.slicer, q)[0], by_hand, rtol=1e-12, atol=1e-14)


def test_authors_rope_is_attnlabs_on_reordered_channels():
    torch.manual_seed(3)
    layer = build_attention("sliced_relu", 8, 2, rope=True).double()
    q = torch.randn(2, 2, 7, 4, dtype=torch.float64)
    ours, _ = layer.rotary(q[..., even_first(4)], q[..., even_first(4)])
    torch.testing.assert_close(authors_rope(q), ours, rtol=1e-12, atol=1e-14)


def test_the_authors_padding_rule_moves_real_outputs_and_the_invariant_rule_does_not():
    """Padding a sequence further changes the authors' real outputs; attnlab's default does not."""
    torch.manual_seed(4)
    ref = AuthorsSlicedReLU(DIM, HEADS, fixed=True).double().eval()
    options = {"padded_queries": "attend"}
    authors = copy_into(build_attention("sliced_relu", DIM, HEADS, padding_rule="authors", **options), ref)
    invariant = build_attention("sliced_relu", DIM, HEADS, **options)
    invariant.load_state_dict(authors.state_dict())
    x = torch.randn(1, 20, DIM, dtype=torch.float64)
    short, long = torch.zeros(1, 12, dtype=torch.bool), torch.zeros(1, 20, dtype=torch.bool)
    short[:, :8] = long[:, :8] = True
    for layer in (authors.double().eval(), invariant.double().eval()):
        a, b = layer(x[:, :12], short)[:, :8], layer(x, long)[:, :8]
        moved = ((a - b).norm() / a.norm()).item()
        assert (moved > 0.01) if layer is authors else (moved < 1e-12)
    torch.testing.assert_close(authors(x, long), ref(x, long), rtol=1e-10, atol=1e-12)


def test_distance_sums_and_the_authors_standardisation_by_hand():
    torch.manual_seed(5)
    s, t = torch.randn(2, 3, 9, dtype=torch.float64), torch.randn(2, 3, 9, dtype=torch.float64)
    w = torch.rand(2, 1, 9, dtype=torch.float64)
    by_hand = ((s[..., :, None] - t[..., None, :]).abs() * w[..., None, :]).sum(-1)
    torch.testing.assert_close(distance_sums(s, t, w), by_hand, rtol=1e-12, atol=1e-12)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    s1, t1 = standardise_scores_authors(s, t, mask)
    real = mask[:, None].double()
    zs, zt = s * real, t * real
    mean = (zs.sum(-1, keepdim=True) + zt.sum(-1, keepdim=True)) / (2 * real.sum(-1, keepdim=True))
    var = ((zs - mean) ** 2 + (zt - mean) ** 2).sum(-1, keepdim=True) / (2 * real.sum(-1, keepdim=True))
    torch.testing.assert_close(s1, (zs - mean) / (var + 1e-6).sqrt(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t1, (zt - mean) / (var + 1e-6).sqrt(), rtol=1e-12, atol=1e-12)


def test_bad_values_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match=r"score_layout must be one of token, authors; got 'heads'"):
        build_attention("sliced_relu", DIM, HEADS, score_layout="heads")
    for backend in ("sliced_relu", "sliced_relu_bump"):
        with pytest.raises(ValueError, match=r"reads the future\): causal layers take score_layout='token'"):
            build_attention(backend, DIM, HEADS, score_layout="authors", causal=True)
    with pytest.raises(ValueError, match=r"padding_rule must be one of invariant, authors; got 'lra'"):
        build_attention("sliced_relu", DIM, HEADS, padding_rule="lra")
    with pytest.raises(ValueError, match=r"needs standardise='sequence'.*got standardise='none'"):
        build_attention("sliced_relu", DIM, HEADS, padding_rule="authors", standardise="none")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
def test_authors_layout_on_the_gpu_kernels_equals_the_float64_transcription(backend):
    """On CUDA the sorted path runs the Triton kernels: float32 there, against the transcription in
    float64 on the CPU, at a length where the sorted path is the one taken."""
    torch.manual_seed(6)
    ref, layer = _pair(backend, path="sorted")
    x = torch.randn(2, 512, DIM, dtype=torch.float64)
    mask = torch.ones(2, 512, dtype=torch.bool)
    mask[1, 300:] = False
    want = ref(x, mask)
    got = layer.float().cuda()(x.float().cuda(), mask.cuda()).double().cpu()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
