"""Sliced ReLU-bump attention: ``ops`` (the public op), ``sorted`` (the O(T log T) torch op),
``dense`` (O(T²), short T), ``causal`` (O(T log² T)), ``segments`` (packed rows: several sequences
per row), ``triton`` + ``triton_kernels`` (the CUDA path),
``decoding`` (one token at a time), ``normaliser`` (count or mass), ``reference`` (float64, T×T),
``layer``. The machinery it shares with sliced ReLU is in ``attnlab.attention.sliced_common``."""

from __future__ import annotations

from attnlab.attention.sliced_relu_bump.ops import sliced_relu_bump_attention
from attnlab.attention.sliced_relu_bump.segments import sliced_relu_bump_attention_segments

__all__ = ["sliced_relu_bump_attention", "sliced_relu_bump_attention_segments"]
