"""Sliced ReLU attention: ``ops`` (the public op: checks, then which implementation runs),
``sorted`` (the O(T log T) torch op), ``dense`` (O(T²), short T), ``causal`` (O(T log² T)),
``segments`` (packed rows: several sequences per row),
``triton`` + ``triton_kernels`` (the CUDA path), ``decoding`` (one token at a time), ``authors``
(the authors' padding rule), ``reference`` (float64, T×T), ``layer``. The machinery it shares with
ReLU-bump is in ``attnlab.attention.sliced_common``."""

from __future__ import annotations

from attnlab.attention.sliced_relu.ops import sliced_relu_attention
from attnlab.attention.sliced_relu.segments import sliced_relu_attention_segments

__all__ = ["sliced_relu_attention", "sliced_relu_attention_segments"]
