"""The sliced ops on packed rows: every sequence of a row gets what the float64 reference gives it
alone, outputs and every gradient, ties and window edges included; a broken sequence stays alone;
float32 keeps its precision at a large score offset; bad inputs are refused by name."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.attention.common import native
from attnlab.attention.common.packing import PackedLayout, first_fit
from attnlab.attention.sliced_common import causal as causal_common
from attnlab.attention.sliced_common.scores import standardise_scores, standardise_scores_prefix
from attnlab.attention.sliced_common.segments import (
    segment_runs,
    standardise_scores_prefix_segments,
    standardise_scores_segments,
)
from attnlab.attention.sliced_relu import reference as relu_reference
from attnlab.attention.sliced_relu.ops import sliced_relu_attention
from attnlab.attention.sliced_relu.segments import sliced_relu_attention_segments
from attnlab.attention.sliced_relu_bump import reference as bump_reference
from attnlab.attention.sliced_relu_bump.ops import sliced_relu_bump_attention
from attnlab.attention.sliced_relu_bump.segments import sliced_relu_bump_attention_segments

F64 = torch.float64
LENGTHS = [5, 3, 1, 7, 2, 2, 9]
ROWS = [[0, 1, 2], [3], [4, 5], [6]]  # rows of 9 slots: full, 2 empty, 5 empty, full
HEADS, DIM = 2, 4
BANDWIDTH = torch.tensor([0.5, 1.25], dtype=F64)  # 0.5: scores on a 0.25 grid meet the window edges


# the causal ops' dominance sums take dense chunks of 32 tokens and sorted levels above: rows of 80
CAUSAL_LENGTHS = [37, 3, 24, 1, 70, 9, 2]
CAUSAL_ROWS = [[0, 1, 2], [3, 4, 5], [6]]


def _inputs(grid: bool, seed: int = 0, lengths=LENGTHS, rows=ROWS):
    gen = torch.Generator().manual_seed(seed)
    layout = PackedLayout.from_rows(lengths, rows)
    rows, length = layout.pack_index.shape
    s, t = (torch.randn(rows, HEADS, length, generator=gen, dtype=F64) for _ in range(2))
    if grid:  # ties between queries and keys, and keys exactly at a window's edge
        s, t = (torch.round(x * 4) / 4 for x in (s, t))
    v = torch.randn(rows, HEADS, length, DIM, generator=gen, dtype=F64)
    return layout, s, t, v


def _run(kind, s, t, v, segments, bandwidth, causal=False, normaliser="count"):
    if kind == "relu":
        return sliced_relu_attention_segments(s, t, v, segments, causal=causal)
    return sliced_relu_bump_attention_segments(s, t, v, bandwidth, segments, causal, normaliser)


def _reference(kind, s, t, v, bandwidth, causal=False, normaliser="count"):
    if kind == "relu":
        op = relu_reference.causal_sliced_relu_attention if causal else relu_reference.sliced_relu_attention
        return op(s, t, v)
    if causal:
        return bump_reference.causal_sliced_relu_bump_attention(s, t, v, bandwidth, normaliser=normaliser)
    return bump_reference.sliced_relu_bump_attention(s, t, v, bandwidth)


def _check_each_sequence_alone(
    kind, layout, lengths, inputs, causal=False, normaliser="count", score_grads=True
):
    """Every sequence of the packed rows against the float64 reference of it alone: the output and
    the gradients of v, t and (``score_grads``) s and the bandwidth."""
    s, t, v = (x.requires_grad_(True) for x in inputs)
    s.requires_grad_(score_grads)
    b = BANDWIDTH.clone().requires_grad_(score_grads)
    out = _run(kind, s, t, v, layout.segments, b, causal, normaliser)
    grad = torch.randn_like(out) * layout.row_mask[:, None, :, None]  # empty slots read by no loss
    out.backward(grad)
    leaves = [s, t, v] if score_grads else [t, v]
    got = [layout.unpack_heads(x) for x in (out, *(x.grad for x in leaves))]
    grad_b = torch.zeros_like(b)
    for n, length in enumerate(lengths):
        alone = [
            layout.unpack_heads(x.detach())[n : n + 1, :, :length].requires_grad_(True) for x in (s, t, v)
        ]
        b_alone = BANDWIDTH.clone().requires_grad_(True)
        want = _reference(kind, *alone, b_alone, causal, normaliser)
        want.backward(layout.unpack_heads(grad)[n : n + 1, :, :length])
        theirs = [want, *(x.grad for x in (alone if score_grads else alone[1:]))]
        for mine, their in zip(got, theirs, strict=True):
            torch.testing.assert_close(mine[n : n + 1, :, :length], their, rtol=1e-10, atol=1e-12)
        if kind == "bump":
            grad_b += b_alone.grad
    if kind == "bump" and score_grads:
        torch.testing.assert_close(b.grad, grad_b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("grid", [False, True], ids=["random", "ties-and-edges"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_each_sequence_gets_what_the_reference_gives_it_alone(kind, grid):
    layout, *inputs = _inputs(grid)
    _check_each_sequence_alone(kind, layout, LENGTHS, inputs)


CAUSAL_CASES = [
    pytest.param("relu", "count", True, id="relu"),
    pytest.param("bump", "count", True, id="bump-count"),
    pytest.param("bump", "mass", True, id="bump-mass"),
    pytest.param("bump", "count", False, id="bump-no-score-grads"),  # the keys' side alone
]


@pytest.mark.parametrize("many_ties", [False, True], ids=["tied-pairs-listed", "tied-pairs-pass"])
@pytest.mark.parametrize("grid", [False, True], ids=["random", "ties-and-edges"])
@pytest.mark.parametrize(("kind", "normaliser", "score_grads"), CAUSAL_CASES)
def test_causal_each_sequence_gets_what_the_reference_gives_it_alone(
    kind, normaliser, score_grads, grid, many_ties, monkeypatch, cpu_code
):
    """Rows of 80 slots: sums inside the dense chunks and across the sorted levels (or blocks, by the
    C++ kernels), sequences that start mid-chunk; ``many_ties``: the tied pairs taken by a pass of
    their own, not from a list."""
    if many_ties:
        monkeypatch.setattr(causal_common, "TIE_PAIR_BUDGET", 0)
    layout, *inputs = _inputs(grid, lengths=CAUSAL_LENGTHS, rows=CAUSAL_ROWS)
    _check_each_sequence_alone(kind, layout, CAUSAL_LENGTHS, inputs, True, normaliser, score_grads)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_causal_random_packings_give_each_sequence_its_reference(kind, seed, cpu_code):
    """First-fit rows of 1 to 90 tokens into rows of 130: sequences of one token, sequences that fill
    a row, and the empty slots after them, at random places against the chunks and levels."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 91, (9,), generator=gen).tolist()
    layout = PackedLayout.from_rows(lengths, first_fit(lengths, capacity=130), 130)
    rows, length = layout.pack_index.shape
    s, t = (torch.randn(rows, HEADS, length, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(rows, HEADS, length, DIM, generator=gen, dtype=F64)
    _check_each_sequence_alone(kind, layout, lengths, [s, t, v], causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_a_non_finite_sequence_gives_nan_at_its_own_tokens_only(kind, causal):
    layout, s, t, v = _inputs(grid=False)
    clean = _run(kind, s, t, v, layout.segments, BANDWIDTH, causal)
    t[0, 1, 6] = float("nan")  # sequence 1 (row 0, slots 5-7), head 1
    v[2, 0, 1, 2] = float("inf")  # sequence 4 (row 2, slots 0-1), head 0
    out = _run(kind, s, t, v, layout.segments, BANDWIDTH, causal)
    broken = torch.zeros(out.shape[:3], dtype=torch.bool)  # (row, head, slot): each head is its own
    broken[0, 1, 5:8] = True
    broken[2, 0, 0:2] = True
    assert out[broken].isnan().all()
    torch.testing.assert_close(out[~broken], clean[~broken])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_float32_at_a_large_score_offset_keeps_float32_precision(kind, causal, monkeypatch):
    """One row of 8 sequences of 512 tokens (the running tables cross every sequence of the row)
    in float32 against float64: within 2.5x the error of each sequence alone through the padded op's
    torch code. Measured: ReLU 4.1e-7 (alone 2.1e-7; 3.7e-8 by the CPU kernel, which sums in double),
    bump 5.1e-7 (2.7e-7): the bidirectional prefix tables run over the whole row; causal: ReLU 1.14e-6
    (1.19e-6), bump 4.4e-7 (4.4e-7)."""
    monkeypatch.setenv(native.SWITCH, "off")
    gen = torch.Generator().manual_seed(3)
    segments = torch.arange(8).repeat_interleave(512)[None]
    s, t = (torch.randn(1, HEADS, 4096, generator=gen, dtype=F64) + 1000.0 for _ in range(2))
    v = torch.randn(1, HEADS, 4096, DIM, generator=gen, dtype=F64)
    s, t, v = (x.float().double() for x in (s, t, v))  # the float32 inputs, exactly

    def error(run, *inputs):
        want, got = run(*inputs, BANDWIDTH), run(*(x.float() for x in inputs), BANDWIDTH.float())
        return ((got.double() - want).norm() / want.norm()).item()

    def alone(s, t, v, b):  # each sequence in a row of its own: (8, H, 512)
        s, t, v = (x.view(HEADS, 8, 512, *x.shape[3:]).transpose(0, 1) for x in (s, t, v))
        if kind == "relu":
            return sliced_relu_attention(s, t, v, causal=causal, path="sorted")
        return sliced_relu_bump_attention(s, t, v, b, causal=causal, path="sorted")

    rows = error(lambda s, t, v, b: _run(kind, s, t, v, segments, b, causal), s, t, v)
    each_alone = error(alone, s, t, v)
    assert rows < 2.5 * each_alone, (rows, each_alone)


def test_segment_ids_need_only_differ_between_neighbouring_segments():
    runs = segment_runs(torch.tensor([[4, 4, 1, 1, 1, 4]]), heads=1)
    assert runs.local.tolist() == [[0, 0, 1, 1, 1, 2]]
    assert runs.start.tolist() == [[0, 0, 2, 2, 2, 5]]
    assert runs.size.tolist() == [[2, 2, 3, 3, 3, 1]]


@pytest.mark.parametrize(
    ("in_segments", "alone"),
    [
        (standardise_scores_segments, standardise_scores),
        (standardise_scores_prefix_segments, standardise_scores_prefix),
    ],
    ids=["sequence", "prefix"],
)
def test_standardisation_in_segments_is_each_sequence_standardised_alone(in_segments, alone):
    layout, s, t, _ = _inputs(grid=False)
    s, t = s + 50.0, t + 50.0  # an offset the running sums must not carry from one sequence to the next
    got = [layout.unpack_heads(x) for x in in_segments(s, t, layout.segments)]
    for n, length in enumerate(LENGTHS):
        one = (layout.unpack_heads(x)[n : n + 1, :, :length] for x in (s, t))
        for mine, theirs in zip(got, alone(*one, None), strict=True):
            torch.testing.assert_close(mine[n : n + 1, :, :length], theirs, rtol=1e-12, atol=1e-12)


def test_bad_inputs_are_refused_by_name():
    layout, s, t, v = _inputs(grid=False)
    with pytest.raises(TypeError, match="segments must be an integer tensor"):
        sliced_relu_attention_segments(s, t, v, layout.segments.double())
    with pytest.raises(ValueError, match=r"segments must have shape \(B, L\) = \(4, 9\), got \(4, 8\)"):
        sliced_relu_attention_segments(s, t, v, layout.segments[:, :8])
    with pytest.raises(ValueError, match=r"t must have shape \(B, H, L\) = \(4, 2, 9\)"):
        sliced_relu_attention_segments(s, t[..., :8], v, layout.segments)
    with pytest.raises(ValueError, match="eps must be > 0, got 0.0"):
        sliced_relu_attention_segments(s, t, v, layout.segments, eps=0.0)
    with pytest.raises(ValueError, match=r"bandwidth must have shape \(H,\) = \(2,\), got \(3,\)"):
        sliced_relu_bump_attention_segments(s, t, v, torch.ones(3, dtype=F64), layout.segments)
    with pytest.raises(ValueError, match="bandwidth must be finite and > 0"):
        sliced_relu_bump_attention_segments(s, t, v, torch.tensor([1.0, 0.0], dtype=F64), layout.segments)


@pytest.mark.parametrize(
    ("backend", "causal"),
    [
        ("sliced_relu", False),
        pytest.param("sliced_relu", True, marks=pytest.mark.slow),
        pytest.param("sliced_relu_bump", False, marks=pytest.mark.slow),
        pytest.param("sliced_relu_bump", True, marks=pytest.mark.slow),
    ],
)  # one compile each (3-5 s): the others, whose ops are called the same way, in make test-all
def test_a_packed_layer_compiles_without_a_graph_break(backend, causal):
    """`torch.compile(fullgraph=True)` traces the ops on packed rows (no host read, no data-dependent
    shape): the same outputs and gradients as eager."""
    layout = PackedLayout.from_rows(LENGTHS, ROWS)
    torch.manual_seed(0)
    layer = build_attention(backend, 16, HEADS, causal=causal, path="sorted")
    x = torch.randn(*layout.pack_index.shape, 16, requires_grad=True)
    assert layer.attends_packed(x, layout)
    eager = layer(x, packing=layout)
    eager.backward(torch.ones_like(eager))
    eager_grad, x.grad = x.grad, None
    compiled = torch.compile(lambda x: layer(x, packing=layout), fullgraph=True, backend="aot_eager")(x)
    compiled.backward(torch.ones_like(compiled))
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(x.grad, eager_grad)


def test_double_backward_is_refused_by_name():
    layout, *inputs = _inputs(grid=False)
    s, t, v = (x.requires_grad_(True) for x in inputs)
    out = sliced_relu_attention_segments(s, t, v, layout.segments)
    with pytest.raises(RuntimeError, match="sliced_relu_attention_segments: double backward") as refused:
        torch.autograd.grad(out.sum(), s, create_graph=True)
    assert "sliced_relu_attention(..., path='dense')" in str(refused.value)


def test_float32_gradients_of_sliced_relu_on_packed_rows_keep_float32_precision():
    """The backward's running sums over the whole row, read as differences at each segment's
    start: in float32 they kept the rounding of every earlier segment's sums (dL/dt 4e-4 off
    where each sequence alone is 5e-7)."""
    layout, *inputs = _inputs(False, seed=1, lengths=CAUSAL_LENGTHS, rows=CAUSAL_ROWS)
    results = []
    for dtype in (torch.float32, F64):
        s, t, v = (x.detach().to(dtype).requires_grad_(True) for x in inputs)
        out = sliced_relu_attention_segments(s, t, v, layout.segments, impl="torch")
        out.backward(torch.ones_like(out) * layout.row_mask[:, None, :, None])
        results.append([x.double() for x in (out, s.grad, t.grad, v.grad)])
    for name, got, want in zip(["out", "ds", "dt", "dv"], *results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * want.abs().max().item(), msg=name)


def test_float32_gradients_of_relu_bump_on_packed_rows_keep_float32_precision():
    """ReLU-bump's keys' side sums the queries' rows over the whole row, read inside each segment:
    dL/dv was 1.4e-6 off in float32 (each sequence alone 4e-8), 3e-7 with the sums restarted at
    each segment's end. (dL/dt stays about 8x its error alone: 2e-6 of 1.7.)"""
    layout, *inputs = _inputs(False, seed=1, lengths=CAUSAL_LENGTHS, rows=CAUSAL_ROWS)
    results = []
    for dtype in (torch.float32, F64):
        s, t, v = (x.detach().to(dtype).requires_grad_(True) for x in inputs)
        b = BANDWIDTH.to(dtype).requires_grad_(True)
        out = sliced_relu_bump_attention_segments(s, t, v, b, layout.segments)
        out.backward(torch.ones_like(out) * layout.row_mask[:, None, :, None])
        results.append([x.double() for x in (out, s.grad, t.grad, v.grad, b.grad)])
    tolerance = {"out": 1e-6, "ds": 1e-6, "dt": 2e-6, "dv": 1e-6, "db": 1e-6}
    for (name, tol), got, want in zip(tolerance.items(), *results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item(), msg=name)
