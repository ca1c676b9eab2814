"""What the masked-LM and causal-LM datamodules share: a `TextCorpus` cut into fixed-length blocks.

Both tasks read the same prepared files (`attnlab.data.text_corpus.TextCorpus`: tokenizer and token
streams under ``<data_dir>/mlm/<corpus>/``), batch blocks of ``seq_len`` tokens, and score themselves
against a unigram model of the train split. `CorpusBlocksDataModule` holds that once; a subclass says
only how a split's stream becomes a dataset (`_datasets`: masked blocks for ``task=mlm``, next-token
blocks for ``task=lm``), what the model is built with, and how its baseline scores targets.

``packing=true``: the blocks stay as they are (the stream fills them), but each document attends only
within itself, positions from 0 at its first token: every batch carries the layout of its documents
(`attnlab.data.packing.document_layout`, a new one after each ``</s>``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.loaders import SPLITS, ShardedDataModule
from attnlab.data.packing import check_packing, document_layout
from attnlab.data.tokenizer import BPETokenizer
from attnlab.errors import ConfigError


class TokenSource(Protocol):
    """What the datamodules read of a corpus (`attnlab.data.text_corpus.TextCorpus`, named here only
    in words: that module imports this one)."""

    description: str  # logged, and written to summary.json as data_source
    short_name: str  # names the corpus in data errors

    def prepare(self) -> None: ...

    def tokenizer(self) -> BPETokenizer: ...

    def load(self) -> dict[str, np.ndarray]: ...


class CorpusBlocksDataModule(ShardedDataModule):
    """Blocks of ``seq_len`` tokens of a `TextCorpus`; subclasses implement `_datasets`."""

    def __init__(
        self,
        source: TokenSource,
        seq_len: int = 128,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        packing: bool = False,
    ):
        super().__init__()
        check_packing(packing, None)
        self.documents_apart = packing
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(
                f"task.data.seq_len={seq_len!r}: expected an integer >= 1 (tokens read per block)"
            )
        if batch_size < 1:
            raise ConfigError(f"task.data.batch_size={batch_size}: expected an integer >= 1")
        self.source, self.seq_len = source, seq_len
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.seed = num_workers, seed
        self.datasets: dict[str, Dataset] = {}
        self.streams: dict[str, np.ndarray] = {}

    # ---- what a subclass says ------------------------------------------------------------------------
    def _datasets(self) -> dict[str, Dataset]:
        """One dataset per split from ``self.streams`` (``self.tokenizer`` is loaded by then)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _datasets()")

    # ---- prepared once, loaded once --------------------------------------------------------------------
    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        self.tokenizer = self.source.tokenizer()
        self.streams = self.source.load()
        self.datasets = self._datasets()
        sizes = ", ".join(f"{s} {len(self.datasets[s]):,} blocks" for s in SPLITS)
        log = logging.getLogger(type(self).__module__)  # the subclass's module names the data
        log.info("data: %s (%s of %d tokens)", self.source.description, sizes, self.seq_len)
        if self.documents_apart:
            log.info(
                "packing: attention within each document (about %.1f documents per block in train)",
                self._documents_per_block(),
            )

    def _documents_per_block(self) -> float:
        """Documents (``</s>`` + 1) per block over the train stream's first 16M tokens: a sample, so a
        large memory-mapped corpus is not read whole at every start."""
        sample = np.asarray(self.streams["train"][: 1 << 24])
        blocks = max(len(sample) / self.seq_len, 1.0)
        return (int((sample == self.tokenizer.eos_id).sum()) + blocks) / blocks

    def _with_documents(self, batch: dict[str, torch.Tensor], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``batch`` with the layout of the documents in ``ids`` (its unmasked blocks) when packing."""
        if self.documents_apart:
            batch.update(document_layout(ids, self.tokenizer.eos_id, self.tokenizer.pad_id).batch_items())
        return batch

    # ---- what the pipeline reads ---------------------------------------------------------------------
    def max_length(self, split: str = "train") -> int:
        return self.seq_len

    def _unigram(self, never: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
        """Token counts of the train split with the ``never``-scored ids zeroed, and the add-one smoothed
        log-probabilities of a unigram model fitted to them (unseen tokens stay finite). After `setup`."""
        vocab = self.tokenizer.vocab_size
        counts = np.zeros(vocab, dtype=np.float64)
        stream = self.streams["train"]
        for start in range(0, len(stream), 1 << 24):  # chunks: a large memory-mapped stream stays on disk
            counts += np.bincount(np.asarray(stream[start : start + (1 << 24)]), minlength=vocab)
        counts[list(never)] = 0
        return counts, np.log((counts + 1.0) / (counts.sum() + vocab))

    # ---- loaders ---------------------------------------------------------------------------------
    def train_lengths(self) -> np.ndarray:
        return np.full(len(self.datasets["train"]), self.seq_len)

    @property
    def train_items(self) -> str:
        return f"blocks of {self.seq_len} tokens"
