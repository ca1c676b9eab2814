"""The sliced ReLU layer: Π (MLP or linear), score standardisation, then `sliced_relu_attention`."""

from __future__ import annotations

from torch import nn

from attnlab.attention.common.layer import Capabilities, check_dropout_site, check_int, check_number
from attnlab.attention.sliced_common.layer import SlicedAttentionLayer
from attnlab.attention.sliced_common.path import check_path
from attnlab.attention.sliced_common.scores import standardise_scores, standardise_scores_prefix
from attnlab.attention.sliced_common.segments import (
    standardise_scores_prefix_segments,
    standardise_scores_segments,
)
from attnlab.attention.sliced_relu.authors import PADDING_RULES, authors_padded_sliced_relu
from attnlab.attention.sliced_relu.ops import sliced_relu_attention
from attnlab.attention.sliced_relu.segments import sliced_relu_attention_segments

STANDARDISE = ("auto", "sequence", "prefix", "none")


class SlicedReLUAttention(SlicedAttentionLayer):
    """Sliced ReLU attention (docs/attention.md): Π maps each token's concatenated heads to a score per head.

    `projection="mlp"` is H·D -> H·D -> H with GELU, `"linear"` is H·D -> H. The same Π maps q to s and
    k to t, which are then standardised per sequence and head over valid tokens: `standardise="sequence"`
    with one mean and std over the whole sequence (`standardise_scores`), `"prefix"` with the running
    statistics of tokens j <= i (`standardise_scores_prefix`, sees no future), `"none"` not at all;
    `"auto"` is "prefix" for a causal layer and "sequence" otherwise. `path` chooses the evaluation of
    the kernel (`attnlab.attention.sliced_common.path`: "auto", dense O(T²) at short T; "dense"; "sorted"):
    the same function, a speed choice. Causal layers decode with `step`.

    `projection_hidden` is the MLP's hidden width (null: H·D, the authors' choice; a linear Π has
    none and ignores it). `dropout_site`:
    `"output"` (attnlab's default) drops the attention output at `dropout`; `"projection"` is the
    authors' placement (SiwanB/Sliced_ReLU_Attention): dropout at `dropout / 2` after the MLP's GELU,
    none on the output (a linear Π then has no dropout at all).

    `padding_rule`: ``"invariant"`` (default) makes padding change nothing at real positions (every
    statistic over real tokens); ``"authors"`` is the authors' code with a padding mask
    (`attnlab.attention.sliced_relu.authors`), whose real outputs move with the amount of padding; it
    needs the whole-sequence standardisation (`standardise="sequence"`, bidirectional layers).
    """

    name = "sliced_relu"
    kernel = "relu"
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

    @property
    def attends_packed_rows(self) -> bool:
        """Layers attend on packed rows (`sliced_relu_attention_segments`, sorted, causal or not);
        `path="dense"` and the authors' padding rule lay each sequence out alone."""
        return self.path != "dense" and self.padding_rule != "authors"

    def attend_segments(self, s, t, v, segments):
        if self.standardise == "sequence":
            s, t = standardise_scores_segments(s, t, segments)
        elif self.standardise == "prefix":
            s, t = standardise_scores_prefix_segments(s, t, segments)
        o = sliced_relu_attention_segments(s, t, v, segments, eps=self.eps, causal=self.causal)
        return self.output_dropout(o)

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
