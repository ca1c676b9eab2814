"""Linear attention, φ = elu + 1: ``ops`` (the public op and its choice of implementation),
``chunked`` (the feature-map core, shared with Performer), ``triton`` + ``triton_kernels`` (the causal
CUDA path), ``decoding`` (the recurrent state (S, z)), ``reference`` (float64, T×T), ``layer``."""

from __future__ import annotations

from attnlab.attention.linear.ops import linear_attention, linear_attention_segments

__all__ = ["linear_attention", "linear_attention_segments"]
