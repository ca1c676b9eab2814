"""The skeleton every attention layer shares; each backend's layer is in its family's ``layer.py``.

All layers map (B, T, dim) -> (B, T, dim). They share the same skeleton (fused q/k/v projection,
optional RoPE on q and k, the backend's op, output projection) and the same constructor keywords:
dim, num_heads, rope, rope_base, dropout, causal, qkv_bias, qkv_dim, out_bias, padded_queries.
Backend-specific keywords come after those.
Each class declares its `capabilities`, which the registry reads to refuse requests a backend
cannot serve.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention import decoding
from attnlab.attention.common.packing import PackedLayout
from attnlab.attention.common.padding import COMMON_PADDED_QUERIES, check_padded_queries
from attnlab.attention.common.precision import FLOAT_DTYPES
from attnlab.attention.common.rope import RotaryEmbedding


class UnsupportedAttentionError(ValueError):
    """A backend was asked for something it cannot do (e.g. a recurrent step of softmax)."""


# Option checks shared by every layer, run when the layer is built: a bad value from a config file
# fails there, named, instead of at the first forward pass or (a string "false" for a flag) never.


def check_flag(name: str, value: object) -> None:
    """`value` must be a real bool: a YAML string such as 'false' would otherwise count as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_int(name: str, value: object, minimum: int, *, allow_none: bool = False) -> None:
    """`value` must be an int >= `minimum` (bools are refused: True is not a width)."""
    if value is None and allow_none:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        also = " or null" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{also}, got {value!r}")


def check_number(name: str, value: object, *, low: float, low_open: bool, high: float = math.inf) -> None:
    """`value` must be a finite real number in (low, high) or [low, high) (`low_open` decides)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value < high
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g})"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; `reasons` explains each unsupported feature (shown in errors)."""

    padding_mask: bool = True
    causal: bool = False
    recurrent_step: bool = False
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    reasons: dict[str, str] = field(default_factory=dict)


DROPOUT_SITES = ("output", "projection")


def check_dropout_site(value: object) -> None:
    """`dropout_site` of the sliced layers: where their `dropout` acts (see `SlicedReLUAttention`)."""
    if value not in DROPOUT_SITES:
        raise ValueError(f"dropout_site must be one of {', '.join(DROPOUT_SITES)}; got {value!r}")


class AttentionLayer(nn.Module):
    """Shared skeleton; subclasses implement `attend(q, k, v, key_padding_mask)` on (B, H, T, D)."""

    name: str = ""
    capabilities = Capabilities()
    #: True where `forward_packed` can attend on the packed rows themselves (a segment-aware op), False
    #: where it lays each sequence out alone; `attends_packed` says which a given batch takes
    attends_packed_rows = False
    padded_query_modes: tuple[str, ...] = COMMON_PADDED_QUERIES  # what `padded_queries` may be
    dropout_site = "output"  # the sliced layers may move their dropout into the slicing projection

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        rope: bool = False,
        rope_base: float = 10000.0,
        dropout: float = 0.0,
        causal: bool = False,
        qkv_bias: bool = True,
        qkv_dim: int | None = None,
        out_bias: bool = True,
        padded_queries: str = "zero",
    ) -> None:
        super().__init__()
        bad_ints = [
            f"{key}={value!r}"
            for key, value in (("dim", dim), ("num_heads", num_heads))
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1
        ]
        if bad_ints:
            raise ValueError(f"dim and num_heads must be positive integers; got {', '.join(bad_ints)}")
        if qkv_dim is None:
            if dim % num_heads != 0:
                raise ValueError(
                    f"dim={dim} is not divisible by num_heads={num_heads}: "
                    "each head needs dim / num_heads channels"
                )
            qkv_dim = dim
        # q, k, v may be narrower or wider than the model (the official LRA Image model: 128 wide, qkv 64)
        elif type(qkv_dim) is not int or qkv_dim < 1 or qkv_dim % num_heads != 0:
            raise ValueError(
                f"qkv_dim={qkv_dim!r} must be a positive integer divisible by num_heads={num_heads} "
                "(the width of q, k and v, split across heads), or null for dim"
            )
        for key, value in (
            ("rope", rope),
            ("causal", causal),
            ("qkv_bias", qkv_bias),
            ("out_bias", out_bias),
        ):
            check_flag(key, value)
        check_padded_queries(
            f"attention backend {self.name!r}", padded_queries, causal, self.padded_query_modes
        )
        check_number("dropout", dropout, low=0.0, low_open=False, high=1.0)
        check_number("rope_base", rope_base, low=0.0, low_open=True)
        if causal and not self.capabilities.causal:
            raise UnsupportedAttentionError(
                f"attention backend {self.name!r} cannot serve this request: "
                f"causal: {self.capabilities.reasons.get('causal', 'not supported')}"
            )
        self.dim = dim
        self.num_heads = num_heads
        self.qkv_dim = qkv_dim
        self.head_dim = qkv_dim // num_heads
        self.causal = causal
        self.dropout = dropout
        self.padded_queries = (
            padded_queries  # "attend": LRA's black pixels (attnlab.attention.common.padding)
        )
        self.qkv = nn.Linear(dim, 3 * qkv_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(qkv_dim, dim, bias=out_bias)
        self.rotary = RotaryEmbedding(self.head_dim, rope_base) if rope else None

    def heads(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, dim) -> q, k, v of shape (B, H, T, D), RoPE applied to q and k if enabled."""
        return self.split_heads(self.qkv(x), offset)

    def split_heads(
        self, qkv: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection (B, T, 3·qkv_dim) -> q, k, v (B, H, T, D), RoPE on q and k if enabled
        (at each token's own position where ``positions`` (B, T) is given)."""
        b, t, _ = qkv.shape
        q, k, v = qkv.view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rotary is not None:
            q, k = self.rotary(q, k, offset=offset, positions=positions)
        return q, k, v

    def merge(self, o: torch.Tensor) -> torch.Tensor:
        """(B, H, T, Dv) -> (B, T, H·Dv), heads kept together per token."""
        b, h, t, d = o.shape
        return o.transpose(1, 2).reshape(b, t, h * d)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement attend()")

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        """(B, T, dim) -> (B, T, dim). ``packing``: x holds whole sequences end to end in its rows
        (`attnlab.attention.common.packing`); each sequence attends to itself only."""
        if packing is not None:
            return self.forward_packed(x, key_padding_mask, packing)
        self.check_input(x, key_padding_mask)
        q, k, v = self.heads(x)
        o = self.attend(q, k, v, key_padding_mask)
        return self.out_proj(self.merge(o))

    def forward_packed(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, packing: PackedLayout
    ) -> torch.Tensor:
        """A packed batch: the projections (and RoPE, at each token's position in its sequence) run on
        the packed tokens; q, k, v are then laid out one sequence per row and attended with the padded
        code, so every backend and path gives each sequence what it gives that sequence alone."""
        self.check_packed_input(x, key_padding_mask, packing)
        q, k, v = (
            packing.unpack_heads(y) for y in self.split_heads(self.qkv(x), positions=packing.positions)
        )
        o = self.attend(q, k, v, packing.mask)
        return self.out_proj(packing.pack(self.merge(o)))

    def attends_packed(self, x: torch.Tensor, packing: PackedLayout) -> bool:
        """Whether the packed rows ``x`` (B, L, dim) of ``packing`` are attended on the rows (a
        segment-aware op) or each sequence laid out alone; `attnlab.flops` prices the attention
        accordingly."""
        return self.attends_packed_rows

    def check_packed_input(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, packing: PackedLayout
    ) -> None:
        self.check_input(x, None)
        packing.check(x, key_padding_mask, "key_padding_mask")

    def check_input(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> None:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"expected x of shape (B, T, dim={self.dim}), got {tuple(x.shape)}")
        if key_padding_mask is not None and (
            key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != tuple(x.shape[:2])
        ):
            raise ValueError(
                f"key_padding_mask must be bool of shape (B, T) = {tuple(x.shape[:2])}, True = real token; "
                f"got dtype {key_padding_mask.dtype}, shape {tuple(key_padding_mask.shape)}"
            )

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """A causal layer's forward on a prompt x (B, T, dim) and its decoding state after it
        (`attnlab.attention.decoding`: a KV cache, (S, z), sorted runs...)."""
        return decoding.prefill(self, x)

    def step(self, x_t: torch.Tensor, state: object | None = None) -> tuple[torch.Tensor, object]:
        """Decode one token x_t (B, dim) -> (y_t (B, dim), new state), same weights as `forward`:
        feeding x_0, x_1, ... gives the rows of `forward(x)` of a causal layer (in eval mode)."""
        return decoding.step(self, x_t, state)

    def output_dropout(self, o: torch.Tensor) -> torch.Tensor:
        """Dropout on the attention output, for backends without an attention matrix to drop from."""
        if self.dropout_site != "output":
            return o
        return F.dropout(o, p=self.dropout, training=self.training)

    def extra_repr(self) -> str:
        qkv = "" if self.qkv_dim == self.dim else f", qkv_dim={self.qkv_dim}"
        return (
            f"dim={self.dim}, num_heads={self.num_heads}{qkv}, causal={self.causal}, dropout={self.dropout}"
        )
