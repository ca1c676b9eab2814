"""Public facade of the attention ops: pure functions on (B, H, T, D) tensors (scores (B, H, T)).

Import from here rather than from the implementation modules, which may be reorganised.
"""

from __future__ import annotations

from attnlab.attention.linear import linear_attention, linear_attention_state, linear_attention_step
from attnlab.attention.sliced.decode import (
    sliced_relu_attention_state,
    sliced_relu_attention_step,
    sliced_relu_bump_attention_state,
    sliced_relu_bump_attention_step,
)
from attnlab.attention.sliced.dispatch import sliced_relu_attention, sliced_relu_bump_attention
from attnlab.attention.softmax import softmax_attention

__all__ = [
    "linear_attention",
    "linear_attention_state",
    "linear_attention_step",
    "sliced_relu_attention",
    "sliced_relu_attention_state",
    "sliced_relu_attention_step",
    "sliced_relu_bump_attention",
    "sliced_relu_bump_attention_state",
    "sliced_relu_bump_attention_step",
    "softmax_attention",
]
