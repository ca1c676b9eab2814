"""Public facade of the attention ops: pure functions on (B, H, T, D) tensors (scores (B, H, T)).

Import from here rather than from the implementation modules (each family's ``ops.py`` and
``decoding.py``), which may be reorganised.
"""

from __future__ import annotations

from attnlab.attention.linear.decoding import linear_attention_state, linear_attention_step
from attnlab.attention.linear.ops import linear_attention
from attnlab.attention.sliced_relu.decoding import sliced_relu_attention_state, sliced_relu_attention_step
from attnlab.attention.sliced_relu.ops import sliced_relu_attention
from attnlab.attention.sliced_relu.segments import sliced_relu_attention_segments
from attnlab.attention.sliced_relu_bump.decoding import (
    sliced_relu_bump_attention_state,
    sliced_relu_bump_attention_step,
)
from attnlab.attention.sliced_relu_bump.ops import sliced_relu_bump_attention
from attnlab.attention.sliced_relu_bump.segments import sliced_relu_bump_attention_segments
from attnlab.attention.softmax.ops import softmax_attention

__all__ = [
    "linear_attention",
    "linear_attention_state",
    "linear_attention_step",
    "sliced_relu_attention",
    "sliced_relu_attention_segments",
    "sliced_relu_attention_state",
    "sliced_relu_attention_step",
    "sliced_relu_bump_attention",
    "sliced_relu_bump_attention_segments",
    "sliced_relu_bump_attention_state",
    "sliced_relu_bump_attention_step",
    "softmax_attention",
]
