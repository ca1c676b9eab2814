"""Naive O(T²) definitions of every attention backend, for tests and benchmarks only: each family's
``reference.py`` (``attnlab.attention.<family>.reference``), gathered here.

Each function is written the obvious way, with broadcasting, so that it can be read against
the math of docs/attention.md line by line. They build T×T tensors on purpose: never use them in a
model. Shapes follow the ops: ``q, k, v`` are ``(B, H, T, D)``, scores ``s, t`` are ``(B, H, T)``,
``key_padding_mask`` is a bool ``(B, T)`` with True = real token.

They repeat, on purpose, what the ops also do (shape checks, masks, the centring of values): a
reference that called the op's helpers would share its bugs, so nothing here imports from the ops.

Conventions shared with the fast ops:

- padded keys have no influence at all (they are dropped from every sum, mean and count);
- padded query positions output zeros (never NaN), and so does a query with no visible key;
  with ``padded_queries="attend"`` (bidirectional) they attend to the real keys instead
  (``attnlab.attention.common.padding``);
- kinks are differentiated the way torch autograd does it (``relu'(0) = 0``, ``abs'(0) = 0``),
  which is what the fast ops reproduce at tied scores.

``sliced_relu_attention_concat`` is different in kind: it is the straightforward sort-based
formulation of the public sliced-ReLU reference code (arXiv 2512.11411), kept as the baseline
the benchmark compares the fast op against; it is O(T log T) but plain autograd.
"""

from __future__ import annotations

from attnlab.attention.linear.reference import linear_attention
from attnlab.attention.performer.reference import performer_attention
from attnlab.attention.sliced_relu.reference import (
    causal_sliced_relu_attention,
    sliced_relu_attention,
    sliced_relu_attention_concat,
)
from attnlab.attention.sliced_relu_bump.reference import (
    causal_sliced_relu_bump_attention,
    sliced_relu_bump_attention,
)
from attnlab.attention.softmax.reference import softmax_attention

__all__ = [
    "causal_sliced_relu_attention",
    "causal_sliced_relu_bump_attention",
    "linear_attention",
    "performer_attention",
    "sliced_relu_attention",
    "sliced_relu_attention_concat",
    "sliced_relu_bump_attention",
    "softmax_attention",
]
