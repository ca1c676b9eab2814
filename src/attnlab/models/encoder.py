"""The one pre-LN transformer encoder block that every model in attnlab stacks.

Attention comes from a factory (``attention(dim=..., num_heads=..., rope=..., dropout=...)``, plus
``qkv_dim=...`` only when the model sets one, so factories without that option still work), usually
``functools.partial(attnlab.attention.build_attention, name)`` or what Hydra builds from ``conf/attn``,
so any registered backend slots in without this module knowing about it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

AttentionFactory = Callable[..., nn.Module]


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0):
        super().__init__(
            nn.Linear(dim, hidden_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden_dim, dim)
        )


class EncoderBlock(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)); dropout on both residual branches.

    ``dropout`` acts on the residual branches and inside the MLP; ``attn_dropout`` is the attention
    layer's own (attention weights for softmax, the attention output for the others).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_dim: int,
        attention: AttentionFactory,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        rope: bool = False,
        qkv_dim: int | None = None,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        width = {} if qkv_dim is None else {"qkv_dim": qkv_dim}
        self.attn = attention(dim=dim, num_heads=num_heads, rope=rope, dropout=attn_dropout, **width)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim, mlp_dim, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask=key_padding_mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class Encoder(nn.Module):
    """``depth`` blocks and a final LayerNorm."""

    def __init__(self, depth: int, dim: int, **block_kwargs):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.blocks = nn.ModuleList(EncoderBlock(dim=dim, **block_kwargs) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)
        return self.norm(x)
