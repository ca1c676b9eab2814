"""Bidirectional sliced ReLU attention on sorted keys: a hand-written autograd function.

``o_i = 2 Σ_j ReLU(s_i − t_j)(v_j − vbar) / max(Σ_j |s_i − t_j|, eps)`` from prefix sums over the
keys sorted by score (package docstring: ``attnlab.attention.sliced_common``).

On the CPU the D-wide sums and the ranks run in C++ (``cpu_kernels.cpp``: walks over each row's
sorted keys, summing in double, on torch's threads); the torch code below them runs elsewhere, with
``ATTNLAB_NATIVE=off`` and where no compiler is found. Both evaluate the same formulas.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch

from attnlab.attention.common import native
from attnlab.attention.common.precision import no_autocast
from attnlab.attention.sliced_common.path import KERNEL_SOURCES
from attnlab.attention.sliced_common.rows import (
    centre_scores,
    count_greater,
    cumsum_rows_,
    exclusive_cumsum,
    finite_rows,
    first_order_only,
    masked_mean_rows,
    nan_rows,
    real_counts,
    real_keys,
    reuse_buffer,
    rowdot,
    sort_real_first,
    sorted_rows,
    take_rows,
    take_scalar,
    times_scores,
)


class SlicedReLU(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)`` in the accumulation dtype; ``valid (N, T)`` (real keys)
    and ``queries (N, T)`` (the queries whose output is kept, ``attnlab.attention.common.padding``)
    or None."""

    @staticmethod
    def forward(ctx, s, t, v, valid, queries, eps):
        with no_autocast(v.device):
            return SlicedReLU._forward(ctx, s, t, v, valid, queries, eps)

    @staticmethod
    @first_order_only("sliced_relu_attention")
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return SlicedReLU._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, s, t, v, valid, queries, eps):
        n_rows, length, _ = v.shape
        count = real_counts(valid, n_rows, length, v.dtype, v.device)
        s, t = centre_scores(s, t, valid, count, queries)  # padded slots: harmless finite scores
        s, t, bad = finite_rows(s, t)  # rows with a NaN/inf score: NaN out, below
        t_search, t_sorted, order = sort_real_first(t, valid)
        ctx.kernels = cpu_kernels(v)
        if ctx.kernels is not None:  # the CPU: both ranks in one pass (the backward's too)
            rank, ctx.rank_le = torch.empty_like(order), torch.empty_like(order)
            native.call_rows(ctx.kernels.ranks, (t_search, s, rank, ctx.rank_le), (n_rows, length, 1))
        else:
            rank = torch.searchsorted(t_search, s, side="left")  # p_i = #{j : t_j < s_i}
        p_t = exclusive_cumsum(t_sorted)
        # Σ_j |s_i - t_j| = s_i (2 p_i - n) + Σ_j t_j - 2 Σ_{t_j<s_i} t_j   (ties add 0 either way)
        den = s * (2 * rank.to(s.dtype) - count[:, None]) + p_t[:, -1:] - 2 * take_scalar(p_t, rank)
        scale = 2.0 / den.clamp_min(eps)
        if queries is not None:
            scale = scale.masked_fill(~queries, 0.0)

        if ctx.kernels is not None:  # the CPU: the D-wide sums in one walk per row (cpu_kernels.cpp)
            v = v.contiguous()
            ctx.real = real_keys(valid, n_rows, length)
            out, vbar = torch.empty_like(v), v.new_empty(n_rows, v.shape[-1], dtype=torch.float64)
            arrays = (v, order, t_sorted, s, rank, ctx.real, scale, vbar, out)
            native.call_rows(ctx.kernels.forward, arrays, v.shape)
            below_w = None
        else:
            # Prefix sums over sorted keys of w = v - vbar and of t·w. Padded keys sit after every
            # real key and no rank ever reaches past the real ones, so their rows of the tables
            # (whatever they hold) are never read: no masking pass is needed.
            vbar = masked_mean_rows(v, valid, count)
            p_w = sorted_rows(v, order, vbar, None)
            p_tw = times_scores(p_w, t_sorted)
            cumsum_rows_(p_w)
            cumsum_rows_(p_tw)
            below_w = take_rows(p_w, rank)  # Σ_{t_j<s_i} w_j, kept for the backward pass (see there)
            out = take_rows(p_tw, rank, out=reuse_buffer(p_w, below_w.shape))  # Σ_{t_j<s_i} t_j w_j
            del p_tw
            out.mul_(-scale[..., None]).addcmul_(below_w, (s * scale)[..., None])  # 2 (s P_w - P_tw) / den
        nan_rows(out, bad, queries)

        ctx.save_for_backward(s, t, t_search, order, rank, den, out, v, vbar, count)
        ctx.valid, ctx.queries, ctx.eps, ctx.bad = valid, queries, eps, bad
        ctx.below_w = below_w  # not saved_tensors: the backward pass frees it after one read
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, t_search, order, rank, den, out, v, vbar, count = ctx.saved_tensors
        valid, queries, eps = ctx.valid, ctx.queries, ctx.eps
        # Σ_{t_j<s_i} w_j from the forward pass, (N, T, D): read once, first, and dropped, so that
        # it is not live beside the key-side tables below (a saved tensor would live until the
        # end of this function: peak memory). A second backward through a retained graph
        # rebuilds it from the saved sort.
        below_w, ctx.below_w = ctx.below_w, None
        if below_w is None and ctx.kernels is None:
            p_w = sorted_rows(v, order, vbar, None)
            below_w = take_rows(cumsum_rows_(p_w), rank)
            del p_w
        grad_out = grad_out.contiguous()

        # o_i = 2 N_i / d_i with d_i = max(den_i, eps):  dL/dN_i = a_i = 2 g_i / d_i and
        # dL/dden_i = -(g_i · o_i) / d_i where den_i >= eps (where clamp passes the gradient).
        inv_d = 1.0 / den.clamp_min(eps)
        a_scale, den_scale = 2.0 * inv_d, inv_d * (den >= eps)
        if queries is not None:
            a_scale = a_scale.masked_fill(~queries, 0.0)
            den_scale = den_scale.masked_fill(~queries, 0.0)

        # Queries: dL/ds_i = a_i · Σ_{t_j<s_i} w_j + dden_i (#{t_j<s_i} - #{t_j>s_i}).
        if ctx.kernels is not None:  # the CPU: every sum of the keys' and queries' sides in two walks
            rank_le = ctx.rank_le  # #{j : t_j <= s_i}
            grad_den, below = torch.empty_like(s), torch.empty_like(s)  # dden_i = -(g_i · o_i) den_scale_i
            grad_v, grad_t = torch.empty_like(v), torch.empty_like(t)
            arrays = (v, order, t_search, s, rank, rank_le, ctx.real, vbar, grad_out, a_scale, out, den_scale)
            native.call_rows(ctx.kernels.backward, (*arrays, grad_den, below, grad_v, grad_t), v.shape)
            grad_s = a_scale * below + grad_den * (rank + rank_le - count[:, None]).to(s.dtype)
            return SlicedReLU._gradients(ctx, grad_s, grad_t, grad_v)
        grad_den = -rowdot(grad_out, out) * den_scale
        if queries is not None:
            grad_den = grad_den.masked_fill(~queries, 0.0)
        rank_le = torch.searchsorted(t_search, s, side="right")  # #{j : t_j <= s_i}
        grad_s = a_scale * rowdot(grad_out, below_w)
        del below_w
        grad_s += grad_den * (rank + rank_le - count[:, None]).to(s.dtype)

        # Keys: queries sorted by -s, so that prefix sums are sums over {i : s_i > t_j}.
        # Padded queries (score 0, zero weight) stay in the order so that it matches the counts.
        _, neg_sorted, q_order = sort_real_first(-s, None)
        q_a = sorted_rows(grad_out, q_order, None, torch.gather(a_scale, 1, q_order))
        q_sa = times_scores(q_a, -neg_sorted)
        cumsum_rows_(q_a)  # Σ a_i
        cumsum_rows_(q_sa)  # Σ s_i a_i
        q_den = exclusive_cumsum(torch.gather(grad_den, 1, q_order))

        # s_i > t_j  <=>  #{keys < s_i} > (sorted position of key j), and s_i >= t_j  <=>
        # #{keys <= s_i} > (its position): counting ranks gives every key's count of queries above
        # it without another binary search.
        above = count_greater(rank, order)  # #{i : s_i > t_j}
        at_or_above = count_greater(rank_le, order)  # #{i : s_i >= t_j}
        sum_a = take_rows(q_a, above)
        grad_v = take_rows(q_sa, above, out=reuse_buffer(q_a, sum_a.shape))
        del q_sa
        # dL/dw_j = Σ_{s_i>t_j} (s_i - t_j) a_i
        # dL/dt_j = -w_j · Σ_{s_i>t_j} a_i - Σ_{s_i>t_j} dden_i + Σ_{s_i<t_j} dden_i
        grad_v.addcmul_(sum_a, t[..., None], value=-1.0)
        w_dot_a = rowdot(v, sum_a) - torch.bmm(sum_a, vbar[:, :, None])[..., 0]
        den_above = take_scalar(q_den, above)
        den_below = q_den[:, -1:] - take_scalar(q_den, at_or_above)
        grad_t = den_below - den_above - w_dot_a

        # vbar depends on every real v_k: subtract the mean of dL/dw over the real keys.
        grad_v -= masked_mean_rows(grad_v, valid, count)[:, None, :]
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
        return SlicedReLU._gradients(ctx, grad_s, grad_t, grad_v)

    @staticmethod
    def _gradients(ctx, grad_s, grad_t, grad_v):
        """Zero at dropped queries, NaN where a row was broken (padded keys are zero already)."""
        if ctx.queries is not None:
            grad_s = grad_s.masked_fill(~ctx.queries, 0.0)
        grad_s, grad_t = nan_rows(grad_s, ctx.bad, ctx.queries), nan_rows(grad_t, ctx.bad, ctx.valid)
        return grad_s, grad_t, nan_rows(grad_v, ctx.bad, ctx.valid), None, None, None


KERNELS = KERNEL_SOURCES["relu"]  # cpu_kernels.cpp beside this file (path.py's crossover reads it too)
_ARGTYPES = {
    "sliced_relu_ranks": [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5,
    "sliced_relu_forward": [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 5,
    "sliced_relu_backward": [ctypes.c_void_p] * 16 + [ctypes.c_int64] * 5,
}


class Kernels(NamedTuple):
    ranks: Callable
    forward: Callable
    backward: Callable


def cpu_kernels(v: torch.Tensor) -> Kernels | None:
    """The C++ kernels (``cpu_kernels.cpp``) for CPU values of ``v``'s dtype, or None: not the CPU,
    not float32/float64, ``ATTNLAB_NATIVE=off`` or no compiler (the torch code runs)."""
    found = native.cpu_kernels(v, KERNELS, _ARGTYPES)
    return None if found is None else Kernels(*found.values())
