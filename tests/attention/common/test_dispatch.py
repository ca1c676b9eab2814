"""Implementations declare what they accept: the first that accepts a call runs it, and a call none
accepts is one line naming the op and each implementation tried with why it declined."""

from __future__ import annotations

import re

import pytest
import torch

from attnlab.attention import ops
from attnlab.attention.common.dispatch import (
    Implementation,
    NoImplementationError,
    Request,
    accepting,
    run_first,
)

CPU = torch.device("cpu")


def request(**fields):
    base = dict(
        op="toy_attention", device=CPU, device_type="cpu", dtype=torch.float32, length=100, head_dim=16
    )
    return Request(**{**base, **fields})


def toy(name, out, **declared):
    return Implementation(name, "free", lambda args: out, **declared)


def test_the_first_that_accepts_runs():
    implementations = [toy("short", 1, max_length=10), toy("any", 2), toy("never", 3)]
    assert run_first(implementations, request(), None) == 2
    assert run_first(implementations, request(length=10), None) == 1


def test_one_that_cannot_run_after_all_hands_over_to_the_next():
    """``run`` returning None (a kernel that did not build under ``auto``): the next that accepts."""
    assert run_first([toy("fails", None), toy("works", 2)], request(), None) == 2
    with pytest.raises(NoImplementationError, match=r"fails \[torch, free\]: could not run here"):
        run_first([toy("fails", None)], request(), None)


def test_every_declared_limit_is_a_reason():
    strict = toy(
        "strict",
        1,
        devices=("cuda",),
        dtypes=(torch.float32,),
        causal=(False,),
        max_head_dim=8,
        max_length=50,
        padded_queries=("zero",),
        deterministic=False,
        notes={"head_dim": "registers"},
    )
    reasons = strict.not_supported_reasons(
        request(dtype=torch.float64, causal=True, padded_queries="attend", deterministic=True)
    )
    assert reasons == [
        "runs CUDA tensors, got CPU tensors",
        "no float64 kernel on CPU",
        "no causal=True form",
        "runs head dims up to 8, got 16 (registers)",
        "runs T up to 50, got T=100",
        "no padded_queries='attend'",
        "not deterministic (torch.use_deterministic_algorithms is on)",
    ]


def test_impl_and_path_narrow_the_list_and_availability_is_asked_last():
    asked = []
    fast = toy("fast", 1, impl="triton", path="sorted", available=lambda r: asked.append(r) or "no GPU")
    dense = toy("dense", 2, path="dense", auto_length=lambda r: 64)
    assert fast.not_supported_reasons(request(impl="torch")) == ["is impl='triton'"]
    assert dense.not_supported_reasons(request(path="sorted")) == ["is path='dense'"]
    assert not asked  # filtered out before anything is asked
    assert dense.not_supported_reasons(request()) == [
        "path='auto' takes it up to T=64 on cpu float32, got T=100"
    ]
    assert dense.not_supported_reasons(request(path="dense")) == []  # named, past the crossover
    assert fast.not_supported_reasons(request()) == ["no GPU"] and len(asked) == 1
    assert accepting([fast, dense], request(length=64)) == [dense]


def test_none_accepting_is_one_line_naming_the_op_and_each_implementation():
    implementations = [toy("a", 1, max_length=10), toy("b", 2, impl="triton")]
    with pytest.raises(NoImplementationError) as err:
        run_first(implementations, request(impl="torch"), None)
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (
        "toy_attention: no implementation accepts this call (impl='torch', causal=False, cpu float32, "
        "T=100, head dim 16); tried a [torch, free]: runs T up to 10, got T=100 | b [triton, free]: "
        "is impl='triton'"
    )


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("sliced_relu_attention", lambda s, t, v, **kw: ops.sliced_relu_attention(s, t, v, **kw)),
        (
            "sliced_relu_bump_attention",
            lambda s, t, v, **kw: ops.sliced_relu_bump_attention(s, t, v, torch.ones(2), **kw),
        ),
    ],
)
def test_a_causal_request_to_the_triton_kernels_which_have_no_causal_form(op, call):
    s, t = torch.randn(1, 2, 9), torch.randn(1, 2, 9)
    v = torch.randn(1, 2, 9, 4)
    with pytest.raises(ValueError) as err:
        call(s, t, v, causal=True, impl="triton")
    message = str(err.value)
    assert message.startswith(f"{op}: no implementation accepts this call (impl='triton', causal=True, ")
    assert "\n" not in message
    assert re.search(
        r"triton \[triton, [^]]*\]: [^|]*no causal=True form \(no causal Triton kernel yet\)", message
    )
    for name in ("dense", "causal", "sorted"):
        assert re.search(rf"{name} \[torch, [^]]*\]: is impl='torch'", message), name
