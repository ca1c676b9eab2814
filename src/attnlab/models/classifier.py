"""Sequence classifiers: token embedding + positions → encoder → pooling → head.

`SequenceClassifier` serves every single-sequence task (ListOps, Text, Image, Pathfinder);
with ``dual=True`` it is the two-tower model of LRA Retrieval: one shared encoder embeds both
documents into u and v, and an MLP classifies ``[u, v, u*v, u-v]`` (``pair_features="nli"``) or
``[u, v]`` (``"concat"``, the official LRA Transformer's dual encoder).

The options exist so that presets can state the models they claim: the official LRA Transformers
(lra_benchmarks/models/transformer/transformer.py: fixed sinusoidal or learned positions, CLS or
first-token or mean pooling, q/k/v narrower than the model, a ReLU head of ``mlp_dim``) and the sliced
ReLU authors' model (an embedding LayerNorm, mean pooling, a GELU head of 4·dim with dropout).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import nn

from attnlab.attention import PackedLayout
from attnlab.models.encoder import AttentionFactory, Encoder

POSITIONS = ("learned", "sinusoidal", "rope", "none")
POOLINGS = ("mean", "mean_all", "cls", "first")
CLS_MASKS = ("real", "first")
#: What a packed batch can be pooled by, and why the others cannot.
PACKED_POOLINGS = ("mean", "first")
PACKING_REFUSED = {
    "cls": "it prepends a learned token to each sequence, which the packed rows hold no slot for",
    "mean_all": "it averages the padded positions too, which a packed sequence does not have",
}
HEAD_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}
PAIR_FEATURES = ("nli", "concat")


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    """A model option outside its choices fails with the option, the value and the choices."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(allowed)}")


def resolve_attention(attention: AttentionFactory | str) -> AttentionFactory:
    """Accept a backend name as a shortcut for ``partial(build_attention, name)``."""
    if isinstance(attention, str):
        from attnlab.attention import build_attention

        return functools.partial(build_attention, attention)
    return attention


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """The Transformer's fixed table ``(length, dim)``: sin at even channels, cos at odd ones.

    Row p, channels 2i and 2i+1 hold sin and cos of p / 10000^(2i/dim), as in LRA's
    ``sinusoidal_init`` (lra_benchmarks/models/layers/common_layers.py).
    """
    position = torch.arange(length, dtype=torch.float64)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: dim // 2])
    return table.float()


def classifier_head(
    in_dim: int, hidden: Sequence[int], num_classes: int, activation: str, dropout: float
) -> nn.Sequential:
    """MLP ``in_dim → hidden... → num_classes``; dropout (when > 0) on its input and after each activation."""
    drop = lambda: [nn.Dropout(dropout)] if dropout > 0 else []  # noqa: E731 (none at 0: same keys as before)
    layers: list[nn.Module] = drop()
    for width in hidden:
        layers += [nn.Linear(in_dim, width), HEAD_ACTIVATIONS[activation](), *drop()]
        in_dim = width
    layers.append(nn.Linear(in_dim, num_classes))
    return nn.Sequential(*layers)


class SequenceClassifier(nn.Module):
    """Embedding, positions, pre-LN encoder, pooling, MLP head.

    positions: learned table, fixed sinusoidal table, RoPE inside attention, or none.
    pooling: ``mean`` over real tokens; ``mean_all`` over every position, padded ones included (LRA's
    MEAN, with ``attn.padded_queries=attend``); ``cls`` prepends a learned token and reads it; ``first`` reads
    the first input token (the official LRA dual encoder, which adds no CLS token).
    qkv_dim: width of q, k, v (null: dim). head_dims: hidden widths of the head (null: [mlp_dim]).
    embed_norm: LayerNorm on embeddings + positions before the encoder (RoBERTa-style embeddings).
    cls_mask: with ``pooling="cls"``, the CLS token is a real token (``real``) or takes the first input
    token's mask (``first``: LRA's encoder, which masks the ids after prepending CLS to them).
    """

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
        qkv_dim: int | None = None,
        embed_norm: bool = False,
        head_dims: Sequence[int] | None = None,
        head_activation: str = "gelu",
        head_dropout: float = 0.0,
        pair_features: str = "nli",
        cls_mask: str = "real",
        short_conv: int = 0,
    ):
        super().__init__()
        check_choice("cls_mask", cls_mask, CLS_MASKS)
        self.cls_mask = cls_mask
        check_choice("positions", positions, POSITIONS)
        check_choice("pooling", pooling, POOLINGS)
        check_choice("head_activation", head_activation, tuple(HEAD_ACTIVATIONS))
        check_choice("pair_features", pair_features, PAIR_FEATURES)
        hidden = [mlp_dim] if head_dims is None else [int(w) for w in head_dims]
        if any(w < 1 for w in hidden):
            raise ValueError(f"head_dims={list(hidden)} must be positive widths (or null for [mlp_dim])")
        if not 0.0 <= head_dropout < 1.0:
            raise ValueError(f"head_dropout must be in [0, 1), got {head_dropout}")
        self.positions, self.pooling, self.max_len, self.dual = positions, pooling, max_len, dual
        self.pair_features = pair_features
        self.embed = nn.Embedding(vocab_size, dim)
        extra = 1 if pooling == "cls" else 0
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, max_len + extra, dim)) if positions == "learned" else None
        )
        if positions == "sinusoidal":  # fixed, not saved: rebuilt from max_len and dim
            self.register_buffer(
                "pos_table", sinusoidal_positions(max_len + extra, dim)[None], persistent=False
            )
        else:
            self.pos_table = None
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if pooling == "cls" else None
        self.embed_norm = nn.LayerNorm(dim) if embed_norm else None
        self.drop = nn.Dropout(dropout)
        # this model's own config keywords, spelt out (attnlab/models/__init__.py says why)
        self.encoder = Encoder(
            depth=depth,
            dim=dim,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            attention=resolve_attention(attention),
            dropout=dropout,
            attn_dropout=attn_dropout,
            rope=positions == "rope",
            qkv_dim=qkv_dim,
            short_conv=short_conv,  # centred: a classifier sees the whole sequence
        )
        head_in = (4 if pair_features == "nli" else 2) * dim if dual else dim
        self.head = classifier_head(head_in, hidden, num_classes, head_activation, head_dropout)
        for p in (self.pos_embed, self.cls):
            if p is not None:
                nn.init.normal_(p, std=0.02)

    def encode(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Pooled representation ``(B, dim)`` of a batch of token ids ``(B, T)``; with ``packing``,
        ``(N, dim)`` of the N sequences packed in the rows of ``input_ids``."""
        if packing is not None:
            return self.encode_packed(input_ids, mask, packing)
        batch, length = input_ids.shape
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_len={self.max_len}")
        if mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        x = self.embed(input_ids)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(batch, -1, -1), x], dim=1)
            cls = mask[:, :1] if self.cls_mask == "first" else mask.new_ones(batch, 1)
            mask = torch.cat([cls, mask], dim=1)
        if self.pos_embed is not None:
            x = x + self.pos_embed[:, : x.shape[1]]
        if self.pos_table is not None:
            x = x + self.pos_table[:, : x.shape[1]].to(x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.encoder(self.drop(x), key_padding_mask=mask)
        if self.pooling in ("cls", "first"):
            return x[:, 0]
        if self.pooling == "mean_all":  # LRA's MEAN: every position, padded ones included
            return x.mean(dim=1)
        weights = mask.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def packing_refusal(self) -> str | None:
        """Why this model cannot read a packed batch, or None when it can."""
        if self.pooling in PACKED_POOLINGS:
            return None
        return (
            f"pooling={self.pooling!r} cannot read a packed batch (allowed: {', '.join(PACKED_POOLINGS)}): "
            f"{PACKING_REFUSED[self.pooling]}"
        )

    def encode_packed(
        self, input_ids: torch.Tensor, mask: torch.Tensor | None, packing: PackedLayout
    ) -> torch.Tensor:
        """`encode` of a packed batch: embeddings, positions (each sequence's own, from 0), norms and
        MLPs on the packed tokens; attention and pooling per sequence. The layout is the mask."""
        refusal = self.packing_refusal()
        if refusal:
            raise ValueError(f"{refusal}; set task.data.packing=false")
        packing.check(input_ids, mask)
        if packing.unpack_index.shape[1] > self.max_len:
            raise ValueError(
                f"sequence length {packing.unpack_index.shape[1]} exceeds the model's max_len={self.max_len}"
            )
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed[0, packing.positions]
        if self.pos_table is not None:
            x = x + self.pos_table[0, packing.positions].to(x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.encoder(self.drop(x), packing=packing)
        if self.pooling == "first":
            return packing.unpack(x)[:, 0]
        return packing.mean(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        input_ids2: torch.Tensor | None = None,
        mask2: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
        packing2: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Logits of a batch; ``packing``/``packing2``: the layout of each side of a packed batch."""
        u = self.encode(input_ids, mask, packing)
        if not self.dual:
            return self.head(u)
        if input_ids2 is None:
            raise ValueError("a dual (two-tower) classifier needs input_ids2")
        v = self.encode(input_ids2, mask2, packing2)
        pair = [u, v, u * v, u - v] if self.pair_features == "nli" else [u, v]
        return self.head(torch.cat(pair, dim=-1))
