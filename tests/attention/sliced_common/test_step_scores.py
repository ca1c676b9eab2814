"""Π of a decoding step by one C++ call (`step_scores`): equal to the module, and only where it applies."""

from __future__ import annotations

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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("rows", [1, 2, 5, step_scores.MAX_ROWS])
def test_kernel_equals_the_module(dtype, tol, rows):
    slicer = mlp(dtype=dtype)
    x = torch.randn(rows, 48, dtype=dtype) * 3
    with torch.no_grad():
        got = step_scores.scores(slicer, x)
        expected = slicer(x)
    assert got is not None and got.dtype == dtype and got.shape == (rows, 3)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_idle_dropout_after_the_gelu_is_allowed():
    slicer = mlp(act=nn.Sequential(nn.GELU(), nn.Dropout(0.3)))
    x = torch.randn(2, 48)
    with torch.no_grad():
        torch.testing.assert_close(step_scores.scores(slicer, x), slicer(x), rtol=1e-5, atol=1e-6)
        slicer.train()  # dropout at work: the module's own draws
        assert step_scores.scores(slicer, x) is None


@pytest.mark.parametrize(
    "slicer",
    [
        nn.Linear(48, 3),  # a linear Π: one small op already
        mlp(act=nn.GELU(approximate="tanh")),
        mlp(act=nn.ReLU()),
        nn.Sequential(nn.Linear(48, 40, bias=False), nn.GELU(), nn.Linear(40, 3)),
    ],
    ids=["linear", "tanh-gelu", "relu", "no-bias"],
)
def test_other_projections_run_the_module(slicer):
    with torch.no_grad():
        assert step_scores.scores(slicer, torch.randn(2, 48)) is None


def test_gradients_other_dtypes_and_many_rows_run_the_module():
    slicer = mlp()
    x = torch.randn(2, 48)
    assert step_scores.scores(slicer, x) is None  # autograd on: the module keeps the graph
    with torch.no_grad():
        assert step_scores.scores(slicer, x.double()) is None
        assert step_scores.scores(slicer, torch.randn(step_scores.MAX_ROWS + 1, 48)) is None
        assert step_scores.scores(slicer, x) is not None


def test_weights_changed_in_place_are_read_again():
    slicer = mlp()
    x = torch.randn(2, 48)
    with torch.no_grad():
        before = step_scores.scores(slicer, x)
        slicer[0].weight.mul_(-2.0)  # as an optimiser step does: same storage, new version
        after = step_scores.scores(slicer, x)
        torch.testing.assert_close(after, slicer(x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before, after)


def test_parameters_made_under_inference_mode_run_the_module():
    with torch.inference_mode():  # such tensors keep no version counter to notice an update by
        slicer = mlp()
        x = torch.randn(2, 48)
        assert step_scores.scores(slicer, x) is None
