"""Packed batches: the layout's gathers, first-fit rows, and every backend's layer on a packed batch
giving each sequence exactly what it gives that sequence alone (float64, outputs and gradients)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attnlab.attention import available_backends, backend_capabilities, build_attention
from attnlab.attention.common.packing import PackedLayout, first_fit
from attnlab.attention.sliced_common.path import crossover

DIM, HEADS = 12, 3
SLICED = ("sliced_relu", "sliced_relu_bump")
LENGTHS = [5, 3, 1, 7, 2, 2]
ROWS = [[0, 1, 2], [3], [4, 5]]  # three rows of 9 slots: full, 2 empty, 5 empty


def test_layout_places_each_sequence_end_to_end_in_its_row():
    layout = PackedLayout.from_rows(LENGTHS, ROWS)
    assert layout.unpack_index.shape == (6, 7) and layout.pack_index.shape == (3, 9)
    assert layout.mask.sum(1).tolist() == [5, 3, 1, 7, 2, 2]
    assert layout.row_mask.sum(1).tolist() == [9, 7, 4]
    assert layout.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0]
    x = torch.arange(27.0).view(3, 9, 1)
    seqs = layout.unpack(x)[..., 0]
    assert seqs[1, :3].tolist() == [5.0, 6.0, 7.0] and seqs[1, 3:].eq(0).all()
    assert seqs[3].tolist() == [9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert seqs[5, :2].tolist() == [20.0, 21.0]
    back = layout.pack(layout.unpack(x))
    torch.testing.assert_close(back, x * layout.row_mask[..., None])


def test_sequences_keep_their_batch_order_wherever_their_rows_put_them():
    layout = PackedLayout.from_rows([2, 3, 1], [[1], [2, 0]])
    x = torch.arange(6.0).view(2, 3, 1)
    assert layout.unpack(x)[..., 0].tolist() == [[4.0, 5.0, 0.0], [0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]


def test_layout_refuses_what_cannot_be_laid_out():
    with pytest.raises(ValueError, match="length >= 1"):
        PackedLayout.from_rows([3, 0], [[0, 1]])
    with pytest.raises(ValueError, match="must place each of the 2 sequences once"):
        PackedLayout.from_rows([3, 2], [[0], [0]])
    with pytest.raises(ValueError, match="row_length=4 is shorter than the fullest row \\(5 tokens\\)"):
        PackedLayout.from_rows([3, 2], [[0, 1]], row_length=4)
    layout = PackedLayout.from_rows([3, 2], [[1, 0]])
    with pytest.raises(ValueError, match=r"\(B, L\) = \(1, 5\)"):
        layout.check(torch.zeros(1, 6, 2))


def test_first_fit_fills_rows_without_splitting_a_sequence():
    lengths = [6, 2, 9, 3, 4, 1, 5]
    rows = first_fit(lengths, capacity=9)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 9 for row in rows)
    assert len(rows) == 4  # 30 tokens need at least 4 rows of 9
    assert rows[0] == [2]  # the longest opens the first row
    with pytest.raises(ValueError, match="a sequence of 9 tokens does not fit in a packed row of 8"):
        first_fit(lengths, capacity=8)


def _layer(name: str, **options):
    torch.manual_seed(0)
    if name == "performer":
        options.setdefault("redraw_interval", None)
    return build_attention(name, DIM, HEADS, **options).to(torch.float64).eval()


def _cases():
    for name in available_backends():
        yield pytest.param(name, False, False, {}, id=f"{name}")
        yield pytest.param(name, False, True, {}, id=f"{name}-rope")
        if backend_capabilities(name).causal:
            yield pytest.param(name, True, True, {}, id=f"{name}-causal-rope")
        if name in SLICED:  # the op on the packed rows (at 9 tokens `auto` lays each sequence out, dense)
            yield pytest.param(name, False, True, {"path": "sorted"}, id=f"{name}-rope-rows")
            yield pytest.param(name, True, True, {"path": "sorted"}, id=f"{name}-causal-rope-rows")


@pytest.mark.parametrize(("name", "causal", "rope", "options"), list(_cases()))
def test_packed_batch_gives_each_sequence_what_it_gets_alone(name, causal, rope, options):
    layer = _layer(name, causal=causal, rope=rope, **options)
    if options:  # the case of the op on the rows: 27 slots for 6 sequences laid out in 42
        layout = PackedLayout.from_rows(LENGTHS, ROWS)
        assert layer.attends_packed(torch.zeros(3, 9, DIM), layout)
    _check_packed_equals_alone(layer)


@pytest.mark.parametrize("name", SLICED)
def test_sliced_layers_attend_on_the_rows_where_it_pays(name):
    """``path="auto"``: rows up to the dense crossover lay each sequence out (dense), longer rows take
    the op on the rows where they save enough slots; ``"sorted"`` the rows where they save enough;
    ``"dense"`` never; causal layers as bidirectional ones, by their own crossover."""
    longest = crossover("relu" if name == "sliced_relu" else "bump", "cpu", torch.float32)

    def two_per_row(length):  # one row for a long and a short sequence: about 2x fewer slots than alone
        return torch.zeros(1, length, DIM), PackedLayout.from_rows([length - 1, 1], [[0, 1]])

    at, past = two_per_row(longest), two_per_row(longest + 1)
    full = torch.zeros(2, longest + 1, DIM), PackedLayout.from_rows([longest + 1, longest], [[0], [1]])
    auto = build_attention(name, DIM, HEADS)
    assert not auto.attends_packed(*at) and auto.attends_packed(*past)
    assert not auto.attends_packed(*full)  # rows as full as each sequence alone: the padded op
    assert build_attention(name, DIM, HEADS, path="sorted").attends_packed(*at)
    assert not build_attention(name, DIM, HEADS, path="dense").attends_packed(*past)
    assert build_attention(name, DIM, HEADS, causal=True, path="sorted").attends_packed(*at)
    causal_longest = crossover(f"causal_{'relu' if name == 'sliced_relu' else 'bump'}", "cpu", torch.float32)
    causal = build_attention(name, DIM, HEADS, causal=True)
    assert not causal.attends_packed(*two_per_row(causal_longest))
    assert causal.attends_packed(*two_per_row(causal_longest + 1))


def test_the_authors_score_layout_is_refused_by_name():
    # its Π rows mix neighbouring tokens, padding included: no packed batch reproduces that
    layout = PackedLayout.from_rows([2, 1], [[0, 1]])
    with pytest.raises(ValueError, match="score_layout='authors' cannot read a packed batch"):
        _layer("sliced_relu", score_layout="authors")(
            torch.zeros(1, 3, DIM, dtype=torch.float64), packing=layout
        )


def _check_packed_equals_alone(layer):
    layout = PackedLayout.from_rows(LENGTHS, ROWS)
    x = torch.randn(3, 9, DIM, dtype=torch.float64)
    x = x.masked_fill(~layout.row_mask[..., None], 100.0)  # empty slots hold garbage
    x.requires_grad_(True)
    packed = layer(x, packing=layout)
    seqs = layout.unpack(x.detach())
    lengths = layout.mask.sum(1).tolist()
    grad_out = torch.randn_like(packed) * layout.row_mask[..., None]  # a loss reads real tokens only
    packed.backward(grad_out)
    grad_packed = {n: p.grad.clone() for n, p in layer.named_parameters()}
    x_grad = x.grad.clone()
    layer.zero_grad()
    grad_seqs = layout.unpack(grad_out)
    for n, length in enumerate(lengths):
        alone_x = seqs[n : n + 1, :length].clone().requires_grad_(True)
        alone = layer(alone_x)
        torch.testing.assert_close(layout.unpack(packed)[n, :length], alone[0], rtol=1e-10, atol=1e-10)
        alone.backward(grad_seqs[n : n + 1, :length])
        torch.testing.assert_close(layout.unpack(x_grad)[n, :length], alone_x.grad[0], rtol=1e-9, atol=1e-10)
    for pname, p in layer.named_parameters():
        torch.testing.assert_close(grad_packed[pname], p.grad, rtol=1e-9, atol=1e-10, msg=pname)


def test_packing_and_a_padding_mask_together_are_refused():
    layer = _layer("softmax")
    layout = PackedLayout.from_rows([2, 1], [[0, 1]])
    with pytest.raises(ValueError, match="pass packing or key_padding_mask, not both"):
        layer(torch.zeros(1, 3, DIM, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool), layout)


def _segment_ops():
    from attnlab.attention.linear import linear_attention_segments
    from attnlab.attention.linear import reference as linear_reference
    from attnlab.attention.performer import reference as performer_reference
    from attnlab.attention.performer.ops import orthogonal_gaussian_projection
    from attnlab.attention.performer.segments import performer_attention_segments
    from attnlab.attention.softmax import reference as softmax_reference
    from attnlab.attention.softmax.ops import softmax_attention_segments

    projection = orthogonal_gaussian_projection(8, 4, torch.Generator().manual_seed(0))

    def performer(chunk):
        return lambda q, k, v, segments, causal: performer_attention_segments(
            q, k, v, projection, segments, causal, chunk_size=chunk
        )

    def performer_alone(q, k, v, causal):
        return performer_reference.performer_attention(q, k, v, projection, causal=causal)

    # chunks shorter than a sequence, sequences across chunk ends, one chunk
    return {
        "softmax": (softmax_attention_segments, softmax_reference.softmax_attention),
        **{
            f"linear-chunk{c}": (
                partial(linear_attention_segments, chunk_size=c),
                linear_reference.linear_attention,
            )
            for c in (1, 3, 64)
        },
        **{f"performer-chunk{c}": (performer(c), performer_alone) for c in (1, 3, 64)},
    }


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", list(_segment_ops()))
def test_ops_in_segments_equal_the_float64_reference_of_each_sequence(op, causal):
    """The ops that attend on packed rows: each query reads only its own sequence's keys."""
    segments_op, reference_op = _segment_ops()[op]
    layout = PackedLayout.from_rows(LENGTHS, ROWS)
    q, k, v = (torch.randn(3, 2, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = segments_op(q, k, v, layout.segments, causal)
    grad = torch.randn_like(out) * layout.row_mask[:, None, :, None]
    out.backward(grad)
    got = [layout.unpack_heads(y) for y in (out, q.grad, k.grad, v.grad)]
    for n, length in enumerate(LENGTHS):
        alone = [
            layout.unpack_heads(x.detach())[n : n + 1, :, :length].requires_grad_(True) for x in (q, k, v)
        ]
        want = reference_op(*alone, causal=causal)
        want.backward(layout.unpack_heads(grad)[n : n + 1, :, :length])
        for mine, theirs in zip(got, [want, *(x.grad for x in alone)], strict=True):
            torch.testing.assert_close(mine[n : n + 1, :, :length], theirs, rtol=1e-10, atol=1e-12)


def _every_op_on_packed_rows():
    from attnlab.attention import ops
    from attnlab.attention.linear.ops import linear_attention_segments
    from attnlab.attention.performer.ops import orthogonal_gaussian_projection
    from attnlab.attention.performer.segments import performer_attention_segments
    from attnlab.attention.softmax.ops import softmax_attention_segments

    bandwidth = torch.tensor([0.7, 1.3], dtype=torch.float64)
    projection = orthogonal_gaussian_projection(8, 4, torch.Generator().manual_seed(0))
    for causal in (False, True):
        tag = "causal" if causal else "bidirectional"
        yield pytest.param(partial(softmax_attention_segments, causal=causal), "qkv", id=f"softmax-{tag}")
        yield pytest.param(partial(linear_attention_segments, causal=causal), "qkv", id=f"linear-{tag}")
        yield pytest.param(
            partial(ops.sliced_relu_attention_segments, causal=causal), "scores", id=f"relu-{tag}"
        )
        bump = lambda s, t, v, seg, causal=causal: ops.sliced_relu_bump_attention_segments(  # noqa: E731
            s, t, v, bandwidth, seg, causal
        )
        yield pytest.param(bump, "scores", id=f"bump-{tag}")
        performer = lambda q, k, v, seg, causal=causal: performer_attention_segments(  # noqa: E731
            q, k, v, projection, seg, causal
        )
        yield pytest.param(performer, "qkv", id=f"performer-{tag}")


@pytest.mark.parametrize(("op", "inputs"), list(_every_op_on_packed_rows()))
def test_segment_ids_that_come_back_later_in_a_row_are_new_segments(op, inputs):
    """Ids need only differ between neighbouring segments (`segment_runs`): every op on packed rows
    gives the row (4, 4, 1, 1, 1, 4) three segments, the last one apart from the first."""
    gen = torch.Generator().manual_seed(0)
    segments, reused = torch.tensor([[4, 4, 1, 1, 1, 4]]), torch.tensor([[0, 0, 1, 1, 1, 2]])
    if inputs == "qkv":
        args = [torch.randn(1, 2, 6, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    else:
        args = [torch.randn(1, 2, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
        args.append(torch.randn(1, 2, 6, 4, generator=gen, dtype=torch.float64))
    torch.testing.assert_close(op(*args, segments), op(*args, reused))


@pytest.mark.parametrize("op", ["softmax", "linear-chunk64", "performer-chunk64"])
def test_segments_of_the_wrong_shape_are_refused_by_name(op):
    segments_op, _ = _segment_ops()[op]
    q, k, v = (torch.zeros(3, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match=r"segments must be \(B, L\) = \(3, 9\), got \(3, 8\)"):
        segments_op(q, k, v, torch.zeros(3, 8, dtype=torch.long), False)
