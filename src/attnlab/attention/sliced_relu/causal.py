"""Causal sliced ReLU attention in O(T log² T): a hand-written autograd function over dominance sums.

The shared machinery (and the derivation, precision notes) is in ``attnlab.attention.sliced_common.causal``.
"""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced_common import dominance_native
from attnlab.attention.sliced_common.causal import (
    DEFAULT_CHUNK,
    check_chunk,
    later_sum,
    running_sum,
    segment_codes,
    shift_scores,
    tied_pairs,
)
from attnlab.attention.sliced_common.dominance import Query, dominance_sums, dominated_sums
from attnlab.attention.sliced_common.merged import Pairs, merged_dominance_sums, merged_dominated_sums
from attnlab.attention.sliced_common.rows import as_rows, rowdot, take_rows, valid_rows
from attnlab.attention.sliced_common.segments import Runs
from attnlab.attention.sliced_relu import causal_native

__all__ = ["causal_sliced_relu_attention"]


class _CausalSlicedReLU(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)`` in the accumulation dtype; ``valid (N, T)`` or None.

    ``runs``: packed rows (valid None), each token attending the earlier keys of its own segment.
    Keys and queries are then compared by their `segment_codes` (a key of an earlier segment above
    every query of a later one: counted nowhere) and every running statistic restarts at a
    segment's start (`running_sum`, `later_sum`)."""

    @staticmethod
    def forward(ctx, s, t, v, valid, eps, chunk, runs=None):
        with no_autocast(v.device):
            return _CausalSlicedReLU._forward(ctx, s, t, v, valid, eps, chunk, runs)

    @staticmethod
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _CausalSlicedReLU._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, s, t, v, valid, eps, chunk, runs):
        n_rows, length, dim = v.shape
        s, t, first = shift_scores(s, t, valid, runs)
        v = v - take_rows(v, first)  # output is invariant to a common value shift
        real = None if valid is None else valid.to(v.dtype)
        if real is not None:  # padded values, NaN or not, vanish from every sum (a product by 0 keeps NaN)
            v = v.masked_fill(~valid[..., None], 0.0)
        key = t if valid is None else t.masked_fill(~valid, float("inf"))
        query = s  # what the keys are compared with
        if runs is not None:
            key, query = segment_codes([t, s], runs, later_first=True)
        ones = torch.ones_like(t) if real is None else real
        # A_i, B_i, C_i, E_i: the sums of v, t v, 1 and t over the keys j <= i below s_i
        sums, levels = merged_dominance_sums(key, query, Pairs(v, None, t, ones, t), chunk)
        sum_v, sum_tv, count, sum_t = sums
        # #{j <= i : t_j <= s_i} (for the gradient) is #{t_j < s_i} plus the tied pairs
        orders = levels if isinstance(levels, dominance_native.Orders) else None  # the kernels' sorts
        pairs = tied_pairs(query, key, valid, orders)
        if pairs is None:  # too many ties to list: count them in a pass of their own
            weights = ones[..., None].contiguous()
            count_le = dominance_sums(key, weights, [Query(query, "right")], chunk)[0][..., 0]
        else:
            count_le = count.clone()
            count_le.view(-1).index_add_(0, pairs[0], torch.ones_like(pairs[0], dtype=count.dtype))

        fused = _fused_kernels(v, levels, runs)
        if fused is not None:  # the CPU: the element-wise work below in one pass of C++
            out, den, relu_mass, n_safe = causal_native.forward(fused, s, t, v, real, sums, eps)
            vbar = None  # summed again where the backward needs it
        else:
            n = running_sum(ones, runs)  # real keys j <= i
            n_safe = n.clamp_min(1)
            vbar = running_sum(v, runs).div_(n_safe[..., None])
            total_t = running_sum(t, runs)
            relu_mass = s * count - sum_t  # Σ_{j≤i} ReLU(s_i − t_j)
            # numerator Σ_{j≤i, t_j<s_i} (s_i − t_j)(v_j − vbar_i) = s A − B − vbar (s C − E)
            num = torch.addcmul(-sum_tv, sum_v, s[..., None]).sub_(vbar * relu_mass[..., None])
            den = s * (2 * count - n) + total_t - 2 * sum_t  # Σ_{j≤i} |s_i − t_j|
            scale = 2.0 / den.clamp_min(eps)
            if valid is not None:
                scale = scale.masked_fill(~valid, 0.0)
            out = num.mul_(scale[..., None])
        ctx.save_for_backward(s, t, v, sum_v, vbar, count, count_le, n_safe, relu_mass, den, out, key, query)
        ctx.valid, ctx.eps, ctx.chunk, ctx.pairs, ctx.levels = valid, eps, chunk, pairs, levels
        ctx.runs, ctx.fused = runs, fused
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        s, t, v, sum_v, vbar, count, count_le, n, relu_mass, den, out, key, query = ctx.saved_tensors
        valid, eps, chunk, pairs, runs = ctx.valid, ctx.eps, ctx.chunk, ctx.pairs, ctx.runs
        grad_out = grad_out.contiguous()
        real = None if valid is None else valid.to(v.dtype)
        if ctx.fused is not None:
            a_scale, grad_den, a_vbar, grad_s = causal_native.backward_queries(
                ctx.fused, grad_out, out, v, real, sum_v, den, count, count_le, n, eps
            )
        else:
            inv_d = 1.0 / den.clamp_min(eps)
            a_scale = 2.0 * inv_d  # a_i = dL/dnum_i = a_scale_i g_i
            grad_den = -rowdot(grad_out, out) * inv_d * (den >= eps)
            if valid is not None:
                a_scale = a_scale.masked_fill(~valid, 0.0)
                grad_den = grad_den.masked_fill(~valid, 0.0)
            a_vbar = a_scale * rowdot(grad_out, vbar)
            # Queries: dL/ds_i = a_i·(A_i − C_i vbar_i) + dden_i (#{t_j<s_i} − #{t_j>s_i}), j ≤ i.
            grad_s = a_scale * rowdot(grad_out, sum_v) - count * a_vbar + grad_den * (count + count_le - n)

        # Keys: sums over the later queries i ≥ j with s_i > t_j of a_i, s_i a_i, dden_i and a_i·vbar_i
        # (the transposed dominance sums, over the forward pass's levels).
        table = Pairs(grad_out, a_scale, s, grad_den, a_vbar)
        sum_a, sum_sa, den_above, vbar_a_above = merged_dominated_sums(key, query, table, chunk, ctx.levels)
        if pairs is None:  # Σ_{i≥j, s_i>=t_j} dden_i in a pass of its own
            weights = grad_den[..., None].contiguous()
            at_or_above = dominated_sums(query, weights, [Query(key, "right")], chunk)[0][..., 0]
        else:  # Σ_{i≥j, s_i>=t_j} dden_i: the tied pairs' share added to the strict sum
            at_or_above = den_above.clone()
            at_or_above.view(-1).index_add_(0, pairs[1], grad_den.reshape(-1)[pairs[0]])
        if ctx.fused is not None:
            grad_v, grad_t = causal_native.backward_keys(
                ctx.fused, grad_out, v, t, real, sum_a, sum_sa, a_scale, relu_mass, n, grad_den, den_above,
                at_or_above.contiguous(), vbar_a_above,
            )  # fmt: skip
            return grad_s, grad_t, grad_v, None, None, None, None
        # dL/dv_j = Σ_{i≥j, s_i>t_j} (s_i − t_j) a_i − Σ_{i≥j} (ReLU mass_i / n_i) a_i   (vbar_i's share)
        grad_v = sum_sa.addcmul_(sum_a, t[..., None], value=-1.0)
        grad_v -= later_sum(grad_out * (a_scale * relu_mass / n)[..., None], runs)
        # dL/dt_j = −(v_j − vbar_i)·a_i over s_i > t_j, − dden_i over s_i > t_j, + dden_i over s_i < t_j
        den_below = later_sum(grad_den, runs) - at_or_above
        grad_t = vbar_a_above - rowdot(v, sum_a) - den_above + den_below
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
            grad_s = grad_s.masked_fill(~valid, 0.0)
        return grad_s, grad_t, grad_v, None, None, None, None


def _fused_kernels(v, levels, runs) -> dict | None:
    """`causal_native`'s kernels where the dominance sums ran in C++ (their levels are the kernels'
    orders) on one sequence per row; None: the torch code."""
    if runs is not None or not isinstance(levels, dominance_native.Orders):
        return None
    return causal_native.kernels(v)


def causal_sliced_relu_attention(s, t, v, key_padding_mask=None, eps=1e-4, chunk=DEFAULT_CHUNK):
    """Causal sliced ReLU attention, ``(B, H, T, D)``; inputs already checked by the public op.

    ``o_i = 2 Σ_{j≤i} ReLU(s_i − t_j)(v_j − vbar_i) / max(Σ_{j≤i} |s_i − t_j|, eps)``, vbar_i the
    mean of the real v_j, j ≤ i. ``chunk`` is the dense local block (a speed knob, not semantics).
    """
    check_chunk(chunk)
    batch, heads, length, dim = v.shape
    acc = accumulation_dtype(s.dtype, t.dtype, v.dtype)
    valid = valid_rows(key_padding_mask, heads, v.device)
    out = _CausalSlicedReLU.apply(as_rows(s, acc), as_rows(t, acc), as_rows(v, acc), valid, float(eps), chunk)
    return out.view(batch, heads, length, dim).to(v.dtype)


def causal_sliced_relu_rows(
    s, t, v, runs: Runs, eps: float, chunk: int | None = DEFAULT_CHUNK
) -> torch.Tensor:
    """The causal op on packed rows ``s, t (N, L)``, ``v (N, L, D)`` (accumulation dtype): each token
    attends the keys ``j ≤ i`` of its own segment (`sliced_relu_attention_segments` with causal)."""
    check_chunk(chunk)
    return _CausalSlicedReLU.apply(s, t, v, None, float(eps), chunk, runs)
