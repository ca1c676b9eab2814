"""The one registry of attention backends: build any layer by name with validated options.

Accepted options are read from each layer's constructor signature, so they cannot drift from the
code; capabilities are declared by each layer class (`Capabilities`), and a request a backend cannot
serve fails with the backend's name and the reason. Built-in and user backends go through the same
`register_backend`, so a user's class gets exactly the same checks (docs/extending.md).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from attnlab.attention.common.layer import AttentionLayer, Capabilities
from attnlab.attention.linear.layer import LinearAttention
from attnlab.attention.performer.layer import PerformerAttention
from attnlab.attention.sliced_relu.layer import SlicedReLUAttention
from attnlab.attention.sliced_relu_bump.layer import SlicedReLUBumpAttention
from attnlab.attention.softmax.layer import SoftmaxAttention
from attnlab.errors import ConfigError

_BACKENDS: dict[str, type[AttentionLayer]] = {}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def register_backend(name: str) -> Callable[[type[AttentionLayer]], type[AttentionLayer]]:
    """Class decorator: make an `AttentionLayer` subclass buildable as `build_attention(name, ...)`.

    The class implements `attend(q, k, v, key_padding_mask)` on (B, H, T, D) tensors, declares its
    `capabilities`, and takes `(dim, num_heads, *, <its options>, **common)`, passing `**common`
    on to `AttentionLayer.__init__`. Its options are read from that signature. Registering another
    class under a taken name is an error; registering the same class again (a re-imported module)
    is not.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"backend name must be a Python identifier such as 'my_attn', got {name!r}")

    def register(cls: type[AttentionLayer]) -> type[AttentionLayer]:
        if not (isinstance(cls, type) and issubclass(cls, AttentionLayer)):
            raise TypeError(
                f"register_backend({name!r}) needs a subclass of attnlab.attention.AttentionLayer, "
                f"got {cls!r}"
            )
        params = list(inspect.signature(cls.__init__).parameters)[1:3]
        if params != ["dim", "num_heads"]:
            raise TypeError(
                f"{cls.__qualname__}.__init__ must start with (self, dim, num_heads, ...), "
                f"got (self, {', '.join(params)}, ...)"
            )
        if not isinstance(cls.capabilities, Capabilities):
            raise TypeError(f"{cls.__qualname__}.capabilities must be a Capabilities instance")
        known = _BACKENDS.get(name)
        if known is not None and _qualified(known) != _qualified(cls):
            raise ValueError(
                f"attention backend {name!r} is already registered by {_qualified(known)}; "
                f"choose another name for {_qualified(cls)}"
            )
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return register


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


for _builtin in (
    SoftmaxAttention,
    SlicedReLUAttention,
    SlicedReLUBumpAttention,
    LinearAttention,
    PerformerAttention,
):
    register_backend(_builtin.name)(_builtin)


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
        if cls is nn.Module or not issubclass(cls, AttentionLayer) or "__init__" not in vars(cls):
            continue
        for param in list(inspect.signature(cls.__init__).parameters.values())[3:]:
            if param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
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


def build_attention(
    name: str, dim: int, num_heads: int, *, module: str | None = None, **options: Any
) -> AttentionLayer:
    """Build attention backend `name` for model width `dim` split into `num_heads` heads.

    Common options: rope, rope_base, dropout, causal, qkv_bias; see `backend_options(name)` for the
    backend's own. `module` names a Python module to import first: a user backend registers itself
    there with `register_backend` (how a config file selects a class defined outside attnlab).
    Unknown names, unknown options, bad values, a width not divisible by the head count and
    requests the backend does not support all raise ValueError with what is allowed.
    """
    if module is not None:
        _import_backend_module(name, module)
    layer = _layer(name)
    accepted = backend_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for attention backend {name!r}; "
            f"accepted options: {', '.join(accepted)}"
        )
    return layer(dim, num_heads, **options)  # the layer checks width, heads, values and support


def _import_backend_module(name: str, module: str) -> None:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or not (module == err.name or module.startswith(err.name + ".")):
            raise  # the module exists but one of its own imports is missing: show that
        raise ModuleNotFoundError(
            f"attention backend {name!r}: module {module!r} not found; put the folder that holds it on "
            "PYTHONPATH (e.g. `export PYTHONPATH=$PWD` in that folder)"
        ) from err
    if name not in _BACKENDS:
        raise ValueError(
            f"module {module!r} was imported but registers no attention backend {name!r} "
            f"(decorate the class with @register_backend({name!r})); known backends: {', '.join(_BACKENDS)}"
        )
