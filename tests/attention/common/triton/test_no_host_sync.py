"""The Triton ops read nothing back to the host where host reads are off (CUDA tensors): no value
moved to Python (``_local_scalar_dense``: ``.item()``, ``bool(tensor)``) and no shape that depends on
values (``nonzero``, ``masked_select``), forward and backward, padded or not. A CUDA graph can capture
only such an op, and on a GPU each read would stall the stream.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, where the ops may read the host
to skip work; ``host_reads_allowed`` answers as it does for CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from attnlab.attention.common import compiler  # noqa: E402
from attnlab.attention.ops import (  # noqa: E402
    linear_attention,
    sliced_relu_attention,
    sliced_relu_bump_attention,
)

HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}


class HostReads(TorchDispatchMode):
    """Records the ops that read values back to the host or size a tensor by them."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def sliced_relu(s, t, v, b, mask):
    return sliced_relu_attention(s, t, v, mask, impl="triton", path="sorted")


def sliced_relu_bump(s, t, v, b, mask):
    return sliced_relu_bump_attention(s, t, v, b, mask, impl="triton", path="sorted")


def causal_linear(q, k, v, b, mask):
    return linear_attention(q[..., None].expand(*q.shape, 4), k[..., None].expand(*k.shape, 4), v, mask,
                            causal=True, impl="triton")  # fmt: skip


@pytest.mark.parametrize("op", [sliced_relu, sliced_relu_bump, causal_linear], ids=lambda f: f.__name__)
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_triton_ops_read_nothing_back_where_host_reads_are_off(op, padded, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(compiler, "host_reads_allowed", lambda x: False)  # as for CUDA tensors
    gen = torch.Generator().manual_seed(0)
    s, t = (torch.randn(2, 2, 40, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(2, 2, 40, 8, generator=gen).requires_grad_()
    bandwidth = torch.rand(2, generator=gen) + 0.3
    mask = torch.arange(40)[None, :] < torch.tensor([[40], [23]]) if padded else None
    with HostReads() as reads:
        out = op(s, t, v, bandwidth, mask)
        out.square().sum().backward()
    assert torch.isfinite(out).all() and v.grad is not None
    assert reads.seen == []
