"""float64 on CUDA runs the torch op under ``impl="auto"`` and is refused by name under ``"triton"``
(the float64 ReLU-bump key walk spills kilobytes of stack); the interpreter keeps float64 for the
exactness tests."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import ops
from attnlab.attention.sliced_common.dispatch import triton_takes_dtype

CUDA = torch.device("cuda")


@pytest.mark.parametrize("op", ["sliced_relu_attention", "sliced_relu_bump_attention"])
def test_float64_on_cuda_goes_to_torch_under_auto_and_is_refused_under_triton(op):
    assert triton_takes_dtype(op, "auto", CUDA, torch.float64) is False
    with pytest.raises(TypeError, match=f"^{op}: impl='triton' has no float64 kernel on CUDA; use impl="):
        triton_takes_dtype(op, "triton", CUDA, torch.float64)


def test_float32_accumulation_and_the_interpreter_keep_the_kernels():
    """Half and float32 inputs accumulate in float32: the kernels take them on CUDA."""
    assert triton_takes_dtype("sliced_relu_attention", "triton", CUDA, torch.float32)
    assert triton_takes_dtype("sliced_relu_attention", "triton", torch.device("cpu"), torch.float64)


def test_float64_through_the_op_under_the_interpreter_runs_triton(monkeypatch):
    """CPU tensors under TRITON_INTERPRET=1 with impl='triton' are not refused in float64."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    s, t = (torch.randn(1, 1, 9, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 1, 9, 4, generator=g, dtype=torch.float64)
    triton = ops.sliced_relu_attention(s, t, v, impl="triton", path="sorted")
    torch.testing.assert_close(triton, ops.sliced_relu_attention(s, t, v, impl="torch", path="sorted"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float64_on_a_gpu_auto_equals_torch_and_triton_is_refused():
    g = torch.Generator().manual_seed(1)
    s, t = (torch.randn(2, 2, 300, generator=g, dtype=torch.float64).cuda() for _ in range(2))
    v = torch.randn(2, 2, 300, 16, generator=g, dtype=torch.float64).cuda()
    width = torch.full((2,), 0.5, dtype=torch.float64, device="cuda")
    torch.testing.assert_close(
        ops.sliced_relu_attention(s, t, v, path="sorted"),
        ops.sliced_relu_attention(s, t, v, impl="torch", path="sorted"),
    )
    torch.testing.assert_close(
        ops.sliced_relu_bump_attention(s, t, v, width, path="sorted"),
        ops.sliced_relu_bump_attention(s, t, v, width, impl="torch", path="sorted"),
    )
    with pytest.raises(TypeError, match="no float64 kernel on CUDA"):
        ops.sliced_relu_bump_attention(s, t, v, width, impl="triton")
