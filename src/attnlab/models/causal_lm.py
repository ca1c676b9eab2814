"""A small causal language model: embeddings and positions, the pre-LN encoder (causal), a vocab head.

It is the encoder every attnlab model stacks (`attnlab.models.encoder.Encoder`), with ``causal=True``
added to the attention factory, so any backend with a causal form slots in (MQAR recall, decoding);
a backend without one is refused by name, with the list of those that have one.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from attnlab.attention import PackedLayout, UnsupportedAttentionError
from attnlab.attention.registry import available_backends, check_support
from attnlab.errors import UserError
from attnlab.models.classifier import POSITIONS, check_choice, resolve_attention, sinusoidal_positions
from attnlab.models.encoder import AttentionFactory, Encoder, init_like_gpt2

INITS = ("torch", "gpt2")


class NoCausalAttentionError(UnsupportedAttentionError, UserError):
    """The chosen attention backend has no causal form; a user's choice, so `train.py` prints it plainly."""


def causal_backends() -> list[str]:
    """Registered backends that accept ``causal=True``."""
    return [name for name in available_backends() if not check_support(name, causal=True)]


class CausalLM(nn.Module):
    """Token ids ``(B, T)`` → next-token logits ``(B, T, vocab_size)``; position i sees tokens ≤ i only.

    positions: learned table, fixed sinusoidal table, RoPE inside attention, or none.
    mlp_dim: hidden width of each block's MLP; null: ``mlp_ratio × dim``, so a width sweep
    (``task.model.dim=32,64,128``) scales the whole block and not the attention alone.
    Padding must be on the right (attnlab's collates pad there): then no real token ever has a pad
    before it, so causal attention alone keeps pads out and the mask is not passed to attention, which
    keeps softmax on its fused causal kernel. Outputs at padded positions are meaningless.

    GPT-2 as nanoGPT builds it: ``tie_embeddings=True`` (the output head is the token embedding),
    ``bias=False`` (no bias in any Linear or LayerNorm, the attention's q/k/v and output projections
    included; the head never has one when tied), ``init="gpt2"`` (normal(0, 0.02) weights, the
    residual projections at 0.02/√(2·depth); ``"torch"``: PyTorch's defaults, learned positions
    normal(0, 0.02)).
    """

    def __init__(
        self,
        vocab_size: int,
        attention: AttentionFactory | str,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 2,
        mlp_dim: int | None = None,
        mlp_ratio: float = 2.0,
        max_len: int = 2048,
        positions: str = "rope",
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        qkv_dim: int | None = None,
        short_conv: int = 0,
        bias: bool = True,
        tie_embeddings: bool = False,
        init: str = "torch",
    ):
        super().__init__()
        check_choice("positions", positions, POSITIONS)
        check_choice("init", init, INITS)
        for key, value in (("bias", bias), ("tie_embeddings", tie_embeddings)):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r}")
        if not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0 (MLP width = mlp_ratio × dim), got {mlp_ratio}")
        if mlp_dim is None:
            mlp_dim = max(1, round(mlp_ratio * dim))
        self.vocab_size, self.max_len, self.positions = vocab_size, max_len, positions
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len, dim)) if positions == "learned" else None
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)
        if positions == "sinusoidal":  # fixed, not saved: rebuilt from max_len and dim
            self.register_buffer("pos_table", sinusoidal_positions(max_len, dim)[None], persistent=False)
        else:
            self.pos_table = None
        self.drop = nn.Dropout(dropout)
        no_bias = {} if bias else {"qkv_bias": False, "out_bias": False}
        causal_attention = functools.partial(resolve_attention(attention), causal=True, **no_bias)
        try:
            # this model's own config keywords, spelt out (attnlab/models/__init__.py says why)
            self.encoder = Encoder(
                depth=depth,
                dim=dim,
                num_heads=num_heads,
                mlp_dim=mlp_dim,
                attention=causal_attention,
                dropout=dropout,
                attn_dropout=attn_dropout,
                rope=positions == "rope",
                qkv_dim=qkv_dim,
                short_conv=short_conv,
                causal=True,
                bias=bias,
            )
        except UnsupportedAttentionError as err:
            raise NoCausalAttentionError(
                f"{err}. A causal language model needs causal attention; backends with a causal form: "
                f"{', '.join(causal_backends())} (e.g. attn=softmax)"
            ) from err
        self.head = nn.Linear(dim, vocab_size, bias=bias and not tie_embeddings)
        self.init = init
        if init == "gpt2":
            init_like_gpt2(self, depth)
        if tie_embeddings:
            self.head.weight = self.embed.weight  # one (vocab, dim) matrix, counted once

    def _embed(self, input_ids: torch.Tensor, packing: PackedLayout | None = None) -> torch.Tensor:
        """Token embeddings plus the position table's rows (for a packed batch, at each token's position
        in its own sequence)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        length = input_ids.shape[1] if packing is None else packing.unpack_index.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_len={self.max_len}")
        x = self.embed(input_ids)
        for table in (self.pos_embed, self.pos_table):
            if table is not None:
                rows = table[:, : input_ids.shape[1]] if packing is None else table[0, packing.positions]
                x = x + rows.to(x.dtype)
        return self.drop(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab). With ``packing`` (a batch of stream blocks holding several documents;
        `attnlab.data.packing.document_layout`), each document attends only within itself and its
        positions start at 0; the logits keep their (B, T) places."""
        if mask is not None and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError("CausalLM needs right padding: a real token follows a padded one in `mask`")
        if packing is None:
            return self.head(self.encoder(self._embed(input_ids)))
        packing.check(input_ids)
        return self.head(self.encoder(self._embed(input_ids, packing), packing=packing))

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, tuple[int, list]]:
        """A prompt (B, T) through the parallel causal forward: its logits (B, T, vocab) and the state
        `step` continues from (each layer's KV cache, (S, z) or sorted runs; see
        `attnlab.attention.decoding`)."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be (B, T >= 1), got shape {tuple(input_ids.shape)}")
        x, blocks = self.encoder.prefill(self._embed(input_ids))
        return self.head(x), (input_ids.shape[1], blocks)

    def step(self, token: torch.Tensor, state: tuple[int, list] | None = None) -> tuple[torch.Tensor, tuple]:
        """Next-token logits (B, vocab) after ``token`` (B,), and the new state: recurrent decoding with
        each layer's own step, equal to `forward`'s logits at that position. ``state``: None at the start,
        or what `prefill` or the previous step returned (it may be updated in place)."""
        position, blocks = state if state is not None else (0, None)
        if position >= self.max_len:
            raise ValueError(f"decoding past the model's max_len={self.max_len}")
        x = self.embed(token)
        if self.pos_embed is not None:
            x = x + self.pos_embed[0, position]
        if self.pos_table is not None:
            x = x + self.pos_table[0, position].to(x.dtype)
        x, blocks = self.encoder.step(self.drop(x), blocks)
        return self.head(x), (position + 1, blocks)
