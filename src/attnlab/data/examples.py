"""What every dataset in attnlab agrees on: the example format, padding, and what pixel 0 is.

An example is a dict with ``input_ids`` (1-D LongTensor of token ids, 0 is always padding),
``label`` (int) and, for two-sequence tasks (Retrieval), ``input_ids2``. `pad_collate` turns a
list of examples into a batch with ``mask`` (bool, True = real token) next to each id tensor,
which is the ``key_padding_mask`` the attention layers take. Id 0 is masked wherever it stands,
inside a sequence too: that is how ``zero_pixels="padding"`` keeps black pixels out of attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.errors import check_choice

PAD_ID = 0
#: What pixel value 0 is in Image / Pathfinder / Path-X. ``padding``: LRA's rule; the pixel value is
#: the token, so black pixels are id 0 and masked out of attention (LRA's encoder masks ``inputs > 0``).
#: ``token``: every pixel is a real token, ``pixel + 1``, attended like any other.
ZERO_PIXELS = ("padding", "token")


def pixel_offset(zero_pixels: str) -> int:
    """What is added to a pixel value to make its token id under the ``zero_pixels`` rule."""
    check_choice("zero_pixels", zero_pixels, ZERO_PIXELS)
    return 0 if zero_pixels == "padding" else 1


def describe_zero_pixels(zero_pixels: str) -> str:
    """The rule in words, for ``data_source``."""
    if zero_pixels == "padding":
        return "pixel 0 = padding (black pixels masked out of attention, as LRA's inputs > 0)"
    return "pixel 0 = token (tokens are pixel + 1; every pixel attended)"


class TokenSequenceDataset(Dataset):
    """In-memory token sequences (compact numpy arrays) with integer labels.

    ``sequences2`` is given for two-sequence tasks and becomes ``input_ids2``.
    """

    def __init__(
        self,
        sequences: Sequence[np.ndarray],
        labels: Sequence[int],
        sequences2: Sequence[np.ndarray] | None = None,
    ):
        if len(sequences) != len(labels):
            raise ValueError(f"{len(sequences)} sequences but {len(labels)} labels")
        if sequences2 is not None and len(sequences2) != len(sequences):
            raise ValueError(f"{len(sequences)} first sequences but {len(sequences2)} second ones")
        self.sequences, self.sequences2 = list(sequences), sequences2
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sequences)

    def lengths(self) -> np.ndarray:
        """Token count of each example (the longer of the pair), for length-bucketed batching."""
        return np.max(self.side_lengths(), axis=0)

    def side_lengths(self) -> list[np.ndarray]:
        """Token count of each example's sequence, one array per side (two for a pair)."""
        sides = [self.sequences] if self.sequences2 is None else [self.sequences, self.sequences2]
        return [np.fromiter((len(s) for s in side), dtype=np.int64, count=len(self)) for side in sides]

    def __getitem__(self, index: int) -> dict:
        example = {
            "input_ids": torch.as_tensor(np.asarray(self.sequences[index], dtype=np.int64)),
            "label": int(self.labels[index]),
        }
        if self.sequences2 is not None:
            example["input_ids2"] = torch.as_tensor(np.asarray(self.sequences2[index], dtype=np.int64))
        return example


def _pad(tensors: list[torch.Tensor], pad_to_multiple_of: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(1, max(len(t) for t in tensors))
    length = math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(tensors), length), PAD_ID, dtype=torch.long)
    for row, tensor in enumerate(tensors):
        ids[row, : len(tensor)] = tensor
    mask = ids != PAD_ID  # 0 is padding wherever it stands (black pixels under zero_pixels=padding)
    return ids, mask


def pad_collate(batch: list[dict], pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Pad a list of examples to the longest one; ``mask`` is True on real tokens."""
    ids, mask = _pad([ex["input_ids"] for ex in batch], pad_to_multiple_of)
    out = {"input_ids": ids, "mask": mask, "labels": torch.tensor([ex["label"] for ex in batch])}
    if "input_ids2" in batch[0]:
        out["input_ids2"], out["mask2"] = _pad([ex["input_ids2"] for ex in batch], pad_to_multiple_of)
    return out
