"""The first-use check: under ``impl="auto"`` a Triton op that disagrees with the torch code on the
device is dropped for the rest of the run with one warning; ``compare``'s verdicts themselves."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnlab.attention import ops
from attnlab.attention.common.triton import runtime, selfcheck

pytest.importorskip("triton")


def test_compare_accepts_the_same_function_and_names_what_differs():
    g = torch.Generator().manual_seed(0)
    s, t = (torch.randn(1, 2, 50, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 50, 8, generator=g)
    op = ops.sliced_relu_attention
    same = selfcheck.compare(op, op, [s, t, v])
    assert same.ok and same.triton_err < 1e-5

    def off_in_v_gradient(s, t, v):
        return op(s, t, v * (1 + 1e-2 * torch.arange(8)))  # the output moves too, dv most

    wrong = selfcheck.compare(off_in_v_gradient, op, [s, t, v])
    assert not wrong.ok and wrong.triton_err > 1e-3
    assert "relative error" in wrong.describe() and "torch op" in wrong.describe()
    nan = selfcheck.compare(lambda s, t, v: op(s, t, v) * float("nan"), op, [s, t, v])
    assert not nan.ok and nan.triton_err == float("inf")


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """`auto` takes Triton as on CUDA (the tensors count as CUDA tensors, the device probe passes);
    the kernels run in the interpreter on CPU tensors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(runtime, "on_cuda", lambda tensors: True)
    monkeypatch.setattr(runtime, "_probe", lambda device: None)
    monkeypatch.setattr(runtime, "_PROBED", {})


def _scores(length=40, dim=8):
    g = torch.Generator().manual_seed(3)
    s, t = (torch.randn(1, 2, length, generator=g) for _ in range(2))
    return s, t, torch.randn(1, 2, length, dim, generator=g)


def test_a_kernel_that_disagrees_is_dropped_with_one_warning(as_on_a_gpu, monkeypatch):
    from attnlab.attention.sliced_relu import triton as sliced

    real = sliced.sliced_relu
    monkeypatch.setattr(sliced, "sliced_relu", lambda *args: real(*args) * 1.05)
    s, t, v = _scores()
    torch_out = ops.sliced_relu_attention(s, t, v, impl="torch", path="sorted")
    said = (
        r"^sliced_relu_attention: the Triton kernels disagree with the torch code on cpu "
        r"\(torch.float32\) in the first-use check: relative error"
    )
    with pytest.warns(RuntimeWarning, match=said) as caught:
        first = ops.sliced_relu_attention(s, t, v, path="sorted")
    assert len([w for w in caught if "disagree" in str(w.message)]) == 1
    torch.testing.assert_close(first, torch_out)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # said once: the second call is silent
        torch.testing.assert_close(ops.sliced_relu_attention(s, t, v, path="sorted"), torch_out)
    # asked for by name, the kernels run unchecked
    torch.testing.assert_close(
        ops.sliced_relu_attention(s, t, v, impl="triton", path="sorted"), torch_out * 1.05
    )


def test_kernels_that_agree_run_under_auto(as_on_a_gpu, monkeypatch):
    from attnlab.attention.sliced_relu_bump import triton as bump

    calls = []
    real = bump.sliced_relu_bump
    monkeypatch.setattr(bump, "sliced_relu_bump", lambda *args: calls.append(1) or real(*args))
    s, t, v = _scores()
    width = torch.tensor([0.6, 1.1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = ops.sliced_relu_bump_attention(s, t, v, width, path="sorted")
    assert len(calls) == 2  # the check (forward and backward), then the call itself
    torch.testing.assert_close(
        out, ops.sliced_relu_bump_attention(s, t, v, width, impl="torch", path="sorted")
    )


def test_causal_linear_attention_is_checked_too(as_on_a_gpu, monkeypatch):
    from attnlab.attention.linear import triton as triton_linear

    real = triton_linear.causal_linear_attention
    monkeypatch.setattr(triton_linear, "causal_linear_attention", lambda *args: real(*args).flip(-2))
    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="^linear_attention: the Triton kernels disagree"):
        out = ops.linear_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ops.linear_attention(q, k, v, causal=True, impl="torch"))


def test_an_error_in_the_check_is_a_failed_check(as_on_a_gpu, monkeypatch):
    from attnlab.attention.sliced_relu import triton as sliced

    def broken(*args):
        raise RuntimeError("illegal memory access\nmore lines")

    monkeypatch.setattr(sliced, "sliced_relu", broken)
    s, t, v = _scores()
    with pytest.warns(RuntimeWarning, match="first-use check: RuntimeError: illegal memory access; running"):
        out = ops.sliced_relu_attention(s, t, v, path="sorted")
    torch.testing.assert_close(out, ops.sliced_relu_attention(s, t, v, impl="torch", path="sorted"))


def test_a_first_call_under_inference_mode_is_checked_and_trusted(as_on_a_gpu, monkeypatch):
    """Lightning's sanity check and `trainer.test` run under inference mode: the check still has
    autograd there, passes, and the kernels serve the training steps after it."""
    from attnlab.attention.sliced_relu import triton as sliced

    calls = []
    real = sliced.sliced_relu
    monkeypatch.setattr(sliced, "sliced_relu", lambda *args: calls.append(1) or real(*args))
    s, t, v = _scores()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.inference_mode():
            ops.sliced_relu_attention(s, t, v, path="sorted")
        ops.sliced_relu_attention(s, t, v, path="sorted")
    assert len(calls) == 3  # the check, the call under inference mode, the call after it
