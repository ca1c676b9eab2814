"""Every test starts with no first-use verdict on the Triton kernels (``selfcheck.trusted``): a test
that breaks a kernel on purpose must not leave the torch fallback to the tests after it. ``cpu_code``
runs a test by the C++ kernels and by the torch code; ``interpret`` runs the Triton kernels under
Triton's interpreter."""

from __future__ import annotations

import shutil

import pytest

from attnlab.attention.common import native
from attnlab.attention.common.triton import selfcheck
from attnlab.attention.linear import decoding as linear_decoding
from attnlab.attention.sliced_common import decoding
from attnlab.attention.sliced_common.path import KERNEL_SOURCES
from attnlab.attention.sliced_common.rows import SORT_KERNELS
from attnlab.attention.sliced_relu import causal_native

#: every C++ source of the CPU kernels
CPU_KERNELS = [
    decoding.KERNELS,
    linear_decoding.KERNELS,
    SORT_KERNELS,
    causal_native.SOURCE,
    *dict.fromkeys(KERNEL_SOURCES.values()),
]


@pytest.fixture
def interpret(monkeypatch):
    """The Triton kernels under Triton's interpreter: on the CPU, for this test only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_first_use_checks():
    selfcheck.forget()
    yield
    selfcheck.forget()


@pytest.fixture(params=["native", "torch"])
def cpu_code(request, monkeypatch):
    """The ops and decoding steps by the C++ kernels (``attnlab.attention.common.native``: the CPU
    default) or by the torch code (other devices, decoding under autograd, no compiler). Where a
    compiler and ninja are installed the kernels must build: a silent fallback would test the torch
    code twice."""
    if request.param == "torch":
        monkeypatch.setenv(native.SWITCH, "off")
        return request.param
    monkeypatch.delenv(native.SWITCH, raising=False)
    if any(native.library(source) is None for source in CPU_KERNELS):
        if shutil.which("ninja") and shutil.which("c++"):
            pytest.fail(
                "the C++ CPU kernels did not build although c++ and ninja are installed (see the log)"
            )
        pytest.skip("no C++ compiler or ninja: the torch code is tested")
    return request.param
