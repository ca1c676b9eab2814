"""The Triton causal linear attention kernel against the float64 reference and the torch chunked form.

Interpreter runs (``TRITON_INTERPRET=1``) on tiny shapes; ``gpu`` tests at realistic sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention import reference as ref  # noqa: E402
from attnlab.attention.linear.ops import linear_attention  # noqa: E402

F64 = torch.float64


def qkv(batch, heads, length, dim, dim_v, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, length, dim)] * 2 + [(batch, heads, length, dim_v)]
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]


def run(op, args, mask, grad_out, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in args]
    out = op(*leaves, key_padding_mask=mask, causal=True, **kw)
    return out, torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


def errors(got, want):
    """Max error relative to the largest expected value (at least 1e-2: at T = 1 the q, k gradients
    are of the order of eps, differences of O(1) terms)."""
    return [
        ((a.double() - b.double()).abs().max() / max(b.double().abs().max().item(), 1e-2)).item()
        for a, b in zip(got, want, strict=True)
    ]


@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 1, 1), (2, 2, 37, 5, 3), (1, 2, 64, 16, 16), (1, 1, 70, 8, 4)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_matches_float64_reference_and_torch_form(interpret, shape, masked):
    """T not a multiple of the chunk, D != Dv, padded keys and queries (zero outputs)."""
    batch, _, length = shape[:3]
    args = qkv(*shape, seed=sum(shape))
    mask = None
    if masked:
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[-1, length // 2 :] = False
    grad_out = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    out, grads = run(linear_attention, args, mask, grad_out, impl="triton")
    assert out.dtype == torch.float32
    want, want_grads = run(ref.linear_attention, [x.double() for x in args], mask, grad_out)
    assert max(errors([out, *grads], [want, *want_grads])) < 2e-5
    torch_out, torch_grads = run(linear_attention, args, mask, grad_out, impl="torch")
    assert max(errors([out, *grads], [torch_out, *torch_grads])) < 2e-5
    if masked:
        assert out[-1, :, length // 2 :].abs().max() == 0


@pytest.mark.parametrize("segment", [16, 32])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
def test_segments_walked_in_parallel_match_one_walk(interpret, monkeypatch, segment, masked):
    """Rows split into segments (several programs per row, carried states): the same as the
    reference, T not a multiple of the segment, padded keys in the middle of a segment."""
    from attnlab.attention.linear import triton as triton_linear

    monkeypatch.setattr(triton_linear, "SEGMENT", segment)
    shape = (2, 2, 75, 8, 6)
    assert triton_linear.segments(4, 75, 16, torch.device("cpu")) == (segment, -(-75 // segment))
    args = qkv(*shape, seed=11)
    mask = None
    if masked:
        mask = torch.ones(2, 75, dtype=torch.bool)
        mask[-1, 40:] = False
    grad_out = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    out, grads = run(linear_attention, args, mask, grad_out, impl="triton")
    want, want_grads = run(ref.linear_attention, [x.double() for x in args], mask, grad_out)
    assert max(errors([out, *grads], [want, *want_grads])) < 2e-5


def test_segments_fill_the_gpu_and_stay_long():
    """About four programs per SM, segments of at least MIN_SEGMENT tokens, whole chunks."""
    from attnlab.attention.linear.triton import MIN_SEGMENT, segments

    cpu = torch.device("cpu")  # one "SM": four programs
    assert segments(64, 65536, 32, cpu) == (65536, 1)
    assert segments(2, 65536, 32, cpu) == (32768, 2)
    assert segments(1, 1000, 32, cpu) == (1024, 1)
    seg, n_seg = segments(1, 5 * MIN_SEGMENT + 7, 16, cpu)
    assert seg % 16 == 0 and seg >= MIN_SEGMENT and n_seg == 4


def test_bfloat16_inputs(interpret):
    args = qkv(1, 2, 40, 8, 8, seed=4, dtype=torch.bfloat16)
    grad_out = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    out, grads = run(linear_attention, args, None, grad_out, impl="triton")
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    want, want_grads = run(linear_attention, args, None, grad_out, impl="torch")
    assert max(errors([out, *grads], [want, *want_grads])) < 2e-2


def test_float64_has_no_kernel(interpret):
    args = qkv(1, 1, 8, 4, 4, dtype=F64)
    with pytest.raises(
        ValueError, match=r"triton \[triton, .*\]: no float64 kernel on CPU \(the kernels keep float32"
    ):
        linear_attention(*args, causal=True, impl="triton")
    out = linear_attention(*args, causal=True)  # auto: torch
    assert out.dtype == F64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_float64_torch_form(dtype):
    args = qkv(2, 4, 4096, 64, 64, seed=6, dtype=dtype, device="cuda")
    mask = (torch.arange(4096)[None, :] < torch.tensor([[4096], [3000]])).cuda()
    grad_out = torch.randn(args[2].shape, generator=torch.Generator().manual_seed(7), dtype=F64).cuda()
    out, grads = run(linear_attention, args, mask, grad_out, impl="triton")
    want, want_grads = run(linear_attention, [x.double() for x in args], mask, grad_out, impl="torch")
    assert max(errors([out, *grads], [want, *want_grads])) < (1e-4 if dtype == torch.float32 else 3e-2)
