"""Bidirectional sliced ReLU-bump attention on sorted keys: a hand-written autograd function.

``o_i = (1/n) Σ_j max(0, 1 − |s_i − t_j| / b) v_j``: the hat kernel is three sliced-ReLU sums, so
every output is a combination of prefix-table rows at the window bounds ``s_i − b``, ``s_i``,
``s_i + b`` (package docstring: ``attnlab.attention.sliced_common``).

On the CPU the D-wide sums run in C++ (``cpu_kernels.cpp``: walkers at the window bounds going up each
row's sorted scores, summing in double, on torch's threads; no prefix tables); the torch code below
them runs elsewhere, with ``ATTNLAB_NATIVE=off`` and where no compiler is found. Both evaluate the
same formulas.
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
    cumsum_rows_,
    exclusive_cumsum,
    finite_rows,
    first_order_only,
    hat_terms,
    hat_windows,
    key_windows,
    masked_mean_rows,
    nan_rows,
    real_counts,
    real_keys,
    rowdot,
    sort_real_first,
    sort_rows,
    sorted_rows,
    take_rows,
    times_scores,
)
from attnlab.attention.sliced_common.segments import add_back_totals_, restart_at_segment_ends_


def _gather_combine(table, terms, dots_with=None, out=None, buffer=None, read=None):
    """``out += Σ_k coef_k · table[index_k]`` (row-wise) and the row dots ``dots_with · table[index_k]``.

    ``terms`` is a list of ``(index (N, T), coef (N, T) or None)``; a ``None`` coefficient only
    takes the dot. Every gathered row goes through one reused buffer, so a combination of any
    number of prefix-table lookups costs two ``(N, T, D)`` tensors at most. ``read(rows, index)``:
    what a gather needs added (a table restarted at each segment's end).
    Returns ``(out, [dots...] or None, buffer)``.
    """
    dots = [] if dots_with is not None else None
    for index, coef in terms:
        buffer = take_rows(table, index, out=buffer)
        if read is not None:
            buffer = read(buffer, index)
        if dots is not None:
            dots.append(rowdot(dots_with, buffer))
        if coef is None:
            continue
        if out is None:
            out, buffer = buffer.mul_(coef[..., None]), None
        else:
            out.addcmul_(buffer, coef[..., None])
    return out, dots, buffer


class SlicedReLUBump(torch.autograd.Function):
    """Rows ``s, t (N, T)``, ``v (N, T, D)``, per-row bandwidth ``b (N, 1)``; ``valid`` (real keys)
    and ``queries`` (the queries whose output is kept) or None, as in ``SlicedReLU``."""

    @staticmethod
    def forward(ctx, s, t, v, b, valid, queries):
        with no_autocast(v.device):
            return SlicedReLUBump._forward(ctx, s, t, v, b, valid, queries)

    @staticmethod
    @first_order_only("sliced_relu_bump_attention")
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return SlicedReLUBump._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, s, t, v, b, valid, queries):
        n_rows, length, _ = v.shape
        count = real_counts(valid, n_rows, length, v.dtype, v.device)
        s, t = centre_scores(s, t, valid, count, queries)
        s, t, bad = finite_rows(s, t)  # rows with a NaN/inf score: NaN out, below
        t_search, t_sorted, order = sort_real_first(t, valid)
        coef = (1.0 / (count[:, None] * b)).expand(-1, length)  # 1 / (n b)
        if queries is not None:
            coef = coef.masked_fill(~queries, 0.0)
        ctx.kernels = cpu_kernels(v)
        if ctx.kernels is not None:  # the CPU: walks up the sorted scores (cpu_kernels.cpp), no tables
            real = real_keys(valid, n_rows, length)
            s_sorted, s_order = sort_rows(s)  # every query (dropped ones: s = 0, coef = 0)
            v, coef, width = v.contiguous(), coef.contiguous(), b.reshape(-1).contiguous()
            out = torch.empty_like(v)
            arrays = (v, order, t_sorted, real, s, s_order, width, coef, out)
            native.call_rows(ctx.kernels.forward, arrays, v.shape)
            nan_rows(out, bad, queries)
            ctx.save_for_backward(s, t.contiguous(), v, width, order, t_sorted, real, s_sorted, s_order, coef)
            ctx.valid, ctx.queries, ctx.bad = valid, queries, bad
            return out
        # Tables of the centred values w = v - vbar (running totals stay of order sqrt(T) instead of
        # T·|vbar|); vbar comes back as vbar · (hat mass), from the scalar tables below.
        # Padded rows are never read (see SlicedReLU).
        vbar = masked_mean_rows(v, valid, count)
        p_v = sorted_rows(v, order, vbar, None)
        p_tv = times_scores(p_v, t_sorted)
        cumsum_rows_(p_v)
        cumsum_rows_(p_tv)
        p_t = exclusive_cumsum(t_sorted.to(torch.float64))

        lo, mid, hi = hat_windows(t_search, s, b)
        out = hat_output(p_v, p_tv, p_t, (lo, mid, hi), s, b, coef, vbar[:, None, :])
        nan_rows(out, bad, queries)

        ctx.save_for_backward(s, t, v, b, t_search, p_v, p_tv, p_t, vbar, lo, mid, hi, coef)
        ctx.valid, ctx.queries, ctx.bad = valid, queries, bad
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        if ctx.kernels is not None:
            grad_s, grad_t, grad_v, grad_b = SlicedReLUBump._kernel_gradients(ctx, grad_out)
        else:
            grad_s, grad_t, grad_v, grad_b = SlicedReLUBump._torch_gradients(ctx, grad_out)
        valid, queries = ctx.valid, ctx.queries
        if valid is not None:
            grad_v.masked_fill_(~valid[..., None], 0.0)
            grad_t = grad_t.masked_fill(~valid, 0.0)
        if queries is not None:
            grad_s = grad_s.masked_fill(~queries, 0.0)
        bad = ctx.bad
        grad_s, grad_t, grad_v = (
            nan_rows(grad_s, bad, queries),
            nan_rows(grad_t, bad, valid),
            nan_rows(grad_v, bad, valid),
        )
        return grad_s, grad_t, grad_v, nan_rows(grad_b, bad), None, None

    @staticmethod
    def _kernel_gradients(ctx, grad_out):
        """The CPU: the queries' side and the keys' side in one walk each (``cpu_kernels.cpp``)."""
        s, t, v, width, order, t_sorted, real, s_sorted, s_order, coef = ctx.saved_tensors
        grad_s, grad_b = torch.empty_like(s), torch.empty_like(s)
        arrays = (v, order, t_sorted, real, s, s_order, width, coef, grad_out, grad_s, grad_b)
        native.call_rows(ctx.kernels.query_grads, arrays, v.shape)
        grad_v, grad_t = torch.empty_like(v), torch.empty_like(t)
        arrays = (grad_out, s_order, s_sorted, coef, v, order, real, t, width, grad_v, grad_t)
        native.call_rows(ctx.kernels.key_grads, arrays, v.shape)
        return grad_s, grad_t, grad_v, grad_b.sum(dim=1, keepdim=True)

    @staticmethod
    def _torch_gradients(ctx, grad_out):
        s, t, v, b, t_search, p_v, p_tv, p_t, vbar, lo, mid, hi, coef = ctx.saved_tensors
        queries = ctx.queries

        below = torch.searchsorted(t_search, s, side="left")  # #{t < s}
        g_vbar = torch.bmm(grad_out, vbar[:, :, None])[..., 0]
        grad_s, grad_b, buffer = query_gradients(
            p_v, p_tv, p_t, (lo, below, mid, hi), grad_out, g_vbar, s, b, coef
        )
        s_search, s_sorted, q_order = sort_real_first(s, queries)
        k_lo, k_mid, k_hi = hat_windows(s_search, t, b)
        k_below = torch.searchsorted(s_search, t, side="left")
        grad_v, grad_t = key_gradients(
            grad_out, q_order, s_sorted, (k_lo, k_below, k_mid, k_hi), t, v, b, coef, buffer
        )
        return grad_s, grad_t, grad_v, grad_b


def hat_output(p_v, p_tv, p_t, windows, s, b, coef, vbar):
    """The bump op's output from the key tables (`SlicedReLUBump`): ``p_v``, ``p_tv`` the prefix
    tables of w = v − vbar and t·w over the sorted keys, ``p_t`` the float64 one of the key scores,
    ``windows`` = (lo, mid, hi) each query's window bounds among them, ``coef`` = 1 / (n b) per query
    and ``vbar`` its keys' mean value ((N, 1, D) or per query (N, T, D))."""
    lo, mid, hi = windows
    rows, scored = hat_terms(lo, mid, hi, s, b, coef)
    out, _, buffer = _gather_combine(p_v, rows)
    out, _, _ = _gather_combine(p_tv, scored, out=out, buffer=buffer)
    # (1/n) Σ_j hat(s_i - t_j) = coef · ((b - s) n_left + t_left + (b + s) n_right - t_right)
    left_n, right_n, left_t, right_t = key_windows(p_t, lo, mid, hi, s.dtype)
    mass = coef * ((b - s) * left_n + left_t + (b + s) * right_n - right_t)
    return out.addcmul_(mass[..., None], vbar)


def query_gradients(p_v, p_tv, p_t, windows, grad_out, g_vbar, s, b, coef):
    """dL/ds and dL/db from the forward pass's key tables (`hat_output`); ``windows`` = (lo, below,
    mid, hi), ``below`` the keys strictly under each query; ``g_vbar`` = g_i · vbar. Returns them and
    the gather buffer for reuse.

    hat'(r) = -sign(r)/b inside the window and 0 at r = 0 and |r| = b, so
      dL/ds_i = coef g_i · (Σ_{t∈(s,s+b)} v - Σ_{t∈(s-b,s)} v)
              = coef g_i · (P[hi] - P[mid] + P[lo] - P[below])   (keys tied with s_i drop out)
      dL/db   = Σ_i coef/b · g_i · Σ_{|r|<b} |r| v_j = coef/b · g_i · (s (L - R) + R_x - L_x).
    The tables hold w = v - vbar: window sums of v add vbar times the window's key count (resp. its
    key-score sum), i.e. g·vbar times a scalar window term.
    """
    lo, below, mid, hi = windows
    _, (g_lo, g_mid, g_hi, g_below), buffer = _gather_combine(
        p_v, [(lo, None), (mid, None), (hi, None), (below, None)], dots_with=grad_out
    )
    _, (gx_lo, gx_mid, gx_hi), buffer = _gather_combine(
        p_tv, [(lo, None), (mid, None), (hi, None)], dots_with=grad_out, buffer=buffer
    )
    left_n, right_n, left_t, right_t = key_windows(p_t, lo, mid, hi, s.dtype)
    tied = (mid - below).to(s.dtype)  # keys with t = s: in the left window, not in the derivative
    grad_s = coef * (g_hi - g_mid + g_lo - g_below + g_vbar * (right_n - left_n + tied))
    left, right = g_mid - g_lo + g_vbar * left_n, g_hi - g_mid + g_vbar * right_n
    left_x, right_x = gx_mid - gx_lo + g_vbar * left_t, gx_hi - gx_mid + g_vbar * right_t
    grad_b = (coef / b * (s * (left - right) + right_x - left_x)).sum(dim=1, keepdim=True)
    return grad_s, grad_b, buffer


def key_gradients(grad_out, q_order, s_sorted, windows, t, v, b, coef, buffer=None, runs=None):
    """dL/dv and dL/dt: the same windows with queries and keys exchanged (the hat is symmetric), on
    prefix tables of c_i g_i and s_i c_i g_i over the queries sorted by s (``q_order``, ``s_sorted``;
    c = coef); ``windows`` = (lo, below, mid, hi), each key's bounds among the sorted queries.
      dL/dv_j = Σ_i c_i hat(s_i - t_j) g_i
      dL/dt_j = v_j · (Σ_{s∈(t,t+b)} c g - Σ_{s∈(t-b,t)} c g)
    ``runs``: packed rows (queries sorted by segment first), the tables restarted at each segment's
    end (`segments.restart_at_segment_ends_`).
    """
    k_lo, k_below, k_mid, k_hi = windows
    q_g = sorted_rows(grad_out, q_order, None, torch.gather(coef, 1, q_order))
    q_sg = times_scores(q_g, s_sorted)
    reads = [None, None]
    if runs is not None:
        totals = restart_at_segment_ends_([q_g, q_sg], runs)
        reads = [
            lambda rows, index, total=total: add_back_totals_(rows, total, index == runs.end, runs)
            for total in totals
        ]
    cumsum_rows_(q_g)
    cumsum_rows_(q_sg)
    rows, scored = hat_terms(k_lo, k_mid, k_hi, t, b, torch.ones_like(coef))
    grad_v, (v_lo, v_mid, v_hi), buffer = _gather_combine(
        q_g, rows, dots_with=v, buffer=buffer, read=reads[0]
    )
    _, (v_below,), buffer = _gather_combine(q_g, [(k_below, None)], dots_with=v, buffer=buffer, read=reads[0])
    grad_v, _, _ = _gather_combine(q_sg, scored, out=grad_v, buffer=buffer, read=reads[1])
    return grad_v, v_hi - v_mid + v_lo - v_below


KERNELS = KERNEL_SOURCES["bump"]  # cpu_kernels.cpp beside this file (path.py's crossover reads it too)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = {
    "sliced_relu_bump_forward": [_P] * 9 + [_I] * 5,
    "sliced_relu_bump_query_grads": [_P] * 11 + [_I] * 5,
    "sliced_relu_bump_key_grads": [_P] * 11 + [_I] * 5,
}


class Kernels(NamedTuple):
    forward: Callable
    query_grads: Callable
    key_grads: Callable


def cpu_kernels(v: torch.Tensor) -> Kernels | None:
    """The C++ kernels (``cpu_kernels.cpp``) for CPU values of ``v``'s dtype, or None: not the CPU,
    not float32/float64, ``ATTNLAB_NATIVE=off`` or no compiler (the torch code runs)."""
    found = native.cpu_kernels(v, KERNELS, _ARGTYPES)
    return None if found is None else Kernels(*found.values())
