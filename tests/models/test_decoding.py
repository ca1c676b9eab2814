"""Generation as an RNN: `CausalLM.prefill` (the parallel causal forward) then `step` gives the parallel
forward's logits at every position, for every causal backend, with and without RoPE and a short conv."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.attention.decoding import KVCache, LinearAttentionState, state_nbytes
from attnlab.models.causal_lm import CausalLM, causal_backends

OPTIONS = {
    "performer": {"redraw_interval": None, "num_features": 24},
    "sliced_relu_bump": {"normaliser": "mass"},
}


def model_for(attn: str, positions: str, short_conv: int, **extra) -> CausalLM:
    torch.manual_seed(0)
    options = {**OPTIONS.get(attn, {}), **extra}
    model = CausalLM(
        vocab_size=19, attention=partial(build_attention, attn, **options), dim=16, depth=2, num_heads=2,
        max_len=32, positions=positions, short_conv=short_conv,
    )  # fmt: skip
    with torch.no_grad():
        for block in model.encoder.blocks:
            if block.short_conv is not None:
                block.short_conv.weight.normal_(0, 0.5)
    return model.double().eval()


def backends_and_variants():
    yield from ((attn, {}) for attn in causal_backends())
    yield "sliced_relu", {"standardise": "none"}
    yield "sliced_relu_bump", {"normaliser": "count"}


@pytest.mark.parametrize(("attn", "extra"), list(backends_and_variants()))
@pytest.mark.parametrize("positions", ["rope", "none"])
@pytest.mark.parametrize("short_conv", [0, 3])
@pytest.mark.parametrize("prompt", [1, 2, 6])
def test_prefill_then_steps_equal_the_parallel_forward(attn, extra, positions, short_conv, prompt):
    model = model_for(attn, positions, short_conv, **extra)
    ids = torch.randint(0, 19, (2, 15), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        parallel = model(ids)
        logits, state = model.prefill(ids[:, :prompt])
        torch.testing.assert_close(logits, parallel[:, :prompt], rtol=1e-10, atol=1e-10)
        for t in range(prompt, ids.shape[1]):
            step_logits, state = model.step(ids[:, t], state)
            torch.testing.assert_close(step_logits, parallel[:, t], rtol=1e-9, atol=1e-9)
    assert state[0] == ids.shape[1]


@pytest.mark.parametrize("attn", ["sliced_relu", "sliced_relu_bump"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_long_prefill_and_steps_reach_the_sorted_runs(attn, dtype):
    """Past the 32 recent tokens the sliced state keeps sorted runs (merged as they fill, searched
    at once in float32): an 80-token sequence with a 40-token prompt goes through them at model level,
    with the prefix score statistics."""
    model = model_for(attn, "rope", 3)
    model.max_len = 96
    model = model.to(dtype)
    ids = torch.randint(0, 19, (2, 80), generator=torch.Generator().manual_seed(5))
    tolerance = 1e-9 if dtype == torch.float64 else 2e-4
    with torch.no_grad():
        parallel = model(ids)
        logits, state = model.prefill(ids[:, :40])
        torch.testing.assert_close(logits, parallel[:, :40], rtol=tolerance, atol=tolerance)
        for t in range(40, ids.shape[1]):
            step_logits, state = model.step(ids[:, t], state)
            torch.testing.assert_close(step_logits, parallel[:, t], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("attn", causal_backends())
def test_steps_from_nothing_equal_the_parallel_forward(attn):
    model = model_for(attn, "learned", 2)
    ids = torch.randint(0, 19, (3, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        parallel, state = model(ids), None
        for t in range(ids.shape[1]):  # past 16: the KV cache doubles its buffers
            step_logits, state = model.step(ids[:, t], state)
            torch.testing.assert_close(step_logits, parallel[:, t], rtol=1e-9, atol=1e-9)


def test_state_memory_grows_with_the_context_only_for_the_kv_cache():
    layers = {n: build_attention(n, 32, 4, causal=True).eval() for n in ("softmax", "linear")}
    sizes = {n: [] for n in layers}
    for name, layer in layers.items():
        state = None
        with torch.no_grad():
            for _ in range(40):
                _, state = layer.step(torch.randn(1, 32), state)
                sizes[name].append(state_nbytes(state))
    assert isinstance(state, LinearAttentionState) and len(set(sizes["linear"])) == 1
    assert sizes["softmax"][-1] == 40 * 2 * 32 * 4  # keys and values of 40 tokens, float32
    assert isinstance(layers["softmax"].step(torch.randn(1, 32))[1], KVCache)


def test_decoding_errors_are_one_line():
    with pytest.raises(ValueError, match="needs a causal layer"):
        build_attention("softmax", 16, 2).step(torch.randn(1, 16))
    with pytest.raises(ValueError, match=r"expected x_t of shape \(B, dim=16\)"):
        build_attention("linear", 16, 2, causal=True).step(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T >= 1\)"):
        model_for("linear", "rope", 0).prefill(torch.zeros(2, 0, dtype=torch.long))
