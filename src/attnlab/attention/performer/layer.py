"""The Performer (FAVOR+) layer: random features redrawn during training, inside the shared skeleton."""

from __future__ import annotations

from attnlab.attention.common.layer import AttentionLayer, Capabilities, check_int, check_number
from attnlab.attention.linear.chunked import DEFAULT_CHUNK_SIZE
from attnlab.attention.performer.ops import PerformerFeatureMap, performer_attention
from attnlab.attention.performer.segments import performer_attention_segments


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

    @property
    def attends_packed_rows(self) -> bool:
        return self.causal

    def forward_packed(self, x, key_padding_mask, packing):
        """A causal packed batch attended in its rows, each query summing only its own sequence's keys
        with its own sequence's running stabiliser (`performer_attention_segments`). Non-causal: each
        sequence alone, as for linear attention (its two matmuls cost less than the rows' chunked
        sums run both ways)."""
        if not self.causal:
            return super().forward_packed(x, key_padding_mask, packing)
        self.check_packed_input(x, key_padding_mask, packing)
        q, k, v = self.split_heads(self.qkv(x), positions=packing.positions)
        o = performer_attention_segments(
            q,
            k,
            v,
            self.feature_map(),
            packing.segments,
            causal=True,
            eps=self.eps,
            chunk_size=self.chunk_size,
        )
        return self.out_proj(self.merge(self.output_dropout(o)))

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
