"""Π of a decoding step by one C++ call (`step_scores`): equal to the module, and only where it applies."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from attnlab.attention.common import native
from attnlab.attention.sliced_common import step_scores


@pytest.fixture(autouse=True)
def kernels_built(monkeypatch):
    monkeypatch.delenv(native.SWITCH, raising=False)
    if native.library(step_scores.KERNELS) is None:
        pytest.skip("no C++ compiler: the module runs")


def mlp(width=48, hidden=40, outs=3, dtype=torch.float32, act=None):
    torch.manual_seed(0)
    act = nn.GELU() if act is None else act
    return nn.Sequential(nn.Linear(width, hidden), act, nn.Linear(hidden, outs)).to(dtype).eval()


def state():
    """What keeps the transposed map: a decoding state (any object with attributes will do)."""
    return types.SimpleNamespace()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("rows", [1, 2, 5, step_scores.MAX_ROWS])
def test_kernel_equals_the_module(dtype, tol, rows):
    slicer = mlp(dtype=dtype)
    x = torch.randn(rows, 48, dtype=dtype) * 3
    with torch.no_grad():
        got = step_scores.scores(slicer, x, state())
        expected = slicer(x)
    assert got is not None and got.dtype == dtype and got.shape == (rows, 3)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_idle_dropout_after_the_gelu_is_allowed():
    slicer = mlp(act=nn.Sequential(nn.GELU(), nn.Dropout(0.3)))
    x = torch.randn(2, 48)
    with torch.no_grad():
        torch.testing.assert_close(step_scores.scores(slicer, x, state()), slicer(x), rtol=1e-5, atol=1e-6)
        slicer.train()  # dropout at work: the module's own draws
        assert step_scores.scores(slicer, x, state()) is None


class Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.mark.parametrize(
    "slicer",
    [
        nn.Linear(48, 3),  # a linear Π: one small op already
        mlp(act=nn.GELU(approximate="tanh")),
        mlp(act=nn.ReLU()),
        nn.Sequential(nn.Linear(48, 40, bias=False), nn.GELU(), nn.Linear(40, 3)),
        nn.Sequential(Scaled(48, 40), nn.GELU(), nn.Linear(40, 3)),  # a subclass computes otherwise
    ],
    ids=["linear", "tanh-gelu", "relu", "no-bias", "subclass"],
)
def test_other_projections_run_the_module(slicer):
    with torch.no_grad():
        assert step_scores.scores(slicer, torch.randn(2, 48), state()) is None


def test_hooks_autocast_gradients_shapes_and_no_state_run_the_module():
    slicer = mlp()
    x = torch.randn(2, 48)
    assert step_scores.scores(slicer, x, state()) is None  # autograd on: the module keeps the graph
    with torch.no_grad():
        assert step_scores.scores(slicer, x, None) is None  # the first token: no state yet
        assert step_scores.scores(slicer, x.double(), state()) is None
        assert step_scores.scores(slicer, torch.randn(step_scores.MAX_ROWS + 1, 48), state()) is None
        assert step_scores.scores(slicer, torch.randn(2, 32), state()) is None  # the module names the error
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert step_scores.scores(slicer, x, state()) is None
        handle = slicer[2].register_forward_hook(lambda module, args, out: out * 0)
        assert step_scores.scores(slicer, x, state()) is None
        handle.remove()
        assert step_scores.scores(slicer, x, state()) is not None


def test_weights_changed_through_autograd_are_read_again():
    slicer, kept = mlp(), state()
    x = torch.randn(2, 48)
    with torch.no_grad():
        before = step_scores.scores(slicer, x, kept)
        slicer[0].weight.mul_(-2.0)  # as an optimiser step does: same storage, new version
        after = step_scores.scores(slicer, x, kept)
        torch.testing.assert_close(after, slicer(x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before, after)


def test_each_state_reads_the_weights_afresh():
    """A change that bypasses the version counter (``.data``) is seen by the next generation's state."""
    slicer = mlp()
    x = torch.randn(2, 48)
    with torch.no_grad():
        step_scores.scores(slicer, x, state())
        slicer[0].weight.data.mul_(-2.0)
        torch.testing.assert_close(step_scores.scores(slicer, x, state()), slicer(x), rtol=1e-5, atol=1e-6)


def test_parameters_made_under_inference_mode_run_the_module():
    with torch.inference_mode():  # such tensors keep no version counter to notice an update by
        slicer = mlp()
        x = torch.randn(2, 48)
        assert step_scores.scores(slicer, x, state()) is None
