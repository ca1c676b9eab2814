"""The authors' attention layers written out (SiwanB/Sliced_ReLU_Attention), for comparisons only.

`AuthorsSlicedReLU` and `AuthorsSlicedReLUBump` compute what the published layers
(``models/sliced_relu_attention.py``, ``models/sliced_relu_bump_attention.py``) compute, step by step
and with the kernels as dense O(T²) sums, so that tests and ``attnlab bench authors`` can hold
attnlab's layers against them:

- q, k, v from three Linear maps, split into heads (B, H, T, D); RoPE (optional) on q and k pairs
  channels (2i, 2i + 1) and writes the rotated pairs out as two halves;
- scores: Π on ``q.reshape(B, T, H·D)`` of the (B, H, T, D) tensor (``fixed=True``: on each token's
  heads instead, the paper's Π), (B, T, H);
- with a padding mask (B, T), True = real: values zeroed at padded positions; for sliced ReLU the
  scores too, then standardised with the real tokens' mean and a variance summed over every position;
  values centred by their mean over all T positions; normaliser over real keys;
- ReLU-bump: no standardisation, hat kernel of bandwidth softplus(θ) + 1e-4, divided by the number
  of real tokens;
- every position is a query; the output is the (B, T, H·D) context, before any output projection.

The RoPE angles are computed in float64 (the published code uses float32), so that a float64
comparison sees the layers, not the rounding of the angles. Not used in training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def authors_rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE of the authors' code on (B, H, T, D): pairs (2i, 2i + 1) turned by pos · base^(−2i/D),
    first members then second members. attnlab's RoPE turns pairs (i, i + D/2): the two agree on q
    whose channels are reordered even-first within each head (a permutation of W_q's rows)."""
    length, dim = x.shape[-2], x.shape[-1]
    freq = base ** (-torch.arange(dim // 2, dtype=torch.float64, device=x.device) / (dim // 2))
    angle = torch.arange(length, dtype=torch.float64, device=x.device)[:, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, even * sin + odd * cos], dim=-1)


def even_first(head_dim: int) -> torch.Tensor:
    """Channel order within a head that maps the authors' RoPE onto attnlab's (see `authors_rope`)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


class _AuthorsLayer(nn.Module):
    """q/k/v maps, heads, RoPE and the score rows shared by both transcriptions."""

    def __init__(self, dim: int, num_heads: int, slicer: nn.Module, rope: bool, fixed: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.slicer, self.rope, self.fixed = slicer, rope, fixed

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def scores_and_values(self, x: torch.Tensor):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        if self.rope:
            q, k = authors_rope(q), authors_rope(k)
        b, h, t, d = q.shape

        def rows(y):  # the one line that differs: in place (published), or each token's heads
            return y.transpose(1, 2).reshape(b, t, h * d) if self.fixed else y.reshape(b, t, h * d)

        return self.slicer(rows(q)), self.slicer(rows(k)), v  # (B, T, H), (B, T, H), (B, H, T, D)

    @staticmethod
    def merged(context: torch.Tensor) -> torch.Tensor:
        b, h, t, d = context.shape
        return context.transpose(1, 2).reshape(b, t, h * d)


class AuthorsSlicedReLU(_AuthorsLayer):
    """The authors' sliced ReLU layer: MLP Π ``H·D → H·D → GELU → H`` (``projection="linear"``:
    one Linear H·D → H), dropout none (eval), standardised scores, centred values."""

    def __init__(
        self, dim: int, num_heads: int, *, projection="mlp", rope=False, fixed=False, eps=1e-4
    ) -> None:
        if projection == "mlp":
            slicer: nn.Module = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, num_heads))
        else:
            slicer = nn.Linear(dim, num_heads)
        super().__init__(dim, num_heads, slicer, rope, fixed)
        self.eps = eps

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        s, t, v = self.scores_and_values(x)
        real = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
        v = v * real[:, None, :, None]
        s, t = s * real[..., None], t * real[..., None]
        count = real.sum(1)[:, None, None].clamp_min(1.0)
        mean = (s.sum(1, keepdim=True) + t.sum(1, keepdim=True)) / (2 * count)
        var = (((s - mean) ** 2).sum(1, keepdim=True) + ((t - mean) ** 2).sum(1, keepdim=True)) / (2 * count)
        std = torch.sqrt(var + 1e-6)
        s, t = ((s - mean) / std).transpose(1, 2), ((t - mean) / std).transpose(1, 2)  # (B, H, T)
        diff = s[..., :, None] - t[..., None, :]  # (B, H, query, key)
        centred = v - v.mean(dim=2, keepdim=True)  # mean over all T positions
        numerator = torch.einsum("bhij,bhjd->bhid", diff.relu(), centred)
        normaliser = (diff.abs() * real[:, None, None, :]).sum(-1, keepdim=True).clamp_min(self.eps)
        return self.merged(2 * numerator / normaliser)


class AuthorsSlicedReLUBump(_AuthorsLayer):
    """The authors' ReLU-bump layer: linear Π without bias, per-head bandwidth, no dropout anywhere."""

    def __init__(self, dim: int, num_heads: int, *, rope=False, fixed=False) -> None:
        super().__init__(dim, num_heads, nn.Linear(dim, num_heads, bias=False), rope, fixed)
        self.log_bandwidth = nn.Parameter(torch.zeros(num_heads))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        s, t, v = self.scores_and_values(x)
        real = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
        v = v * real[:, None, :, None]
        width = (F.softplus(self.log_bandwidth) + 1e-4).clamp_min(1e-4)[None, :, None, None]
        diff = s.transpose(1, 2)[..., :, None] - t.transpose(1, 2)[..., None, :]
        hat = (1 - diff.abs() / width).clamp_min(0.0)
        context = torch.einsum("bhij,bhjd->bhid", hat, v) / real.sum(1).clamp_min(1.0)[:, None, None, None]
        return self.merged(context)


@torch.no_grad()
def copy_into(layer: nn.Module, authors: _AuthorsLayer) -> nn.Module:
    """Give an attnlab sliced layer (same dim, heads; ``qkv_bias``, ``out_bias`` on) the weights of a
    transcription, so that the two compute the same function: q/k/v into the fused projection (rows
    reordered even-first per head when RoPE is on, see `authors_rope`), Π and the bandwidth as they
    are, and the output projection set to the identity (the published layer has none). Returns it."""
    order = torch.arange(layer.qkv_dim)
    if authors.rope:
        heads = torch.arange(authors.num_heads)[:, None] * authors.head_dim
        order = (heads + even_first(authors.head_dim)[None]).reshape(-1)
    weights = [authors.query.weight[order], authors.key.weight[order], authors.value.weight]
    biases = [authors.query.bias[order], authors.key.bias[order], authors.value.bias]
    layer.qkv.weight.copy_(torch.cat(weights))
    layer.qkv.bias.copy_(torch.cat(biases))
    layer.slicer.load_state_dict(authors.slicer.state_dict())
    if hasattr(authors, "log_bandwidth"):
        layer.bandwidth_logit.copy_(authors.log_bandwidth)
    layer.out_proj.weight.copy_(torch.eye(layer.dim, dtype=layer.out_proj.weight.dtype))
    layer.out_proj.bias.zero_()
    return layer
