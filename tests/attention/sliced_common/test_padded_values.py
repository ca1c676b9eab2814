"""NaN in the values of padded keys reaches nothing: the sorted sliced ops, bidirectional and causal,
with their C++ kernels and with the torch code, give what they give with those values zeroed
(outputs and gradients). A padded token's value is whatever the batch holds there; a product by a
weight of 0 keeps NaN, so the ops must not read it at all."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.common import native
from attnlab.attention.ops import sliced_relu_attention, sliced_relu_bump_attention

F64 = torch.float64
LENGTH, HEADS, DIM = 37, 2, 5


def _run(kind, causal, s, t, v, mask):
    s, t, v = (x.clone().requires_grad_() for x in (s, t, v))
    if kind == "relu":
        out = sliced_relu_attention(s, t, v, mask, causal=causal, path="sorted")
    else:
        width = torch.full((HEADS,), 0.7, dtype=F64)
        out = sliced_relu_bump_attention(s, t, v, width, mask, causal=causal, path="sorted")
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    (out * weights).sum().backward()
    return out.detach(), s.grad, t.grad, v.grad


@pytest.mark.parametrize("kind", ["relu", "bump"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("code", ["kernels", "torch"])
def test_nan_in_padded_values_reaches_no_output_or_gradient(kind, causal, code):
    gen = torch.Generator().manual_seed(0)
    s, t = (torch.randn(2, HEADS, LENGTH, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(2, HEADS, LENGTH, DIM, generator=gen, dtype=F64)
    mask = torch.arange(LENGTH)[None, :] < torch.tensor([[LENGTH - 6], [LENGTH]])  # row 0 padded
    padded = ~mask[:, None, :, None].expand_as(v)
    zeroed, poisoned = v.masked_fill(padded, 0.0), v.masked_fill(padded, float("nan"))
    if code == "torch":
        with native.torch_code():
            expected, got = _run(kind, causal, s, t, zeroed, mask), _run(kind, causal, s, t, poisoned, mask)
    else:
        expected, got = _run(kind, causal, s, t, zeroed, mask), _run(kind, causal, s, t, poisoned, mask)
    for name, a, b in zip(["out", "ds", "dt", "dv"], got, expected, strict=True):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
