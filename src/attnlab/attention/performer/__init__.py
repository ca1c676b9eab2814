"""Performer / FAVOR+ attention: ``ops`` (random features, the op on linear attention's chunked
core), ``decoding`` (the recurrent state), ``reference`` (the estimator token by token, float64),
``layer``."""

from __future__ import annotations

from attnlab.attention.performer.ops import performer_attention

__all__ = ["performer_attention"]
