"""Every Triton kernel builds for V100, A100 and H100/H200 (sm_70, sm_80, sm_90) in fp16, bf16 and fp32
with the launch shapes the ops use, without spilling more than 1 KiB of registers per thread.

The interpreter checks the arithmetic, not that the kernels compile: triton's own compiler (ptxas ships
with triton) builds each one here, no GPU needed, and ``cuobjdump -res-usage`` reads its stack (spills).
The chunk and pipeline of causal linear attention come from ``launch_config``, as at launch.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

from attnlab.attention.triton import runtime

triton = pytest.importorskip("triton")
from attnlab.attention.triton.bump import BUMP as BUMP_TUNING  # noqa: E402
from attnlab.attention.triton.linear import NUM_WARPS, launch_config, precision  # noqa: E402
from attnlab.attention.triton.sliced import TUNING  # noqa: E402

SPILL_BOUND = 1024  # bytes of stack per thread
TARGETS = {"sm_70": (7, 0), "sm_80": (8, 0), "sm_90": (9, 0)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
F32, F64, VAL = "*fp32", "*fp64", "VAL"  # VAL: a tensor in the op's dtype
STREAM = {"BLOCK": TUNING.block, "BD": TUNING.block_d}
BUMP = {
    "BS": BUMP_TUNING.sinks,
    "BK": BUMP_TUNING.sources,
    "TB": BUMP_TUNING.table,
    "BD": BUMP_TUNING.block_d,
}


def _bump_blocks(mode: int) -> dict:
    """The walk's sinks per program and its sources' table blocks, as ``bump._walk`` launches it."""
    sinks = BUMP_TUNING.query_sinks if mode == 1 else BUMP_TUNING.sinks
    table_blocks = BUMP_TUNING.query_sinks if mode == 2 else BUMP_TUNING.sinks
    return {"BS": sinks, "RPB": table_blocks // BUMP_TUNING.table}


LINEAR = {"HAS_MASK": True, "HAS_START": True, "BD": 64, "BDV": 64}
# kernel -> (argument types, constants); every flag on, the widest tiles the ops launch (D ≤ 64 per block)
KERNELS = {
    "stream_kernel": (
        ["*i32", VAL, F32, F32, F32, F32, F32, VAL, F32, *["i32"] * 6],
        {"HAS_XSHIFT": True, "HAS_W": True, "HAS_CARRY": True, **STREAM},
    ),
    "stream_totals_kernel": (
        ["*i32", VAL, F32, F32, F32, F32, F32, F32, *["i32"] * 5],
        {
            "HAS_XSHIFT": True,
            "HAS_W": True,
            "SINKS_AS_SOURCES": False,
            "HAS_C4": True,
            "SCALARS": True,
            **STREAM,
        },
    ),
    "relu_backward_kernel": (
        ["*i32", VAL, F32, F32, F32, VAL, F32, F32, F32, VAL, F32, F32, F32, *["i32"] * 6],
        {"HAS_W": True, "HAS_KCARRY": True, **STREAM},
    ),
    # ReLU-bump: the keys' prefix table, then the walk in its three modes (forward, query and key
    # sides of the backward); scores in the accumulation dtype, tables float64
    "bump_table_kernel": (
        ["*i32", F32, VAL, "*i32", F64, F64, *["i32"] * 4],
        {k: v for k, v in BUMP.items() if k != "BK"},
    ),
    **{
        f"bump_walk_kernel[{name}]": (
            [F32, "*i32", F32, "*i32", VAL, VAL, F64, F64, "*i32", F32, F64, "*i32", "*i32"]
            + [VAL, F32, F64, F64, F64, *["i32"] * 7],
            {"MODE": mode, "KEY_SINKS": mode == 2, **BUMP, **_bump_blocks(mode)},
        )
        for mode, name in enumerate(("fwd", "query", "key"))
    },
    # scalar (N, T) passes, in the accumulation dtype whatever the op's
    "merge_kernel[scalar]": (["*i32", "*i64", "*i32", "*i64", "*i32", "*i64", "i32"], {"BLOCK": 1024}),
    "relu_scalars_kernel[scalar]": (
        [F32, "*i64", "*i32", F32, F32, F32, "*i1", *[F32] * 5, "i32"],
        {"HAS_QUERIES": True, "BLOCK": 1024},
    ),
    "linear_causal_state_kernel": (
        [VAL, VAL, "*i8", F32, F32, *["i32"] * 6],
        {k: v for k, v in LINEAR.items() if k != "HAS_START"},
    ),
    "linear_causal_fwd_kernel": (
        [VAL, VAL, VAL, "*i8", VAL, F32, F32, F32, *["i32"] * 4, "fp32", "i32", "i32"],
        LINEAR,
    ),
    "linear_causal_bwd_q_kernel": (
        [
            VAL,
            VAL,
            VAL,
            "*i8",
            VAL,
            F32,
            VAL,
            F32,
            F32,
            F32,
            F32,
            F32,
            F32,
            *["i32"] * 4,
            "fp32",
            "i32",
            "i32",
        ],
        LINEAR,
    ),
    "linear_causal_bwd_kv_kernel": (
        [VAL, VAL, VAL, "*i8", F32, F32, VAL, VAL, F32, F32, *["i32"] * 6],
        LINEAR,
    ),
}
CASES = [
    (kernel, target, dtype)
    for kernel in KERNELS
    for target in TARGETS
    for dtype in (["fp32"] if kernel.endswith("[scalar]") else DTYPES)
]


def _launch(kernel: str, target: str, dtype: str) -> tuple[list[str], dict, dict]:
    """(types, constants, compile options) of ``kernel`` as the op launches it."""
    types, constants = KERNELS[kernel]
    types = [f"*{dtype}" if t == VAL else t for t in types]
    constants = dict(constants)
    options = {"num_warps": BUMP_TUNING.num_warps if kernel.startswith("bump_") else TUNING.num_warps}
    if kernel == "relu_backward_kernel":
        options["maxnreg"] = TUNING.backward_max_registers
    if kernel.startswith("linear_"):
        config = launch_config(DTYPES[dtype], TARGETS[target])
        constants.update(C=config.pop("C"), PRECISION=precision(DTYPES[dtype]))
        options = {"num_warps": NUM_WARPS, **config}
    return types, constants, options


@pytest.mark.parametrize(("kernel", "target", "dtype"), CASES, ids=["-".join(case) for case in CASES])
def test_kernel_compiles_without_spilling(kernel, target, dtype, monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = getattr(runtime.kernels(), kernel.split("[")[0])
    types, constants, options = _launch(kernel, target, dtype)
    names = [n for n in fn.arg_names if n not in constants]
    assert len(names) == len(types), f"{kernel}: signature out of date"
    signature = {**dict(zip(names, types, strict=True)), **dict.fromkeys(constants, "constexpr")}
    major, minor = TARGETS[target]
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constants),
            target=GPUTarget("cuda", 10 * major + minor, 32),
            options=options,
        )
    except RuntimeError as err:  # no ptxas in this triton build: nothing to check here
        if "ptxas" in str(err).lower():
            pytest.skip(f"cannot build for {target} here: {err}")
        raise
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.fail(f"no cuobjdump in this triton build ({cuobjdump}): the spill check cannot run")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", handle.name], capture_output=True, text=True).stdout
    stack = int(usage.split("STACK:")[1].split()[0])
    assert stack <= SPILL_BOUND, (
        f"{kernel} {target} {dtype}: {stack} bytes of stack (register spills): {usage}"
    )


def test_the_launch_config_is_what_the_op_uses(monkeypatch):
    """The chunk the compile test builds is the one the op launches with (interpreter: sm_90's)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnlab.attention import ops

    seen = {}
    kernels = runtime.kernels()
    real = kernels.linear_causal_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs)
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(kernels, "linear_causal_fwd_kernel", Spy())
    for dtype, chunk in ((torch.float32, 16), (torch.bfloat16, 32)):
        q, k, v = (torch.randn(1, 1, 40, 16).to(dtype) for _ in range(3))
        seen.clear()
        ops.linear_attention(q, k, v, causal=True, impl="triton")
        assert seen["C"] == chunk and seen.get("num_stages") == launch_config(dtype, (9, 0)).get("num_stages")


def test_heads_wider_than_the_kernels_fit_run_on_torch_or_are_refused(monkeypatch):
    """D = 128 would spill the (D, Dv) state: `auto` keeps such heads on torch, `triton` says why."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnlab.attention import ops
    from attnlab.attention.triton.linear import MAX_HEAD_DIM

    q, k, v = (torch.randn(1, 1, 20, MAX_HEAD_DIM + 1) for _ in range(3))
    with pytest.raises(ValueError, match=f"impl='triton' runs head dims up to {MAX_HEAD_DIM}, got q/k 65"):
        ops.linear_attention(q, k, v, causal=True, impl="triton")
    expected = ops.linear_attention(q, k, v, causal=True, impl="torch")
    from attnlab.attention import linear

    # as on a GPU, `auto` resolves to Triton (and trusts it: no first-use check); the width check
    # must then choose torch
    monkeypatch.setattr(linear, "resolve_impl", lambda op, impl, *tensors: "triton")
    monkeypatch.setattr(linear.selfcheck, "trusted", lambda *args: True)
    monkeypatch.setattr(runtime.kernels(), "linear_causal_fwd_kernel", None)  # never reached
    assert torch.equal(ops.linear_attention(q, k, v, causal=True, impl="auto"), expected)
    narrow = [x[..., :MAX_HEAD_DIM] for x in (q, k, v)]
    with pytest.raises(TypeError):  # the kernel is reached at 64 (here: removed, so the call fails)
        ops.linear_attention(*narrow, causal=True, impl="auto")
