"""One LightningDataModule for every token-sequence task; the task's data comes from a *source*.

A source knows one dataset family (ListOps, Pathfinder, ...): ``prepare()`` generates or checks
files (run once per node, before training), ``load(on_bad_rows=...)`` returns the
``train``/``val``/``test`` datasets, and ``description`` says which files or generator fed the run
(logged, and written to ``summary.json`` as ``data_source``). This module holds the reading policies
the config sets (``on_bad_rows``: a malformed row stops the run, or is skipped and counted;
``zero_pixels``, for sources with ``reads_pixels``: is pixel value 0 padding, as in LRA, or a token)
and batches: length buckets for training, length-sorted batches for evaluation, padding masks
everywhere, or (``packing=true``) each batch's sequences packed end to end in rows
(`attnlab.data.packing`).
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from attnlab.data.errors import ON_BAD_ROWS, DataError, check_choice
from attnlab.data.examples import ZERO_PIXELS, TokenSequenceDataset, pad_collate
from attnlab.data.loaders import SPLITS, ShardedDataModule
from attnlab.data.packing import check_packing, pack_collate

log = logging.getLogger(__name__)


class DataSource(Protocol):
    name: str
    vocab_size: int

    def prepare(self) -> None: ...

    def load(self, on_bad_rows: str = "error") -> dict[str, TokenSequenceDataset]: ...

    @property
    def description(self) -> str: ...


class SequenceDataModule(ShardedDataModule):
    def __init__(
        self,
        source: DataSource,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        bucket_by_length: bool = True,
        pad_to_multiple_of: int = 1,
        seed: int = 0,
        on_bad_rows: str = "error",
        zero_pixels: str | None = None,
        packing: bool = False,
        pack_length: int | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_packing(packing, pack_length)
        check_choice("task.data.on_bad_rows", on_bad_rows, ON_BAD_ROWS)
        if zero_pixels is not None:
            check_choice("task.data.zero_pixels", zero_pixels, ZERO_PIXELS)
            if not getattr(source, "reads_pixels", False):
                raise ValueError(
                    f"task.data.zero_pixels applies to pixel tasks (image, pathfinder, pathx); the "
                    f"{source.name!r} source reads no pixels: remove zero_pixels={zero_pixels!r}"
                )
        self.source, self.on_bad_rows, self.zero_pixels = source, on_bad_rows, zero_pixels
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.bucket_by_length = num_workers, bucket_by_length
        self.pad_to_multiple_of, self.seed = pad_to_multiple_of, seed
        self.packing, self.pack_length = packing, pack_length
        self.datasets: dict[str, TokenSequenceDataset] = {}

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        policies = {"on_bad_rows": self.on_bad_rows}
        if self.zero_pixels is not None:  # else the source's own default
            policies["zero_pixels"] = self.zero_pixels
        self.datasets = self.source.load(**policies)
        missing = [s for s in SPLITS if s not in self.datasets]
        if missing:
            raise ValueError(f"data source {self.source.name!r} returned no {', '.join(missing)} split")
        empty = [s for s in SPLITS if len(self.datasets[s]) == 0]
        if empty:  # the sources check their files; this catches any source that does not
            raise DataError(self.source.description, f"the {', '.join(empty)} split is empty")
        sizes = ", ".join(f"{s} {len(self.datasets[s]):,}" for s in SPLITS)
        log.info("data: %s (%s)", self.source.description, sizes)

    def model_kwargs(self) -> dict[str, int]:
        """What the model is built with from the data (the pipeline passes it to ``task.model``)."""
        return {"vocab_size": self.source.vocab_size}

    def majority_baseline(self, split: str = "test") -> float:
        """Accuracy of always predicting the most frequent label of ``split``."""
        self.setup()
        labels = self.datasets[split].labels
        return float(np.bincount(labels).max() / len(labels))

    def max_length(self, split: str = "train") -> int:
        self.setup()
        return int(self.datasets[split].lengths().max())

    def _collate(self, batch):
        if self.packing:
            return pack_collate(batch, self.pad_to_multiple_of, self.pack_length)
        return pad_collate(batch, self.pad_to_multiple_of)

    def train_lengths(self) -> np.ndarray:
        return self.datasets["train"].lengths()

    def packed_sides(self) -> list[np.ndarray]:
        return self.datasets["train"].side_lengths()

    @property
    def pool_batches(self) -> int:
        return 50 if self.bucket_by_length else 1

    @property
    def train_items(self) -> str:
        return f"{self.source.name} examples"

    def eval_order(self, split: str) -> np.ndarray:
        return np.argsort(self.datasets[split].lengths(), kind="stable")  # length-sorted: little padding
