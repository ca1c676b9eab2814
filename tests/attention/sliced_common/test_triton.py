"""The Triton sliced ReLU / ReLU-bump kernels against the float64 references and the torch ops.

Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set per test: the kernels
are loaded for the mode in force at the call), on tiny shapes so that the file takes seconds.
The ``gpu`` tests repeat the comparison at realistic sizes when CUDA is present.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention import reference as ref  # noqa: E402
from attnlab.attention.ops import sliced_relu_attention, sliced_relu_bump_attention  # noqa: E402
from attnlab.attention.sliced_relu import triton as triton_sliced  # noqa: E402
from attnlab.attention.sliced_relu_bump import triton as triton_bump  # noqa: E402

F64 = torch.float64
OPS = {
    "relu": (sliced_relu_attention, ref.sliced_relu_attention),
    "bump": (sliced_relu_bump_attention, ref.sliced_relu_bump_attention),
}


def inputs(batch, heads, length, dim, seed=0, dtype=F64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    s, t = (torch.randn(batch, heads, length, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(batch, heads, length, dim, generator=gen, dtype=F64)
    bandwidth = torch.rand(heads, generator=gen, dtype=F64) + 0.3
    return [x.to(device=device, dtype=dtype) for x in (s, t, v, bandwidth)]


def run(op, kind, args, mask, grad_out, **kw):
    """Output and gradients (s, t, v [, bandwidth]) of ``op`` on fresh leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in (args if kind == "bump" else args[:3])]
    out = op(*leaves, key_padding_mask=mask, **kw)
    return out, torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def compare(kind, args, mask=None, out_tol=1e-10, grad_tol=1e-9, against="reference"):
    fast, naive = OPS[kind]
    expected_op = naive if against == "reference" else (lambda *a, **k: fast(*a, **k, impl="torch"))
    grad_out = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    out, grads = run(fast, kind, args, mask, grad_out, impl="triton")
    expected, expected_grads = run(expected_op, kind, args, mask, grad_out)
    assert out.dtype == args[2].dtype and torch.isfinite(out).all()
    scale = expected.abs().max().item() + 1e-30
    assert (out - expected).abs().max().item() <= out_tol * max(1.0, scale), "output"
    for name, got, want in zip(["s", "t", "v", "bandwidth"], grads, expected_grads, strict=False):
        err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert err <= grad_tol, f"{kind}: gradient of {name} off by {err:.3g}"


@pytest.mark.parametrize("kind", ["relu", "bump"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 2, 37, 5), (1, 4, 64, 16)], ids=str)
def test_float64_matches_reference(interpret, kind, shape):
    compare(kind, inputs(*shape, seed=sum(shape)))


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_padding_matches_reference(interpret, kind):
    args = inputs(2, 2, 40, 3, seed=3)
    args[2][1, :, 25:] = 1e6  # whatever sits in padded slots must not reach a real position
    mask = torch.arange(40)[None, :] < torch.tensor([[40], [25]])
    compare(kind, args, mask)


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_ties_and_kinks(interpret, kind):
    """Scores on a coarse grid (many ties, queries equal to keys, windows ending on a key) with
    padding: the kinks are differentiated as torch autograd does on the naive formula."""
    s, t, v, bandwidth = inputs(2, 2, 48, 4, seed=5)
    s, t = torch.round(2 * s) / 2, torch.round(2 * t) / 2
    s[0, 0, :10] = t[0, 0, :10]
    bandwidth = torch.tensor([0.5, 1.0], dtype=F64)  # hat windows end exactly on grid scores
    mask = torch.arange(48)[None, :] < torch.tensor([[48], [30]])
    compare(kind, [s, t, v, bandwidth], mask)


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_all_scores_equal(interpret, kind):
    s, t, v, bandwidth = inputs(1, 2, 20, 3, seed=6)
    compare(kind, [torch.zeros_like(s), torch.zeros_like(t), v, bandwidth])


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_chunked_scan_and_d_blocks(interpret, monkeypatch, kind):
    """Rows split into several chunks (carried totals) and D into several blocks (summed dots); for
    ReLU-bump, blocks of 16 and 32 sorted positions over tiles of 16 (several walks per row)."""
    monkeypatch.setattr(triton_sliced.TUNING, "block", 16)
    monkeypatch.setattr(triton_sliced.TUNING, "chunk", 16)
    monkeypatch.setattr(triton_sliced.TUNING, "block_d", 16)
    for name, value in {
        "sinks": 32,
        "query_sinks": 16,
        "key_sinks": 32,
        "sources": 16,
        "table": 16,
        "block_d": 16,
    }.items():
        monkeypatch.setattr(triton_bump.BUMP, name, value)
    args = inputs(1, 2, 45, 20, seed=8)
    mask = torch.arange(45)[None, :] < 41
    compare(kind, args, mask)


# make test-all: the wide-window precision tests run every jump's lines (coverage.py, line sets compared)
@pytest.mark.slow
@pytest.mark.parametrize(("padded", "scores"), [(False, "random"), (True, "random"), (True, "tied")])
def test_bump_walks_jump_over_runs_of_keys_and_queries(interpret, monkeypatch, padded, scores):
    """Wide windows over small blocks: every walk (forward, both backward sides) jumps over runs
    whose sums come from the float64 prefix tables; a wrong table row, carry or side breaks the
    outputs and every gradient. Scores from {0, 1, 2} with b = 1.5 make runs tied with whole blocks
    of sinks too (a hat slope of 0), besides the runs below and above."""
    for name, value in {
        "sinks": 64,
        "query_sinks": 32,
        "key_sinks": 64,
        "sources": 16,
        "table": 32,
        "block_d": 16,
    }.items():
        monkeypatch.setattr(triton_bump.BUMP, name, value)
    stats = []
    monkeypatch.setattr(triton_bump, "WALK_STATS", stats)
    args = inputs(2, 1, 300, 20, seed=12)
    args[3] = torch.tensor([1.5], dtype=F64)
    if scores == "tied":
        gen = torch.Generator().manual_seed(13)
        args[0], args[1] = (torch.randint(0, 3, (2, 1, 300), generator=gen).to(F64) for _ in range(2))
    mask = (torch.arange(300)[None, :] < torch.tensor([[300], [230]])) if padded else None
    compare("bump", args, mask)
    assert sorted(mode for mode, _ in stats) == [0, 1, 2]
    for _, walk in stats:  # (N, blocks, 2): tiles walked, table rows jumped over
        assert (walk[..., 1] > 0).any()


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_float32_matches_torch_op_and_reference(interpret, kind):
    args = inputs(2, 2, 64, 8, seed=9, dtype=torch.float32)
    mask = torch.arange(64)[None, :] < torch.tensor([[64], [50]])
    compare(kind, args, mask, out_tol=2e-6, grad_tol=2e-5, against="torch")
    compare(kind, args, mask, out_tol=2e-6, grad_tol=2e-5, against="reference")


@pytest.mark.parametrize("kind", ["relu", "bump"])
@pytest.mark.parametrize("chunk", [None, 64], ids=["one-chunk", "chunks"])
def test_float32_values_far_from_zero_stay_as_precise(interpret, monkeypatch, kind, chunk):
    """Values with a common offset of 1e4 (exact in float32, the reference on the same numbers):
    sliced ReLU sums the values less their mean, which came from block sums of the raw values and
    put 3e-3 into the outputs (a thousand times the error at offset 0); its totals now sum the
    values less one of them, and the mean goes to the walks in two parts."""
    if chunk is not None:
        monkeypatch.setattr(triton_sliced.TUNING, "chunk", chunk)
        monkeypatch.setattr(triton_sliced.TUNING, "block", 16)
    args = inputs(2, 2, 300, 16, seed=14, dtype=torch.float32)
    args[2] = args[2] + 1e4
    mask = torch.arange(300)[None, :] < torch.tensor([[300], [217]])
    fast, naive = OPS[kind]
    grad_out = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    out, grads = run(fast, kind, args, mask, grad_out, impl="triton")
    expected, expected_grads = run(naive, kind, [x.double() for x in args], mask, grad_out)
    for got, want in zip([out, *grads], [expected, *expected_grads], strict=True):
        assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_bfloat16_inputs_keep_their_dtype_and_sum_in_float32(interpret, kind):
    """Half inputs are read as they are and summed in float32: the same as the torch op, which
    converts them to float32 first, up to the final rounding of the output to bfloat16."""
    args = inputs(1, 2, 32, 8, seed=10)
    half = [x.to(torch.bfloat16) for x in args]
    fast, _ = OPS[kind]
    grad_out = torch.randn(half[2].shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    out, grads = run(fast, kind, half, None, grad_out, impl="triton")
    expected, expected_grads = run(fast, kind, half, None, grad_out, impl="torch")
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert (out.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()
    for got, want in zip(grads, expected_grads, strict=True):
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max() + 1e-6


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_double_backward_refused_by_name(interpret, kind):
    s, t, v, bandwidth = (x.requires_grad_() for x in inputs(1, 1, 6, 2, seed=2))
    op, _ = OPS[kind]
    out = op(s, t, v, *((bandwidth,) if kind == "bump" else ()), impl="triton")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), (s, t, v), create_graph=True)


# ---- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["relu", "bump"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_float64_torch_op(kind, dtype):
    args = inputs(2, 4, 4096, 64, seed=11, dtype=dtype, device="cuda")
    args[3] = args[3].float()
    mask = (torch.arange(4096)[None, :] < torch.tensor([[4096], [3000]])).cuda()
    fast, _ = OPS[kind]
    grad_out = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(1), dtype=F64).cuda()
    out, grads = run(fast, kind, args, mask, grad_out, impl="triton")
    wide = [x.double() for x in args]
    expected, expected_grads = run(fast, kind, wide, mask, grad_out, impl="torch")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.double() - expected).abs().max() <= tol * expected.abs().max()
    kinks = _at_a_kink(kind, args, mask, grad_out) if dtype == torch.float32 else None
    for index, (got, want) in enumerate(zip(grads, expected_grads, strict=True)):
        error = (got.double() - want).abs()
        bound = 10 * tol * want.abs().max()
        if kinks is not None and index < 2:  # dL/ds, dL/dt: no derivative on a kink
            error = error.masked_fill(kinks[index], 0.0)
        if kinks is not None and index == 3:  # dL/db: each edge pair may add its jump, or not
            bound = bound + kinks[2]
        assert (error <= bound).all(), (index, error.max(), bound)


def _at_a_kink(kind, args, mask, grad_out):
    """Queries and keys with a pair within float32 rounding of a kink of the kernel (the hat's edges
    |s - t| = b and its peak s = t; s = t for sliced ReLU), and per head the sum of the jumps such
    edge pairs can make in dL/db: the derivative jumps there, float32 and float64 may land on either
    side, and that moves dL/ds_i, dL/dt_j and the head's dL/db by |v_j · g_i| / (b n). Seen on an
    H200: one pair of 2 × 4 × 4,096² moved all three by 4e-3. (bf16 scores tie exactly, a case both
    implementations resolve alike.)"""
    s, t = (x.double() for x in args[:2])
    gap = s[..., :, None] - t[..., None, :]  # (B, H, T, T)
    real = mask[:, None, None, :] & mask[:, None, :, None]
    edge = torch.zeros_like(real)
    if kind == "bump":
        width = args[3].double()[None, :, None, None]
        edge = ((gap.abs() - width).abs() < 1e-6 * (1 + width)) & real
    near = edge | ((gap.abs() < 1e-6) & real)
    assert near.float().mean() < 1e-5, "the kinks are rare on random float32 scores"
    jumps = torch.zeros(s.shape[1], dtype=torch.float64, device=s.device)
    b, h, i, j = edge.nonzero(as_tuple=True)
    if len(b):
        v = args[2].double()
        count = mask.sum(dim=1).double()
        jump = (grad_out[b, h, i] * v[b, h, j]).sum(dim=-1).abs() / (args[3].double()[h] * count[b])
        jumps.index_add_(0, h, jump)
    return near.any(dim=-1), near.any(dim=-2), jumps


@pytest.mark.parametrize("kind", ["relu", "bump"])
def test_backward_sorts_nothing(interpret, kind):
    """The forward's two sorts (keys real-first, kept queries first) serve the backward pass too:
    its op list holds no sort (the bump's re-sorted s twice before)."""
    from attnlab.bench.byte_count import count_bytes

    args = inputs(1, 2, 40, 8, seed=11, dtype=torch.float32)
    mask = torch.arange(40)[None, :] < 33
    fast, _ = OPS[kind]
    leaves = [x.detach().clone().requires_grad_() for x in (args if kind == "bump" else args[:3])]
    out = fast(*leaves, key_padding_mask=mask, impl="triton")
    assert [r.calls for r in count_bytes(lambda: fast(*leaves, key_padding_mask=mask, impl="triton"))
            if r.name == "sort"] == [2]  # fmt: skip
    backward = count_bytes(lambda: out.backward(torch.ones_like(out)))
    assert not [r for r in backward if r.name in ("sort", "argsort", "msort")]
    assert all(x.grad is not None for x in leaves)
