"""A minimal point-cloud transformer: per-point embedding → pre-LN encoder → pooling → MLP head.

The sliced ReLU paper's ModelNet40 model (the authors' ``models/pointcloud_transformer.py``): each point's
coordinates go through ``Linear(C, dim) → GELU → Linear(dim, dim)``, a LayerNorm and dropout, then
``depth`` of attnlab's pre-LN blocks (attention from the registry: every backend) and a final LayerNorm;
no neighbourhood grouping, no farthest-point sampling, no hierarchy, so the attention kernel alone
makes the difference. The classifier is mean pooling and an MLP ``dim → 4·dim → GELU → classes`` with
dropout. PCT's (Guo et al. 2021) choices are options: ``features="concat"`` concatenates every block's
output (each through the encoder's final LayerNorm) and ``pooling="max_mean"`` joins max and mean
pooling.

Points are a set: there is no positional encoding (RoPE cannot be turned on), so the logits do not
depend on the order of the points, for every backend (tests check it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from attnlab.models.classifier import HEAD_ACTIVATIONS, check_choice, classifier_head, resolve_attention
from attnlab.models.encoder import AttentionFactory, Encoder, init_like_roberta

FEATURES = ("last", "concat")
POOLINGS = ("mean", "max", "max_mean")


class PointCloudClassifier(nn.Module):
    """Classify clouds ``points (B, N, C)`` (C = ``in_channels``: xyz, or xyz + normals).

    ``points`` may also be ``(B, V, N, C)``: V versions of each cloud (test-time voting), whose logits
    are averaged. ``mask`` (B, N), True = real point, serves padded clouds; fixed-size clouds need none.
    """

    def __init__(
        self,
        num_classes: int,
        attention: AttentionFactory | str,
        in_channels: int = 3,
        dim: int = 128,
        depth: int = 4,
        num_heads: int = 4,
        mlp_dim: int = 512,
        dropout: float = 0.1,
        attn_dropout: float = 0.0,
        qkv_dim: int | None = None,
        features: str = "last",
        pooling: str = "mean",
        head_dims: Sequence[int] | None = None,
        head_activation: str = "gelu",
        head_dropout: float = 0.1,
        mlp_dropout: bool = True,
        norm_eps: float = 1e-5,
        init_std: float | None = None,
    ):
        """``mlp_dropout=False``, ``norm_eps=1e-12`` and ``init_std=0.02`` are the authors' blocks
        (their RoBERTa config's settings and ``post_init``); the defaults are PyTorch's."""
        super().__init__()
        check_choice("features", features, FEATURES)
        check_choice("pooling", pooling, POOLINGS)
        check_choice("head_activation", head_activation, tuple(HEAD_ACTIVATIONS))
        if in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {in_channels}")
        if not 0.0 <= head_dropout < 1.0:
            raise ValueError(f"head_dropout must be in [0, 1), got {head_dropout}")
        hidden = [4 * dim] if head_dims is None else [int(w) for w in head_dims]
        if any(w < 1 for w in hidden):
            raise ValueError(f"head_dims={hidden} must be positive widths (or null for [4 * dim])")
        self.in_channels, self.features, self.pooling = in_channels, features, pooling
        self.embed = nn.Sequential(nn.Linear(in_channels, dim), nn.GELU(), nn.Linear(dim, dim))
        self.embed_norm = nn.LayerNorm(dim, eps=norm_eps)
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
            rope=False,  # a set has no order
            qkv_dim=qkv_dim,
            mlp_dropout=mlp_dropout,
            norm_eps=norm_eps,
        )
        width = dim * (depth if features == "concat" else 1) * (2 if pooling == "max_mean" else 1)
        self.head = classifier_head(width, hidden, num_classes, head_activation, head_dropout)
        if init_std is not None:
            init_like_roberta(self, init_std)

    def encode(self, points: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-point features ``(B, N, width)``."""
        x = self.drop(self.embed_norm(self.embed(points)))
        if self.features == "last":
            return self.encoder(x, key_padding_mask=mask)
        outputs = []
        for block in self.encoder.blocks:
            x = block(x, key_padding_mask=mask)
            outputs.append(self.encoder.norm(x))
        return torch.cat(outputs, dim=-1)

    def pool(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            mean, peak = x.mean(1), (x.amax(1) if self.pooling != "mean" else None)
        else:
            weights = mask.unsqueeze(-1).to(x.dtype)
            mean = (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)
            peak = (
                x.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1) if self.pooling != "mean" else None
            )
            if peak is not None:
                peak = torch.where(mask.any(1, keepdim=True), peak, torch.zeros_like(peak))
        if self.pooling == "mean":
            return mean
        return peak if self.pooling == "max" else torch.cat([peak, mean], dim=-1)

    def forward(self, points: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if points.ndim == 4:  # (B, V, N, C): average the logits of the V versions of each cloud
            batch, votes = points.shape[:2]
            if mask is not None:
                raise ValueError("voting batches (B, V, N, C) take no mask: every version is a full cloud")
            return self(points.flatten(0, 1)).unflatten(0, (batch, votes)).mean(1)
        if points.ndim != 3 or points.shape[-1] != self.in_channels:
            raise ValueError(
                f"points must be (batch, num_points, {self.in_channels}) (or (batch, votes, num_points, "
                f"{self.in_channels})), got {tuple(points.shape)}"
            )
        if mask is not None and mask.shape != points.shape[:2]:
            raise ValueError(
                f"mask must be (batch, num_points) = {tuple(points.shape[:2])}, got {tuple(mask.shape)}"
            )
        return self.head(self.pool(self.encode(points, mask), mask))
