"""The backends `attnlab bench attention` and `attnlab bench bytes` run: each name's op and inputs.

A backend is an op (a function of `attnlab.attention.ops`, a forced variant of one, the official
concatenate-and-sort formulation, or a decoding step) and a builder of random inputs of shape
(B, H, T, D) (scores (B, H, T) for the sliced ops). Both benchmarks read this one table, so a name
means the same code in the timings and in the byte counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def _qkv_inputs(batch, heads, length, dim, dtype, device, generator):
    shape = (batch, heads, length, dim)
    return [torch.randn(shape, generator=generator, dtype=torch.float32).to(device, dtype) for _ in range(3)]


def _score_inputs(batch, heads, length, dim, dtype, device, generator):
    scores = [torch.randn(batch, heads, length, generator=generator).to(device, dtype) for _ in range(2)]
    values = torch.randn(batch, heads, length, dim, generator=generator).to(device, dtype)
    return [*scores, values]


def _bump_inputs(batch, heads, length, dim, dtype, device, generator):
    return [
        *_score_inputs(batch, heads, length, dim, dtype, device, generator),
        torch.ones(heads, device=device),
    ]


ROW_SEQUENCES = 8  # sequences end to end in each packed row of the `*_rows` backends


def _row_segments(batch, length, device):
    """(B, T) segment ids: ``ROW_SEQUENCES`` sequences of (nearly) equal length end to end per row."""
    ids = torch.arange(length, device=device) * ROW_SEQUENCES // max(length, 1)
    return ids.expand(batch, length).contiguous()


def _rows_inputs(batch, heads, length, dim, dtype, device, generator):
    """Scores and values as `_score_inputs`, on packed rows (`_row_segments`)."""
    return [
        *_score_inputs(batch, heads, length, dim, dtype, device, generator),
        _row_segments(batch, length, device),
    ]


def _bump_rows_inputs(batch, heads, length, dim, dtype, device, generator):
    return [
        *_bump_inputs(batch, heads, length, dim, dtype, device, generator),
        _row_segments(batch, length, device),
    ]


def _decode_inputs(batch, heads, length, dim, dtype, device, generator):
    """One new token and the decoding state left by a prefix of ``length`` tokens (prefilled, untimed)."""
    from attnlab.attention.ops import linear_attention_state

    k, v = _qkv_inputs(batch, heads, length, dim, dtype, device, generator)[:2]
    state = linear_attention_state(k, v)
    token = [torch.randn(batch, heads, dim, generator=generator).to(device, dtype) for _ in range(3)]
    return [*token, state]


def _sliced_decode_inputs(batch, heads, length, dim, dtype, device, generator):
    """One new token and the sorted-runs state of a causal sliced ReLU prefix of ``length`` tokens."""
    from attnlab.attention.ops import sliced_relu_attention_state

    t, _, v = _score_inputs(batch, heads, length, dim, dtype, device, generator)
    state = sliced_relu_attention_state(t, v)
    token = [torch.randn(batch, heads, generator=generator).to(device, dtype) for _ in range(2)]
    return [*token, torch.randn(batch, heads, dim, generator=generator).to(device, dtype), state]


def _kv_cache_inputs(batch, heads, length, dim, dtype, device, generator):
    """One new token and a KV cache holding ``length`` tokens, with room for one more."""
    k, v = _qkv_inputs(batch, heads, length, dim, dtype, device, generator)[:2]
    cache = [torch.cat([x, torch.zeros_like(x[:, :, :1])], dim=2) for x in (k, v)]
    token = [torch.randn(batch, heads, dim, generator=generator).to(device, dtype) for _ in range(3)]
    return [*token, tuple(cache)]


def softmax_kv_cache_step(q_t, k_t, v_t, cache):
    """One softmax decoding step: write the token into the last cache slot, attend over the cache."""
    k_cache, v_cache = cache
    k_cache[:, :, -1] = k_t
    v_cache[:, :, -1] = v_t
    return torch.nn.functional.scaled_dot_product_attention(q_t[:, :, None], k_cache, v_cache)[:, :, 0]


def state_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) decoding state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if callable(getattr(obj, "nbytes", None)):  # a state that counts its own (the sliced sorted runs)
        return obj.nbytes()
    if isinstance(obj, tuple | list):
        return sum(state_bytes(item) for item in obj)
    return 0


# op names of forced variants: the torch code where "auto" would take Triton on CUDA, causal linear
VARIANTS: dict[str, tuple[str, dict]] = {
    "sliced_relu_attention_torch": ("sliced_relu_attention", {"impl": "torch"}),
    "sliced_relu_bump_attention_torch": ("sliced_relu_bump_attention", {"impl": "torch"}),
    # the two evaluations of the sliced kernels (attnlab.attention.sliced_common.path): the plain names
    # take path="auto" (dense up to the crossover); these force one, to measure the crossover
    "sliced_relu_attention_dense": ("sliced_relu_attention", {"path": "dense"}),
    "sliced_relu_attention_sorted": ("sliced_relu_attention", {"path": "sorted"}),
    "sliced_relu_bump_attention_dense": ("sliced_relu_bump_attention", {"path": "dense"}),
    "sliced_relu_bump_attention_sorted": ("sliced_relu_bump_attention", {"path": "sorted"}),
    "sliced_relu_attention_causal_dense": ("sliced_relu_attention", {"causal": True, "path": "dense"}),
    "sliced_relu_attention_causal_sorted": ("sliced_relu_attention", {"causal": True, "path": "sorted"}),
    "sliced_relu_bump_attention_causal_dense": (
        "sliced_relu_bump_attention",
        {"causal": True, "path": "dense"},
    ),
    "sliced_relu_bump_attention_causal_sorted": (
        "sliced_relu_bump_attention",
        {"causal": True, "path": "sorted"},
    ),
    "linear_attention_causal": ("linear_attention", {"causal": True}),
    "linear_attention_causal_torch": ("linear_attention", {"causal": True, "impl": "torch"}),
    # a decoder's loop: the token added to the state's own tensors (as the layers step)
    "linear_attention_step_inplace": ("linear_attention_step", {"inplace": True}),
}


def op(name: str) -> Callable:
    """The op behind a backend, imported on first use (the facade `attnlab.attention.ops`)."""
    if name == "softmax_kv_cache_step":
        return softmax_kv_cache_step
    if name.startswith("causal:"):
        from attnlab.attention import ops

        causal_op = getattr(ops, name.removeprefix("causal:"))
        return lambda *args: causal_op(*args, causal=True)
    if name in VARIANTS:
        base, keywords = VARIANTS[name]
        return functools.partial(op(base), **keywords)
    if name == "sliced_relu_concat":
        from attnlab.attention.reference import sliced_relu_attention_concat

        return sliced_relu_attention_concat
    from attnlab.attention import ops

    return getattr(ops, name)


# backend name -> (op name, input builder)
BACKENDS: dict[str, tuple[str, Callable]] = {
    "softmax": ("softmax_attention", _qkv_inputs),
    "linear": ("linear_attention", _qkv_inputs),
    "sliced_relu": ("sliced_relu_attention", _score_inputs),
    "sliced_relu_bump": ("sliced_relu_bump_attention", _bump_inputs),
    "sliced_relu_concat": ("sliced_relu_concat", _score_inputs),
    # on CUDA the plain names run the Triton kernels (impl="auto"); these force the torch code
    "sliced_relu_torch": ("sliced_relu_attention_torch", _score_inputs),
    "sliced_relu_bump_torch": ("sliced_relu_bump_attention_torch", _bump_inputs),
    "linear_causal": ("linear_attention_causal", _qkv_inputs),
    "linear_causal_torch": ("linear_attention_causal_torch", _qkv_inputs),
    # one recurrent decoding step at position T: its time and memory must not grow with T
    "linear_decode": ("linear_attention_step_inplace", _decode_inputs),
    "sliced_relu_decode": ("sliced_relu_attention_step", _sliced_decode_inputs),
    "softmax_decode": ("softmax_kv_cache_step", _kv_cache_inputs),
    "sliced_relu_causal": ("causal:sliced_relu_attention", _score_inputs),
    "sliced_relu_bump_causal": ("causal:sliced_relu_bump_attention", _bump_inputs),
    # the ops on packed rows of T slots (`ROW_SEQUENCES` sequences each): against the plain names at
    # the same T, what a slot costs on packed rows (the sort by sequence and score, the reads from
    # each sequence's start)
    "sliced_relu_rows": ("sliced_relu_attention_segments", _rows_inputs),
    "sliced_relu_bump_rows": ("sliced_relu_bump_attention_segments", _bump_rows_inputs),
    "sliced_relu_causal_rows": ("causal:sliced_relu_attention_segments", _rows_inputs),
    "sliced_relu_bump_causal_rows": ("causal:sliced_relu_bump_attention_segments", _bump_rows_inputs),
}
# <backend>_dense / <backend>_sorted: one evaluation forced (the plain name takes path="auto")
for _name in ("sliced_relu", "sliced_relu_bump", "sliced_relu_causal", "sliced_relu_bump_causal"):
    _base = _name.replace("_causal", "")
    _suffix = "_causal" if _name.endswith("_causal") else ""
    for _path in ("dense", "sorted"):
        BACKENDS[f"{_name}_{_path}"] = (f"{_base}_attention{_suffix}_{_path}", BACKENDS[_base][1])
INFERENCE_ONLY = {"linear_decode", "sliced_relu_decode", "softmax_decode"}
