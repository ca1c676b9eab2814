"""Softmax on packed rows through FlexAttention (``softmax.flex``): its mask lets each query see
exactly the keys of its own sequence (``j <= i`` too when causal), checked with FlexAttention's eager
form on the CPU against the float64 reference of each sequence alone; and a kernel that fails its
first-use check is never used (SDPA instead, one warning). The compiled kernel runs on CUDA only
(``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.common.packing import PackedLayout, run_ids, segment_mask
from attnlab.attention.softmax import flex
from attnlab.attention.softmax import reference as softmax_reference
from attnlab.attention.softmax.ops import softmax_attention_segments

F64 = torch.float64
LENGTHS, ROWS = [37, 3, 24, 1, 70, 9, 2], [[0, 1, 2], [3, 4, 5], [6]]  # rows of 80 slots, some empty


def _inputs(dtype=F64):
    gen = torch.Generator().manual_seed(0)
    layout = PackedLayout.from_rows(LENGTHS, ROWS)
    batch, length = layout.pack_index.shape
    q, k, v = (torch.randn(batch, 2, length, 8, generator=gen, dtype=dtype) for _ in range(3))
    return layout, q, k, v


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_mask_gives_each_sequence_what_it_gets_alone(causal):
    layout, *inputs = _inputs()
    q, k, v = (x.requires_grad_(True) for x in inputs)
    out = flex.attend(q, k, v, run_ids(layout.segments), causal, compiled=False)
    grad = torch.randn_like(out) * layout.row_mask[:, None, :, None]
    out.backward(grad)
    got = [layout.unpack_heads(x) for x in (out, q.grad, k.grad, v.grad)]
    for n, length in enumerate(LENGTHS):
        alone = [
            layout.unpack_heads(x.detach())[n : n + 1, :, :length].requires_grad_(True) for x in (q, k, v)
        ]
        want = softmax_reference.softmax_attention(*alone, causal=causal)
        want.backward(layout.unpack_heads(grad)[n : n + 1, :, :length])
        for name, mine, theirs in zip(
            ["out", "dq", "dk", "dv"], got, [want, *(x.grad for x in alone)], strict=True
        ):
            torch.testing.assert_close(mine[n : n + 1, :, :length], theirs, rtol=1e-10, atol=1e-12, msg=name)


def test_a_kernel_that_fails_its_first_use_check_is_never_used(monkeypatch):
    """The first-use check on a device where the compiled kernel cannot run (here: a CPU without
    the compile of a kernel that raises): one warning, None (SDPA) then and on every later call."""
    monkeypatch.setattr(flex, "_TRUSTED", {})
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(flex, "attend", broken)
    layout, q, k, v = _inputs(torch.float32)
    runs = run_ids(layout.segments)
    with pytest.warns(RuntimeWarning, match="FlexAttention is not used on cpu torch.float32 .no kernel"):
        assert flex.flex_segments(q, k, v, runs, False) is None
    assert flex.flex_segments(q, k, v, runs, True) is None  # no second check, no second warning
    assert len(calls) == 1


def test_off_cuda_the_op_takes_sdpa_with_the_dense_mask(monkeypatch):
    monkeypatch.setattr(flex, "flex_segments", lambda *a: pytest.fail("FlexAttention off CUDA"))
    layout, q, k, v = _inputs()
    out = softmax_attention_segments(q, k, v, layout.segments)
    assert out.shape == q.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_compiled_flex_matches_sdpa_on_cuda(causal):
    layout, *inputs = _inputs(torch.float32)
    q, k, v = (x.cuda() for x in inputs)
    segments = layout.segments.cuda()
    flex._TRUSTED.clear()
    got = softmax_attention_segments(q, k, v, segments, causal)
    assert any(flex._TRUSTED.values()), "the first-use check refused FlexAttention on this GPU"
    mask = segment_mask(run_ids(segments), causal)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
