"""The public sliced ReLU-bump op: input checks, then which implementation runs (as
``attnlab.attention.sliced_relu.ops``: dense, causal, Triton or the sorted torch op)."""

from __future__ import annotations

import functools

import torch

from attnlab.attention.common.padding import check_padded_queries, query_mask
from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.common.triton import selfcheck
from attnlab.attention.sliced_common.dispatch import empty_batch, like_v, run_triton, torch_only_causal
from attnlab.attention.sliced_common.path import choose_path
from attnlab.attention.sliced_common.rows import as_rows, check_scores_inputs, valid_rows
from attnlab.attention.sliced_relu_bump.causal import causal_sliced_relu_bump_attention
from attnlab.attention.sliced_relu_bump.dense import dense_causal_sliced_relu_bump, dense_sliced_relu_bump
from attnlab.attention.sliced_relu_bump.normaliser import check_bump_normaliser
from attnlab.attention.sliced_relu_bump.sorted import SlicedReLUBump

__all__ = ["sliced_relu_bump_attention"]


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
    ``impl`` as in ``sliced_relu_attention``.
    ``normaliser``: ``"count"`` (divide by n or n_i, the authors' code's bump) or, with ``causal=True``,
    ``"mass"``: divide by the hat weight seen, ``Σ_{j≤i} hat(s_i − t_j) + mass_eps``, so a causal
    output does not shrink like 1/i with its position i. ``mass_eps`` is relative to one fully
    matching key (hat = 1); it bounds the ratio's gradient (about 1 / (4 b mass_eps)) where a query's
    window holds almost no weight. ``padded_queries`` and ``path`` as in ``sliced_relu_attention``.
    """
    check_scores_inputs("sliced_relu_bump_attention", s, t, v, key_padding_mask)
    batch, heads, length, _ = v.shape
    if not isinstance(bandwidth, torch.Tensor) or tuple(bandwidth.shape) != (heads,):
        shape = tuple(bandwidth.shape) if isinstance(bandwidth, torch.Tensor) else type(bandwidth).__name__
        raise ValueError(
            f"sliced_relu_bump_attention: bandwidth must have shape (H,) = ({heads},), got {shape}"
        )
    if not bandwidth.is_floating_point():
        raise TypeError(
            f"sliced_relu_bump_attention: bandwidth must be a float tensor, got {bandwidth.dtype}"
        )
    # b = inf would be the plain mean of v, but the window formula turns it into inf - inf = NaN
    positive = "sliced_relu_bump_attention: bandwidth must be finite and > 0 everywhere"
    good = ((bandwidth > 0) & torch.isfinite(bandwidth)).all()
    if bandwidth.is_cuda:  # checked on the device: a host-side check would stall every layer call
        torch._assert_async(good, positive)
    elif not bool(good):
        raise ValueError(f"{positive}, got {bandwidth.detach().tolist()}")
    check_bump_normaliser("sliced_relu_bump_attention", normaliser, mass_eps, causal)
    check_padded_queries("sliced_relu_bump_attention", padded_queries, causal)
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype, bandwidth.dtype)
    op = "causal_bump" if causal else "bump"
    dense = choose_path("sliced_relu_bump_attention", op, path, impl, length, v.device, acc) == "dense"
    valid = valid_rows(key_padding_mask, heads, v.device)
    if causal:
        torch_only_causal("sliced_relu_bump_attention", impl)
    if v.numel() == 0:
        return empty_batch(v, s, t, bandwidth)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]  # row n = (b, h) → b_h
    if causal:
        if dense:
            mass = None if normaliser == "count" else float(mass_eps)
            out = dense_causal_sliced_relu_bump(
                as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), width, valid, mass
            )
            return like_v(out, v)
        return causal_sliced_relu_bump_attention(
            s, t, v, bandwidth, key_padding_mask, normaliser=normaliser, mass_eps=mass_eps
        )
    queries = valid_rows(query_mask(key_padding_mask, padded_queries), heads, v.device)
    if dense:
        out = dense_sliced_relu_bump(as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), width, valid, queries)
        return like_v(out, v)
    out = run_triton(
        "sliced_relu_bump_attention",
        impl,
        s,
        t,
        v,
        acc,
        lambda: _triton().sliced_relu_bump(s, t, v, width, valid, queries, acc),
        _check_case,
    )
    if out is not None:
        return out
    out = SlicedReLUBump.apply(as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), width, valid, queries)
    return like_v(out, v)


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


def _triton():
    """The Triton launcher, imported when used: triton loads slowly."""
    from attnlab.attention.sliced_relu_bump import triton

    return triton
