"""Which implementation runs: CPU tensors never reach Triton unless asked (and interpreted); bad
``impl`` values and impossible requests are refused by name; the kernels compile for the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from attnlab.attention import ops
from attnlab.attention.triton import runtime

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
    for module in ("attnlab.attention.triton.sliced", "attnlab.attention.triton.linear"):
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
    with pytest.raises(runtime.TritonUnavailableError, match=f"{op}: impl='triton'.*TRITON_INTERPRET=1"):
        CALLS[op](*small(), impl="triton")


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


# ---- the compiled kernels: built for sm_90 by triton's own compiler (no GPU needed) ---------------

F32, F64, BF16 = "*fp32", "*fp64", "*bf16"
STREAM_FLAGS = dict(HAS_XSHIFT=True, HAS_W=True, HAS_C3=True, DOT_VEC=True, HAS_YSHIFT=True, HAS_CARRY=True)
COMPILE_CASES = {
    "stream_kernel": (
        ["*i32", BF16, *[F32] * 7, BF16, BF16, *[F32] * 5, *["i32"] * 6],
        {**STREAM_FLAGS, "WRITE": 2, "DOTS": True, "YSUM": True, "BLOCK": 32, "BD": 64},
    ),
    # ReLU-bump's float64 streams (sums, coefficients, out and dots in float64; values, g in float32)
    "stream_kernel[wide]": (
        ["*i32", F32, F32, F32, F64, F64, F64, F64, F32, F64, F32, F32, F64, F32, F64, F64, *["i32"] * 6],
        {**STREAM_FLAGS, "WRITE": 2, "DOTS": True, "YSUM": True, "BLOCK": 32, "BD": 32},
    ),
    "stream_totals_kernel[wide]": (
        ["*i32", F32, F32, F32, F64, F64, *["i32"] * 5],
        {"HAS_XSHIFT": True, "HAS_W": True, "BLOCK": 32, "BD": 32},
    ),
    "stream_totals_kernel": (
        ["*i32", BF16, F32, F32, F32, F32, *["i32"] * 5],
        {"HAS_XSHIFT": True, "HAS_W": True, "BLOCK": 32, "BD": 64},
    ),
    "linear_causal_fwd_kernel": (
        [BF16, BF16, BF16, "*i8", BF16, F32, *["i32"] * 4, "fp32"],
        {"HAS_MASK": True, "C": 32, "BD": 64, "BDV": 64, "PRECISION": "tf32"},
    ),
    "linear_causal_bwd_q_kernel": (
        [BF16, BF16, BF16, "*i8", BF16, F32, BF16, F32, F32, *["i32"] * 4, "fp32"],
        {"HAS_MASK": True, "C": 32, "BD": 64, "BDV": 64, "PRECISION": "tf32"},
    ),
    "linear_causal_bwd_kv_kernel": (
        [BF16, BF16, BF16, "*i8", F32, F32, BF16, BF16, *["i32"] * 5],
        {"HAS_MASK": True, "C": 32, "BD": 64, "BDV": 64, "PRECISION": "tf32"},
    ),
}


@pytest.mark.parametrize("name", sorted(COMPILE_CASES))
def test_kernel_compiles_for_sm90_without_spilling_much(name, monkeypatch):
    """The interpreter checks the arithmetic, not that the kernels compile: build each one for an
    H100/H200 (ptxas ships with triton) and read its register use and stack (spills)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = getattr(runtime.kernels(), name.split("[")[0])
    types, constants = COMPILE_CASES[name]
    names = [n for n in fn.arg_names if n not in constants]
    assert len(names) == len(types), f"{name}: signature out of date"
    signature = {**dict(zip(names, types, strict=True)), **dict.fromkeys(constants, "constexpr")}
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 8},
        )
    except RuntimeError as err:  # no ptxas in this triton build: nothing to check here
        if "ptxas" in str(err).lower():
            pytest.skip(f"cannot build for sm_90 here: {err}")
        raise
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):  # the check reads the stack size with it: without it, say so
        pytest.skip(f"no cuobjdump in this triton build ({cuobjdump}): spills not checked")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", handle.name], capture_output=True, text=True).stdout
    stack = int(usage.split("STACK:")[1].split()[0])
    assert stack <= 1024, f"{name}: {stack} bytes of stack (register spills): {usage}"
