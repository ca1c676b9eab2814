"""What every dataset in attnlab agrees on: the example format, padding, length buckets, errors.

An example is a dict with ``input_ids`` (1-D LongTensor of token ids, 0 is always padding),
``label`` (int) and, for two-sequence tasks (Retrieval), ``input_ids2``. `pad_collate` turns a
list of examples into a batch with ``mask`` (bool, True = real token) next to each id tensor,
which is the ``key_padding_mask`` the attention layers take.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

PAD_ID = 0


class DataError(ValueError):
    """A data file is malformed; the message names the file (and line when there is one)."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path, self.line = Path(path), line


class MissingDataError(FileNotFoundError):
    """A dataset is absent; the message says where it was expected and how to obtain it."""

    def __init__(self, expected: str | Path, how_to_obtain: str):
        super().__init__(f"dataset not found at {expected}. {how_to_obtain}")
        self.expected = Path(expected)


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
        lengths = np.fromiter((len(s) for s in self.sequences), dtype=np.int64, count=len(self))
        if self.sequences2 is not None:
            lengths = np.maximum(lengths, [len(s) for s in self.sequences2])
        return lengths

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
    mask = torch.zeros((len(tensors), length), dtype=torch.bool)
    for row, tensor in enumerate(tensors):
        ids[row, : len(tensor)] = tensor
        mask[row, : len(tensor)] = True
    return ids, mask


def pad_collate(batch: list[dict], pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Pad a list of examples to the longest one; ``mask`` is True on real tokens."""
    ids, mask = _pad([ex["input_ids"] for ex in batch], pad_to_multiple_of)
    out = {"input_ids": ids, "mask": mask, "labels": torch.tensor([ex["label"] for ex in batch])}
    if "input_ids2" in batch[0]:
        out["input_ids2"], out["mask2"] = _pad([ex["input_ids2"] for ex in batch], pad_to_multiple_of)
    return out


class LengthBucketSampler(Sampler[list[int]]):
    """Batches of similar lengths, so padding wastes little compute.

    Shuffles, cuts the shuffled order into pools of ``pool_batches`` batches, sorts each pool by
    length, cuts it into batches and shuffles the batches. Deterministic given ``seed`` and the
    epoch (`set_epoch`), and shardable across DDP ranks (``num_replicas``, ``rank``).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        pool_batches: int = 50,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths = np.asarray(lengths)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.pool_batches, self.drop_last = pool_batches, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        rng = random.Random(self.seed + 1_000_003 * self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        pool = self.batch_size * self.pool_batches
        batches = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start : start + pool], key=lambda i: self.lengths[i])
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        if self.shuffle:
            rng.shuffle(batches)
        # every rank gets the same number of batches (DDP needs equal step counts)
        per_rank = len(batches) // self.num_replicas if self.num_replicas > 1 else len(batches)
        return batches[self.rank :: self.num_replicas][:per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())
