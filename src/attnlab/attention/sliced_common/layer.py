"""What both sliced layers share: Π maps q and k to one score per head, then the family's op runs on
the scores."""

from __future__ import annotations

import torch
from torch import nn

from attnlab.attention.common.layer import AttentionLayer
from attnlab.attention.common.packing import PackedLayout
from attnlab.attention.common.precision import accumulation_dtype
from attnlab.attention.sliced_common.path import crossover
from attnlab.attention.sliced_common.scores import (
    check_score_layout,
    first_map,
    fold_rotated_scores,
    fold_scores,
    slice_tokens,
)

#: How many times more slots each sequence laid out alone (N·M) must take than the packed rows (B·L)
#: for the layer to take the op on the rows: chosen between measurements (docs/benchmarks.md, "CPU:
#: packed batches"), where the rows won at 1.9x and 3.2x fewer slots and lost on ListOps' full rows.
ROWS_PAY_FROM = 1.5


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
    kernel: str  # "relu" or "bump": the kernel's name in `attnlab.attention.sliced_common.path`

    def __init__(self, dim: int, num_heads: int, *, score_layout: str = "token", **common) -> None:
        super().__init__(dim, num_heads, **common)
        check_score_layout(score_layout, self.causal)
        self.score_layout = score_layout

    def packing_refusal(self) -> str | None:
        """Why this layer cannot read a packed batch, or None when it can."""
        if self.score_layout == "token":
            return None
        return (
            f"score_layout={self.score_layout!r} cannot read a packed batch: its Π rows mix neighbouring "
            "tokens, padding included, so its output depends on the padding a packed batch does not have"
        )

    def fold(self, batch: int, packed: bool = False) -> str | None:
        """How `forward` (``packed``: `forward_packed`) computes the scores of a batch: ``"plain"``
        (`fold_scores`), ``"rotated"`` (`fold_rotated_scores`) or None (q and k, then Π). When folded,
        the projection's and Π's first Linear modules are not called, their weights are read
        (`attnlab.flops` counts what runs)."""
        if self.score_layout != "token":
            return None
        if self.rotary is None:
            return "plain"
        return "rotated" if not packed and batch > first_map(self.slicer)[0].out_features else None

    def folded_flops(self, batch: int, length: int, packed: bool = False) -> float:
        """Forward FLOPs of the fold `fold(batch, packed)` names (0 for None), matmuls only."""
        out, width, dim = first_map(self.slicer)[0].out_features, self.qkv_dim, self.dim
        kind = self.fold(batch, packed)
        if kind == "plain":  # A·W_q and A·W_k, then one dim → 2·out + width map per token
            return 2.0 * (2 * out * width * dim + batch * length * dim * (2 * out + width))
        if kind == "rotated":  # (A R_t)·W_q and ·W_k per position, then per token dim → 2·out and → width
            return 2.0 * (2 * length * out * width * dim + batch * length * dim * (2 * out + width))
        return 0.0

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        kind = self.fold(x.shape[0]) if x.dim() == 3 and packing is None else None
        if kind is None:
            return super().forward(x, key_padding_mask, packing)
        self.check_input(x, key_padding_mask)
        if kind == "plain":
            s, t, v = fold_scores(self.qkv, self.slicer, self.num_heads, x)
        else:
            s, t, v = fold_rotated_scores(self.qkv, self.slicer, self.rotary, self.num_heads, x)
        return self.out_proj(self.merge(self.attend_scores(s, t, v, key_padding_mask)))

    def forward_packed(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, packing: PackedLayout
    ) -> torch.Tensor:
        """A packed batch: the projection, RoPE and Π run on the packed tokens (folded as `forward`
        folds without RoPE). Where `attends_packed`, the op runs on the packed rows
        (`attend_segments`); elsewhere the scores and values are laid out one sequence per row for
        the padded op. Standardisation and centring are per sequence either way."""
        refusal = self.packing_refusal()
        if refusal:
            raise ValueError(f"{refusal}; set task.data.packing=false or score_layout=token")
        self.check_packed_input(x, key_padding_mask, packing)
        if self.fold(x.shape[0], packed=True) == "plain":
            s, t, v = fold_scores(self.qkv, self.slicer, self.num_heads, x)
        else:
            q, k, v = self.split_heads(self.qkv(x), positions=packing.positions)
            s, t = slice_tokens(self.slicer, q), slice_tokens(self.slicer, k)
        if self.attends_packed(x, packing):
            return self.out_proj(self.merge(self.attend_segments(s, t, v, packing.segments)))
        s, t, v = (packing.unpack_heads(y) for y in (s, t, v))
        return self.out_proj(packing.pack(self.merge(self.attend_scores(s, t, v, packing.mask))))

    def attends_packed(self, x: torch.Tensor, packing: PackedLayout) -> bool:
        """On the rows where the layer can (`attends_packed_rows`) and it pays: the rows hold at most
        1 / `ROWS_PAY_FROM` of the slots of each sequence laid out alone (the op on rows costs more
        per slot than the padded op: its sort is by sequence and score), and ``path="auto"`` does
        not take the dense evaluation at the rows' length (there each sequence laid out alone and
        evaluated densely is faster; its length is at most the rows')."""
        if not self.attends_packed_rows:
            return False
        kernel = f"causal_{self.kernel}" if self.causal else self.kernel
        dense_up_to = crossover(kernel, x.device, accumulation_dtype(x.dtype))
        if self.path == "auto" and x.shape[1] <= dense_up_to:
            return False
        return packing.unpack_index.numel() >= ROWS_PAY_FROM * packing.pack_index.numel()

    def attend(self, q, k, v, key_padding_mask):
        s = slice_tokens(self.slicer, q, self.score_layout)
        t = slice_tokens(self.slicer, k, self.score_layout)
        return self.attend_scores(s, t, v, key_padding_mask)

    def attend_scores(self, s, t, v, key_padding_mask):
        raise NotImplementedError(f"{type(self).__name__} must implement attend_scores()")

    def attend_segments(self, s, t, v, segments):
        """The op on packed rows (scores (B, H, L), ``segments`` (B, L)), where `attends_packed`."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend_segments()")
