"""Attention backends: pure ops (`attnlab.attention.ops`), nn.Module layers, and the registry.

Depends on torch only (no Lightning, no Hydra), so every backend can be built and tested standalone:

    from attnlab.attention import build_attention
    layer = build_attention("sliced_relu", dim=128, num_heads=4, rope=True)

Your own backend: subclass `AttentionLayer` and decorate it with `register_backend` (docs/extending.md).
"""

from __future__ import annotations

from attnlab.attention import ops
from attnlab.attention.common.layer import AttentionLayer, Capabilities, UnsupportedAttentionError
from attnlab.attention.common.packing import PackedLayout
from attnlab.attention.registry import (
    available_backends,
    backend_capabilities,
    backend_options,
    build_attention,
    check_support,
    register_backend,
)

__all__ = [
    "AttentionLayer",
    "Capabilities",
    "PackedLayout",
    "UnsupportedAttentionError",
    "available_backends",
    "backend_capabilities",
    "backend_options",
    "build_attention",
    "check_support",
    "ops",
    "register_backend",
]
