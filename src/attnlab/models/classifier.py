"""Sequence classifiers: token embedding + positions → encoder → pooling → head.

`SequenceClassifier` serves every single-sequence task (ListOps, Text, Image, Pathfinder);
with ``dual=True`` it is the two-tower model of LRA Retrieval: one shared encoder embeds both
documents into u and v, and an MLP classifies ``[u, v, u*v, u-v]``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from attnlab.models.encoder import AttentionFactory, Encoder

POSITIONS = ("learned", "rope", "none")
POOLINGS = ("mean", "cls")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(allowed)}")


def resolve_attention(attention: AttentionFactory | str) -> AttentionFactory:
    """Accept a backend name as a shortcut for ``partial(build_attention, name)``."""
    if isinstance(attention, str):
        from attnlab.attention import build_attention

        return functools.partial(build_attention, attention)
    return attention


class SequenceClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        attention: AttentionFactory | str,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 2,
        mlp_dim: int = 128,
        max_len: int = 2048,
        positions: str = "learned",
        pooling: str = "mean",
        dropout: float = 0.1,
        attn_dropout: float = 0.0,
        dual: bool = False,
    ):
        super().__init__()
        _check_choice("positions", positions, POSITIONS)
        _check_choice("pooling", pooling, POOLINGS)
        self.positions, self.pooling, self.max_len, self.dual = positions, pooling, max_len, dual
        self.embed = nn.Embedding(vocab_size, dim)
        extra = 1 if pooling == "cls" else 0
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, max_len + extra, dim)) if positions == "learned" else None
        )
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if pooling == "cls" else None
        self.drop = nn.Dropout(dropout)
        self.encoder = Encoder(
            depth=depth,
            dim=dim,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            attention=resolve_attention(attention),
            dropout=dropout,
            attn_dropout=attn_dropout,
            rope=positions == "rope",
        )
        head_in = 4 * dim if dual else dim
        self.head = nn.Sequential(nn.Linear(head_in, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, num_classes))
        for p in (self.pos_embed, self.cls):
            if p is not None:
                nn.init.normal_(p, std=0.02)

    def encode(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled representation ``(B, dim)`` of a batch of token ids ``(B, T)``."""
        batch, length = input_ids.shape
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_len={self.max_len}")
        if mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        x = self.embed(input_ids)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(batch, -1, -1), x], dim=1)
            mask = torch.cat([mask.new_ones(batch, 1), mask], dim=1)
        if self.pos_embed is not None:
            x = x + self.pos_embed[:, : x.shape[1]]
        x = self.encoder(self.drop(x), key_padding_mask=mask)
        if self.cls is not None:
            return x[:, 0]
        weights = mask.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        input_ids2: torch.Tensor | None = None,
        mask2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        u = self.encode(input_ids, mask)
        if not self.dual:
            return self.head(u)
        if input_ids2 is None:
            raise ValueError("a dual (two-tower) classifier needs input_ids2")
        v = self.encode(input_ids2, mask2)
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))
