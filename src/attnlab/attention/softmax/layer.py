"""The softmax layer: SDPA inside the shared skeleton (`attnlab.attention.common.layer`)."""

from __future__ import annotations

from attnlab.attention.common.layer import AttentionLayer, Capabilities
from attnlab.attention.common.padding import PADDED_QUERIES
from attnlab.attention.softmax.ops import softmax_attention


class SoftmaxAttention(AttentionLayer):
    """Standard multi-head attention via SDPA; `dropout` drops attention weights."""

    name = "softmax"
    capabilities = Capabilities(causal=True, recurrent_step=True)  # decodes with a KV cache
    padded_query_modes = PADDED_QUERIES  # with LRA's rule (attnlab.attention.common.padding)

    def attend(self, q, k, v, key_padding_mask):
        p = self.dropout if self.training else 0.0
        return softmax_attention(
            q, k, v, key_padding_mask, causal=self.causal, dropout_p=p, padded_queries=self.padded_queries
        )
