"""The public sliced ReLU op: input checks, then which implementation runs.

``path`` (``auto``/``dense``/``sorted``, ``attnlab.attention.sliced_common.path``) chooses between the
dense O(T²) evaluation (``dense``, short sequences) and the sorted ops; on the sorted path
``causal=True`` → ``causal``, and ``impl`` (``auto``/``triton``/``torch``,
``attnlab.attention.common.triton``) chooses between the Triton kernels (``triton``) and the sorted
torch op (``sorted``).
"""

from __future__ import annotations

import functools

import torch

from attnlab.attention.common.padding import check_padded_queries, query_mask
from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.common.triton import selfcheck
from attnlab.attention.sliced_common.dispatch import empty_batch, like_v, run_triton, torch_only_causal
from attnlab.attention.sliced_common.path import choose_path
from attnlab.attention.sliced_common.rows import as_rows, check_scores_inputs, valid_rows
from attnlab.attention.sliced_relu.causal import causal_sliced_relu_attention
from attnlab.attention.sliced_relu.dense import dense_causal_sliced_relu, dense_sliced_relu
from attnlab.attention.sliced_relu.sorted import SlicedReLU

__all__ = ["sliced_relu_attention"]


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
    (``attnlab.attention.sliced_common.causal``; torch code only, no Triton kernel yet). ``impl``:
    ``"auto"`` (Triton kernels for CUDA tensors, this torch code otherwise), ``"triton"`` or
    ``"torch"`` (see ``attnlab.attention.common.triton``). ``path``: ``"auto"`` (dense O(T²) evaluation up
    to a measured crossover length, sorted above), ``"dense"`` or ``"sorted"``
    (``attnlab.attention.sliced_common.path``); the same function either way.
    """
    check_scores_inputs("sliced_relu_attention", s, t, v, key_padding_mask)
    if not eps > 0:
        raise ValueError(f"sliced_relu_attention: eps must be > 0, got {eps}")
    check_padded_queries("sliced_relu_attention", padded_queries, causal)
    _, heads, length, _ = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    op = "causal_relu" if causal else "relu"
    dense = choose_path("sliced_relu_attention", op, path, impl, length, v.device, acc) == "dense"
    if causal:
        torch_only_causal("sliced_relu_attention", impl)
    if v.numel() == 0:
        return empty_batch(v, s, t)
    if causal:
        if dense:
            valid = valid_rows(key_padding_mask, heads, v.device)
            out = dense_causal_sliced_relu(
                as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), valid, float(eps)
            )
            return like_v(out, v)
        return causal_sliced_relu_attention(s, t, v, key_padding_mask, eps)
    valid = valid_rows(key_padding_mask, heads, v.device)
    queries = valid_rows(query_mask(key_padding_mask, padded_queries), heads, v.device)
    if dense:
        out = dense_sliced_relu(as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), valid, queries, float(eps))
        return like_v(out, v)
    out = run_triton(
        "sliced_relu_attention",
        impl,
        s,
        t,
        v,
        acc,
        lambda: _triton().sliced_relu(s, t, v, valid, queries, eps, acc),
        _check_case,
    )
    if out is not None:
        return out
    out = SlicedReLU.apply(as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), valid, queries, float(eps))
    return like_v(out, v)


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


def _triton():
    """The Triton launcher, imported when used: triton loads slowly."""
    from attnlab.attention.sliced_relu import triton

    return triton
