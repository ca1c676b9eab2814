"""Softmax (scaled dot-product) attention: ``ops`` (SDPA, LRA's padding rules), ``flex`` (packed
rows through FlexAttention's block mask on CUDA), ``reference`` (float64, T×T), ``decoding`` (KV
cache), ``layer``."""

from __future__ import annotations

from attnlab.attention.softmax.ops import softmax_attention

__all__ = ["softmax_attention"]
