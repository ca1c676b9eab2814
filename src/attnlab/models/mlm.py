"""RoBERTa-shaped text encoder on attnlab's pre-LN blocks: masked-LM pretraining and GLUE heads.

`TextEncoder`: token embedding → LayerNorm → dropout → `Encoder` (RoPE inside attention, no position
table, as the sliced ReLU authors' model) → hidden states. `MaskedLanguageModel` adds RoBERTa's LM head
(dense → GELU → LayerNorm → vocabulary projection tied to the input embedding, plus a bias) and scores
only the positions asked for: at 20 % masking most logits would be thrown away. `SentenceClassifier`
puts the authors' classification head (mean over real tokens, dropout, dim → 4·dim → GELU → outputs)
on the same encoder; one output is regression (STS-B). Both keep the encoder under ``backbone``, so a
pretrained checkpoint's ``model.backbone.*`` weights load into either.
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.attention import PackedLayout
from attnlab.models.classifier import classifier_head, resolve_attention
from attnlab.models.encoder import AttentionFactory, Encoder


class TextEncoder(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        attention: AttentionFactory | str,
        dim: int = 128,
        depth: int = 2,
        num_heads: int = 4,
        mlp_dim: int = 512,
        max_len: int = 512,
        dropout: float = 0.1,
        attn_dropout: float = 0.0,
        qkv_dim: int | None = None,
        pad_id: int = 0,
        short_conv: int | None = 0,
    ):
        super().__init__()
        self.max_len, self.pad_id = max_len, pad_id
        short_conv = short_conv or 0  # None: a checkpoint saved before the option existed
        # the model's shape as plain values: saved in checkpoints, compared when fine-tuning loads one
        self.shape = dict(vocab_size=vocab_size, dim=dim, depth=depth, num_heads=num_heads, mlp_dim=mlp_dim)
        self.shape.update(max_len=max_len, qkv_dim=qkv_dim, pad_id=pad_id, short_conv=short_conv)
        self.embed = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.embed_norm = nn.LayerNorm(dim)
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
            rope=True,
            qkv_dim=qkv_dim,
            short_conv=short_conv,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Hidden states ``(B, T, dim)`` of token ids ``(B, T)``; ``mask`` True on real tokens. With
        ``packing`` (no mask: the layout is the mask), the rows hold several sequences end to end and
        attention stays within each (RoPE at each token's position in its own sequence)."""
        length = input_ids.shape[1] if packing is None else packing.unpack_index.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_len={self.max_len}")
        x = self.drop(self.embed_norm(self.embed(input_ids)))
        if packing is not None:
            packing.check(input_ids, mask)
            return self.encoder(x, packing=packing)
        if mask is None:
            mask = input_ids != self.pad_id
        return self.encoder(x, key_padding_mask=mask)


class _OnTextEncoder(nn.Module):
    """A `TextEncoder` under ``backbone`` (``options``: its keywords) and its shape as ``config``: what
    pretraining and fine-tuning share, so a checkpoint's ``model.backbone.*`` weights fit either head."""

    def __init__(self, vocab_size: int, attention: AttentionFactory | str, **options):
        super().__init__()
        self.backbone = TextEncoder(vocab_size, attention, **options)
        self.config = {
            **self.backbone.shape,
            "attention": type(self.backbone.encoder.blocks[0].attn).__name__,
        }


class MaskedLanguageModel(_OnTextEncoder):
    """The encoder (``shape``: `TextEncoder`'s keywords) and RoBERTa's LM head, tied to the input."""

    def __init__(self, vocab_size: int, attention: AttentionFactory | str, dim: int = 128, **shape):
        super().__init__(vocab_size, attention, dim=dim, **shape)
        self.lm_dense = nn.Linear(dim, dim)
        self.lm_act = nn.GELU()
        self.lm_norm = nn.LayerNorm(dim)
        self.lm_bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Vocabulary logits: ``(N, V)`` at the True entries of ``positions`` (B, T), else ``(B, T, V)``;
        ``packing``: the blocks' documents, each attending within itself (no mask then)."""
        hidden = self.backbone(input_ids, mask, packing)
        if positions is not None:
            hidden = hidden[positions]
        hidden = self.lm_norm(self.lm_act(self.lm_dense(hidden)))
        return nn.functional.linear(hidden, self.backbone.embed.weight, self.lm_bias)  # tied to the input


class SentenceClassifier(_OnTextEncoder):
    """The pretrained encoder (``shape``: `TextEncoder`'s keywords) and a pooled head;
    ``num_outputs=1`` is a regression (a score per pair)."""

    def __init__(
        self,
        vocab_size: int,
        num_outputs: int,
        attention: AttentionFactory | str,
        dim: int = 128,
        head_dropout: float = 0.1,
        **shape,
    ):
        super().__init__(vocab_size, attention, dim=dim, **shape)
        self.head = classifier_head(dim, [4 * dim], num_outputs, "gelu", head_dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, num_outputs)``: mean of the hidden states over real tokens, then the head;
        with ``packing``, ``(N, num_outputs)`` of the N sequences packed in the rows."""
        if packing is not None:
            return self.head(packing.mean(self.backbone(input_ids, mask, packing)))
        if mask is None:
            mask = input_ids != self.backbone.pad_id
        hidden = self.backbone(input_ids, mask)
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0))
