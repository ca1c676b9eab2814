"""Sliced ReLU's backward walk fits two blocks per SM on A100 and H100/H200 (sm_80, sm_90) by the
compiler's own register count: uncapped it took 188-197 registers a thread at 8 warps, one block of
256 threads per SM (12.5 % occupancy), and the walk is bound by latency, not bytes."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from attnlab.attention.common.triton.occupancy import A100, H100, blocks_per_sm  # noqa: E402
from triton_builds import LaunchSpy, build, launch_options, resource_usage  # noqa: E402


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_backward_walk_fits_two_blocks_per_sm(target, dtype):
    usage = resource_usage(build("relu_backward_kernel", target, dtype))
    warps = launch_options("relu_backward_kernel", target, dtype)[2]["num_warps"]
    sm = A100 if target == "sm_80" else H100
    assert blocks_per_sm(usage["REG"], warps, usage["SHARED"], sm) >= 2, f"{usage} at {warps} warps"


def test_the_op_launches_the_walk_with_that_cap(monkeypatch):
    """The build above takes the cap from the launch options; the op itself must pass it too."""
    import torch

    from attnlab.attention import ops
    from attnlab.attention.common.triton import runtime
    from attnlab.attention.sliced_relu.triton import TUNING

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = runtime.kernels()
    spy = LaunchSpy(kernels.relu_backward_kernel)
    monkeypatch.setattr(kernels, "relu_backward_kernel", spy)
    s, t = (torch.randn(1, 2, 40, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 40, 8, requires_grad=True)
    ops.sliced_relu_attention(s, t, v, impl="triton", path="sorted").sum().backward()
    assert spy.seen["maxnreg"] == TUNING.backward_max_registers == 128
