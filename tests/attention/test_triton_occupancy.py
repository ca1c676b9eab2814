"""Sliced ReLU's backward walk fits two blocks per SM on A100 and H100/H200 (sm_80, sm_90) by the
compiler's own register count: uncapped it took 188-197 registers a thread at 8 warps, one block of
256 threads per SM (12.5 % occupancy), and the walk is bound by latency, not bytes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

REGISTERS_PER_SM = 65536  # sm_80 and sm_90
_MATRIX = Path(__file__).with_name("test_triton_compile.py")


def _matrix():
    spec = importlib.util.spec_from_file_location("triton_compile_matrix", _MATRIX)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_backward_walk_fits_two_blocks_per_sm(target, dtype, monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnlab.attention.triton import runtime

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    matrix = _matrix()
    fn = runtime.kernels().relu_backward_kernel
    types, constants, options = matrix._launch("relu_backward_kernel", target, dtype)
    names = [n for n in fn.arg_names if n not in constants]
    signature = {**dict(zip(names, types, strict=True)), **dict.fromkeys(constants, "constexpr")}
    major, minor = matrix.TARGETS[target]
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 10 * major + minor, 32),
        options=options,
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", handle.name], capture_output=True, text=True).stdout
    registers = int(usage.split("REG:")[1].split()[0])
    threads = 32 * options["num_warps"]
    assert REGISTERS_PER_SM // (registers * threads) >= 2, f"{registers} registers x {threads} threads"
