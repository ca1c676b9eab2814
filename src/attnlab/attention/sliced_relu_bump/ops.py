"""The public sliced ReLU-bump op: input checks, then the first implementation that accepts the call
(``IMPLEMENTATIONS``, as in ``attnlab.attention.sliced_relu.ops``: dense, Triton, causal, sorted)."""

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
from attnlab.attention.sliced_relu_bump.causal import causal_sliced_relu_bump_attention
from attnlab.attention.sliced_relu_bump.dense import dense_causal_sliced_relu_bump, dense_sliced_relu_bump
from attnlab.attention.sliced_relu_bump.normaliser import check_bump_normaliser
from attnlab.attention.sliced_relu_bump.sorted import SlicedReLUBump

__all__ = ["IMPLEMENTATIONS", "sliced_relu_bump_attention"]

OP = "sliced_relu_bump_attention"


class _Call(NamedTuple):
    """A checked call, as every implementation takes it."""

    s: torch.Tensor
    t: torch.Tensor
    v: torch.Tensor
    bandwidth: torch.Tensor  # (H,)
    width: torch.Tensor  # (B·H, 1): row n = (b, h) → b_h, in the accumulation dtype
    key_padding_mask: torch.Tensor | None
    valid: torch.Tensor | None  # (B·H, T) real keys
    queries: torch.Tensor | None  # (B·H, T) the queries whose output is kept
    causal: bool
    normaliser: str
    mass_eps: float
    impl: str
    acc: torch.dtype


def _dense(c: _Call) -> torch.Tensor:
    s, t, v = (as_rows(x, c.acc) for x in (c.s, c.t, c.v))
    if c.causal:
        mass = None if c.normaliser == "count" else float(c.mass_eps)
        return dispatch.like_v(dense_causal_sliced_relu_bump(s, t, v, c.width, c.valid, mass), c.v)
    return dispatch.like_v(dense_sliced_relu_bump(s, t, v, c.width, c.valid, c.queries), c.v)


def _triton(c: _Call) -> torch.Tensor | None:
    def call():
        from attnlab.attention.sliced_relu_bump import triton  # imported when used: triton loads slowly

        return triton.sliced_relu_bump(c.s, c.t, c.v, c.width, c.valid, c.queries, c.acc)

    return dispatch.launch_triton(OP, c.impl, c.v, call, _check_case)


def _causal(c: _Call) -> torch.Tensor:
    return causal_sliced_relu_bump_attention(
        c.s, c.t, c.v, c.bandwidth, c.key_padding_mask, normaliser=c.normaliser, mass_eps=c.mass_eps
    )


def _sorted(c: _Call) -> torch.Tensor:
    s, t, v = (as_rows(x, c.acc) for x in (c.s, c.t, c.v))
    return dispatch.like_v(SlicedReLUBump.apply(s, t, v, c.width, c.valid, c.queries), c.v)


#: in the order they are preferred: the first that accepts a call runs it
IMPLEMENTATIONS: tuple[Implementation, ...] = (
    dispatch.dense("bump", _dense),
    dispatch.triton(_triton),
    Implementation("causal", dispatch.CAUSAL_COST, _causal, path="sorted", causal=(True,)),
    Implementation("sorted", dispatch.SORTED_COST, _sorted, path="sorted", causal=(False,)),
)


def sliced_relu_bump_attention(
    s: torch.Tensor,
    t: torch.Tensor,
    v: torch.Tensor,
    bandwidth: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    impl: str = "auto",
    normaliser: str = "count",
    mass_eps: float = 1e-2,
    padded_queries: str = "zero",
    path: str = "auto",
) -> torch.Tensor:
    """Exact sliced ReLU-bump attention in O(T log T): ``(B, H, T, D)`` output.

    ``o_i = (1/n) Σ_j max(0, 1 - |s_i - t_j| / b_h) v_j`` over the n real keys (values are not
    centred). ``bandwidth`` is a positive finite ``(H,)`` tensor, one width per head, and receives a
    gradient (it is a learned parameter of the layer). Other arguments as in
    ``sliced_relu_attention``. The window sums are prefix-sum differences, so in float32 very
    narrow bandwidths at long T lose precision on the torch path (the window is small next to the
    running totals; figures in ``attnlab.attention.sliced_common``); the Triton path sums each window's
    keys with their exact weights and keeps float32's own precision. The scores' offset does not
    matter (the op centres them).
    ``causal=True``: keys j <= i only, n_i = real keys j <= i, in O(T log² T) (torch code only).
    ``impl`` and ``path`` as in ``sliced_relu_attention``: they narrow ``IMPLEMENTATIONS``.
    ``normaliser``: ``"count"`` (divide by n or n_i, the authors' code's bump) or, with ``causal=True``,
    ``"mass"``: divide by the hat weight seen, ``Σ_{j≤i} hat(s_i − t_j) + mass_eps``, so a causal
    output does not shrink like 1/i with its position i. ``mass_eps`` is relative to one fully
    matching key (hat = 1); it bounds the ratio's gradient (about 1 / (4 b mass_eps)) where a query's
    window holds almost no weight. ``padded_queries`` as in ``sliced_relu_attention``.
    """
    check_scores_inputs(OP, s, t, v, key_padding_mask)
    batch, heads, length, _ = v.shape
    check_bandwidth(OP, bandwidth, heads)
    check_bump_normaliser(OP, normaliser, mass_eps, causal)
    check_padded_queries(OP, padded_queries, causal)
    check_choice(OP, impl, path)
    if v.numel() == 0:
        return dispatch.empty_batch(v, s, t, bandwidth)
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    request = Request(
        OP, v.device, device_type(s, t, v), acc, impl, path, causal, v.shape[-1], length, padded_queries
    )
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]  # row n = (b, h) → b_h
    valid = valid_rows(key_padding_mask, heads, v.device)
    queries = valid_rows(query_mask(key_padding_mask, padded_queries), heads, v.device)
    call = _Call(
        s, t, v, bandwidth, width, key_padding_mask, valid, queries, causal, normaliser, mass_eps, impl, acc
    )
    opaque = lambda: _OPAQUE(  # noqa: E731
        s, t, v, bandwidth, key_padding_mask, causal, impl, normaliser, float(mass_eps), padded_queries, path
    )
    return run_first(IMPLEMENTATIONS, request, call, opaque)


def check_bandwidth(op: str, bandwidth, heads: int) -> None:
    """``bandwidth`` is a float (H,) tensor, finite and > 0 (checked on the device when the host may
    not read it: no stall, no graph break)."""
    if not isinstance(bandwidth, torch.Tensor) or tuple(bandwidth.shape) != (heads,):
        shape = tuple(bandwidth.shape) if isinstance(bandwidth, torch.Tensor) else type(bandwidth).__name__
        raise ValueError(f"{op}: bandwidth must have shape (H,) = ({heads},), got {shape}")
    if not bandwidth.is_floating_point():
        raise TypeError(f"{op}: bandwidth must be a float tensor, got {bandwidth.dtype}")
    # b = inf would be the plain mean of v, but the window formula turns it into inf - inf = NaN
    positive = f"{op}: bandwidth must be finite and > 0 everywhere"
    good = ((bandwidth > 0) & torch.isfinite(bandwidth)).all()
    if not compiler.host_reads_allowed(bandwidth):
        torch._assert_async(good, positive)
    elif not bool(good):
        raise ValueError(f"{positive}, got {bandwidth.detach().tolist()}")


#: the op as ``torch.compile`` calls its sorted and Triton forms (``attnlab.attention.common.compiler``)
_OPAQUE = compiler.opaque_op(
    OP,
    sliced_relu_bump_attention,
    "Tensor s, Tensor t, Tensor v, Tensor bandwidth, Tensor? key_padding_mask, bool causal, str impl, "
    "str normaliser, float mass_eps, str padded_queries, str path",
    differentiable=4,
)


def _check_case(like: torch.Tensor):
    """The first-use check's case (``selfcheck.trusted``): two rows of 200 tokens, one padded to 150,
    in ``like``'s dtype, device and head dim, through the Triton kernels and the torch code."""
    inputs, mask = selfcheck.random_case("bump", 2, 2, 200, like.shape[-1], like.dtype, like.device)
    keywords = {"key_padding_mask": mask, "path": "sorted"}
    fast, slow = (
        functools.partial(sliced_relu_bump_attention, impl="triton"),
        functools.partial(sliced_relu_bump_attention, impl="torch"),
    )
    return fast, slow, inputs, keywords
