"""A tiny Vision Transformer on timm's machinery, with attention from attnlab's registry in every block.

timm's `VisionTransformer` supplies the patch-embedding slot, class token, learned positions, blocks
(pre-norm, `Mlp`, `DropPath`, optional `LayerScale`), pooling, head and its weight init. Two of its own
extension points make it attnlab's:

- ``embed_layer``: timm's `HybridEmbed` over a small convolutional stem (3x3 convolutions with
  BatchNorm and GELU, ``log2(patch_size)`` of them with stride 2, as in Xiao et al. 2021, "Early
  convolutions help transformers see better"), then HybridEmbed's 1x1 projection to ``dim``. A 32 px
  image with ``patch_size=4`` gives 8 x 8 = 64 tokens, a 64 px one 256.
- ``block_fn``: `RegistryBlock`, a thin subclass of timm's `Block` whose ``attn`` is the layer the
  attention factory builds (``conf/attn/*.yaml``), so every backend slots in unchanged.

Every image has the same number of tokens, so no padding mask is needed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import torch
from timm.layers import HybridEmbed
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from attnlab.attention.registry import available_backends
from attnlab.models.classifier import resolve_attention
from attnlab.models.encoder import AttentionFactory

POOLINGS = {"cls": ("token", True), "mean": ("avg", False)}  # ours -> (timm global_pool, class token)


class RegistryBlock(Block):
    """timm's pre-norm block (norms, Mlp, LayerScale, DropPath) with an attnlab registry attention.

    timm builds the block's parts from its usual arguments; the attention slot gets a placeholder
    (`nn.Identity` takes and ignores timm's attention arguments) and then the registry layer, built by
    ``attention(dim=..., num_heads=..., dropout=attn_drop)``: q/k/v bias and backend options come from the
    attention config. ``proj_drop`` drops the attention output, as in timm's own attention.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        attention: AttentionFactory,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        attn_layer: object = None,  # timm's own attention choice: replaced by `attention`
        **block_kwargs,
    ):
        if qk_norm:
            raise ValueError("qk_norm is a timm Attention option; registry attention layers have none")
        super().__init__(dim, num_heads, proj_drop=proj_drop, attn_layer=nn.Identity, **block_kwargs)
        self.attn = attention(dim=dim, num_heads=num_heads, dropout=attn_drop)
        self.attn_out_drop = nn.Dropout(proj_drop)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("RegistryBlock takes no attn_mask or is_causal: every image has all its tokens")
        x = x + self.drop_path1(self.ls1(self.attn_out_drop(self.attn(self.norm1(x)))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def conv_stem(in_chans: int, channels: Sequence[int], patch_size: int) -> nn.Sequential:
    """3x3 conv + BatchNorm + GELU per entry of ``channels``; the first log2(patch_size) have stride 2."""
    if patch_size < 1 or patch_size & (patch_size - 1):
        raise ValueError(f"patch_size={patch_size!r} must be a power of two (each stride-2 conv halves)")
    strided = int(math.log2(patch_size))
    if len(channels) < max(1, strided):
        raise ValueError(
            f"stem_channels={list(channels)} has {len(channels)} conv(s); patch_size={patch_size} needs "
            f"at least {max(1, strided)} (one stride-2 conv per halving)"
        )
    layers: list[nn.Module] = []
    for i, width in enumerate(channels):
        stride = 2 if i < strided else 1
        layers += [
            nn.Conv2d(in_chans, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.GELU(),
        ]
        in_chans = width
    return nn.Sequential(*layers)


def backend_name(attention: AttentionFactory | str) -> str | None:
    """The registry name an attention factory builds: a name, or hydra's partial of build_attention."""
    if isinstance(attention, str):
        return attention
    if isinstance(attention, functools.partial):
        return attention.keywords.get("name", attention.args[0] if attention.args else None)
    return None


def with_backend_options(
    attention: AttentionFactory | str, backend_options: Mapping[str, Mapping] | None
) -> AttentionFactory:
    """The factory with the options a preset states for its backend (``backend_options[name]``).

    A preset compares several backends under one ``attn=...`` sweep, yet some sizes are per backend
    (the sliced ReLU projection's width, where each backend drops): those live in the model config,
    keyed by backend name. An option the attention config itself sets (``+attn.<key>=...``) wins.
    """
    factory = resolve_attention(attention)
    if not backend_options:
        return factory
    unknown = sorted(set(backend_options) - set(available_backends()))
    if unknown:
        raise ValueError(
            f"task.model.backend_options names unknown backend(s) {', '.join(unknown)}; "
            f"known: {', '.join(available_backends())}"
        )
    options = dict(backend_options.get(backend_name(attention), None) or {})
    given = factory.keywords if isinstance(factory, functools.partial) else {}
    options = {key: value for key, value in options.items() if given.get(key) is None}
    return functools.partial(factory, **options) if options else factory


def tiny_vit(
    attention: AttentionFactory | str,
    num_classes: int,
    img_size: int = 32,
    in_chans: int = 3,
    patch_size: int = 4,
    stem_channels: Sequence[int] = (64, 128),
    dim: int = 256,
    depth: int = 7,
    num_heads: int = 4,
    mlp_dim: int = 512,
    pooling: str = "cls",
    dropout: float = 0.0,
    attn_dropout: float = 0.0,
    drop_path: float = 0.1,
    head_dropout: float = 0.0,
    layer_scale: float | None = None,
    backend_options: Mapping[str, Mapping] | None = None,
) -> VisionTransformer:
    """timm's `VisionTransformer` with a convolutional stem and registry attention (see the module doc).

    pooling: ``cls`` reads a class token, ``mean`` averages the patch tokens (timm's ``avg``, with the
    final norm after pooling). dropout: timm's ``proj_drop_rate`` (MLP and attention output);
    attn_dropout: the attention layer's own; drop_path: stochastic depth rate (timm's linear rule over
    depth); layer_scale: LayerScale init value (null: off); backend_options: per backend name, options
    for its attention layer (`with_backend_options`).
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not supported; choose one of {', '.join(POOLINGS)}")
    if mlp_dim < 1 or dim < 1:
        raise ValueError(f"dim and mlp_dim must be positive, got dim={dim}, mlp_dim={mlp_dim}")
    global_pool, class_token = POOLINGS[pooling]
    stem = conv_stem(in_chans, list(stem_channels), patch_size)
    if img_size % patch_size:
        raise ValueError(f"img_size={img_size} is not divisible by patch_size={patch_size}")
    model = VisionTransformer(
        img_size=img_size,
        patch_size=1,  # HybridEmbed's 1x1 projection over the stem's feature map: the stem sets the stride
        in_chans=in_chans,
        num_classes=num_classes,
        global_pool=global_pool,
        class_token=class_token,
        embed_dim=dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_dim / dim,
        init_values=layer_scale,
        drop_rate=head_dropout,
        proj_drop_rate=dropout,
        attn_drop_rate=attn_dropout,
        drop_path_rate=drop_path,
        embed_layer=functools.partial(HybridEmbed, backbone=stem),
        block_fn=functools.partial(RegistryBlock, attention=with_backend_options(attention, backend_options)),
    )
    hidden = model.blocks[0].mlp.fc1.out_features
    if hidden != mlp_dim:  # timm takes a ratio and rounds dim * ratio down
        raise ValueError(f"mlp_dim={mlp_dim} is not reachable as int(dim * ratio) for dim={dim} ({hidden})")
    return model


def num_tokens(model: VisionTransformer) -> int:
    """Patch tokens per image (the class token not counted)."""
    return int(model.patch_embed.num_patches)
