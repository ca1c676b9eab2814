"""``impl="auto"`` falls back to the torch code, with one warning naming the reason, when Triton
cannot build or launch a kernel on the device; ``impl="triton"`` raises with the reason.
No GPU here: the tensors are declared CUDA (``runtime.on_cuda``) and the failure is faked
where the kernels are loaded, or in the per-device probe."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.errors import PTXASError  # noqa: E402

from attnlab.attention import ops  # noqa: E402
from attnlab.attention.common.triton import runtime  # noqa: E402
from attnlab.attention.linear import triton as triton_linear  # noqa: E402
from attnlab.attention.sliced_common import triton_scores  # noqa: E402
from attnlab.attention.sliced_relu import triton as triton_sliced  # noqa: E402
from attnlab.attention.sliced_relu_bump import triton as triton_bump  # noqa: E402

PTXAS = "ptxas fatal   : Value 'sm_70a' is not defined for option 'gpu-name'"
# the sliced ops on their sorted path: at this length path="auto" would take the dense torch path
# (attnlab.attention.sliced_common.path), which never asks for Triton
CALLS = {
    "sliced_relu_attention": lambda s, t, q, k, v, **kw: ops.sliced_relu_attention(
        s, t, v, path="sorted", **kw
    ),
    "sliced_relu_bump_attention": lambda s, t, q, k, v, **kw: ops.sliced_relu_bump_attention(
        s, t, v, torch.ones(2), path="sorted", **kw
    ),
    "linear_attention": lambda s, t, q, k, v, **kw: ops.linear_attention(q, k, v, causal=True, **kw),
}


def small():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(1, 2, 9, generator=gen), torch.randn(1, 2, 9, generator=gen)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    return s, t, q, k, v


@pytest.fixture
def on_cuda(monkeypatch):
    """Tensors count as CUDA tensors; nothing probed or warned yet."""
    monkeypatch.setattr(runtime, "on_cuda", lambda tensors: True)
    monkeypatch.setattr(runtime, "_PROBED", {})
    monkeypatch.setattr(runtime, "_WARNED", set())


@pytest.fixture
def kernels_fail(monkeypatch, on_cuda):
    """The device probe passes, then building the op's kernels fails as ptxas fails; counts tries."""
    monkeypatch.setattr(runtime, "_probe", lambda device: None)
    tries = []

    def fail():
        tries.append(1)
        raise PTXASError(
            f"PTXAS error: Internal Triton PTX codegen error\n`ptxas` stderr:\n{PTXAS}\n\n// PTX ..."
        )

    for module in (triton_scores, triton_sliced, triton_bump, triton_linear):
        monkeypatch.setattr(module, "kernels", fail)
    return tries


@pytest.mark.parametrize("op", sorted(CALLS))
def test_auto_falls_back_with_one_warning(op, kernels_fail):
    args = small()
    with pytest.warns(RuntimeWarning) as caught:
        got = CALLS[op](*args)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"{op}: impl='auto' runs the torch code instead of the Triton kernels: ")
    assert PTXAS in message and "// PTX" not in message  # the reason, not pages of PTX
    assert torch.equal(got, CALLS[op](*args, impl="torch"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and the kernels are not tried again
        assert torch.equal(CALLS[op](*args), got)
    assert len(kernels_fail) == 1


@pytest.mark.parametrize("op", sorted(CALLS))
def test_triton_raises_with_the_reason(op, kernels_fail):
    with pytest.raises(
        runtime.TritonUnavailableError, match=f"{op}: impl='triton' cannot run: .*sm_70a"
    ) as caught:
        CALLS[op](*small(), impl="triton")
    assert "impl='auto' falls back" in str(caught.value)


@pytest.mark.parametrize("op", sorted(CALLS))
def test_probe_failure_keeps_auto_on_torch(op, on_cuda, monkeypatch):
    """The per-device probe (build and launch a tiny kernel) fails: no kernel of the op is tried."""
    reason = "Triton cannot run on cuda:0 (Tesla V100-SXM2-32GB, sm_70): CUDA driver too old"
    probes = []
    monkeypatch.setattr(runtime, "_probe", lambda device: probes.append(device) or reason)

    def refuse():
        raise AssertionError("the Triton kernels were reached")

    for module in (triton_scores, triton_sliced, triton_bump, triton_linear):
        monkeypatch.setattr(module, "kernels", refuse)
    args = small()
    with pytest.warns(RuntimeWarning, match="driver too old"):
        got = CALLS[op](*args)
    assert torch.equal(got, CALLS[op](*args, impl="torch"))
    with pytest.raises(ValueError, match=f"^{op}: no implementation accepts this call .*triton .*: ") as err:
        CALLS[op](*args, impl="triton")  # the Triton implementation declines with the probe's reason
    assert re.search(r"triton \[triton, [^]]*\]: " + re.escape(reason), str(err.value))
    assert len(probes) == 1  # once per device


def test_compile_problem_for_named_targets():
    """The probe kernel built for real targets (no GPU): V100 to Blackwell build, sm_130 does not."""
    for capability in [(7, 0), (7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0)]:
        assert runtime.compile_problem(capability) is None, capability
    problem = runtime.compile_problem((13, 0))
    assert problem.startswith(f"Triton {triton.__version__} cannot build kernels for sm_130: ")
    assert "\n" not in problem
