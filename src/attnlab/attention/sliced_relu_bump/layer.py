"""The sliced ReLU-bump layer: linear Π without bias, learned per-head bandwidth, then
`sliced_relu_bump_attention`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention.common.layer import Capabilities, check_dropout_site
from attnlab.attention.sliced_common.layer import SlicedAttentionLayer
from attnlab.attention.sliced_common.path import check_path
from attnlab.attention.sliced_relu_bump.normaliser import check_bump_normaliser
from attnlab.attention.sliced_relu_bump.ops import sliced_relu_bump_attention
from attnlab.attention.sliced_relu_bump.segments import sliced_relu_bump_attention_segments


class SlicedReLUBumpAttention(SlicedAttentionLayer):
    """Sliced ReLU-bump attention: linear Π without bias, no standardisation, learned per-head bandwidth.

    `normaliser="count"` divides by the number of keys (the authors' code); `"mass"` (causal layers only)
    by the hat weight seen plus `mass_eps`, so that a causal output does not shrink like 1/position
    (`attnlab.attention.sliced_relu_bump.normaliser`). `path` as in `SlicedReLUAttention`. Causal
    layers decode with `step`. `dropout_site`:
    `"output"` drops the attention output at `dropout`; `"projection"` is the authors' bump layer,
    which has no dropout (its Π is linear).
    """

    name = "sliced_relu_bump"
    kernel = "bump"
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

    @property
    def attends_packed_rows(self) -> bool:
        """Layers attend on packed rows (`sliced_relu_bump_attention_segments`, sorted, causal or not);
        `path="dense"` lays each sequence out alone."""
        return self.path != "dense"

    def attend_segments(self, s, t, v, segments):
        o = sliced_relu_bump_attention_segments(
            s, t, v, self.bandwidth, segments, self.causal, self.normaliser, self.mass_eps
        )
        return self.output_dropout(o)

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
