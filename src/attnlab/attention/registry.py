"""The one registry of attention backends: build any layer by name with validated options.

Accepted options are read from each layer's constructor signature, so they cannot drift from the
code; capabilities are declared by each layer class (`Capabilities`), and a request a backend cannot
serve fails with the backend's name and the reason.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from attnlab.attention.layers import (
    AttentionLayer,
    Capabilities,
    LinearAttention,
    PerformerAttention,
    SlicedReLUAttention,
    SlicedReLUBumpAttention,
    SoftmaxAttention,
)

_BACKENDS: dict[str, type[AttentionLayer]] = {
    layer.name: layer
    for layer in (
        SoftmaxAttention,
        SlicedReLUAttention,
        SlicedReLUBumpAttention,
        LinearAttention,
        PerformerAttention,
    )
}


def available_backends() -> list[str]:
    """Names accepted by `build_attention`, in registration order."""
    return list(_BACKENDS)


def _layer(name: str) -> type[AttentionLayer]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known backends: {', '.join(_BACKENDS)}")
    return _BACKENDS[name]


def backend_capabilities(name: str) -> Capabilities:
    """What backend `name` supports: padding mask, causal, recurrent step, dtypes (+ reasons)."""
    return _layer(name).capabilities


def backend_options(name: str) -> dict[str, Any]:
    """Keyword options of backend `name` (common ones included) with their defaults."""
    layer = _layer(name)
    options: dict[str, Any] = {}
    for cls in reversed(layer.__mro__):  # base class first, so common options come first
        if cls is nn.Module or not issubclass(cls, AttentionLayer):
            continue
        for param in inspect.signature(cls.__init__).parameters.values():
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                options[param.name] = param.default
    return options


def check_support(
    name: str,
    *,
    causal: bool = False,
    padding_mask: bool = False,
    recurrent_step: bool = False,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Reasons why backend `name` cannot serve this request (empty list: it can)."""
    caps = backend_capabilities(name)
    wanted = {"causal": causal, "padding_mask": padding_mask, "recurrent_step": recurrent_step}
    reasons = [
        f"{feature}: {caps.reasons.get(feature, 'not supported')}"
        for feature, asked in wanted.items()
        if asked and not getattr(caps, feature)
    ]
    if dtype is not None and dtype not in caps.dtypes:
        reasons.append(f"dtype: {dtype} not in {', '.join(str(d) for d in caps.dtypes)}")
    return reasons


def build_attention(name: str, dim: int, num_heads: int, **options: Any) -> AttentionLayer:
    """Build attention backend `name` for model width `dim` split into `num_heads` heads.

    Common options: rope, rope_base, dropout, causal, qkv_bias; see `backend_options(name)` for the
    backend's own. Unknown names, unknown options, a width not divisible by the head count and requests
    the backend does not support all raise ValueError with what is allowed.
    """
    layer = _layer(name)
    accepted = backend_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for attention backend {name!r}; "
            f"accepted options: {', '.join(accepted)}"
        )
    return layer(dim, num_heads, **options)  # the layer checks width, heads and what it supports
