"""Causal sliced ReLU / ReLU-bump: the O(T log² T) ops against the float64 O(T²) references
(outputs and every gradient, padding, ties, T = 1, odd shapes), float32 precision, decoding steps
against the parallel op at every step (the layers: test_causal_layers.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.attention import reference as ref
from attnlab.attention.common import native
from attnlab.attention.ops import sliced_relu_attention, sliced_relu_bump_attention
from attnlab.attention.sliced_common import causal, decoding, merged
from attnlab.attention.sliced_common.decoding import SlicedDecodeState
from attnlab.attention.sliced_relu.causal import causal_sliced_relu_attention
from attnlab.attention.sliced_relu.decoding import sliced_relu_attention_state, sliced_relu_attention_step
from attnlab.attention.sliced_relu_bump.causal import causal_sliced_relu_bump_attention
from attnlab.attention.sliced_relu_bump.decoding import (
    sliced_relu_bump_attention_state,
    sliced_relu_bump_attention_step,
)

F64 = torch.float64

# every test by the C++ kernels (CPU dominance sums, decoding steps) and by the torch code
pytestmark = pytest.mark.usefixtures("cpu_code")
OUT_TOL = 1e-9
GRAD_TOL = 1e-7
KINDS = ["relu", "bump", "bump_mass"]  # bump_mass: the bump with normaliser="mass"
PATHS = ["sorted", "dense"]  # the two evaluations of the same kernels (attnlab.attention.sliced_common.path)


def normaliser(kind):
    return "mass" if kind == "bump_mass" else "count"


def random_inputs(batch, heads, length, dim, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, heads, length, generator=gen, dtype=F64)
    t = torch.randn(batch, heads, length, generator=gen, dtype=F64)
    v = torch.randn(batch, heads, length, dim, generator=gen, dtype=F64)
    bandwidth = torch.rand(heads, generator=gen, dtype=F64) + 0.3
    return s.to(dtype), t.to(dtype), v.to(dtype), bandwidth.to(dtype)


def fast_op(kind, chunk=None, path="sorted"):
    """The causal op through the public entry point (default chunk, on ``path``) or with a given chunk."""
    if chunk is None:
        if kind == "relu":
            return lambda s, t, v, b, mask: sliced_relu_attention(s, t, v, mask, causal=True, path=path)
        return lambda s, t, v, b, mask: sliced_relu_bump_attention(
            s, t, v, b, mask, causal=True, normaliser=normaliser(kind), path=path
        )
    if kind == "relu":
        return lambda s, t, v, b, mask: causal_sliced_relu_attention(s, t, v, mask, chunk=chunk)
    return lambda s, t, v, b, mask: causal_sliced_relu_bump_attention(
        s, t, v, b, mask, chunk=chunk, normaliser=normaliser(kind)
    )


def ref_op(kind):
    if kind == "relu":
        return lambda s, t, v, b, mask: ref.causal_sliced_relu_attention(s, t, v, mask)
    return lambda s, t, v, b, mask: ref.causal_sliced_relu_bump_attention(
        s, t, v, b, mask, normaliser=normaliser(kind)
    )


def outputs_and_grads(op, kind, s, t, v, bandwidth, mask, grad_seed=1):
    inputs = [
        x.detach().clone().requires_grad_() for x in ((s, t, v) if kind == "relu" else (s, t, v, bandwidth))
    ]
    extra = bandwidth if kind == "relu" else inputs[3]
    out = op(*inputs[:3], extra, mask)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=out.dtype)
    return out, torch.autograd.grad(out, inputs, grad_out)


def assert_matches_reference(kind, s, t, v, bandwidth, mask=None, chunk=None):
    """The public op on both paths (sorted with the default chunk, and dense), or ``chunk``'s sorted op."""
    ref_out, ref_grads = outputs_and_grads(ref_op(kind), kind, s, t, v, bandwidth, mask)
    ops = {"sorted": fast_op(kind, chunk)} if chunk is not None else {p: fast_op(kind, path=p) for p in PATHS}
    for path, op in ops.items():
        out, grads = outputs_and_grads(op, kind, s, t, v, bandwidth, mask)
        assert torch.isfinite(out).all()
        assert (out - ref_out).abs().max().item() <= OUT_TOL, f"{kind} ({path}): output"
        for name, got, expected in zip(["s", "t", "v", "bandwidth"], grads, ref_grads, strict=False):
            err = (got - expected).abs().max().item()
            assert err <= GRAD_TOL, f"{kind} ({path}): gradient of {name} off by {err:.3g}"


# ---- against the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 1), (1, 1, 2, 3), (2, 3, 7, 1), (3, 2, 33, 5), (1, 4, 64, 16), (2, 1, 129, 2), (1, 2, 300, 3)],
    ids=lambda shape: "x".join(map(str, shape)),
)
def test_matches_reference(kind, shape):
    assert_matches_reference(kind, *random_inputs(*shape, seed=sum(shape)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_every_chunk_size_is_the_same_function(kind, chunk):
    # chunk 1: every pair but the diagonal goes through the sorted levels; 64 > T: all dense
    assert_matches_reference(kind, *random_inputs(2, 2, 45, 3, seed=chunk), chunk=chunk)


@pytest.mark.parametrize("kind", KINDS)
def test_wide_scores_narrow_bandwidth_and_offset_scores(kind):
    s, t, v, bandwidth = random_inputs(2, 2, 50, 3, seed=5)
    assert_matches_reference(kind, 10 * s, 10 * t, v, bandwidth / 10)
    assert_matches_reference(kind, s + 1e3, t + 1e3, v + 50, bandwidth)


# ---- padding ----------------------------------------------------------------------------------


def padded_batch(lengths, heads=2, length=13, dim=3, seed=0):
    """A right-padded batch whose padded slots hold huge (finite) garbage, with its mask."""
    s, t, v, bandwidth = random_inputs(len(lengths), heads, length, dim, seed=seed)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return (*with_garbage(s, t, v, mask, seed), bandwidth, mask)


def with_garbage(s, t, v, mask, seed):
    gen = torch.Generator().manual_seed(seed + 100)
    garbage = ~mask[:, None, :]
    s = torch.where(garbage, 1e6 * torch.randn(s.shape, generator=gen, dtype=F64), s)
    t = torch.where(garbage, -1e6 * torch.randn(t.shape, generator=gen, dtype=F64), t)
    v = torch.where(garbage[..., None], 1e8 * torch.randn(v.shape, generator=gen, dtype=F64), v)
    return s, t, v


@pytest.mark.parametrize("kind", KINDS)
def test_padding_matches_reference(kind):
    assert_matches_reference(kind, *padded_batch([13, 9, 1, 0]))


@pytest.mark.parametrize("kind", KINDS)
def test_padding_anywhere_matches_reference(kind):
    # holes in the middle and at the start: the prefix statistics skip them
    s, t, v, bandwidth = random_inputs(3, 2, 40, 3, seed=6)
    mask = torch.rand(3, 40, generator=torch.Generator().manual_seed(6)) > 0.4
    mask[1, :5] = False
    s, t, v = with_garbage(s, t, v, mask, 6)
    assert_matches_reference(kind, s, t, v, bandwidth, mask, chunk=4)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_batch_equals_each_sequence_alone(kind):
    lengths = [13, 8, 1]
    s, t, v, bandwidth, mask = padded_batch(lengths)
    op = fast_op(kind)
    inputs = [x.clone().requires_grad_() for x in (s, t, v)]
    out = op(*inputs, bandwidth, mask)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    grads = torch.autograd.grad(out, inputs, grad_out)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        alone = [x[b : b + 1, :, :n].clone().requires_grad_() for x in (s, t, v)]
        out_alone = op(*alone, bandwidth, None)
        grads_alone = torch.autograd.grad(out_alone, alone, grad_out[b : b + 1, :, :n])
        torch.testing.assert_close(out[b : b + 1, :, :n], out_alone, atol=1e-12, rtol=0)
        assert torch.all(out[b, :, n:] == 0), "padded query positions output zeros"
        for got, expected in zip(grads, grads_alone, strict=True):
            torch.testing.assert_close(got[b : b + 1, :, :n], expected, atol=1e-10, rtol=0)
            assert torch.all(got[b, :, n:] == 0), "padded inputs receive no gradient"


# ---- ties -------------------------------------------------------------------------------------


def tied_inputs(seed, batch=2, heads=2, length=40, dim=3):
    """Scores from {-2, ..., 2}: ties between keys, between queries, and between the two."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randint(-2, 3, (batch, heads, length), generator=gen).to(F64)
    t = torch.randint(-2, 3, (batch, heads, length), generator=gen).to(F64)
    v = torch.randn(batch, heads, length, dim, generator=gen, dtype=F64)
    bandwidth = torch.tensor([1.0, 2.0], dtype=F64)  # |s - t| = b happens: the hat's outer kinks
    return s, t, v, bandwidth


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [None, 4])
def test_tied_scores(kind, chunk):
    assert_matches_reference(kind, *tied_inputs(seed=0), chunk=chunk)


@pytest.mark.parametrize("kind", KINDS)
def test_queries_equal_keys_and_all_scores_equal(kind):
    s, _, v, bandwidth = random_inputs(2, 2, 17, 3, seed=7)
    assert_matches_reference(kind, s, s.clone(), v, bandwidth, chunk=4)
    flat = torch.full((2, 2, 17), 0.25, dtype=F64)  # sliced ReLU: the normaliser sits on eps
    assert_matches_reference(kind, flat, flat.clone(), v, bandwidth, chunk=4)


@pytest.mark.parametrize("kind", KINDS)
def test_tied_scores_with_padding(kind):
    s, t, v, bandwidth = tied_inputs(seed=1, batch=3)
    mask = torch.arange(40)[None, :] < torch.tensor([[40], [10], [3]])
    assert_matches_reference(kind, s, t, v, bandwidth, mask, chunk=4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("budget", [0, 10**9], ids=["extra_pass", "listed_pairs"])
def test_ties_listed_or_counted_in_a_pass(kind, budget, monkeypatch):
    """Both ways of taking tied scores apart: the list of tied pairs (few ties, as in real data)
    and, past the budget, one more dominance pass. A few ties among distinct scores, many ties
    (scores from five values), queries equal to keys, padding."""
    monkeypatch.setattr(causal, "TIE_PAIR_BUDGET", budget)
    s, t, v, bandwidth = random_inputs(2, 2, 70, 3, seed=21)
    t[..., ::7] = s[..., 3::7]  # a few keys tied with earlier and later queries
    assert_matches_reference(kind, s, t, v, bandwidth)
    assert_matches_reference(kind, *tied_inputs(seed=5), chunk=4)
    assert_matches_reference(kind, s, s.clone(), v, bandwidth, chunk=8)
    s, t, v, bandwidth = tied_inputs(seed=6, batch=3)
    mask = torch.arange(40)[None, :] < torch.tensor([[40], [10], [3]])
    assert_matches_reference(kind, s, t, v, bandwidth, mask, chunk=4)


@pytest.mark.parametrize("kind", ["bump", "bump_mass"])
@pytest.mark.parametrize("inputs", ["random", "tied"])
def test_bump_key_gradients_alone(kind, inputs):
    """The forward pass takes the query side's window sums only when s or the bandwidth needs a
    gradient; with s and b fixed, dL/dt and dL/dv still match the reference (ties included)."""
    if inputs == "random":
        s, t, v, bandwidth = random_inputs(2, 2, 70, 3, seed=31)
    else:
        s, t, v, bandwidth = tied_inputs(seed=8)
    mask = torch.arange(s.shape[-1])[None, :] < torch.tensor([[s.shape[-1]], [25]])
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    grads = []
    for op in (fast_op(kind), ref_op(kind)):
        t_, v_ = t.clone().requires_grad_(), v.clone().requires_grad_()
        out = op(s, t_, v_, bandwidth, mask)
        grads.append((out, *torch.autograd.grad(out, (t_, v_), grad_out)))
    for got, expected in zip(*grads, strict=True):
        assert (got - expected).abs().max().item() <= GRAD_TOL
    with torch.no_grad():
        assert (fast_op(kind)(s, t, v, bandwidth, mask) - grads[1][0]).abs().max().item() <= OUT_TOL


def test_tied_pairs_are_listed_below_the_budget_only(cpu_code):
    s = torch.tensor([[0.0, 1.0, 2.0, 1.0]])
    t = torch.tensor([[1.0, 5.0, 1.0, 2.0]])
    # j <= i with s_i == t_j: (1, 0), (3, 0), (3, 2); (2, 3) is in the future
    query, key = causal.tied_pairs(s, t, None)
    assert sorted(zip(query.tolist(), key.tolist(), strict=True)) == [(1, 0), (3, 0), (3, 2)]
    query, key = causal.tied_pairs(s, t, torch.tensor([[True, True, True, False]]))
    assert sorted(zip(query.tolist(), key.tolist(), strict=True)) == [(1, 0)]
    flat = torch.zeros(1, 5)
    assert causal.tied_pairs(flat, flat, None) is None  # 25 candidate pairs > 4 per position


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernels_list_the_tied_pairs_the_torch_code_lists(dtype):
    """Quantised scores (many ties), NaN, ±inf, −0 against +0, padding: the same pairs both ways."""
    generator = torch.Generator().manual_seed(3)
    s, t = (torch.randint(-12, 13, (3, 40), generator=generator).to(dtype) / 2 for _ in range(2))
    s[0, 5], t[0, 2], s[1, 7], t[1, 3] = float("nan"), float("nan"), float("inf"), float("inf")
    s[2, 9], t[2, 1], s[2, 11], t[2, 4] = float("-inf"), float("-inf"), -0.0, 0.0
    valid = torch.rand(3, 40, generator=generator) > 0.2
    for mask in (None, valid):
        got = causal.tied_pairs(s, t, mask)
        with native.torch_code():
            want = causal.tied_pairs(s, t, mask)
        pairs = [sorted(zip(*(x.tolist() for x in found), strict=True)) for found in (got, want)]
        assert pairs[0] == pairs[1] and len(pairs[0]) > 20


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    length=st.integers(1, 70),
    dim=st.integers(1, 5),
    chunk=st.sampled_from([1, 3, 8, 32]),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
    padded=st.booleans(),
)
def test_random_shapes(kind, batch, heads, length, dim, chunk, seed, ties, padded):
    s, t, v, _ = random_inputs(batch, heads, length, dim, seed=seed)
    bandwidth = torch.rand(heads, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.2
    if ties:
        s, t = s.round(), t.round()
        bandwidth = bandwidth.round().clamp_min(1.0)
    mask = None
    if padded:
        mask = torch.rand(batch, length, generator=torch.Generator().manual_seed(seed + 1)) > 0.3
    assert_matches_reference(kind, s, t, v, bandwidth, mask, chunk=chunk)


def test_gradcheck():
    s, t, v, bandwidth = random_inputs(2, 2, 9, 2, seed=12)
    mask = torch.tensor([[True] * 9, [False] + [True] * 6 + [False] * 2])
    inputs = [x.requires_grad_() for x in (s, t, v, 2 * bandwidth)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: causal_sliced_relu_attention(a, b, c, mask, chunk=2), inputs[:3]
    )
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: causal_sliced_relu_bump_attention(a, b, c, d, mask, chunk=2), inputs
    )


# ---- causality and precision ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_and_gradients_ignore_the_future(kind):
    s, t, v, bandwidth = random_inputs(1, 2, 100, 4, seed=3, dtype=torch.float32)
    s2, t2, v2, _ = random_inputs(1, 2, 100, 4, seed=4, dtype=torch.float32)
    cut = 61
    changed = [torch.cat([a[:, :, :cut], b[:, :, cut:]], dim=2) for a, b in ((s, s2), (t, t2), (v, v2))]
    op = fast_op(kind)
    inputs = [x.clone().requires_grad_() for x in (s, t, v)]
    changed = [x.clone().requires_grad_() for x in changed]
    out, out_changed = op(*inputs, bandwidth, None), op(*changed, bandwidth, None)
    assert torch.equal(out[:, :, :cut], out_changed[:, :, :cut])  # bit for bit: no shift from the future
    assert not torch.equal(out[:, :, cut:], out_changed[:, :, cut:])
    # gradients of the past outputs reach the past inputs only, and the same whatever the future holds
    grad = torch.randn(out[:, :, :cut].shape, generator=torch.Generator().manual_seed(5))
    past = torch.autograd.grad(out[:, :, :cut], inputs, grad)
    past_changed = torch.autograd.grad(out_changed[:, :, :cut], changed, grad)
    for mine, theirs in zip(past, past_changed, strict=True):
        assert torch.equal(mine[:, :, cut:], torch.zeros_like(mine[:, :, cut:]))
        torch.testing.assert_close(mine[:, :, :cut], theirs[:, :, :cut], rtol=1e-5, atol=1e-6)
        assert mine[:, :, :cut].abs().sum() > 0


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_float32_against_float64(kind, offset, record_property):
    length, dim = 8192, 16
    s, t, v, bandwidth = random_inputs(1, 2, length, dim, seed=2)
    # a constant offset, which the op shifts away; both dtypes see the same (float32-rounded) inputs
    s, t, v = ((x + offset).float().double() for x in (s, t, v - offset))
    grad_out = torch.randn(v.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    results = {}
    for dtype in (torch.float32, F64):
        inputs = [x.to(dtype).requires_grad_() for x in (s, t, v)]
        out = fast_op(kind)(*inputs, bandwidth.to(dtype), None)
        results[dtype] = (out.detach(), torch.autograd.grad(out, inputs, grad_out.to(dtype)))
    errors = {"output": relative_error(results[torch.float32][0], results[F64][0])}
    for name, a, b in zip("stv", results[torch.float32][1], results[F64][1], strict=True):
        errors[f"grad {name}"] = relative_error(a, b)
    for name, value in errors.items():
        record_property(f"{kind} T={length} offset={offset} {name}", f"{value:.3g}")
        print(f"{kind} T={length} offset={offset}: float32 {name} vs float64 relative error {value:.3g}")
    if kind == "bump_mass":
        # dividing by the hat mass + eps (small for the first queries) instead of n amplifies the
        # prefix sums' rounding: measured 3e-5 (output) and 7.6e-4 (gradients) at T = 8192, eps = 1e-2
        assert errors["output"] < 1e-4 and max(errors["grad s"], errors["grad t"], errors["grad v"]) < 2e-3
        return
    assert errors["output"] < 1e-5 and errors["grad v"] < 1e-5
    # the hat's derivative jumps at |s - t| = b: a float32 rounding of s ± b that moves a key across
    # a window edge changes the bump's score gradients by a whole jump (measured ~1e-4)
    assert max(errors["grad s"], errors["grad t"]) < (1e-5 if kind == "relu" else 1e-3)


def test_merged_order_radix_and_row_sort_agree(monkeypatch):
    """The causal sliced ReLU's levels order keys and thresholds by one flat integer sort (radix
    sort: float32 on CPU, 32,768+ elements) or by sorting the float rows; both give one order,
    thresholds before equal keys, with ties, -0.0 against +0.0 and infinities."""
    gen = torch.Generator().manual_seed(4)
    half = 64
    values = torch.randint(-6, 6, (merged.RADIX_MIN // (2 * half) + 3, 2 * half), generator=gen).float() / 4
    values[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    values[0, half : half + 4] = torch.tensor([-0.0, 0.0, float("inf"), -float("inf")])
    values[1] = torch.randn(2 * half, generator=gen)
    radix = merged._merged_order(values, half)
    monkeypatch.setattr(merged, "RADIX_MIN", 10**12)
    rows = merged._merged_order(values, half)
    assert torch.equal(radix, rows)
    ordered = values.view(-1)[radix].view(values.shape)
    assert (ordered[:, 1:] >= ordered[:, :-1]).all()
    columns = radix.view(values.shape) % (2 * half)
    ties = ordered[:, 1:] == ordered[:, :-1]  # a key (column >= half) never precedes an equal threshold
    assert not (ties & (columns[:, :-1] >= half) & (columns[:, 1:] < half)).any()


@pytest.mark.parametrize("ties", [False, True])
def test_radix_sorted_levels_give_the_row_sorted_result(ties, monkeypatch):
    """float32 rows long enough for the radix sort: outputs and gradients bit for bit those of the
    row-sorted levels (which the float64 tests check against the reference), padding included."""
    s, t, v, _ = random_inputs(4, 8, 1100, 3, seed=13, dtype=torch.float32)
    if ties:
        s, t = (s * 4).round() / 4, (t * 4).round() / 4
    mask = torch.arange(1100)[None, :] < torch.tensor([[1100], [1000], [517], [3]])
    results = []
    for radix_min in (merged.RADIX_MIN, 10**12):
        monkeypatch.setattr(merged, "RADIX_MIN", radix_min)
        results.append(outputs_and_grads(fast_op("relu"), "relu", s, t, v, None, mask))
    (out, grads), (row_out, row_grads) = results
    assert torch.equal(out, row_out)
    for got, expected in zip(grads, row_grads, strict=True):
        assert torch.equal(got, expected)


def test_half_inputs_and_autocast_keep_float32_sums():
    s, t, v, bandwidth = random_inputs(2, 2, 200, 8, seed=9, dtype=torch.float32)
    expected = sliced_relu_attention(s, t, v, causal=True)
    half = sliced_relu_attention(s.bfloat16(), t.bfloat16(), v.bfloat16(), causal=True)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sliced_relu_bump_attention(s, t, v, bandwidth, causal=True)
    assert out.dtype == torch.float32
    assert relative_error(out, sliced_relu_bump_attention(s, t, v, bandwidth, causal=True)) < 1e-6
    assert relative_error(half.float(), expected) < 5e-2


def test_bad_chunk_named():
    s, t, v, _ = random_inputs(1, 1, 4, 2)
    with pytest.raises(
        ValueError, match=r"chunk must be a positive integer or None \(each evaluation's own\), got 0"
    ):
        causal_sliced_relu_attention(s, t, v, chunk=0)


# ---- decoding ---------------------------------------------------------------------------------


def decode(kind, s, t, v, bandwidth, state=None, start=0):
    outs = []
    for i in range(start, s.shape[-1]):
        if kind == "relu":
            out, state = sliced_relu_attention_step(s[..., i], t[..., i], v[..., i, :], state)
        else:
            out, state = sliced_relu_bump_attention_step(
                s[..., i], t[..., i], v[..., i, :], bandwidth, state, normaliser=normaliser(kind)
            )
        outs.append(out)
    return torch.stack(outs, dim=2), state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,atol", [(F64, 1e-11), (torch.float32, 2e-5)])
def test_steps_equal_the_causal_parallel_op(kind, dtype, atol, cpu_code):
    s, t, v, bandwidth = random_inputs(2, 3, 70, 4, seed=1, dtype=dtype)
    v = v + 2.0  # values with a mean: the running vbar matters
    parallel = fast_op(kind)(s, t, v, bandwidth, None)
    steps, state = decode(kind, s, t, v, bandwidth)
    assert steps.dtype == dtype
    if kind == "bump_mass":
        # the step takes second differences of F (sums over every past key) and divides them by the
        # hat mass + eps instead of n: measured 1.0e-11 (float64) and 2.7e-3 (float32, torch code; the
        # C++ kernel, differencing in double, 6.6e-4) here, against 3.9e-15 and 2.2e-6 with the count
        # (the parallel op: 7.6e-5 in float32 against float64)
        atol = {F64: 5e-11, torch.float32: 6e-3 if cpu_code == "torch" else 1.5e-3}[dtype]
    torch.testing.assert_close(steps, parallel, atol=atol, rtol=0)
    assert state.count == 70 and state.run_sizes == [64] and state.recent == 6  # 70 = 2 x 32 sorted + 6


@pytest.mark.parametrize("kind", KINDS)
def test_float32_states_search_all_runs_at_once_as_float64_states_search_each(kind, cpu_code):
    """The one-search path (float32: int64 keys run << 32 | order(t)) against the per-run one (float64)
    on the same numbers, over several runs, with ties and negative zeros among the keys."""
    s, t, v, bandwidth = random_inputs(2, 3, 300, 4, seed=5, dtype=torch.float32)
    t = torch.round(t * 4) / 4  # many ties, within and across runs
    t[..., 7] = -0.0
    s[..., 11] = 0.0
    steps32, state = decode(kind, s, t, v, bandwidth)
    steps64, _ = decode(kind, *(x.double() for x in (s, t, v, bandwidth)))
    assert state.search is not None and state.run_sizes == [256, 32] and state.recent == 12
    torch.testing.assert_close(steps32.double(), steps64, atol=5e-3 if kind == "bump_mass" else 2e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_steps_with_ties_equal_the_parallel_op(kind, cpu_code):
    s, t, v, bandwidth = tied_inputs(seed=2, length=33)
    steps, _ = decode(kind, s, t, v, bandwidth)
    torch.testing.assert_close(steps, fast_op(kind)(s, t, v, bandwidth, None), atol=1e-11, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_steps_equal_the_parallel_op(kind, cpu_code):
    s, t, v, bandwidth = random_inputs(1, 2, 140, 3, seed=4)
    prefill = sliced_relu_attention_state if kind == "relu" else sliced_relu_bump_attention_state
    for start in (1, 23, 101):
        state = prefill(t[..., :start], v[..., :start, :])
        expected_runs = {1: [], 23: [], 101: [64, 32]}[start]  # what stepping would have sorted by then
        assert state.run_sizes == expected_runs and state.recent == start - sum(expected_runs)
        steps, _ = decode(kind, s, t, v, bandwidth, state=state, start=start)
        parallel = fast_op(kind)(s, t, v, bandwidth, None)[:, :, start:]
        torch.testing.assert_close(steps, parallel, atol=1e-10 if kind == "bump_mass" else 1e-11, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_cpu_steps_are_one_kernel_call_and_equal_the_torch_code(kind, dtype, monkeypatch):
    """On the CPU a step never reaches the torch search (``evaluate``): the C++ kernel pushes, searches
    and combines; its outputs and state are the torch code's (several runs, ties, a negative zero)."""
    s, t, v, bandwidth = random_inputs(2, 3, 300, 4, seed=5, dtype=dtype)
    t = torch.round(t * 4) / 4
    t[..., 7] = -0.0
    prefill = sliced_relu_attention_state if kind == "relu" else sliced_relu_bump_attention_state
    monkeypatch.setenv(native.SWITCH, "off")
    by_torch, torch_state = decode(
        kind, s, t, v, bandwidth, state=prefill(t[..., :40], v[..., :40, :]), start=40
    )
    monkeypatch.delenv(native.SWITCH)
    if native.library(decoding.KERNELS) is None:
        pytest.skip("no C++ compiler or ninja")
    monkeypatch.setattr(SlicedDecodeState, "evaluate", None)  # the torch search: must not be called
    by_kernel, kernel_state = decode(
        kind, s, t, v, bandwidth, state=prefill(t[..., :40], v[..., :40, :]), start=40
    )
    atol = {F64: 1e-11, torch.float32: 5e-3 if kind == "bump_mass" else 2e-5}[dtype]
    torch.testing.assert_close(by_kernel, by_torch, atol=atol, rtol=0)
    assert kernel_state.run_sizes == torch_state.run_sizes == [256, 32] and kernel_state.count == 300
    for name in ("recent_t", "recent_rows", "sum_v", "sum_t", "keys", "tables"):
        torch.testing.assert_close(
            getattr(kernel_state, name), getattr(torch_state, name), atol=1e-4, rtol=1e-5
        )


def test_state_holds_d_plus_four_numbers_per_token():
    dim, n = 64, 1025  # 1,024 tokens in one sorted run, 1 in the buffer
    _, t, v, _ = random_inputs(1, 2, n, dim, dtype=torch.float32)
    state = sliced_relu_attention_state(t, v)
    assert state.run_sizes == [1024] and state.recent == 1
    per_token = 2 * (dim + 4) * 4  # two heads, float32: key, D + 1 table entries, the int64 search key
    extra = state.nbytes() - 1024 * per_token
    # shifts, running sums and one run total: O(D); the buffer of 32 recent tokens: O(32 D)
    assert 0 <= extra <= 2 * 4 * (3 * dim + 3 + 32 * (dim + 2))
    kv_cache = n * 2 * 2 * dim * 4
    assert state.nbytes() < 0.6 * kv_cache
    state64 = sliced_relu_attention_state(t.double(), v.double())  # no search key: (D + 2) per token
    assert state64.search is None and state64.nbytes() - 2 * extra <= 1024 * 2 * (dim + 2) * 8


def test_step_input_errors():
    s, t, v, bandwidth = random_inputs(2, 3, 2, 4)
    out, state = sliced_relu_attention_step(s[..., 0], t[..., 0], v[..., 0, :])
    with pytest.raises(ValueError, match=r"expected s_t, t_t \(B, H\) and v_t \(B, H, D\)"):
        sliced_relu_attention_step(s, t[..., 0], v[..., 0, :])
    with pytest.raises(ValueError, match=r"state holds \(B, H, D\) = \(2, 3, 4\)"):
        sliced_relu_attention_step(s[:1, :, 0], t[:1, :, 0], v[:1, :, 0, :], state)
    with pytest.raises(ValueError, match="state of sliced_relu decoding"):
        sliced_relu_bump_attention_step(s[..., 1], t[..., 1], v[..., 1, :], bandwidth, state)
    with pytest.raises(TypeError, match="SlicedDecodeState or None"):
        sliced_relu_attention_step(s[..., 1], t[..., 1], v[..., 1, :], (state.keys,))  # a tuple of runs
    with pytest.raises(ValueError, match=r"bandwidth must have shape \(H,\) = \(3,\)"):
        sliced_relu_bump_attention_step(s[..., 0], t[..., 0], v[..., 0, :], bandwidth[:2])
    assert isinstance(state, SlicedDecodeState)
