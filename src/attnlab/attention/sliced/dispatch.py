"""The public sliced ops: input checks, then which implementation runs, in one place.

``path`` (``auto``/``dense``/``sorted``, see ``attnlab.attention.sliced.path``) chooses between the
dense O(T²) evaluation (``attnlab.attention.sliced.dense``, short sequences) and the sorted ops;
on the sorted path ``causal=True`` → ``attnlab.attention.sliced.causal``, and ``impl``
(``auto``/``triton``/``torch``, see ``attnlab.attention.triton``) chooses between the Triton kernels
and the sorted torch ops (``relu``, ``bump``). Nothing below this module imports it back.
"""

from __future__ import annotations

import functools

import torch

from attnlab.attention.padding import check_padded_queries, query_mask
from attnlab.attention.precision import accumulation_dtype
from attnlab.attention.sliced.bump import _SlicedReLUBump
from attnlab.attention.sliced.causal import causal_sliced_relu_attention, causal_sliced_relu_bump_attention
from attnlab.attention.sliced.common import _check_inputs, _rows, _valid_rows
from attnlab.attention.sliced.dense import (
    dense_causal_sliced_relu,
    dense_causal_sliced_relu_bump,
    dense_sliced_relu,
    dense_sliced_relu_bump,
)
from attnlab.attention.sliced.normaliser import check_bump_normaliser
from attnlab.attention.sliced.path import choose_path
from attnlab.attention.sliced.relu import _SlicedReLU
from attnlab.attention.triton import selfcheck
from attnlab.attention.triton.runtime import IMPLS, launch, resolve_impl

__all__ = ["sliced_relu_attention", "sliced_relu_bump_attention"]


def _like(rows: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An op's (B·H, T, D) rows back in v's layout and dtype."""
    return rows.view(v.shape).to(v.dtype)


def _empty_batch(v: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """B, H or D = 0 (nothing to sort or reduce over, which the ops' reshapes cannot take): the
    empty output, still in the graph of every input, whose gradients come back empty (or zero)."""
    return v * 0 + sum(x.sum() for x in inputs) * 0


def _triton(op: str, impl: str, s, t, v, acc: torch.dtype, call) -> torch.Tensor | None:
    """``call(kernels)`` on the Triton kernels when ``impl`` picks them for these tensors; None when
    the torch code is to run (not CUDA, ``impl="torch"``, float64 on CUDA under ``auto``, or ``auto``
    and either Triton could not build a kernel here, which `launch` has warned about, or the kernels
    failed their first-use check against the torch code, which `selfcheck` has warned about)."""
    if resolve_impl(op, impl, s, t, v) != "triton" or not triton_takes_dtype(op, impl, v.device, acc):
        return None
    from attnlab.attention.triton import sliced  # imported when used: triton loads slowly

    check = lambda: selfcheck.trusted(op, v.device, v.dtype, lambda: _check_case(op, v))  # noqa: E731
    return launch(op, impl, v.device, lambda: call(sliced), check=check)


def _check_case(op: str, like: torch.Tensor):
    """The first-use check's case (``selfcheck.trusted``): two rows of 200 tokens, one padded to 150,
    in ``like``'s dtype, device and head dim, through the Triton kernels and the torch code."""
    kind = "bump" if op == "sliced_relu_bump_attention" else "scores"
    inputs, mask = selfcheck.random_case(kind, 2, 2, 200, like.shape[-1], like.dtype, like.device)
    fn = sliced_relu_bump_attention if op == "sliced_relu_bump_attention" else sliced_relu_attention
    keywords = {"key_padding_mask": mask, "path": "sorted"}
    return functools.partial(fn, impl="triton"), functools.partial(fn, impl="torch"), inputs, keywords


def triton_takes_dtype(op: str, impl: str, device: torch.device, acc: torch.dtype) -> bool:
    """Whether the sliced Triton kernels run in the accumulation dtype ``acc`` on ``device``.

    float64 on CUDA does not: the compiled ReLU-bump key walk spills 4-13 KB of stack per thread in
    float64 (sm_70-90), and fp64 units are a fraction of the GPU, so the torch op is the better
    float64 path; ``auto`` takes it, ``triton`` is refused by name. The interpreter (CPU tensors)
    runs float64, which the exactness tests use.
    """
    if acc != torch.float64 or device.type != "cuda":
        return True
    if impl == "triton":
        raise TypeError(
            f"{op}: impl='triton' has no float64 kernel on CUDA; use impl='auto' or impl='torch' "
            "for float64 inputs (the torch op runs them on the GPU)"
        )
    return False


def _torch_only_causal(op: str, impl: str) -> None:
    """The causal ops have no Triton kernel yet: ``auto`` runs the torch code, ``triton`` is refused."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "triton":
        raise ValueError(f"{op}: causal=True has no Triton kernel yet; use impl='auto' or impl='torch'")


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
    (``"attend"``, bidirectional only; ``attnlab.attention.padding``). Differentiable in ``s``, ``t``
    and ``v``.
    ``causal=True``: keys j <= i only, every statistic over that prefix, in O(T log² T)
    (``attnlab.attention.sliced.causal``; torch code only, no Triton kernel yet). ``impl``:
    ``"auto"`` (Triton kernels for CUDA tensors, this torch code otherwise), ``"triton"`` or
    ``"torch"`` (see ``attnlab.attention.triton``). ``path``: ``"auto"`` (dense O(T²) evaluation up
    to a measured crossover length, sorted above), ``"dense"`` or ``"sorted"``
    (``attnlab.attention.sliced.path``); the same function either way.
    """
    _check_inputs("sliced_relu_attention", s, t, v, key_padding_mask)
    if not eps > 0:
        raise ValueError(f"sliced_relu_attention: eps must be > 0, got {eps}")
    check_padded_queries("sliced_relu_attention", padded_queries, causal)
    _, heads, length, _ = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    op = "causal_relu" if causal else "relu"
    dense = choose_path("sliced_relu_attention", op, path, impl, length, v.device, acc) == "dense"
    if causal:
        _torch_only_causal("sliced_relu_attention", impl)
    if v.numel() == 0:
        return _empty_batch(v, s, t)
    if causal:
        if dense:
            valid = _valid_rows(key_padding_mask, heads, v.device)
            out = dense_causal_sliced_relu(_rows(s, acc), _rows(t, acc), _rows(v, acc), valid, float(eps))
            return _like(out, v)
        return causal_sliced_relu_attention(s, t, v, key_padding_mask, eps)
    valid = _valid_rows(key_padding_mask, heads, v.device)
    queries = _valid_rows(query_mask(key_padding_mask, padded_queries), heads, v.device)
    if dense:
        out = dense_sliced_relu(_rows(s, acc), _rows(t, acc), _rows(v, acc), valid, queries, float(eps))
        return _like(out, v)
    out = _triton(
        "sliced_relu_attention",
        impl,
        s,
        t,
        v,
        acc,
        lambda k: k.sliced_relu(s, t, v, valid, queries, eps, acc),
    )
    if out is not None:
        return out
    out = _SlicedReLU.apply(_rows(s, acc), _rows(t, acc), _rows(v, acc), valid, queries, float(eps))
    return _like(out, v)


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
    running totals; figures in ``attnlab.attention.sliced``); the Triton path sums each window's
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
    _check_inputs("sliced_relu_bump_attention", s, t, v, key_padding_mask)
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
    valid = _valid_rows(key_padding_mask, heads, v.device)
    if causal:
        _torch_only_causal("sliced_relu_bump_attention", impl)
    if v.numel() == 0:
        return _empty_batch(v, s, t, bandwidth)
    width = bandwidth.to(device=v.device, dtype=acc).repeat(batch)[:, None]  # row n = (b, h) → b_h
    if causal:
        if dense:
            mass = None if normaliser == "count" else float(mass_eps)
            out = dense_causal_sliced_relu_bump(
                _rows(s, acc), _rows(t, acc), _rows(v, acc), width, valid, mass
            )
            return _like(out, v)
        return causal_sliced_relu_bump_attention(
            s, t, v, bandwidth, key_padding_mask, normaliser=normaliser, mass_eps=mass_eps
        )
    queries = _valid_rows(query_mask(key_padding_mask, padded_queries), heads, v.device)
    if dense:
        out = dense_sliced_relu_bump(_rows(s, acc), _rows(t, acc), _rows(v, acc), width, valid, queries)
        return _like(out, v)
    out = _triton(
        "sliced_relu_bump_attention",
        impl,
        s,
        t,
        v,
        acc,
        lambda k: k.sliced_relu_bump(s, t, v, width, valid, queries, acc),
    )
    if out is not None:
        return out
    out = _SlicedReLUBump.apply(_rows(s, acc), _rows(t, acc), _rows(v, acc), width, valid, queries)
    return _like(out, v)
