"""Every Triton kernel builds for V100, A100 and H100/H200 (sm_70, sm_80, sm_90) in fp16, bf16 and fp32
with the launch shapes the ops use, without spilling more than 1 KiB of registers per thread (the fast
suite builds each kernel twice, every target and dtype among them; ``make test-all`` the whole matrix).

The interpreter checks the arithmetic, not that the kernels compile: triton's own compiler (ptxas ships
with triton) builds each one here, no GPU needed, and ``cuobjdump -res-usage`` reads its stack (spills).
The chunk and pipeline of causal linear attention come from ``launch_config``, as at launch.
"""

from __future__ import annotations

import os

import pytest
import torch

from attnlab.attention.common.triton import runtime

triton = pytest.importorskip("triton")
from attnlab.attention.linear.triton import launch_config  # noqa: E402
from triton_builds import CASES, LaunchSpy, build, cuobjdump, resource_usage  # noqa: E402

SPILL_BOUND = 1024  # bytes of stack per thread


SHARED = ("sm_80", "fp32")  # what the offset check (test_offsets.py) builds of every kernel


# make test: each kernel built once, for ``SHARED`` (Triton's cache has it from the offset check). The
# other targets and dtypes run the same Python (only Triton's compiler sees them), so they add minutes
# on a cold cache and no line of coverage: they stay in the matrix as ``slow`` (``make test-all``).
MATRIX = [
    pytest.param(*case, id="-".join(case), marks=() if case[1:] == SHARED else pytest.mark.slow)
    for case in CASES
]


@pytest.mark.parametrize(("kernel", "target", "dtype"), MATRIX)
def test_kernel_compiles_without_spilling(kernel, target, dtype):
    try:
        compiled = build(kernel, target, dtype)
    except RuntimeError as err:  # no ptxas in this triton build: nothing to check here
        if "ptxas" in str(err).lower():
            pytest.skip(f"cannot build for {target} here: {err}")
        raise
    if not os.path.exists(cuobjdump()):
        pytest.fail(f"no cuobjdump in this triton build ({cuobjdump()}): the spill check cannot run")
    usage = resource_usage(compiled)
    assert usage["STACK"] <= SPILL_BOUND, (
        f"{kernel} {target} {dtype}: {usage['STACK']} bytes of stack (register spills): {usage}"
    )


def test_the_launch_config_is_what_the_op_uses(monkeypatch):
    """The chunk the compile test builds is the one the op launches with (interpreter: sm_90's)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnlab.attention import ops

    kernels = runtime.kernels()
    spy = LaunchSpy(kernels.linear_causal_fwd_kernel)
    seen = spy.seen
    monkeypatch.setattr(kernels, "linear_causal_fwd_kernel", spy)
    for dtype, chunk in ((torch.float32, 16), (torch.bfloat16, 32)):
        q, k, v = (torch.randn(1, 1, 40, 16).to(dtype) for _ in range(3))
        seen.clear()
        ops.linear_attention(q, k, v, causal=True, impl="triton")
        assert seen["C"] == chunk and seen.get("num_stages") == launch_config(dtype, (9, 0)).get("num_stages")


def test_heads_wider_than_the_kernels_fit_run_on_torch_or_are_refused(monkeypatch):
    """D = 128 would spill the (D, Dv) state: `auto` keeps such heads on torch, `triton` says why."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnlab.attention import ops
    from attnlab.attention.linear.triton import MAX_HEAD_DIM

    q, k, v = (torch.randn(1, 1, 20, MAX_HEAD_DIM + 1) for _ in range(3))
    said = rf"triton \[triton, [^]]*\]: runs head dims up to {MAX_HEAD_DIM}, got 65 \(a wider \(D, Dv\) state"
    with pytest.raises(ValueError, match=said):
        ops.linear_attention(q, k, v, causal=True, impl="triton")
    expected = ops.linear_attention(q, k, v, causal=True, impl="torch")
    from attnlab.attention.linear import ops as linear

    # as on a GPU (CUDA tensors, a device Triton runs on), `auto` takes Triton where it accepts the
    # call (and trusts it: no first-use check); the width declared must then leave it to torch
    monkeypatch.setattr(runtime, "on_cuda", lambda tensors: True)
    monkeypatch.setattr(runtime, "_probe", lambda device: None)
    monkeypatch.setattr(runtime, "_PROBED", {})
    monkeypatch.setattr(linear.selfcheck, "trusted", lambda *args: True)
    monkeypatch.setattr(runtime.kernels(), "linear_causal_fwd_kernel", None)  # never reached
    assert torch.equal(ops.linear_attention(q, k, v, causal=True, impl="auto"), expected)
    narrow = [x[..., :MAX_HEAD_DIM] for x in (q, k, v)]
    with pytest.raises(TypeError):  # the kernel is reached at 64 (here: removed, so the call fails)
        ops.linear_attention(*narrow, causal=True, impl="auto")
