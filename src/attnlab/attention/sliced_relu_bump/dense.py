"""Sliced ReLU-bump evaluated densely in O(T²), bidirectional and causal: the fast path for short
sequences (``attnlab.attention.sliced_common.dense`` has the rules both sliced families follow)."""

from __future__ import annotations

import torch

from attnlab.attention.common.precision import no_autocast
from attnlab.attention.sliced_common.dense import (
    causal_keys,
    clean_scores,
    keep_queries,
    key_weights,
    poison_rows,
    score_differences,
)

__all__ = ["dense_causal_sliced_relu_bump", "dense_sliced_relu_bump"]


def _bump_sums(s0, t0, b, v, count):
    """``Σ_j ReLU(b − |s_i − t_j|) v_j / (n b)`` in plain autograd ops: differentiable to any order."""
    hat = score_differences(s0, t0).abs().neg_().add_(b[..., None]).relu_()  # b · hat, in place
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
        s0, t0, bad = clean_scores(s, t, valid, queries)
        real, count = key_weights(valid, t0)
        v_real = v if real is None else v.masked_fill(~valid[..., None], 0.0)  # padding, NaN or not, vanishes
        out = _DenseBump.apply(s0, t0, b, v_real, count)
        return poison_rows(keep_queries(out, queries), bad, s, t, v, b, valid, queries)


def dense_causal_sliced_relu_bump(s, t, v, b, valid, mass_eps):
    """``o_i = Σ_{j≤i} hat(s_i − t_j) v_j / den_i`` over real j, ``den_i = n_i`` (count, ``mass_eps``
    None) or ``Σ_{j≤i} hat(s_i − t_j) + mass_eps`` (mass). Padded queries output zeros."""
    with no_autocast(v.device):
        s0, t0, bad = clean_scores(s, t, valid, valid, causal=True)
        allowed, n = causal_keys(valid, t0)
        v_real = v if valid is None else v.masked_fill(~valid[..., None], 0.0)
        hat = (1.0 - (s0[:, :, None] - t0[:, None, :]).abs() / b[..., None]).relu()
        hat = torch.where(allowed, hat, hat.new_zeros(()))
        den = n if mass_eps is None else hat.sum(dim=2) + mass_eps
        out = keep_queries(torch.bmm(hat, v_real) / den[..., None], valid)
        return poison_rows(out, bad, s, t, v, b, valid, valid)
