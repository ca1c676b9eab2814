"""Sliced ReLU's backward walk fits two blocks per SM on A100 and H100/H200 (sm_80, sm_90) by the
compiler's own register count: uncapped it took 188-197 registers a thread at 8 warps, one block of
256 threads per SM (12.5 % occupancy), and the walk is bound by latency, not bytes."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton_builds import build, launch_options, resource_usage  # noqa: E402

REGISTERS_PER_SM = 65536  # sm_80 and sm_90


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_backward_walk_fits_two_blocks_per_sm(target, dtype):
    registers = resource_usage(build("relu_backward_kernel", target, dtype))["REG"]
    threads = 32 * launch_options("relu_backward_kernel", target, dtype)[2]["num_warps"]
    assert REGISTERS_PER_SM // (registers * threads) >= 2, f"{registers} registers x {threads} threads"
