"""ReLU-bump's Triton walk on clustered scores: a block of sorted sinks that straddles two clusters
has its window edges in two far-apart groups of sources. Walking every tile between its first and
last sink's edges (the whole cluster between) made one program's walk tens of times the mean, the
slowest program setting the kernel's time; the walk visits only the tiles that hold some sink's
edge and jumps over each gap between them (``bump_walk_kernel``), so it stays near the mean.

Interpreted (``TRITON_INTERPRET=1``), float64, against the O(T²) reference: the jumps are exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention import reference as ref  # noqa: E402
from attnlab.attention.ops import sliced_relu_bump_attention  # noqa: E402
from attnlab.attention.sliced_relu_bump import triton as triton_bump  # noqa: E402

F64 = torch.float64
TUNING = {"sinks": 64, "query_sinks": 32, "key_sinks": 64, "sources": 16, "table": 32, "block_d": 16}


@pytest.fixture
def interpret(interpret, monkeypatch):
    """The shared interpreter fixture, with this file's tile sizes."""
    for name, value in TUNING.items():
        monkeypatch.setattr(triton_bump.BUMP, name, value)


def clustered(length: int, gen: torch.Generator) -> torch.Tensor:
    """Scores in two tight clusters, 3 apart (a bandwidth of 1 reaches across neither gap)."""
    return 3.0 * torch.randint(0, 2, (1, 1, length), generator=gen).to(F64) + 0.05 * torch.randn(
        1, 1, length, generator=gen, dtype=F64
    )


def span_walk(sinks: torch.Tensor, sources: torch.Tensor, width: float, block: int, tile: int) -> int:
    """The most tiles a block of sorted query sinks would walk between its first and last sink's
    window edges (every tile from ``#{t <= s - b}`` to ``#{t < s + b}``): the walk before."""
    s, t = sinks.sort().values, sources.sort().values
    low = torch.searchsorted(t, s - width, right=True) // tile
    high = torch.searchsorted(t, s + width) // tile
    return max(int(high[i : i + block].max() - low[i : i + block].min() + 1) for i in range(0, len(s), block))


def test_a_block_straddling_two_clusters_walks_about_as_far_as_the_others(interpret, monkeypatch):
    length, dim = 1024, 8
    gen = torch.Generator().manual_seed(3)
    s, t = clustered(length, gen), clustered(length, gen)
    v, grad_out = (torch.randn(1, 1, length, dim, generator=gen, dtype=F64) for _ in range(2))
    width = torch.ones(1, dtype=F64)
    stats = []
    monkeypatch.setattr(triton_bump, "WALK_STATS", stats)
    leaves = [x.clone().requires_grad_() for x in (s, t, v, width)]
    out = sliced_relu_bump_attention(*leaves, impl="triton")
    grads = torch.autograd.grad(out, leaves, grad_out)
    expected_leaves = [x.clone().requires_grad_() for x in (s, t, v, width)]
    expected = ref.sliced_relu_bump_attention(*expected_leaves)
    expected_grads = torch.autograd.grad(expected, expected_leaves, grad_out)
    assert (out - expected).abs().max() <= 1e-10 * expected.abs().max()
    for got, want in zip(grads, expected_grads, strict=True):
        assert (got - want).abs().max() <= 1e-9 * max(1.0, want.abs().max().item())

    forward = next(walk for mode, walk in stats if mode == 0)[0, :, 0]  # tiles walked per block
    before = span_walk(s[0, 0], t[0, 0], 1.0, TUNING["sinks"], TUNING["sources"])
    assert before >= 50  # the straddling block: about one cluster of 512 keys (16 a tile)
    assert forward.max() <= 12 and forward.max() <= 2 * forward.float().mean()
    for _, walk in stats:
        assert (walk[..., 1] > 0).any()  # the gaps between the clusters' edges are jumped over
