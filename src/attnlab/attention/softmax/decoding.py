"""Softmax's recurrent decoding: a KV cache of the rotated keys and values of every past token
(grows by 2·D per token and head; a step reads all of it). ``attnlab.attention.decoding`` calls
``layer_state`` and ``layer_step``."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class KVCache(NamedTuple):
    """Softmax's decoding state: rotated keys and values ``(B, H, capacity, D)``, the first ``length``
    rows used (the buffers double when full, so appending is amortised O(1))."""

    k: torch.Tensor
    v: torch.Tensor
    length: int

    @property
    def position(self) -> int:
        return self.length


def layer_state(layer, q, k, v) -> KVCache:
    """The cache after a prompt's q, k, v (B, H, T, D)."""
    return KVCache(k.contiguous(), v.contiguous(), k.shape[2])


def layer_step(layer, q, k, v, state: KVCache | None):
    n = 0 if state is None else state.length
    if state is None or n == state.k.shape[2]:  # full: double the buffers
        grown = [k.new_empty(*k.shape[:2], max(16, 2 * n), k.shape[-1]) for _ in range(2)]
        if state is not None:
            grown[0][:, :, :n].copy_(state.k)
            grown[1][:, :, :n].copy_(state.v)
        state = KVCache(grown[0], grown[1], n)
    # narrow, not [:, :, n]: under torch.compile an integer index would fix n into the graph
    state.k.narrow(2, n, 1).copy_(k[:, :, None])
    state.v.narrow(2, n, 1).copy_(v[:, :, None])
    keys, values = state.k[:, :, : n + 1], state.v[:, :, : n + 1]
    o = F.scaled_dot_product_attention(q[:, :, None], keys, values)  # the last query sees every cached key
    return o[:, :, 0], KVCache(state.k, state.v, n + 1)
