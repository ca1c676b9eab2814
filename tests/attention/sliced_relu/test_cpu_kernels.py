"""Sliced ReLU's C++ rank search (``cpu_kernels.cpp``, branchless, several queries in step) against
torch's ``searchsorted``, left and right: every length of a halving (1 to 17), ties, queries equal to
the first and last key, infinities and the padded keys' +inf."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.common import native
from attnlab.attention.sliced_relu.sorted import cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_ranks_equal_searchsorted(dtype):
    kernels = cpu_kernels(torch.zeros(1, dtype=dtype))
    if kernels is None:
        pytest.skip("no C++ compiler or ninja")
    gen = torch.Generator().manual_seed(0)
    for length in [*range(1, 18), 100]:
        rows = 5
        keys = torch.randint(-4, 5, (rows, length), generator=gen).to(dtype)  # many ties
        keys[1, length // 2 :] = float("inf")  # padded keys sort last at +inf
        keys = keys.sort(dim=1).values.contiguous()
        queries = torch.randint(-5, 6, (rows, length), generator=gen).to(dtype)
        queries[2] = keys[2]  # every query tied with a key, the first and the last among them
        queries[3, 0], queries[3, -1] = float("-inf"), float("inf")
        rank, rank_le = (
            torch.empty(rows, length, dtype=torch.int64),
            torch.empty(rows, length, dtype=torch.int64),
        )
        native.call_rows(kernels.ranks, (keys, queries.contiguous(), rank, rank_le), (rows, length, 1))
        assert torch.equal(rank, torch.searchsorted(keys, queries, side="left")), length
        assert torch.equal(rank_le, torch.searchsorted(keys, queries, side="right")), length
