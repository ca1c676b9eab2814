"""Which implementation runs: CPU tensors never reach Triton unless asked (and interpreted); bad
``impl`` values and impossible requests are refused by name; the kernels compile for the GPU."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from attnlab.attention import ops
from attnlab.attention.common.triton import runtime

triton = pytest.importorskip("triton")


def small():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(1, 2, 9, generator=gen), torch.randn(1, 2, 9, generator=gen)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    return s, t, q, k, v


CALLS = {
    "sliced_relu_attention": lambda s, t, q, k, v, **kw: ops.sliced_relu_attention(s, t, v, **kw),
    "sliced_relu_bump_attention": lambda s, t, q, k, v, **kw: ops.sliced_relu_bump_attention(
        s, t, v, torch.ones(2), **kw
    ),
    "linear_attention": lambda s, t, q, k, v, **kw: ops.linear_attention(q, k, v, causal=True, **kw),
}


@pytest.fixture
def no_kernels(monkeypatch):
    """Fail loudly if anything loads the Triton kernels."""

    def refuse():
        raise AssertionError("the Triton kernels were reached")

    monkeypatch.setattr(runtime, "kernels", refuse)
    for module in (
        "attnlab.attention.sliced_common.triton_scores",
        "attnlab.attention.sliced_relu.triton",
        "attnlab.attention.sliced_relu_bump.triton",
        "attnlab.attention.linear.triton",
    ):
        if module in sys.modules:
            monkeypatch.setattr(sys.modules[module], "kernels", refuse)


@pytest.mark.parametrize("op", sorted(CALLS))
@pytest.mark.parametrize("interpreted", [False, True], ids=["plain", "TRITON_INTERPRET=1"])
def test_auto_keeps_cpu_tensors_on_torch(op, interpreted, monkeypatch, no_kernels):
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = small()
    auto = CALLS[op](*args)
    assert torch.equal(auto, CALLS[op](*args, impl="torch"))


@pytest.mark.parametrize("op", sorted(CALLS))
def test_triton_on_cpu_needs_the_interpreter(op, monkeypatch, no_kernels):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"^{op}: no implementation accepts this call") as err:
        CALLS[op](*small(), impl="triton")
    message = str(err.value)
    assert "\n" not in message
    assert re.search(
        r"triton \[triton, [^]]*\]: runs CUDA tensors \(CPU tensors under Triton's interpreter: "
        r"TRITON_INTERPRET=1 and impl='triton'\), got CPU tensors",
        message,
    )


@pytest.mark.parametrize("op", sorted(CALLS))
def test_unknown_impl_lists_the_choices(op):
    with pytest.raises(ValueError, match=f"{op}: impl must be one of 'auto', 'triton', 'torch', got 'cuda'"):
        CALLS[op](*small(), impl="cuda")


def test_interpreter_switched_on_after_import(monkeypatch):
    """triton and the ops already imported (and the compiled kernels loaded) before the variable
    is set: the interpreted kernels are loaded for the call all the same."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    runtime.kernels()  # the compiled variant, as on a GPU machine
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    s, t, q, k, v = small()
    got = ops.sliced_relu_attention(s, t, v, impl="triton")
    assert torch.allclose(got, ops.sliced_relu_attention(s, t, v, impl="torch"), atol=1e-6)
