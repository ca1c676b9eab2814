"""Packed batches: whole sequences laid end to end in rows, and the gathers between the packed
layout and the per-sequence one.

A packed batch holds N sequences in B rows of L tokens (no sequence split across rows). Per-token
work (embeddings, projections, MLPs, norms) runs on the packed rows, so none of it is spent on the
padding a batch of N rows of the longest length would carry. Attention and every per-sequence
statistic run on the sequences one by one, laid out as (N, M) with M the longest sequence, through
`PackedLayout.unpack`, and return through `PackedLayout.pack`: a packed batch gives each sequence
exactly what it gets alone, for every backend, because the attention code is the padded code.

Both directions are one gather on indices the collate builds on the host (`PackedLayout.from_rows`),
so a model never reads a size back from the device: no host synchronisation, and nothing for
`torch.compile` to specialise on beyond the tensors' shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: The batch keys a packed batch carries (`PackedLayout.from_batch` reads them).
LAYOUT_KEYS = ("unpack_index", "pack_index", "positions")


@dataclass(frozen=True)
class PackedLayout:
    """Where each sequence's tokens sit in the packed rows.

    ``unpack_index`` (N, M): for token m of sequence n, its flat index into the B·L packed slots;
    B·L where sequence n is shorter than m + 1 (it reads a zero row). ``pack_index`` (B, L): for each
    packed slot, the flat index of its token in the N·M layout; N·M on slots no sequence fills.
    ``positions`` (B, L): each token's position in its own sequence (0 on empty slots), for
    position embeddings.
    """

    unpack_index: torch.Tensor
    pack_index: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def from_rows(
        cls, lengths: Sequence[int], rows: Sequence[Sequence[int]], row_length: int | None = None
    ) -> PackedLayout:
        """Sequence n has ``lengths[n]`` tokens; row r holds the sequences ``rows[r]``, end to end in
        that order (`first_fit` makes such rows). Sequence n stays sequence n of the unpacked layout,
        so labels keep the batch's order. ``row_length`` (default: the fullest row) may leave room."""
        lengths = [int(n) for n in lengths]
        placed = sorted(i for row in rows for i in row)
        if placed != list(range(len(lengths))):
            raise ValueError(f"rows {list(rows)} must place each of the {len(lengths)} sequences once")
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a packed batch needs sequences of length >= 1; got lengths {lengths}")
        fullest = max(sum(lengths[i] for i in row) for row in rows)
        row_length = fullest if row_length is None else row_length
        if row_length < fullest:
            raise ValueError(f"row_length={row_length} is shorter than the fullest row ({fullest} tokens)")
        slots, longest = len(rows) * row_length, max(lengths)
        unpack_index = torch.full((len(lengths), longest), slots, dtype=torch.long)
        pack_index = torch.full((len(rows), row_length), len(lengths) * longest, dtype=torch.long)
        positions = torch.zeros(len(rows), row_length, dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for n in row:
                length = lengths[n]
                span = torch.arange(length)
                unpack_index[n, :length] = r * row_length + start + span
                pack_index[r, start : start + length] = n * longest + span
                positions[r, start : start + length] = span
                start += length
        return cls(unpack_index, pack_index, positions)

    @classmethod
    def from_batch(cls, batch: dict[str, torch.Tensor], suffix: str = "") -> PackedLayout | None:
        """The layout a collated batch carries (keys `LAYOUT_KEYS`, each + ``suffix`` for the second
        sequence of a pair), or None for a padded batch."""
        if "pack_index" + suffix not in batch:
            return None
        return cls(*(batch[key + suffix] for key in LAYOUT_KEYS))

    def batch_items(self, suffix: str = "") -> dict[str, torch.Tensor]:
        """The layout as batch entries (what a collate returns beside the packed ids)."""
        return {key + suffix: getattr(self, key) for key in LAYOUT_KEYS}

    @property
    def num_sequences(self) -> int:
        return self.unpack_index.shape[0]

    @property
    def mask(self) -> torch.Tensor:
        """(N, M) bool, True on real tokens: the key padding mask of the unpacked layout."""
        return self.unpack_index < self.pack_index.numel()

    @property
    def row_mask(self) -> torch.Tensor:
        """(B, L) bool, True on the slots a sequence fills."""
        return self.pack_index < self.unpack_index.numel()

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) packed -> (N, M, ...) one sequence per row, zeros after each sequence's end."""
        flat = x.reshape(self.pack_index.numel(), *x.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *x.shape[2:])])
        return flat.index_select(0, self.unpack_index.flatten()).view(*self.unpack_index.shape, *x.shape[2:])

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """(N, M, ...) one sequence per row -> (B, L, ...) packed, zeros on empty slots."""
        flat = y.reshape(self.unpack_index.numel(), *y.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *y.shape[2:])])
        return flat.index_select(0, self.pack_index.flatten()).view(*self.pack_index.shape, *y.shape[2:])

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, D) packed -> (N, D): the mean over each sequence's tokens (a pooled representation)."""
        weights = self.mask.unsqueeze(-1).to(x.dtype)
        return (self.unpack(x) * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    @property
    def segments(self) -> torch.Tensor:
        """(B, L) int64: the sequence each packed slot belongs to (N on empty slots, which form one more
        segment per row): what a block-diagonal attention mask compares."""
        return torch.div(self.pack_index, self.unpack_index.shape[1], rounding_mode="floor")

    def unpack_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, L, ...) packed per head -> (N, H, M, ...): q, k, v or scores of the attention ops."""
        return self.unpack(x.transpose(1, 2)).transpose(1, 2)

    def check(self, x: torch.Tensor, mask: torch.Tensor | None = None, mask_name: str = "mask") -> None:
        """``x`` must be packed in this layout: (B, L, ...) with the layout's B and L, and come with no
        ``mask`` (``mask_name``: what the caller calls it): the layout is the mask."""
        if mask is not None:
            raise ValueError(
                f"a packed batch masks through its layout: pass packing or {mask_name}, not both"
            )
        if tuple(x.shape[:2]) != tuple(self.pack_index.shape):
            raise ValueError(
                f"a packed input must have (B, L) = {tuple(self.pack_index.shape)} of its layout; "
                f"got shape {tuple(x.shape)}"
            )


def check_segments(segments: torch.Tensor, q: torch.Tensor) -> None:
    """``segments`` is (B, L) for q of shape (B, H, L, D): the ops on packed rows name the shape."""
    want = (q.shape[0], q.shape[2])
    if tuple(segments.shape) != want:
        raise ValueError(f"segments must be (B, L) = {want}, got {tuple(segments.shape)}")


def run_ids(segments: torch.Tensor) -> torch.Tensor:
    """Each slot's run within its row (B, L): 0, 1, ... counting every change of ``segments``' id, so
    equal run ids mean one contiguous segment. The ops accept ids that only differ between
    neighbouring segments (an id may come back later in the row); comparing raw ids would join
    two segments that share one."""
    change = torch.ones_like(segments, dtype=torch.long)
    change[:, 0] = 0
    change[:, 1:] = (segments[:, 1:] != segments[:, :-1]).long()
    return change.cumsum(1)


def segment_mask(runs: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, L, L) bool, the pairs (query i, key j) of one run (`run_ids`), and ``j <= i`` when
    ``causal``: the block-diagonal mask of attention on packed rows."""
    allowed = runs[:, :, None] == runs[:, None, :]
    return allowed & torch.ones_like(allowed[0]).tril() if causal else allowed


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``capacity`` tokens: first-fit decreasing
    (longest first, each into the first row with room), no sequence split. Rows come out in the order
    they were opened, each listing its sequences longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"a sequence of {n} tokens does not fit in a packed row of {capacity}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return rows
