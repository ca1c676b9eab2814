"""Every Triton kernel as the ops launch it, built for a GPU target with Triton's own compiler on a
CPU (ptxas and cuobjdump ship with triton): the table of kernels, their argument types and launch
options, one build function and the compiler's resource report. Shared by the compile matrix
(spills), the offset check (TTIR) and the occupancy check (registers).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import torch

from attnlab.attention.common.triton import runtime
from attnlab.attention.linear.triton import NUM_WARPS, launch_config, precision
from attnlab.attention.sliced_relu.triton import TUNING
from attnlab.attention.sliced_relu_bump.triton import BUMP as BUMP_TUNING
from attnlab.attention.sliced_relu_bump.triton import dot_format

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
    """The walk's sinks per program and its sources' table blocks, as ``bump.walk`` launches it."""
    sinks = (BUMP_TUNING.sinks, BUMP_TUNING.query_sinks, BUMP_TUNING.key_sinks)[mode]
    table_blocks = BUMP_TUNING.query_sinks if mode == 2 else BUMP_TUNING.sinks
    return {"BS": sinks, "RPB": table_blocks // BUMP_TUNING.table}


LINEAR = {"HAS_MASK": True, "HAS_START": True, "BD": 64, "BDV": 64}
# kernel -> (argument types, constants); every flag on, the widest tiles the ops launch (D ≤ 64 per block)
KERNELS = {
    "stream_kernel": (
        ["*i32", VAL, F32, F32, F32, F32, F32, VAL, F32, "*i64", *["i32"] * 6],
        {"HAS_XSHIFT": True, "HAS_W": True, "HAS_CARRY": True, "HAS_SEGMENTS": True, **STREAM},
    ),
    "stream_totals_kernel": (
        ["*i32", VAL, F32, F32, F32, F32, F32, F32, "*i64", *["i32"] * 5],
        {
            "HAS_XSHIFT": True,
            "HAS_W": True,
            "SINKS_AS_SOURCES": False,
            "HAS_C4": True,
            "SCALARS": True,
            "HAS_SEGMENTS": True,
            **STREAM,
        },
    ),
    "relu_backward_kernel": (
        ["*i32", VAL, F32, F32, F32, VAL, F32, F32, VAL, F32, F32, F32, "*i1", "*i64", *["i32"] * 6],
        {"HAS_W": True, "HAS_KCARRY": True, "HAS_SEGMENTS": True, **STREAM},
    ),
    # ReLU-bump: the keys' prefix table, then the walk in its three modes (forward, query and key
    # sides of the backward); scores in the accumulation dtype, tables float64
    "bump_table_kernel": (
        ["*i32", F32, VAL, "*i32", F64, F64, "*i64", *["i32"] * 4],
        {"HAS_SEGMENTS": True, **{k: v for k, v in BUMP.items() if k != "BK"}},
    ),
    **{
        f"bump_walk_kernel[{name}]": (
            [F32, "*i32", F32, "*i32", VAL, VAL, F64, F64, "*i32", F32, F32, "*i32", "*i32"]
            + [VAL, F32, F64, F64, F64, "*i1", "*i32", "*i64", *["i32"] * 7],
            {
                "MODE": mode,
                "KEY_SINKS": mode == 2,
                "STATS": False,
                "HAS_SEGMENTS": True,
                **BUMP,
                **_bump_blocks(mode),
            },
        )
        for mode, name in enumerate(("fwd", "query", "key"))
    },
    # scalar (N, T) passes, in the accumulation dtype whatever the op's
    **{
        f"bump_plan_kernel[{name}-scalar]": (
            [F32, F32, "*i32", F32, "*i32", "*i64", "i32", "i32"],
            {"KEY_SINKS": keys, "SINKS": BUMP_TUNING.sinks, "HAS_SEGMENTS": True, "BLOCK": 64},
        )
        for keys, name in ((False, "queries"), (True, "keys"))
    },
    "score_prologue_kernel[scalar]": (
        [F32, F32, "*i1", "*i1", F32, F32, F32, F32, F32, "*i8", "i32"],
        {"HAS_VALID": True, "HAS_QUERIES": True, "BLOCK": 1024},
    ),
    # the chunks' carries, float64 inside: centred (the forward's mean first) and above (the
    # backward's queries, backwards over the chunks); mode 0 reads the same as 1, less the scalars
    **{
        f"chunk_carry_kernel[{name}-scalar]": ([F32] * 6 + ["i32"] * 3, {"MODE": mode, "BD": 64})
        for mode, name in ((1, "centred"), (2, "above"))
    },
    "relu_query_grads_kernel[scalar]": (
        ["*i64", F32, F32, F32, F32, F32, "*i1", "*i1", F32, F32, "i32", "i32"],
        {"HAS_QUERIES": True, "BLOCK": 1024},
    ),
    "relu_key_grads_kernel[scalar]": (
        [F32, "*i64", "*i64", F32, "*i1", "*i1", F32, "i32", "i32"],
        {"HAS_VALID": True, "BLOCK": 1024},
    ),
    "merge_kernel[scalar]": (
        ["*i32", "*i64", F32, "*i32", "*i64", F32, "*i32", "*i64", F32, "i32"],
        {"BLOCK": 1024},
    ),
    "relu_scalars_kernel[scalar]": (
        [F32, "*i64", "*i32", F32, F32, F32, "*i1", "*i1", *[F32] * 5, "i32"],
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
    for dtype in (["fp32"] if kernel.endswith("scalar]") else DTYPES)
]


def launch_options(kernel: str, target: str, dtype: str) -> tuple[list[str], dict, dict]:
    """(types, constants, compile options) of ``kernel`` as the op launches it."""
    types, constants = KERNELS[kernel]
    types = [f"*{dtype}" if t == VAL else t for t in types]
    constants = dict(constants)
    options = {"num_warps": BUMP_TUNING.num_warps if kernel.startswith("bump_") else TUNING.num_warps}
    if kernel == "relu_backward_kernel":
        options["maxnreg"] = TUNING.backward_max_registers
    if kernel.startswith("bump_walk_kernel"):
        constants.update(dot_format(DTYPES[dtype], torch.float32, TARGETS[target]))
    if kernel.startswith("linear_"):
        config = launch_config(DTYPES[dtype], TARGETS[target])
        constants.update(C=config.pop("C"), PRECISION=precision(DTYPES[dtype]))
        options = {"num_warps": NUM_WARPS, **config}
    return types, constants, options


def build(kernel: str, target: str, dtype: str, **options):
    """``kernel`` compiled for ``target`` as the op launches it in ``dtype`` (``options`` override the
    launch's); Triton's cache makes a second build of the same case cheap."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    previous = os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernels, whatever the mode
    try:
        fn = getattr(runtime.kernels(), kernel.split("[")[0])
    finally:
        if previous is not None:
            os.environ["TRITON_INTERPRET"] = previous
    types, constants, launch = launch_options(kernel, target, dtype)
    names = [n for n in fn.arg_names if n not in constants]
    assert len(names) == len(types), f"{kernel}: signature out of date"
    signature = {**dict(zip(names, types, strict=True)), **dict.fromkeys(constants, "constexpr")}
    major, minor = TARGETS[target]
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 10 * major + minor, 32),
        options={**launch, **options},
    )


def cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(compiled) -> dict[str, int]:
    """The compiler's report of a build: ``REG`` (registers a thread), ``STACK`` (bytes of spills a
    thread), ``SHARED`` (bytes a block), from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        done = subprocess.run([cuobjdump(), "-res-usage", handle.name], capture_output=True, text=True)
    return {key: int(done.stdout.split(f"{key}:")[1].split()[0]) for key in ("REG", "STACK", "SHARED")}


class LaunchSpy:
    """Stands in for a kernel of ``runtime.kernels()`` and records the keyword arguments of each
    launch (``seen``) before launching the real kernel: what the op really passes, checked."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.update(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch
