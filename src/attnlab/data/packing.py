"""Packed batches (``task.data.packing=true``): each batch's sequences laid end to end in rows.

The batch is the same set of examples the sampler draws without packing (so a run sees the same
examples in the same steps, and its loss is the same mean), only laid out in fewer, fuller rows:
first-fit decreasing into rows as long as the batch's longest sequence (or ``pack_length``), no
sequence split. The model runs its per-token work on the rows and attention within each sequence
(`attnlab.attention.PackedLayout`), so each example's output is what it is in a padded batch.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Sequence

import torch

from attnlab.attention.common.packing import PackedLayout, first_fit
from attnlab.data.examples import PAD_ID
from attnlab.data.samplers import LengthBucketSampler

log = logging.getLogger(__name__)


def check_packing(packing: object, pack_length: object) -> None:
    """``packing`` a real bool; ``pack_length`` null or a positive number of tokens."""
    if not isinstance(packing, bool):
        raise ValueError(f"task.data.packing must be true or false, got {packing!r}")
    if pack_length is not None and (
        not isinstance(pack_length, numbers.Integral) or isinstance(pack_length, bool) or pack_length < 1
    ):
        raise ValueError(
            f"task.data.pack_length must be a positive number of tokens or null (the batch's longest "
            f"sequence), got {pack_length!r}"
        )


def _row_length(lengths: Sequence[int], pad_to_multiple_of: int, pack_length: int | None) -> int:
    capacity = max(pack_length or 0, max(lengths))
    return math.ceil(capacity / pad_to_multiple_of) * pad_to_multiple_of


def pack_sequences(
    tensors: list[torch.Tensor],
    pad_to_multiple_of: int = 1,
    row_length: int | None = None,
    pad_id: int = PAD_ID,
) -> dict[str, torch.Tensor]:
    """Sequences laid end to end in rows (first-fit decreasing, none split) of ``row_length`` tokens
    (default: the longest sequence), rounded up to ``pad_to_multiple_of``, empty slots ``pad_id``:
    ``input_ids``, ``mask`` (True on the slots a sequence fills) and the layout's keys."""
    lengths = [len(t) for t in tensors]
    for n, tensor in enumerate(tensors):
        if len(tensor) == 0 or bool((tensor == pad_id).any()):
            raise ValueError(
                f"sequence {n} of the batch is empty or holds the padding id {pad_id} inside it: a packed "
                "row has no mask inside a sequence (pixel tasks: set task.data.zero_pixels=token), or "
                "set task.data.packing=false"
            )
    capacity = _row_length(lengths, pad_to_multiple_of, row_length)
    rows = first_fit(lengths, capacity)
    layout = PackedLayout.from_rows(lengths, rows, capacity)
    ids = torch.full((len(rows), capacity), pad_id, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : sum(lengths[n] for n in row)] = torch.cat([tensors[n] for n in row])
    return {"input_ids": ids, "mask": layout.row_mask, **layout.batch_items()}


def pack_collate(
    batch: list[dict], pad_to_multiple_of: int = 1, row_length: int | None = None
) -> dict[str, torch.Tensor]:
    """A packed batch (`attnlab.attention.PackedLayout`): the examples' sequences end to end in as few
    rows as first-fit finds, labels in the examples' order, and each side of a pair packed on its own
    (``input_ids2``, ``mask2`` and the layout keys with suffix 2)."""
    out = pack_sequences([ex["input_ids"] for ex in batch], pad_to_multiple_of, row_length)
    out["labels"] = torch.tensor([ex["label"] for ex in batch])
    if "input_ids2" in batch[0]:
        second = pack_sequences([ex["input_ids2"] for ex in batch], pad_to_multiple_of, row_length)
        out.update({key + "2": value for key, value in second.items()})
    return out


def document_layout(ids: torch.Tensor, eos_id: int, pad_id: int) -> PackedLayout:
    """The layout of a batch of stream blocks (B, T) whose documents attend only within themselves:
    a new sequence starts after each ``eos_id``; trailing ``pad_id`` slots hold none. The rows stay as
    they are (already full), so outputs and targets keep their (B, T) places."""
    lengths, rows = [], []
    for block in ids.tolist():
        real = len(block)
        while real > 0 and block[real - 1] == pad_id:
            real -= 1
        ends = [i + 1 for i in range(real - 1) if block[i] == eos_id] + [real]
        starts = [0, *ends[:-1]]
        rows.append(list(range(len(lengths), len(lengths) + len(ends))))
        lengths += [end - start for start, end in zip(starts, ends, strict=True)]
    return PackedLayout.from_rows(lengths, rows, ids.shape[1])


def packing_fill(
    batches: Iterable[Sequence[int]],
    sides: Sequence[Sequence[int]],
    pad_to_multiple_of: int,
    pack_length: int | None,
) -> tuple[float, float]:
    """(packed, padded): the share of row slots real tokens fill over ``batches`` (lists of example
    indices), packed as `pack_collate` packs them and padded to each batch's longest as without packing.
    ``sides``: the examples' lengths, one sequence of them per side (two for a pair task, each side
    packed on its own)."""
    real = packed = padded = 0
    for lengths in sides:
        for batch in batches:
            sizes = [int(lengths[i]) for i in batch]
            row = _row_length(sizes, pad_to_multiple_of, pack_length)
            real += sum(sizes)
            packed += len(first_fit(sizes, row)) * row
            padded += len(sizes) * _row_length(sizes, pad_to_multiple_of, None)
    return real / max(packed, 1), real / max(padded, 1)


def log_packing_fill(
    batch_sampler: LengthBucketSampler,
    sides: Sequence[Sequence[int]],
    pad_to_multiple_of: int,
    pack_length: int | None,
) -> float:
    """Log how full the packed rows of an epoch are, beside the padded batches' fill; return the former."""
    batches = batch_sampler.epoch_batches()
    packed, padded = packing_fill(batches, sides, pad_to_multiple_of, pack_length)
    log.info(
        "packing: rows %.1f%% real tokens over %d training batches (padded batches would be %.1f%%)",
        100 * packed,
        len(batches),
        100 * padded,
    )
    return packed
