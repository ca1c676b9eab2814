"""The public sliced ReLU op: input checks, then the first implementation that accepts the call.

``IMPLEMENTATIONS`` lists them in the order they are preferred, each with what it accepts
(``attnlab.attention.common.dispatch``): ``dense`` (O(T²), short sequences: ``path="auto"`` takes
it up to the measured crossover), ``triton`` (CUDA tensors), ``causal`` and ``sorted`` (the torch
ops). ``impl`` (``auto``/``triton``/``torch``) and ``path`` (``auto``/``dense``/``sorted``) narrow
the list.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from attnlab.attention.common import compiler
from attnlab.attention.common.dispatch import Implementation, Request, check_choice, device_type, run_first
from attnlab.attention.common.padding import check_padded_queries, query_mask
from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.common.triton import selfcheck
from attnlab.attention.sliced_common import dispatch
from attnlab.attention.sliced_common.rows import as_rows, check_scores_inputs, valid_rows
from attnlab.attention.sliced_relu.causal import causal_sliced_relu_attention
from attnlab.attention.sliced_relu.dense import dense_causal_sliced_relu, dense_sliced_relu
from attnlab.attention.sliced_relu.sorted import SlicedReLU

__all__ = ["IMPLEMENTATIONS", "sliced_relu_attention"]

OP = "sliced_relu_attention"


class _Call(NamedTuple):
    """A checked call, as every implementation takes it."""

    s: torch.Tensor
    t: torch.Tensor
    v: torch.Tensor
    key_padding_mask: torch.Tensor | None
    valid: torch.Tensor | None  # (B·H, T) real keys
    queries: torch.Tensor | None  # (B·H, T) the queries whose output is kept
    eps: float
    causal: bool
    impl: str
    acc: torch.dtype


def _dense(c: _Call) -> torch.Tensor:
    s, t, v = (as_rows(x, c.acc) for x in (c.s, c.t, c.v))
    if c.causal:
        return dispatch.like_v(dense_causal_sliced_relu(s, t, v, c.valid, c.eps), c.v)
    return dispatch.like_v(dense_sliced_relu(s, t, v, c.valid, c.queries, c.eps), c.v)


def _triton(c: _Call) -> torch.Tensor | None:
    def call():
        from attnlab.attention.sliced_relu import triton  # imported when used: triton loads slowly

        return triton.sliced_relu(c.s, c.t, c.v, c.valid, c.queries, c.eps, c.acc)

    return dispatch.launch_triton(OP, c.impl, c.v, call, _check_case)


def _causal(c: _Call) -> torch.Tensor:
    return causal_sliced_relu_attention(c.s, c.t, c.v, c.key_padding_mask, c.eps)


def _sorted(c: _Call) -> torch.Tensor:
    s, t, v = (as_rows(x, c.acc) for x in (c.s, c.t, c.v))
    return dispatch.like_v(SlicedReLU.apply(s, t, v, c.valid, c.queries, c.eps), c.v)


#: in the order they are preferred: the first that accepts a call runs it
IMPLEMENTATIONS: tuple[Implementation, ...] = (
    dispatch.dense("relu", _dense),
    dispatch.triton(_triton),
    Implementation("causal", dispatch.CAUSAL_COST, _causal, path="sorted", causal=(True,)),
    Implementation("sorted", dispatch.SORTED_COST, _sorted, path="sorted", causal=(False,)),
)


def sliced_relu_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-4,
    causal: bool = False,
    impl: str = "auto",
    padded_queries: str = "zero",
    path: str = "auto",
) -> torch.Tensor:
    """Exact sliced ReLU attention in O(T log T): ``(B, H, T, D)`` output.

    ``o_i = 2 Σ_j ReLU(s_i - t_j)(v_j - vbar) / max(Σ_j |s_i - t_j|, eps)`` with sums and the
    mean ``vbar`` over real keys. ``s`` (query scores) and ``t`` (key scores) are ``(B, H, T)``,
    ``v`` is ``(B, H, T, D)``, ``key_padding_mask`` a bool ``(B, T)`` with True = real token.
    Padded query positions output zeros (``padded_queries="zero"``) or attend to the real keys
    (``"attend"``, bidirectional only; ``attnlab.attention.common.padding``). Differentiable in ``s``, ``t``
    and ``v``.
    ``causal=True``: keys j <= i only, every statistic over that prefix, in O(T log² T)
    (``attnlab.attention.sliced_relu.causal``; torch code only, no Triton kernel yet). ``impl``:
    ``"auto"`` (Triton kernels for CUDA tensors, this torch code otherwise), ``"triton"`` or
    ``"torch"``; ``path``: ``"auto"`` (dense O(T²) evaluation up to a measured crossover length,
    sorted above), ``"dense"`` or ``"sorted"`` (``attnlab.attention.sliced_common.path``); the same
    function either way. They narrow ``IMPLEMENTATIONS``, of which the first that accepts the call
    runs; a call none accepts is one ValueError naming each and why it declined.
    """
    check_scores_inputs(OP, s, t, v, key_padding_mask)
    if not eps > 0:
        raise ValueError(f"{OP}: eps must be > 0, got {eps}")
    check_padded_queries(OP, padded_queries, causal)
    check_choice(OP, impl, path)
    if v.numel() == 0:
        return dispatch.empty_batch(v, s, t)
    _, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    request = Request(
        OP, v.device, device_type(s, t, v), acc, impl, path, causal, dim, length, padded_queries
    )
    valid = valid_rows(key_padding_mask, heads, v.device)
    queries = valid_rows(query_mask(key_padding_mask, padded_queries), heads, v.device)
    call = _Call(s, t, v, key_padding_mask, valid, queries, float(eps), causal, impl, acc)
    opaque = lambda: _OPAQUE(s, t, v, key_padding_mask, float(eps), causal, impl, padded_queries, path)  # noqa: E731
    return run_first(IMPLEMENTATIONS, request, call, opaque)


#: the op as ``torch.compile`` calls its sorted and Triton forms (``attnlab.attention.common.compiler``)
_OPAQUE = compiler.opaque_op(
    OP,
    sliced_relu_attention,
    "Tensor s, Tensor t, Tensor v, Tensor? key_padding_mask, float eps, bool causal, str impl, "
    "str padded_queries, str path",
    differentiable=3,
)


def _check_case(like: torch.Tensor):
    """The first-use check's case (``selfcheck.trusted``): two rows of 200 tokens, one padded to 150,
    in ``like``'s dtype, device and head dim, through the Triton kernels and the torch code."""
    inputs, mask = selfcheck.random_case("scores", 2, 2, 200, like.shape[-1], like.dtype, like.device)
    keywords = {"key_padding_mask": mask, "path": "sorted"}
    fast, slow = (
        functools.partial(sliced_relu_attention, impl="triton"),
        functools.partial(sliced_relu_attention, impl="torch"),
    )
    return fast, slow, inputs, keywords
