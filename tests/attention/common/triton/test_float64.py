"""float64 on CUDA runs the torch op under ``impl="auto"`` and is refused by name under ``"triton"``
(the float64 ReLU-bump key walk spills kilobytes of stack); the interpreter keeps float64 for the
exactness tests."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import ops
from attnlab.attention.common.dispatch import NoImplementationError, Request, accepting, run_first
from attnlab.attention.sliced_relu.ops import IMPLEMENTATIONS as RELU
from attnlab.attention.sliced_relu_bump.ops import IMPLEMENTATIONS as BUMP

CUDA = torch.device("cuda")
FAMILIES = {"sliced_relu_attention": RELU, "sliced_relu_bump_attention": BUMP}


def request(op, dtype, impl="auto"):
    """A call on CUDA (declared: no GPU is needed to ask the declarations) at T = 1,000."""
    return Request(op, CUDA, "cuda", dtype, impl, "auto", False, 16, 1000)


def triton_reasons(op, dtype, impl="auto"):
    (triton,) = [i for i in FAMILIES[op] if i.name == "triton"]
    return triton.not_supported_reasons(request(op, dtype, impl))


@pytest.mark.parametrize("op", sorted(FAMILIES))
def test_float64_on_cuda_goes_to_torch_under_auto_and_is_refused_under_triton(op):
    assert [i.name for i in accepting(FAMILIES[op], request(op, torch.float64))] == ["sorted"]
    assert triton_reasons(op, torch.float64) == [
        "no float64 kernel on CUDA (its float64 key walk spills kilobytes of stack; the torch op runs "
        "float64 on the GPU)"
    ]
    with pytest.raises(
        NoImplementationError, match=f"^{op}: no implementation accepts this call .*float64"
    ) as err:
        run_first(FAMILIES[op], request(op, torch.float64, "triton"), None)
    assert "triton [triton, " in str(err.value) and "no float64 kernel on CUDA" in str(err.value)
    assert "\n" not in str(err.value)


def test_float32_accumulation_and_the_interpreter_keep_the_kernels(monkeypatch):
    """Half and float32 inputs accumulate in float32: the kernels take them on CUDA (once Triton
    can run there); the interpreter (CPU tensors) takes float64."""
    from attnlab.attention.common.triton import runtime

    monkeypatch.setattr(runtime, "triton_problem", lambda *args, **kwargs: None)
    assert triton_reasons("sliced_relu_attention", torch.float32, "triton") == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    on_cpu = Request("sliced_relu_attention", torch.device("cpu"), "cpu", torch.float64, "triton", "sorted")
    assert [i.name for i in RELU if not i.not_supported_reasons(on_cpu)] == ["triton"]


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
    with pytest.raises(ValueError, match="triton .*: no float64 kernel on CUDA"):
        ops.sliced_relu_bump_attention(s, t, v, width, impl="triton")
