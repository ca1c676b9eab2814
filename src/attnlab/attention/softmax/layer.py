"""The softmax layer: SDPA inside the shared skeleton (`attnlab.attention.common.layer`)."""

from __future__ import annotations

from attnlab.attention.common.layer import AttentionLayer, Capabilities
from attnlab.attention.common.padding import PADDED_QUERIES
from attnlab.attention.softmax.ops import softmax_attention, softmax_attention_segments


class SoftmaxAttention(AttentionLayer):
    """Standard multi-head attention via SDPA; `dropout` drops attention weights."""

    name = "softmax"
    capabilities = Capabilities(causal=True, recurrent_step=True)  # decodes with a KV cache
    attends_packed_rows = True
    padded_query_modes = PADDED_QUERIES  # with LRA's rule (attnlab.attention.common.padding)

    def forward_packed(self, x, key_padding_mask, packing):
        """A packed batch attended in its rows, with a block-diagonal mask
        (`softmax_attention_segments`): no sequence is laid out alone."""
        self.check_packed_input(x, key_padding_mask, packing)
        q, k, v = self.split_heads(self.qkv(x), positions=packing.positions)
        p = self.dropout if self.training else 0.0
        o = softmax_attention_segments(q, k, v, packing.segments, self.causal, dropout_p=p)
        return self.out_proj(self.merge(o))

    def attend(self, q, k, v, key_padding_mask):
        p = self.dropout if self.training else 0.0
        return softmax_attention(
            q, k, v, key_padding_mask, causal=self.causal, dropout_p=p, padded_queries=self.padded_queries
        )
