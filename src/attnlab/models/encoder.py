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

from attnlab.attention import PackedLayout
from attnlab.models.short_conv import ShortConv

AttentionFactory = Callable[..., nn.Module]


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0, bias: bool = True):
        super().__init__(
            nn.Linear(dim, hidden_dim, bias=bias),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, dim, bias=bias),
        )


def init_like_roberta(module: nn.Module, std: float = 0.02) -> None:
    """Hugging Face's RoBERTa initialisation, which the paper authors' models get from ``post_init``:
    every Linear and Embedding weight normal(0, std), biases 0, LayerNorm weight 1 and bias 0. Other
    parameters (a ReLU-bump bandwidth, Performer's projection) keep their own initialisation."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear | nn.Embedding):
            nn.init.normal_(layer.weight, std=std)
            if getattr(layer, "bias", None) is not None:
                nn.init.zeros_(layer.bias)
        elif isinstance(layer, nn.LayerNorm) and layer.elementwise_affine:
            nn.init.ones_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


def init_like_gpt2(module: nn.Module, depth: int, std: float = 0.02) -> None:
    """nanoGPT's GPT-2 initialisation: every Linear and Embedding weight normal(0, std), biases 0, and
    the projections that write into the residual stream (each block's attention output projection
    and MLP's second Linear) normal(0, std / sqrt(2·depth)), so the residual's variance does not
    grow with depth. LayerNorms (1, 0) and other parameters (a bandwidth) keep their own."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear | nn.Embedding):
            nn.init.normal_(layer.weight, std=std)
            if getattr(layer, "bias", None) is not None:
                nn.init.zeros_(layer.bias)
    for block in module.modules():
        if isinstance(block, EncoderBlock):
            out_proj = getattr(block.attn, "out_proj", None)
            if not isinstance(out_proj, nn.Linear):
                raise ValueError(
                    f"the GPT-2 initialisation scales the attention's output projection `out_proj`; "
                    f"{type(block.attn).__name__} has no nn.Linear of that name"
                )
            for proj in (out_proj, block.mlp[-1]):
                nn.init.normal_(proj.weight, std=std / (2 * depth) ** 0.5)


class EncoderBlock(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)); dropout on both residual branches. With ``short_conv=k``
    the attention reads ShortConv(LN(x)) (causal when ``causal``), the "previous token" step of recall.

    ``dropout`` acts on the residual branches and (``mlp_dropout``) inside the MLP; ``attn_dropout`` is
    the attention layer's own (attention weights for softmax, the attention output for the others).
    ``mlp_dropout=False`` and ``norm_eps=1e-12`` are the paper authors' block (RoBERTa's settings).
    ``bias=False`` removes every bias of the MLP and the LayerNorms (nanoGPT's ``bias=False``; the
    attention's own biases are its ``qkv_bias``/``out_bias`` options).
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
        mlp_dropout: bool = True,
        norm_eps: float = 1e-5,
        short_conv: int = 0,
        causal: bool = False,
        bias: bool = True,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, bias=bias)
        # k taps over time on the attention's input (attnlab.models.short_conv); 0: none (the paper's)
        self.short_conv = ShortConv(dim, short_conv, causal) if short_conv else None
        width = {} if qkv_dim is None else {"qkv_dim": qkv_dim}
        self.attn = attention(dim=dim, num_heads=num_heads, rope=rope, dropout=attn_dropout, **width)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, bias=bias)
        self.mlp = FeedForward(dim, mlp_dim, dropout if mlp_dropout else 0.0, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        """``packing``: x holds whole sequences end to end (`attnlab.attention.common.packing`); the
        norms and the MLP run on the packed tokens, attention and the short convolution per sequence."""
        h = self.norm1(x)
        if self.short_conv is not None:
            if packing is None:
                h = self.short_conv(h, key_padding_mask)
            else:
                h = packing.pack(self.short_conv(packing.unpack(h), packing.mask))
        if packing is None:
            a = self.attn(h, key_padding_mask=key_padding_mask)
        else:
            a = self.attn(h, key_padding_mask=key_padding_mask, packing=packing)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x)))

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """`forward` on a prompt x (B, T, dim) of a causal block, and the state `step` continues from:
        the attention layer's (`prefill`) and the short convolution's last k−1 inputs."""
        h = self.norm1(x)
        conv_state = None
        if self.short_conv is not None:
            k = self.short_conv.kernel_size
            conv_state = torch.nn.functional.pad(h, (0, 0, k - 1, 0))[:, -(k - 1) :]  # zeros before the start
            h = self.short_conv(h)
        a, attn_state = self._attention("prefill")(h)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x))), (conv_state, attn_state)

    def _attention(self, method: str):
        if not hasattr(self.attn, method):
            raise ValueError(f"attention backend {getattr(self.attn, 'name', '?')!r} has no recurrent step")
        return getattr(self.attn, method)

    def step(self, x_t: torch.Tensor, state: tuple | None = None) -> tuple[torch.Tensor, tuple]:
        """One token of causal decoding, x_t (B, dim) -> (y_t, state): the attention layer's own
        recurrent step (`step`), and the short convolution's last k−1 inputs. Same weights as `forward`."""
        conv_state, attn_state = state if state is not None else (None, None)
        h = self.norm1(x_t)
        if self.short_conv is not None:
            h, conv_state = self.short_conv.step(h, conv_state)
        a, attn_state = self._attention("step")(h, attn_state)
        x = x_t + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x))), (conv_state, attn_state)


class Encoder(nn.Module):
    """``depth`` blocks and a final LayerNorm."""

    def __init__(self, depth: int, dim: int, **block_kwargs):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.blocks = nn.ModuleList(EncoderBlock(dim=dim, **block_kwargs) for _ in range(depth))
        self.norm = nn.LayerNorm(
            dim, eps=block_kwargs.get("norm_eps", 1e-5), bias=block_kwargs.get("bias", True)
        )

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask, packing=packing)
        return self.norm(x)

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        """`forward` of a causal encoder on a prompt, and every block's decoding state after it."""
        states = []
        for block in self.blocks:
            x, block_state = block.prefill(x)
            states.append(block_state)
        return self.norm(x), states

    def step(self, x_t: torch.Tensor, state: list | None = None) -> tuple[torch.Tensor, list]:
        """One token through every block (`EncoderBlock.step`) and the final LayerNorm."""
        states = []
        for block, block_state in zip(self.blocks, state or [None] * len(self.blocks), strict=True):
            x_t, block_state = block.step(x_t, block_state)
            states.append(block_state)
        return self.norm(x_t), states
