"""Multi-head attention layers, one nn.Module per backend, all mapping (B, T, dim) -> (B, T, dim).

Every layer shares the same skeleton (fused q/k/v projection, optional RoPE on q and k, the backend's
op, output projection) and the same constructor keywords: dim, num_heads, rope, rope_base, dropout,
causal, qkv_bias, qkv_dim, out_bias, padded_queries. Backend-specific keywords come after those.
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
from attnlab.attention.decoding import (  # noqa: F401  (the states' names, importable from here too)
    KVCache,
    LinearAttentionState,
    PerformerState,
    SlicedAttentionState,
)
from attnlab.attention.linear import DEFAULT_CHUNK_SIZE, linear_attention
from attnlab.attention.padding import COMMON_PADDED_QUERIES, PADDED_QUERIES, check_padded_queries
from attnlab.attention.performer import PerformerFeatureMap, performer_attention
from attnlab.attention.precision import FLOAT_DTYPES
from attnlab.attention.rope import RotaryEmbedding
from attnlab.attention.scores import (  # noqa: F401  (public here too: the layers' score maps)
    check_score_layout,
    first_map,
    fold_rotated_scores,
    fold_scores,
    slice_tokens,
    standardise_scores,
    standardise_scores_prefix,
)
from attnlab.attention.sliced.authors import PADDING_RULES, authors_padded_sliced_relu
from attnlab.attention.sliced.dispatch import sliced_relu_attention, sliced_relu_bump_attention
from attnlab.attention.sliced.normaliser import check_bump_normaliser
from attnlab.attention.sliced.path import check_path
from attnlab.attention.softmax import softmax_attention


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
        self.padded_queries = padded_queries  # "attend": LRA's black pixels (attnlab.attention.padding)
        self.qkv = nn.Linear(dim, 3 * qkv_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(qkv_dim, dim, bias=out_bias)
        self.rotary = RotaryEmbedding(self.head_dim, rope_base) if rope else None

    def heads(self, x: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, dim) -> q, k, v of shape (B, H, T, D), RoPE applied to q and k if enabled."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.rotary is not None:
            q, k = self.rotary(q, k, offset=offset)
        return q, k, v

    def merge(self, o: torch.Tensor) -> torch.Tensor:
        """(B, H, T, Dv) -> (B, T, H·Dv), heads kept together per token."""
        b, h, t, d = o.shape
        return o.transpose(1, 2).reshape(b, t, h * d)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement attend()")

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.check_input(x, key_padding_mask)
        q, k, v = self.heads(x)
        o = self.attend(q, k, v, key_padding_mask)
        return self.out_proj(self.merge(o))

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


class SoftmaxAttention(AttentionLayer):
    """Standard multi-head attention via SDPA; `dropout` drops attention weights."""

    name = "softmax"
    capabilities = Capabilities(causal=True, recurrent_step=True)  # decodes with a KV cache
    padded_query_modes = PADDED_QUERIES  # with LRA's rule (attnlab.attention.padding)

    def attend(self, q, k, v, key_padding_mask):
        p = self.dropout if self.training else 0.0
        return softmax_attention(
            q, k, v, key_padding_mask, causal=self.causal, dropout_p=p, padded_queries=self.padded_queries
        )


class LinearAttention(AttentionLayer):
    """Linear attention, φ = elu + 1. Causal layers also decode token by token with `step`."""

    name = "linear"
    capabilities = Capabilities(causal=True, recurrent_step=True)

    def __init__(
        self, dim: int, num_heads: int, *, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE, **common
    ) -> None:
        super().__init__(dim, num_heads, **common)
        check_number("eps", eps, low=0.0, low_open=True)  # 0: a query that sees no real key gives 0/0
        check_int("chunk_size", chunk_size, 1)
        self.eps = eps
        self.chunk_size = chunk_size

    def attend(self, q, k, v, key_padding_mask):
        o = linear_attention(
            q, k, v, key_padding_mask, causal=self.causal, eps=self.eps, chunk_size=self.chunk_size,
            padded_queries=self.padded_queries,
        )  # fmt: skip
        return self.output_dropout(o)


class PerformerAttention(AttentionLayer):
    """FAVOR+ attention with `num_features` random features redrawn every `redraw_interval` train calls."""

    name = "performer"
    capabilities = Capabilities(causal=True, recurrent_step=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_features: int = 256,
        redraw_interval: int | None = 1000,
        seed: int | None = None,
        eps: float = 1e-6,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        **common,
    ) -> None:
        super().__init__(dim, num_heads, **common)
        check_int("num_features", num_features, 1)
        check_int("redraw_interval", redraw_interval, 0, allow_none=True)
        check_int("seed", seed, 0, allow_none=True)
        check_number("eps", eps, low=0.0, low_open=True)  # 0: a query that sees no real key gives 0/0
        check_int("chunk_size", chunk_size, 1)
        self.feature_map = PerformerFeatureMap(self.head_dim, num_features, redraw_interval, seed)
        self.eps = eps
        self.chunk_size = chunk_size

    def attend(self, q, k, v, key_padding_mask):
        o = performer_attention(
            q,
            k,
            v,
            self.feature_map(),
            key_padding_mask,
            causal=self.causal,
            eps=self.eps,
            chunk_size=self.chunk_size,
            padded_queries=self.padded_queries,
        )
        return self.output_dropout(o)


STANDARDISE = ("auto", "sequence", "prefix", "none")


class SlicedAttentionLayer(AttentionLayer):
    """What both sliced layers share: Π (`slicer`) maps q and k to one score per head, then
    `attend_scores(s, t, v, key_padding_mask)` runs the backend's op on the scores.

    `forward` folds Π's first linear map into the q/k projection: without RoPE once per call
    (`fold_scores`), with RoPE once per position (`fold_rotated_scores`, when the batch is larger than
    that map's output, where the per-position table is the cheaper side). The same function of the
    same parameters either way; otherwise it takes q and k as the other layers do. Decoding (`step`,
    `prefill`) always takes q and k: one token at a time gains nothing.

    `score_layout` is how q (and k) become Π's rows (`slice_tokens`): ``"token"``, each token's heads
    (the paper's Π, the default); ``"authors"``, the in-place reshape of the authors' code, whose rows
    mix H consecutive tokens of one head (bidirectional layers only; never folded, as its rows are
    not tokens).
    """

    slicer: nn.Module

    def __init__(self, dim: int, num_heads: int, *, score_layout: str = "token", **common) -> None:
        super().__init__(dim, num_heads, **common)
        check_score_layout(score_layout, self.causal)
        self.score_layout = score_layout

    def fold(self, batch: int) -> str | None:
        """How `forward` computes the scores of a batch: ``"plain"`` (`fold_scores`), ``"rotated"``
        (`fold_rotated_scores`) or None (q and k, then Π). When folded, the projection's and Π's first
        Linear modules are not called, their weights are read (`attnlab.flops` counts what runs)."""
        if self.score_layout != "token":
            return None
        if self.rotary is None:
            return "plain"
        return "rotated" if batch > first_map(self.slicer)[0].out_features else None

    def folded_flops(self, batch: int, length: int) -> float:
        """Forward FLOPs of the fold `fold(batch)` names (0 for None), matmuls only."""
        out, width, dim = first_map(self.slicer)[0].out_features, self.qkv_dim, self.dim
        kind = self.fold(batch)
        if kind == "plain":  # A·W_q and A·W_k, then one dim → 2·out + width map per token
            return 2.0 * (2 * out * width * dim + batch * length * dim * (2 * out + width))
        if kind == "rotated":  # (A R_t)·W_q and ·W_k per position, then per token dim → 2·out and → width
            return 2.0 * (2 * length * out * width * dim + batch * length * dim * (2 * out + width))
        return 0.0

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        kind = self.fold(x.shape[0]) if x.dim() == 3 else None
        if kind is None:
            return super().forward(x, key_padding_mask)
        self.check_input(x, key_padding_mask)
        if kind == "plain":
            s, t, v = fold_scores(self.qkv, self.slicer, self.num_heads, x)
        else:
            s, t, v = fold_rotated_scores(self.qkv, self.slicer, self.rotary, self.num_heads, x)
        return self.out_proj(self.merge(self.attend_scores(s, t, v, key_padding_mask)))

    def attend(self, q, k, v, key_padding_mask):
        s = slice_tokens(self.slicer, q, self.score_layout)
        t = slice_tokens(self.slicer, k, self.score_layout)
        return self.attend_scores(s, t, v, key_padding_mask)

    def attend_scores(self, s, t, v, key_padding_mask):
        raise NotImplementedError(f"{type(self).__name__} must implement attend_scores()")


class SlicedReLUAttention(SlicedAttentionLayer):
    """Sliced ReLU attention (docs/attention.md): Π maps each token's concatenated heads to a score per head.

    `projection="mlp"` is H·D -> H·D -> H with GELU, `"linear"` is H·D -> H. The same Π maps q to s and
    k to t, which are then standardised per sequence and head over valid tokens: `standardise="sequence"`
    with one mean and std over the whole sequence (`standardise_scores`), `"prefix"` with the running
    statistics of tokens j <= i (`standardise_scores_prefix`, sees no future), `"none"` not at all;
    `"auto"` is "prefix" for a causal layer and "sequence" otherwise. `path` chooses the evaluation of
    the kernel (`attnlab.attention.sliced.path`: "auto", dense O(T²) at short T; "dense"; "sorted"):
    the same function, a speed choice. Causal layers decode with `step`.

    `projection_hidden` is the MLP's hidden width (null: H·D, the authors' choice; a linear Π has
    none and ignores it). `dropout_site`:
    `"output"` (attnlab's default) drops the attention output at `dropout`; `"projection"` is the
    authors' placement (SiwanB/Sliced_ReLU_Attention): dropout at `dropout / 2` after the MLP's GELU,
    none on the output (a linear Π then has no dropout at all).

    `padding_rule`: ``"invariant"`` (default) makes padding change nothing at real positions (every
    statistic over real tokens); ``"authors"`` is the authors' code with a padding mask
    (`attnlab.attention.sliced.authors`), whose real outputs move with the amount of padding; it
    needs the whole-sequence standardisation (`standardise="sequence"`, bidirectional layers).
    """

    name = "sliced_relu"
    capabilities = Capabilities(causal=True, recurrent_step=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        projection: str = "mlp",
        projection_hidden: int | None = None,
        eps: float = 1e-4,
        standardise: str = "auto",
        dropout_site: str = "output",
        path: str = "auto",
        padding_rule: str = "invariant",
        **common,
    ) -> None:
        super().__init__(dim, num_heads, **common)
        check_number("eps", eps, low=0.0, low_open=True)  # the floor of the normaliser
        check_int("projection_hidden", projection_hidden, 1, allow_none=True)
        check_dropout_site(dropout_site)
        self.dropout_site = dropout_site
        self.path = check_path(path)
        if standardise not in STANDARDISE:
            raise ValueError(f"standardise must be one of {', '.join(STANDARDISE)}; got {standardise!r}")
        if standardise == "auto":
            standardise = "prefix" if self.causal else "sequence"
        if standardise == "sequence" and self.causal:
            raise ValueError(
                'standardise="sequence" reads the statistics of the whole sequence, future tokens included: '
                'a causal layer takes "prefix" (running statistics) or "none"'
            )
        self.standardise = standardise
        if padding_rule not in PADDING_RULES:
            raise ValueError(f"padding_rule must be one of {', '.join(PADDING_RULES)}; got {padding_rule!r}")
        if padding_rule == "authors" and standardise != "sequence":
            raise ValueError(
                "padding_rule='authors' is the authors' whole-sequence standardisation with padding: "
                f"it needs standardise='sequence' (a bidirectional layer), got standardise={standardise!r}"
            )
        self.padding_rule = padding_rule
        width = self.qkv_dim  # Π reads a token's concatenated heads
        if projection == "mlp":
            hidden = width if projection_hidden is None else projection_hidden
            act: nn.Module = nn.GELU()
            if dropout_site == "projection":  # in the parameter-free slot: the same state_dict keys
                act = nn.Sequential(act, nn.Dropout(self.dropout / 2))
            self.slicer = nn.Sequential(nn.Linear(width, hidden), act, nn.Linear(hidden, num_heads))
        elif projection == "linear":  # no hidden layer: projection_hidden does not apply
            self.slicer = nn.Linear(width, num_heads)
        else:
            raise ValueError(f"projection must be 'mlp' or 'linear', got {projection!r}")
        self.projection = projection
        self.eps = eps

    def attend_scores(self, s, t, v, key_padding_mask):
        if self.padding_rule == "authors" and key_padding_mask is not None:
            o = authors_padded_sliced_relu(
                s, t, v, key_padding_mask, eps=self.eps, padded_queries=self.padded_queries, path=self.path
            )
            return self.output_dropout(o)
        if self.standardise == "sequence":
            s, t = standardise_scores(s, t, key_padding_mask)
        elif self.standardise == "prefix":
            s, t = standardise_scores_prefix(s, t, key_padding_mask)
        # scores stay in float32+
        o = sliced_relu_attention(
            s,
            t,
            v,
            key_padding_mask,
            eps=self.eps,
            causal=self.causal,
            padded_queries=self.padded_queries,
            path=self.path,
        )
        return self.output_dropout(o)


class SlicedReLUBumpAttention(SlicedAttentionLayer):
    """Sliced ReLU-bump attention: linear Π without bias, no standardisation, learned per-head bandwidth.

    `normaliser="count"` divides by the number of keys (the authors' code); `"mass"` (causal layers only)
    by the hat weight seen plus `mass_eps`, so that a causal output does not shrink like 1/position
    (`attnlab.attention.sliced.normaliser`). `path` as in `SlicedReLUAttention`. Causal layers decode
    with `step`. `dropout_site`:
    `"output"` drops the attention output at `dropout`; `"projection"` is the authors' bump layer,
    which has no dropout (its Π is linear).
    """

    name = "sliced_relu_bump"
    capabilities = Capabilities(causal=True, recurrent_step=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        normaliser: str = "count",
        mass_eps: float = 1e-2,
        dropout_site: str = "output",
        path: str = "auto",
        **common,
    ) -> None:
        super().__init__(dim, num_heads, **common)
        self.path = check_path(path)
        check_bump_normaliser("sliced_relu_bump", normaliser, mass_eps, self.causal)
        check_dropout_site(dropout_site)
        self.dropout_site = dropout_site
        self.normaliser, self.mass_eps = normaliser, mass_eps
        self.slicer = nn.Linear(self.qkv_dim, num_heads, bias=False)
        self.bandwidth_logit = nn.Parameter(torch.zeros(num_heads))  # θ_h; b_h = softplus(θ_h) + 1e-4

    @property
    def bandwidth(self) -> torch.Tensor:
        """Per-head hat width b_h = softplus(θ_h) + 1e-4 (> 0 so the kernel never degenerates)."""
        return F.softplus(self.bandwidth_logit) + 1e-4

    def attend_scores(self, s, t, v, key_padding_mask):
        o = sliced_relu_bump_attention(
            s,
            t,
            v,
            self.bandwidth,
            key_padding_mask,
            causal=self.causal,
            normaliser=self.normaliser,
            mass_eps=self.mass_eps,
            padded_queries=self.padded_queries,
            path=self.path,
        )
        return self.output_dropout(o)
