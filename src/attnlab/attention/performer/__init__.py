"""Performer / FAVOR+ attention: ``ops`` (random features, the op on linear attention's chunked
core), ``segments`` (packed rows: several sequences per row), ``decoding`` (the recurrent state),
``reference`` (the estimator token by token, float64), ``layer``."""

from __future__ import annotations

from attnlab.attention.performer.ops import performer_attention
from attnlab.attention.performer.segments import performer_attention_segments

__all__ = ["performer_attention", "performer_attention_segments"]
