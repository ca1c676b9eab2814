"""``rows.sort_rows``, the CPU radix sort (``sort_kernels.cpp``), against ``torch.sort``: the same
values, NaN of either sign last, -0.0 beside 0.0, infinities and subnormals in place, an order that
gathers the values and keeps ties in index order; torch's sort under autograd."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.common import native
from attnlab.attention.sliced_common.rows import SORT_KERNELS, sort_rows


def awkward_rows(dtype, length, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, length, generator=gen, dtype=torch.float64).to(dtype)
    x[1] = torch.randint(-3, 4, (length,), generator=gen).to(dtype)  # ties everywhere
    x[2, ::3] = -0.0
    x[2, 1::3] = 0.0
    specials = [float("nan"), -float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).tiny / 4, -1e-30]
    x[3, : min(length, len(specials))] = torch.tensor(specials[:length], dtype=dtype)
    x[4] = x[4] * 1e30
    x[5] = 7.0  # every key alike: each pass is skipped
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 2, 5, 6, 2049, 5000])
def test_sort_rows_matches_torch_sort(dtype, length):
    if native.library(SORT_KERNELS) is None:
        pytest.skip("no C++ compiler or ninja")
    x = awkward_rows(dtype, length, seed=length)
    values, order = sort_rows(x)
    expected = torch.sort(x, dim=1).values
    nan = values.isnan()
    assert torch.equal(nan, expected.isnan())  # NaN last, both signs
    assert torch.equal(values[~nan], expected[~nan])
    assert torch.equal(torch.gather(x, 1, order).isnan(), nan)
    assert torch.equal(torch.gather(x, 1, order)[~nan], values[~nan])
    assert torch.equal(order.sort(dim=1).values, torch.arange(length).expand(6, -1))
    tied = values[:, 1:] == values[:, :-1]  # (-0.0 and 0.0 compare equal: any order is torch's too)
    same_bits = tied & (torch.signbit(values[:, 1:]) == torch.signbit(values[:, :-1]))
    assert (order[:, 1:] > order[:, :-1])[same_bits].all()  # ties in index order


def test_sort_rows_under_autograd_is_torch_sort():
    x = torch.randn(2, 9, requires_grad=True)
    values, _ = sort_rows(x)
    values.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
