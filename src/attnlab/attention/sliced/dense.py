"""The sliced kernels evaluated densely, in O(T²): the fast path for short sequences.

At short T the sorted ops (``relu``, ``bump``, ``causal``) spend their time on launch and dispatch
overhead (sorts, searches, gathers, prefix tables: dozens of small ops per call), while the dense
form is a handful of batched ``(T × T)`` element-wise ops and one ``bmm``. Below a measured
crossover length (``attnlab.attention.sliced.path``) it is the faster of the two.

These functions are the kernels' definitions written with plain torch ops, so autograd gives the
backward; memory is O(N·T²) per call, fine at the lengths where they are chosen. They compute
the same functions as the sorted ops, kinks and ties included (``relu'(0) = 0``, ``abs'(0) = 0``,
as autograd differentiates the naive formula), on the same rows: ``s, t (N, T)``, ``v (N, T, D)``
in the accumulation dtype, ``valid (N, T)`` (real keys) and ``queries (N, T)`` (the queries whose
output is kept) or None, bandwidth ``b (N, 1)``. Padded slots may hold any finite value (scores:
anything, inf and NaN included); they reach no real position, and receive zero gradient.

Non-finite scores at real positions follow the sorted ops (``_finite_rows``): the row's kept
outputs and the gradients of its real inputs are NaN, every other row is exact.
"""

from __future__ import annotations

import torch

from attnlab.attention.precision import no_autocast
from attnlab.attention.sliced.common import _score_centre

__all__ = [
    "dense_causal_sliced_relu",
    "dense_causal_sliced_relu_bump",
    "dense_sliced_relu",
    "dense_sliced_relu_bump",
]


def _clean(s, t, valid, queries, causal=False):
    """Scores shifted by one detached constant per row, with padded keys, dropped queries and rows
    holding a non-finite score set to 0; and those rows ``bad (N,)``. Zeroing (``masked_fill``)
    passes no gradient to the zeroed slots.

    The shift keeps ``Σ_j (s_i − t_j)`` free of the scores' offset: the sorted ops' centre
    (``_score_centre``, exact in ``s − t``) or, causal, the first real key score (no future token).
    """
    with torch.no_grad():
        if causal:
            first = 0 if valid is None else valid.to(torch.int8).argmax(dim=1)
            centre = t[torch.arange(t.shape[0], device=t.device), first][:, None]
        else:
            n_rows, length = s.shape
            full = s.new_full((n_rows,), float(length))
            count = full if valid is None else valid.sum(dim=1).clamp_min(1).to(s.dtype)
            centre = _score_centre(s, t, valid, count)
        centre = centre.masked_fill(~torch.isfinite(centre), 0.0)
    s, t = s - centre, t - centre
    if valid is not None:
        t = t.masked_fill(~valid, 0.0)
    if queries is not None:
        s = s.masked_fill(~queries, 0.0)
    bad = ~(torch.isfinite(s).all(dim=1) & torch.isfinite(t).all(dim=1))
    if s.is_cuda or bool(bad.any()):
        s, t = s.masked_fill(bad[:, None], 0.0), t.masked_fill(bad[:, None], 0.0)
    return s, t, bad


def _poison(out, bad, s, t, v, b, valid, queries):
    """``out`` with NaN at the kept queries of the ``bad`` rows, and NaN gradients flowing from there
    to the row's kept ``s``, real ``t`` and ``v`` and its bandwidth (the sorted ops' ``_nan_rows``).

    The NaN is ``nan · (Σ s + Σ t + Σ v [+ b])`` over those positions, so autograd carries it to
    exactly them; the other rows take ``out`` through ``where`` untouched (their factor is 0, not
    NaN: the ``where`` sends them a zero gradient, and 0 · NaN would poison them).
    """
    if not out.is_cuda and not bool(bad.any()):
        return out
    s_kept = s if queries is None else s.masked_fill(~queries, 0.0)
    t_real = t if valid is None else t.masked_fill(~valid, 0.0)
    v_real = v if valid is None else v.masked_fill(~valid[..., None], 0.0)
    total = s_kept.sum(dim=1) + t_real.sum(dim=1) + v_real.sum(dim=(1, 2))
    if b is not None:
        total = total + b[:, 0]
    nan_where_bad = torch.zeros_like(total).masked_fill(bad, float("nan"))  # 0 · finite elsewhere
    term = (total * nan_where_bad)[:, None, None].expand_as(out)
    where = bad[:, None] if queries is None else bad[:, None] & queries
    return torch.where(where[..., None], term, out)


def _key_weights(valid, like):
    """Real keys as ``(N, T)`` 0/1 weights in ``like``'s dtype, and their count ``(N, 1)`` (>= 1)."""
    if valid is None:
        n_rows, length = like.shape
        return None, like.new_full((n_rows, 1), float(length))
    real = valid.to(like.dtype)
    return real, real.sum(dim=1, keepdim=True).clamp_min(1.0)


def _keep(out, queries):
    return out if queries is None else out.masked_fill(~queries[..., None], 0.0)


def _differences(s, t):
    """``s_i − t_j`` as ``(N, T_query, T_key)``, written as ``s_i + (−t_j)`` so that autograd's
    backward reduces the T×T gradient straight into both (a subtraction would negate all of it)."""
    return s[:, :, None] + (-t)[:, None, :]


def _tie_correction(diff, s, t, real):
    """A term of value 0 whose gradient turns ``2 ReLU(r) − r`` into ``|r|``'s at ties (``r = 0``).

    ``Σ_j |r_ij| = 2 Σ_j ReLU(r_ij) − Σ_j r_ij`` holds for the values, but at ``r = 0`` the right side
    has slope −1 where autograd gives ``abs'(0) = 0``. Adding ``Σ_j [r_ij = 0] r_ij`` (zero, slope
    +1 there) restores it; it costs a T×T comparison and runs only when some pair is tied.
    """
    # on a CPU, skip the term cheaply when no pair in the whole call is tied: the scores are finite
    # here, so a tie is |r| = 0, and one min over |r| costs a sixth of scanning the bool ``r == 0``
    if not diff.is_cuda:
        with torch.no_grad():
            if diff.numel() == 0 or bool(diff.abs().amin() > 0):
                return None
    ties = diff == 0
    weights = ties.to(s.dtype) if real is None else ties.to(s.dtype) * real[:, None, :]
    count = weights.sum(dim=2)
    term = s * count - torch.bmm(weights, t[..., None])[..., 0]  # Σ_j [tie] (s_i − t_j), 0 in value
    return term - term.detach()


def dense_sliced_relu(s, t, v, valid, queries, eps):
    """``o_i = 2 Σ_j ReLU(s_i − t_j)(v_j − vbar) / max(Σ_j |s_i − t_j|, eps)`` over real keys j.

    One ReLU matrix and one ``bmm`` give both sums: the numerator against the centred values and
    the ReLU mass against the key mask, and ``Σ_j |r_ij| = 2 Σ_j ReLU(r_ij) − Σ_j r_ij`` (with
    ``_tie_correction`` for the slope at ties).
    """
    with no_autocast(v.device):
        s0, t0, bad = _clean(s, t, valid, queries)
        real, count = _key_weights(valid, t0)
        v_real = v if real is None else v * real[..., None]  # padded values (finite) vanish
        w = v_real - v_real.sum(dim=1, keepdim=True) / count[..., None]
        ones = torch.ones_like(t0) if real is None else real
        if real is not None:
            w = w * real[..., None]
        diff = _differences(s0, t0)  # (N, T_query, T_key)
        fix = _tie_correction(diff, s0, t0, real)
        sums = torch.bmm(diff.relu_(), torch.cat([w, ones[..., None]], dim=2))
        key_sum = (t0 * ones).sum(dim=1, keepdim=True)
        dist = 2 * sums[..., -1] - (s0 * count - key_sum)  # Σ_j |s_i − t_j| over real keys
        if fix is not None:
            dist = dist + fix
        out = sums[..., :-1] * (2.0 / dist.clamp_min(eps))[..., None]
        return _poison(_keep(out, queries), bad, s, t, v, None, valid, queries)


def _bump_sums(s0, t0, b, v, count):
    """``Σ_j ReLU(b − |s_i − t_j|) v_j / (n b)`` in plain autograd ops: differentiable to any order."""
    hat = _differences(s0, t0).abs().neg_().add_(b[..., None]).relu_()  # b · hat, in place
    return torch.bmm(hat, v) / (count * b)[..., None]


class _DenseBump(torch.autograd.Function):
    """``_bump_sums`` with its first-order backward written out.

    Autograd through the element-wise chain walks the T×T matrix about eight times in backward,
    once with ``sgn`` (abs's derivative, several times slower than ``sign`` on a CPU); here it is
    one ``bmm`` for the weights' gradient, then ReLU's mask (``threshold_backward``), the sign and
    three sums. The kinks are autograd's: ``relu'(0) = 0`` (a weight of exactly 0 passes nothing)
    and ``abs'(0) = 0`` (``sign(0) = 0``). Under ``create_graph=True`` the backward differentiates
    ``_bump_sums`` instead, so the dense path keeps its second derivatives.
    """

    @staticmethod
    def forward(ctx, s0, t0, b, v, count):
        diff = s0[:, :, None] - t0[:, None, :]
        hat = diff.abs().neg_().add_(b[..., None]).relu_()
        scale = 1.0 / (count * b)
        out = torch.bmm(hat, v) * scale[..., None]
        ctx.save_for_backward(s0, t0, b, v, count, diff, hat, scale, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        with no_autocast(grad.device):
            return _DenseBump._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        s0, t0, b, v, count, diff, hat, scale, out = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the formula's own graph, to any order
            inputs = (s0, t0, b, v)
            wanted = [x for x, need in zip(inputs, ctx.needs_input_grad, strict=False) if need]
            grads = iter(torch.autograd.grad(_bump_sums(*inputs, count), wanted, grad, create_graph=True))
            return (*(next(grads) if need else None for need in ctx.needs_input_grad[:4]), None)
        g = grad * scale[..., None]
        grad_v = torch.bmm(hat.transpose(1, 2), g)
        grad_hat = torch.ops.aten.threshold_backward(torch.bmm(g, v.transpose(1, 2)), hat, 0)
        grad_b = grad_hat.sum(dim=(1, 2)) - (grad * out).sum(dim=(1, 2)) / b[:, 0]
        signed = grad_hat.mul_(torch.sign(diff))  # d hat / d s_i = −sign(s_i − t_j), / d t_j = +sign
        return -signed.sum(dim=2), signed.sum(dim=1), grad_b[:, None], grad_v, None


def dense_sliced_relu_bump(s, t, v, b, valid, queries):
    """``o_i = (1/n) Σ_j max(0, 1 − |s_i − t_j| / b) v_j`` over the n real keys j, as
    ``Σ_j ReLU(b − |s_i − t_j|) v_j / (n b)`` (the same kinks: ReLU and abs at 0)."""
    with no_autocast(v.device):
        s0, t0, bad = _clean(s, t, valid, queries)
        real, count = _key_weights(valid, t0)
        v_real = v if real is None else v * real[..., None]
        out = _DenseBump.apply(s0, t0, b, v_real, count)
        return _poison(_keep(out, queries), bad, s, t, v, b, valid, queries)


def _causal_keys(valid, like):
    """``allowed (N, T_query, T_key)``: key j is real and j <= i; and ``n_i`` (N, T) >= 1."""
    length = like.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool, device=like.device).tril()[None]
    if valid is None:
        n = torch.arange(1, length + 1, device=like.device, dtype=like.dtype)[None]
        return allowed, n
    allowed = allowed & valid[:, None, :]
    return allowed, valid.to(like.dtype).cumsum(dim=1).clamp_min(1.0)


def dense_causal_sliced_relu(s, t, v, valid, eps):
    """``o_i = 2 Σ_{j≤i} ReLU(s_i − t_j)(v_j − vbar_i) / max(Σ_{j≤i} |s_i − t_j|, eps)``, real j only,
    ``vbar_i`` the mean of the real ``v_j``, j <= i. Padded queries output zeros."""
    with no_autocast(v.device):
        s0, t0, bad = _clean(s, t, valid, valid, causal=True)
        allowed, n = _causal_keys(valid, t0)
        # The output does not change when every v moves by one constant: shift by the row's first
        # real value (detached, from no future token) so that Σ relu·v − (Σ relu)·vbar does not cancel.
        first = 0 if valid is None else valid.to(torch.int8).argmax(dim=1)
        shift = v[torch.arange(v.shape[0], device=v.device), first].detach()
        v_real = v - shift[:, None, :]
        if valid is not None:
            v_real = v_real.masked_fill(~valid[..., None], 0.0)
        vbar = v_real.cumsum(dim=1) / n[..., None]
        diff = s0[:, :, None] - t0[:, None, :]
        zero = diff.new_zeros(())
        relu = torch.where(allowed, diff.relu(), zero)
        dist = torch.where(allowed, diff.abs(), zero).sum(dim=2)
        num = torch.bmm(relu, v_real) - relu.sum(dim=2)[..., None] * vbar
        out = _keep(num * (2.0 / dist.clamp_min(eps))[..., None], valid)
        return _poison(out, bad, s, t, v, None, valid, valid)


def dense_causal_sliced_relu_bump(s, t, v, b, valid, mass_eps):
    """``o_i = Σ_{j≤i} hat(s_i − t_j) v_j / den_i`` over real j, ``den_i = n_i`` (count, ``mass_eps``
    None) or ``Σ_{j≤i} hat(s_i − t_j) + mass_eps`` (mass). Padded queries output zeros."""
    with no_autocast(v.device):
        s0, t0, bad = _clean(s, t, valid, valid, causal=True)
        allowed, n = _causal_keys(valid, t0)
        v_real = v if valid is None else v.masked_fill(~valid[..., None], 0.0)
        hat = (1.0 - (s0[:, :, None] - t0[:, None, :]).abs() / b[..., None]).relu()
        hat = torch.where(allowed, hat, hat.new_zeros(()))
        den = n if mass_eps is None else hat.sum(dim=2) + mass_eps
        out = _keep(torch.bmm(hat, v_real) / den[..., None], valid)
        return _poison(out, bad, s, t, v, b, valid, valid)
