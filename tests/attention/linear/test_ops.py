"""Linear attention: parallel, causal chunked and recurrent forms against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnlab.attention import reference
from attnlab.attention.linear.ops import linear_attention as linear_attention_chunked
from attnlab.attention.ops import linear_attention, linear_attention_state, linear_attention_step


def lengths_mask(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def random_qkv(shape, dtype=torch.float64, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    b, h, t, d = shape
    q = torch.randn(b, h, t, d, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h, t, d, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h, t, dv or d, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


# (shape, chunk_size): T=1, odd T, D=1, T not a multiple of the chunk, chunk larger than T, chunk 1.
CASES = [
    ((2, 3, 5, 4), 64),
    ((1, 1, 1, 1), 4),
    ((2, 2, 7, 1), 3),
    ((3, 2, 11, 3), 4),
    ((2, 1, 13, 2), 1),
    ((1, 2, 16, 5), 8),
]


@pytest.mark.parametrize("shape,chunk", CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference_outputs_and_gradients(shape, chunk, causal, masked):
    b, _, t, _ = shape
    q, k, v = random_qkv(shape, dv=shape[-1] + 1)
    mask = lengths_mask([max(1, t - 3 * i) for i in range(b)], t) if masked else None
    weight = torch.randn(v.shape, dtype=torch.float64)
    out = linear_attention(q, k, v, mask, causal=causal, chunk_size=chunk)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref = reference.linear_attention(q, k, v, mask, causal=causal)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    assert out.dtype == torch.float64
    assert (out - ref).abs().max() <= 1e-9
    for g, rg in zip(grads, ref_grads, strict=True):
        assert (g - rg).abs().max() <= 1e-7


@pytest.mark.parametrize("causal", [False, True])
def test_valid_positions_equal_each_sequence_alone(causal):
    lengths, t = [9, 4, 1], 9
    q, k, v = (x.detach() for x in random_qkv((3, 2, t, 3)))
    mask = lengths_mask(lengths, t)
    garbage = ~mask[:, None, :, None]
    q, k, v = (x.masked_fill(garbage, 50.0) for x in (q, k, v))
    out = linear_attention(q, k, v, mask, causal=causal, chunk_size=4)
    for i, n in enumerate(lengths):
        alone = linear_attention(q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n], causal=causal)
        torch.testing.assert_close(out[i : i + 1, :, :n], alone, rtol=0, atol=1e-12)
        assert torch.all(out[i, :, n:] == 0)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_recurrent_steps_equal_causal_parallel_form(dtype, atol):
    q, k, v = (x.detach() for x in random_qkv((2, 3, 23, 4), dtype=dtype, dv=6))
    parallel = linear_attention(q, k, v, causal=True, chunk_size=5)
    state, outs = None, []
    for i in range(q.shape[2]):
        o, state = linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, dim=2), parallel, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_in_place_steps_equal_causal_parallel_form(dtype, atol, cpu_code):
    # a decoder's loop (inplace=True, no gradients): on the CPU one C++ call per step, else the torch code
    q, k, v = (x.detach() for x in random_qkv((2, 3, 23, 4), dtype=dtype, dv=6))
    parallel = linear_attention(q, k, v, causal=True, chunk_size=5)
    state, outs = None, []
    with torch.no_grad():
        for i in range(q.shape[2]):
            o, new_state = linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], state, inplace=True)
            if state is not None:  # the state's own tensors, updated
                assert new_state[0] is state[0] and new_state[1] is state[1]
            state = new_state
            outs.append(o)
    torch.testing.assert_close(torch.stack(outs, dim=2), parallel, rtol=0, atol=atol)
    assert state[0].dtype == dtype


def test_in_place_step_under_no_grad_invalidates_a_graph_that_saved_the_state(cpu_code):
    q, k, v = (x.detach() for x in random_qkv((1, 2, 3, 4), dtype=torch.float32))
    state = linear_attention_state(k, v)
    q_t = q[:, :, 0].clone().requires_grad_()
    out, state = linear_attention_step(q_t, k[:, :, 1], v[:, :, 1], state)  # a graph saving S and z
    with torch.no_grad():
        linear_attention_step(q[:, :, 2], k[:, :, 2], v[:, :, 2], state, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize(
    "dtype,state_dtype", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)]
)
def test_state_has_constant_shape_and_wide_dtype(dtype, state_dtype):
    b, h, d, dv = 2, 3, 4, 5
    g = torch.Generator().manual_seed(0)
    state = None
    for _ in range(300):
        q, k = torch.randn(2, b, h, d, generator=g).to(dtype)
        v = torch.randn(b, h, dv, generator=g).to(dtype)
        o, state = linear_attention_step(q, k, v, state)
        assert state[0].shape == (b, h, d, dv) and state[1].shape == (b, h, d)
        assert state[0].dtype == state_dtype and state[1].dtype == state_dtype
        assert o.shape == (b, h, dv) and o.dtype == dtype
    with pytest.raises(ValueError, match="state must be"):
        linear_attention_step(q, k, v, (state[0][:, :, :2], state[1]))


def test_half_inputs_accumulate_in_float32():
    q, k, v = (x.detach() for x in random_qkv((2, 2, 200, 8), dtype=torch.float32))
    ref = linear_attention(q.double(), k.double(), v.double(), causal=True)
    out = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = linear_attention(q, k, v, causal=True)
    assert auto.dtype == torch.float32  # the op opts out of autocast: float32 in, float32 math, float32 out
    torch.testing.assert_close(auto.double(), ref, rtol=1e-4, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_causal_form_builds_no_sequence_by_sequence_tensor():
    t, chunk = 512, 16
    q, k, v = random_qkv((1, 1, t, 4), dtype=torch.float32)
    with _LargestTensor() as probe:
        out = linear_attention_chunked(q, k, v, causal=True, chunk_size=chunk)
        out.sum().backward()
    assert probe.largest <= t * chunk  # chunk-local matrices only; T×T would be 262144 elements


def test_bad_arguments():
    q, k, v = (x.detach() for x in random_qkv((1, 1, 4, 2)))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_attention(q, k, v, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match=r"\(B, H, D\)"):
        linear_attention_step(q, k, v)


def test_prefill_state_continues_like_stepping_through_the_prefix():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 11, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 11, dtype=torch.bool)
    state = linear_attention_state(k[:, :, :7], v[:, :, :7], mask[:, :7])
    causal = linear_attention(q, k, v, causal=True)
    for i in range(7, 11):
        out, state = linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], state)
        torch.testing.assert_close(out, causal[:, :, i], atol=1e-12, rtol=1e-12)
    masked = mask.clone()
    masked[1, 3:7] = False  # padded prefix keys add nothing to the state
    s_masked, z_masked = linear_attention_state(k[:, :, :7], v[:, :, :7], masked[:, :7])
    s_short, z_short = linear_attention_state(k[1:, :, :3], v[1:, :, :3])
    torch.testing.assert_close(s_masked[1:], s_short)
    torch.testing.assert_close(z_masked[1:], z_short)
    with pytest.raises(ValueError, match=r"k \(B, H, T, D\)"):
        linear_attention_state(k[:, :, 0], v)
