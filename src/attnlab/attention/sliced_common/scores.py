"""Slice scores of the sliced layers: Π applied token by token, and their standardisation.

One place for the score maps that a layer's parallel forward (`attnlab.attention.sliced_common.layer`) and its
recurrent decoding (`attnlab.attention.decoding`) both apply, so the two cannot drift apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.common.rope import rotate_half

SCORE_LAYOUTS = ("token", "authors")
#: the variance floor of the score standardisations, sequence, prefix and decoding step alike
STANDARDISE_EPS = 1e-6


def check_score_layout(layout: object, causal: bool) -> None:
    """`score_layout` of the sliced layers: a known name, and not ``"authors"`` in a causal layer."""
    if layout not in SCORE_LAYOUTS:
        raise ValueError(f"score_layout must be one of {', '.join(SCORE_LAYOUTS)}; got {layout!r}")
    if layout == "authors" and causal:
        raise ValueError(
            "score_layout='authors' builds each score row from later tokens too (it reads the future): "
            "causal layers take score_layout='token'"
        )


def slice_tokens(slicer: nn.Module, x: torch.Tensor, layout: str = "token") -> torch.Tensor:
    """(B, H, T, D) -> (B, H, T): Π applied to rows of H·D numbers, a (B, T, H·D) tensor.

    ``layout="token"`` (the paper's Π): row t is token t's heads concatenated; the head axis is
    moved next to D before flattening. ``"authors"``: x is reshaped in place, as the authors' code
    (SiwanB/Sliced_ReLU_Attention) does, which copies in (H, T, D) order: row t then holds H
    consecutive tokens of one head (with T a multiple of H, tokens t·H mod T ... of head t·H // T),
    so a score depends on its neighbours. Kept to train the function behind the published numbers.
    """
    b, h, t, d = x.shape
    rows = x.reshape(b, t, h * d) if layout == "authors" else x.transpose(1, 2).reshape(b, t, h * d)
    return slicer(rows).transpose(1, 2)


def fold_scores(
    qkv: nn.Linear, slicer: nn.Module, num_heads: int, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """s, t (B, H, T) and v (B, H, T, D) from x (B, T, dim): what `slice_tokens` gives on the q and k
    of the fused projection, with Π's first linear map folded into that projection.

    Without a rotation between them, Π's first map A (out × H·D) and the q projection W_q compose:
    A (W_q x + b_q) = (A W_q) x + A b_q. The product is (out × dim), computed once per call, so each
    token costs one dim → out map for s and one for t where it cost a dim → H·D map and then
    H·D → out: at width 64 and two heads, ReLU-bump's q/k work per token falls from 2·64·64 + 2·64·2
    to 2·64·2 multiply-adds, the MLP Π's from 4·64·64 to 2·64·64. It is the same function of the same
    parameters (autograd differentiates through the product), equal to rounding.
    """
    first, rest = first_map(slicer)
    width, out = qkv.out_features // 3, first.out_features
    w_q, w_k, w_v = qkv.weight.split(width)
    weight = torch.cat([first.weight @ w_q, first.weight @ w_k, w_v])
    bias = None
    if qkv.bias is not None or first.bias is not None:
        zero = qkv.weight.new_zeros(out)
        b_q, b_k, b_v = qkv.bias.split(width) if qkv.bias is not None else (None, None, zero.new_zeros(width))
        folded = [zero if b is None else first.weight @ b for b in (b_q, b_k)]
        if first.bias is not None:
            folded = [b + first.bias for b in folded]
        bias = torch.cat([*folded, b_v])
    batch, length, _ = x.shape
    scores, v = F.linear(x, weight, bias).split([2 * out, width], dim=-1)
    scores = scores.view(batch, length, 2, out)
    return _scores_and_values(scores, rest, v, num_heads)


def first_map(slicer: nn.Module) -> tuple[nn.Linear, nn.Module | None]:
    """Π's first linear map and what follows it (None for a linear Π)."""
    return (slicer[0], slicer[1:]) if isinstance(slicer, nn.Sequential) else (slicer, None)


def _scores_and_values(scores, rest, v, num_heads):
    """(B, T, 2, out) first-map outputs and (B, T, H·D) values -> s, t (B, H, T) and v (B, H, T, D)."""
    batch, length, width = v.shape
    if rest is not None:
        scores = rest(scores)
    s, t = scores.permute(2, 0, 3, 1)  # (2, B, H, T)
    return s, t, v.view(batch, length, num_heads, width // num_heads).transpose(1, 2)


def fold_rotated_scores(
    qkv: nn.Linear, slicer: nn.Module, rotary: nn.Module, num_heads: int, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fold_scores` with RoPE between the projection and Π: s_t = A R_t (W_q x_t + b_q), R_t the
    rotation of position t (``rotate_half`` pairs, `attnlab.attention.common.rope`).

    The rotation differs per position, so the folded map does too: A R_t = A ⊙ cos_t −
    rotate_half(A ⊙ sin_t) head by head (a row vector times ``rotate_half`` is minus ``rotate_half`` of
    it), and (A R_t) W_q is a (T, out, dim) table built once per call for T·out·H·D·dim multiply-adds,
    against the B·T·H·D·dim of projecting q. The caller folds only when B > out, where it is cheaper.
    """
    first, rest = first_map(slicer)
    width, out = qkv.out_features // 3, first.out_features
    batch, length, _ = x.shape
    cos, sin = rotary.tables(length, x.device, x.dtype)  # (T, D)
    a = first.weight.view(out, num_heads, width // num_heads)[None]  # (1, out, H, D)
    turned = a * cos[:, None, None, :] - rotate_half(a * sin[:, None, None, :])
    turned = turned.reshape(length, out, width)  # A R_t
    w_q, w_k, w_v = qkv.weight.split(width)
    maps = torch.cat([turned @ w_q, turned @ w_k], dim=1)  # (T, 2·out, dim)
    scores = torch.einsum("btd,tod->bto", x, maps)
    b_v = None
    if qkv.bias is not None:
        b_q, b_k, b_v = qkv.bias.split(width)
        scores = scores + torch.cat([turned @ b_q, turned @ b_k], dim=1)
    if first.bias is not None:
        scores = scores + first.bias.repeat(2)
    v = F.linear(x, w_v, b_v)
    return _scores_and_values(scores.view(batch, length, 2, out), rest, v, num_heads)


def standardise_scores(
    s: torch.Tensor, t: torch.Tensor, key_padding_mask: torch.Tensor | None, eps: float = STANDARDISE_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift and scale s, t (B, H, T) by one mean and one std shared by both, per sequence and head.

    Statistics run over valid tokens only: mean m of the pooled {s_i} ∪ {t_j}, var_s = mean (s_i − m)²,
    var_t likewise, std = sqrt((var_s + var_t)/2 + eps), i.e. the std of the pooled set. Sharing them
    keeps the s − t differences that the kernel sees meaningful. Computed in float32 at least.
    """
    acc = accumulation_dtype(s.dtype)
    s, t = s.to(acc), t.to(acc)
    # (B, 1, T) weights of the tokens that count
    weight = torch.ones_like(s[:, :1]) if key_padding_mask is None else key_padding_mask[:, None, :].to(acc)
    count = weight.sum(dim=-1, keepdim=True).clamp_min(1.0)
    mean = ((s * weight).sum(-1, keepdim=True) + (t * weight).sum(-1, keepdim=True)) / (2 * count)
    var_s = ((s - mean) ** 2 * weight).sum(-1, keepdim=True) / count
    var_t = ((t - mean) ** 2 * weight).sum(-1, keepdim=True) / count
    std = torch.sqrt((var_s + var_t) / 2 + eps)
    return (s - mean) / std, (t - mean) / std


def standardise_scores_prefix(
    s: torch.Tensor, t: torch.Tensor, key_padding_mask: torch.Tensor | None, eps: float = STANDARDISE_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal `standardise_scores`: s_i and t_i shifted and scaled by the pooled mean and std of the
    valid {s_j, t_j : j <= i}, so no score depends on a later token. Unlike the whole-sequence map,
    each token gets its own (running) map, fixed when it arrives, which is what a decoder can keep.
    Sums run on scores shifted by the row's first valid key score (a constant: no cancellation from
    a large common offset). Computed in float32 at least.
    """
    acc = accumulation_dtype(s.dtype)
    s, t = s.to(acc), t.to(acc)
    weight = torch.ones_like(s[:, :1]) if key_padding_mask is None else key_padding_mask[:, None, :].to(acc)
    first = weight.argmax(dim=-1, keepdim=True).expand(-1, s.shape[1], -1)  # first valid token
    shift = torch.gather(t, -1, first)
    ds, dt = s - shift, t - shift
    count = (2 * weight).cumsum(-1).clamp_min(1.0)
    mean = ((ds + dt) * weight).cumsum(-1) / count
    square = ((ds * ds + dt * dt) * weight).cumsum(-1) / count
    std = torch.sqrt((square - mean * mean).clamp_min(0.0) + eps)
    return (ds - mean) / std, (dt - mean) / std


def standardise_step(s, t, stats, seen: int, eps: float = STANDARDISE_EPS):
    """One token of `standardise_scores_prefix` from running (shift, Σ, Σ²) over the ``seen`` tokens
    before it (two scores each; None before the first): scores (B, H) and the statistics after.
    The new s and t go through as one (2, B, H) tensor: a decoding step is a chain of small ops."""
    acc = accumulation_dtype(s.dtype)
    s, t = s.to(acc), t.to(acc)
    if stats is None:
        shift, total, squares = t, torch.zeros_like(t), torch.zeros_like(t)
    else:
        shift, total, squares = stats
    count = 2.0 * (seen + 1)
    pair = torch.stack([s, t]) - shift
    total, squares = total + pair.sum(0), squares + (pair * pair).sum(0)
    mean = total / count
    std = torch.sqrt((squares / count - mean * mean).clamp_min_(0.0) + eps)
    scores = (pair - mean) / std
    return scores[0], scores[1], (shift, total, squares)
