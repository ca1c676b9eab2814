"""The choice between the dense O(T²) and the sorted evaluation of the sliced kernels (``path``).

Exactness of each path against the float64 references is in test_sorted.py,
test_causal.py and common/test_padding.py (every comparison there runs both paths). Here:
``auto`` picks dense up to the measured crossover and sorted above (which function ran, never how
fast), the two paths agree on non-finite scores, and bad ``path`` values get one clear line.
"""

from __future__ import annotations

import re

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.attention.common import native
from attnlab.attention.common.dispatch import Request, accepting
from attnlab.attention.ops import sliced_relu_attention, sliced_relu_bump_attention
from attnlab.attention.sliced_common.path import (
    CROSSOVER,
    DENSE_MAX_LENGTH,
    KERNEL_CROSSOVER,
    KERNEL_SOURCES,
    PATHS,
    crossover,
)
from attnlab.attention.sliced_relu import ops as relu_ops
from attnlab.attention.sliced_relu_bump import ops as bump_ops

F64 = torch.float64
OPS = {"relu": "sliced_relu_attention", "bump": "sliced_relu_bump_attention"}


def inputs(batch, heads, length, dim, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    s, t = (torch.randn(batch, heads, length, generator=gen, dtype=F64).to(dtype) for _ in range(2))
    v = torch.randn(batch, heads, length, dim, generator=gen, dtype=F64).to(dtype)
    return s, t, v, (torch.rand(heads, generator=gen, dtype=F64) + 0.3).to(dtype)


def call(kind, s, t, v, b, **kw):
    if kind == "relu":
        return sliced_relu_attention(s, t, v, **kw)
    return sliced_relu_bump_attention(s, t, v, b, **kw)


def spy(monkeypatch):
    """Record which implementation each public call reaches: ``dense`` or ``sorted``."""
    seen = []
    for module, name in (
        (relu_ops, "dense_sliced_relu"),
        (bump_ops, "dense_sliced_relu_bump"),
        (relu_ops, "dense_causal_sliced_relu"),
        (bump_ops, "dense_causal_sliced_relu_bump"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, **k: (seen.append("dense"), _real(*a, **k))[1]
        )
    for module, name in (
        (relu_ops, "causal_sliced_relu_attention"),
        (bump_ops, "causal_sliced_relu_bump_attention"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, **k: (seen.append("sorted"), _real(*a, **k))[1]
        )
    for cls in (relu_ops.SlicedReLU, bump_ops.SlicedReLUBump):
        real = cls.apply
        monkeypatch.setattr(cls, "apply", lambda *a, _real=real: (seen.append("sorted"), _real(*a))[1])
    return seen


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_auto_takes_dense_up_to_the_crossover_and_sorted_above(monkeypatch, kind, causal):
    op = ("causal_" if causal else "") + kind
    limit = crossover(op, torch.device("cpu"), torch.float32)
    assert limit > 0, f"no CPU float32 crossover measured for {op}"
    seen = spy(monkeypatch)
    for length in (1, limit, limit + 1):
        call(kind, *inputs(1, 1, length, 2), causal=causal)
    assert seen == ["dense", "dense", "sorted"]
    seen.clear()
    for path in ("dense", "sorted"):  # by hand, whatever the length
        call(kind, *inputs(1, 1, limit + 1, 2), causal=causal, path=path)
    assert seen == ["dense", "sorted"]


def test_half_inputs_share_float32s_crossover_and_float64_has_its_own(monkeypatch):
    seen = spy(monkeypatch)
    limit = crossover("relu", torch.device("cpu"), torch.float32)
    sliced_relu_attention(*[x.to(torch.bfloat16) for x in inputs(1, 1, limit, 2)[:3]])
    limit64 = crossover("relu", torch.device("cpu"), F64)
    sliced_relu_attention(*inputs(1, 1, limit64 + 1, 2, dtype=F64)[:3])
    assert seen == ["dense", "sorted"]


def test_every_crossover_entry_names_a_known_op_and_a_positive_length():
    for (op, device, dtype), length in CROSSOVER.items():
        assert op in ("relu", "bump", "causal_relu", "causal_bump")
        assert device in ("cpu", "cuda") and dtype in (torch.float32, F64)
        assert isinstance(length, int) and length > 0
    for (op, device, dtype), length in KERNEL_CROSSOVER.items():
        assert (op, device, dtype) in CROSSOVER and KERNEL_SOURCES[op].is_file()
        assert isinstance(length, int) and 0 <= length <= CROSSOVER[(op, device, dtype)]


@pytest.mark.parametrize(
    ("op", "float32", "float64"),
    [("relu", 32, 0), ("bump", 112, 16), ("causal_relu", 64, 32), ("causal_bump", 192, 96)],
)
def test_the_cpu_kernels_have_their_own_crossover_and_the_torch_code_keeps_its(
    op, float32, float64, monkeypatch
):
    """The sorted ops on the CPU run C++ kernels where they build, and overtake the dense path sooner
    (sliced ReLU in float64 at once); with the torch code (ATTNLAB_NATIVE=off) the measured CROSSOVER."""
    if native.library(KERNEL_SOURCES[op]) is None:
        pytest.skip("no C++ compiler or ninja")
    assert crossover(op, "cpu", torch.float32) == float32 and crossover(op, "cpu", F64) == float64
    monkeypatch.setenv(native.SWITCH, "off")
    assert crossover(op, "cpu", torch.float32) == CROSSOVER[(op, "cpu", torch.float32)]
    assert crossover(op, "cpu", F64) == CROSSOVER[(op, "cpu", F64)]


def accepted(kind, device, impl, path, length, causal=False):
    """The implementations of ``kind`` that accept such a call, in the order they are tried."""
    implementations = relu_ops.IMPLEMENTATIONS if kind == "relu" else bump_ops.IMPLEMENTATIONS
    call = Request("op", torch.device(device), device, torch.float32, impl, path, causal, 8, length)
    return [i.name for i in accepting(implementations, call)]


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_auto_on_an_unmeasured_device_stays_sorted_and_triton_means_sorted(kind, monkeypatch):
    assert accepted(kind, "meta", "auto", "auto", 8) == ["sorted"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert accepted(kind, "cpu", "triton", "auto", 8) == ["triton"]  # the sorted kernels, never dense
    assert accepted(kind, "cpu", "torch", "dense", DENSE_MAX_LENGTH) == ["dense"]
    assert accepted(kind, "cpu", "torch", "auto", 8, causal=True) == ["dense", "causal"]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_dense_beyond_its_range_is_one_line_naming_each_implementation(kind, causal):
    """``path="dense"`` past ``DENSE_MAX_LENGTH``: every implementation declines, in one line."""
    length = DENSE_MAX_LENGTH + 1
    s, t, v, b = (x[..., :1] if x.dim() == 4 else x for x in inputs(1, 1, length, 1))
    with pytest.raises(ValueError) as err:
        call(kind, s, t, v, b[:1], path="dense", causal=causal)
    message = str(err.value)
    assert message.startswith(f"{OPS[kind]}: no implementation accepts this call (impl='auto', path='dense'")
    assert "\n" not in message
    assert re.search(
        rf"dense \[torch, O\(T²\)[^]]*\]: runs T up to {DENSE_MAX_LENGTH}, got T={length}", message
    )
    for name in ("triton", "causal", "sorted"):
        assert re.search(rf"{name} \[[^]]*\]: is path='sorted'", message), name


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_bad_path_values_are_named(kind):
    s, t, v, b = inputs(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"path must be one of 'auto', 'dense', 'sorted', got 'fast'"):
        call(kind, s, t, v, b, path="fast")
    with pytest.raises(
        ValueError, match=r"dense \[torch, [^]]*\]: is impl='torch' \| triton \[[^]]*\]: is path='sorted'"
    ):
        call(kind, s, t, v, b, path="dense", impl="triton")
    with pytest.raises(ValueError, match=r"impl must be one of"):
        call(kind, s, t, v, b, path="dense", impl="cuda")


@pytest.mark.parametrize("name", ["sliced_relu", "sliced_relu_bump"])
def test_layer_path_option(name):
    with pytest.raises(ValueError, match=r"path must be one of 'auto', 'dense', 'sorted', got 'quick'"):
        build_attention(name, 8, 2, path="quick")
    x = torch.randn(2, 11, 8, dtype=F64)
    mask = torch.arange(11)[None, :] < torch.tensor([[11], [6]])
    outs = {}
    for path in PATHS:
        torch.manual_seed(0)
        layer = build_attention(name, 8, 2, path=path).double()
        assert layer.path == path
        outs[path] = layer(x, mask)
    for path in ("dense", "sorted"):
        torch.testing.assert_close(outs[path], outs["auto"], rtol=0, atol=1e-12)


# ---- non-finite scores: the dense path gives what the sorted path gives --------------------------

BAD = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
LENGTH = 13


def nonfinite_inputs(value, masked):
    """Row (0, 1) holds a bad key score, row (1, 0) a bad query score; with ``masked``, batch 1 is
    padded from position 9 and its padded slots hold bad scores (which must change nothing)."""
    s, t, v, b = inputs(2, 2, LENGTH, 3, seed=4, dtype=F64)
    t[0, 1, 4] = value
    s[1, 0, 2] = value
    mask = None
    if masked:
        mask = torch.arange(LENGTH)[None, :] < torch.tensor([[LENGTH], [9]])
        s[1, 1, 10], t[1, 1, 11] = value, value
    return (s, t, v, b), mask


def outputs_and_grads(kind, args, mask, path, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (args if kind == "bump" else args[:3])]
    out = call(kind, *leaves, *([] if kind == "bump" else [None]), key_padding_mask=mask, path=path, **kw)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return [out, *torch.autograd.grad(out, leaves, grad_out)]


@pytest.mark.parametrize("queries", ["zero", "attend"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("value", sorted(BAD))
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_dense_equals_sorted_with_nonfinite_scores(kind, value, masked, queries):
    args, mask = nonfinite_inputs(BAD[value], masked)
    kw = {"padded_queries": queries}
    sorted_path = outputs_and_grads(kind, args, mask, "sorted", **kw)
    dense_path = outputs_and_grads(kind, args, mask, "dense", **kw)
    for name, got, want in zip(["out", "s", "t", "v", "bandwidth"], dense_path, sorted_path, strict=False):
        assert torch.isnan(want).any(), f"{name}: the bad rows must show"
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN in different places"
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, equal_nan=True)


@pytest.mark.parametrize("path", ["dense", "sorted"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_an_empty_batch_gives_an_empty_output_and_gradients(kind, path, causal):
    """B = 0 (an empty last shard, a filtered batch) runs on both paths: nothing to reduce over."""
    s, t, v, b = (x.requires_grad_() for x in inputs(0, 2, 5, 3))
    out = call(kind, s, t, v, b, path=path, causal=causal)
    assert out.shape == (0, 2, 5, 3)
    out.sum().backward()
    assert s.grad.shape == s.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("shape", [(2, 0, 5, 3), (2, 2, 5, 0)], ids=["H=0", "D=0"])
@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_no_heads_or_no_value_columns_give_an_empty_output(kind, shape):
    batch, heads, length, dim = shape
    s, t = torch.randn(batch, heads, length), torch.randn(batch, heads, length)
    out = call(kind, s, t, torch.randn(shape), torch.ones(heads), path="sorted")
    assert out.shape == shape
