"""The data loaders every attnlab datamodule shares: sharded over ranks, resumable, seeded per split.

`ShardedDataModule` owns train/val/test loaders so each task's datamodule only says what is
particular to it: ``_collate`` (a list of examples -> a batch), ``train_lengths()`` (what training
batches are bucketed by; fixed-size inputs give equal lengths), ``train_items`` (what the examples
are called when the train split is too small for one batch), ``pool_batches`` (1: no length
bucketing) and ``eval_order(split)`` (evaluation order, e.g. length-sorted for little padding).
A subclass sets ``datasets`` (split -> Dataset), ``batch_size``, ``eval_batch_size``,
``num_workers`` and ``seed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from attnlab.data.common import LengthBucketSampler, ResumableDataLoader, eval_batches, train_batch_sampler

SPLITS = ("train", "val", "test")


class ShardedDataModule(L.LightningDataModule):
    pool_batches = 1  # training batches drawn from pools of this many batches, sorted by length

    # ---- what a subclass says ------------------------------------------------------------------------
    def _collate(self, examples: list) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement _collate()")

    def train_lengths(self) -> Sequence[int]:
        raise NotImplementedError(f"{type(self).__name__} must implement train_lengths()")

    @property
    def train_items(self) -> str:
        return "examples"

    def eval_order(self, split: str) -> Sequence[int]:
        return range(len(self.datasets[split]))

    # ---- the loaders ---------------------------------------------------------------------------------
    def _replicas(self) -> tuple[int, int]:
        trainer = self.trainer
        return (1, 0) if trainer is None else (trainer.world_size, trainer.global_rank)

    def _loader(self, split: str, batch_sampler) -> DataLoader:
        # Own generators (seeded per split): creating an iterator draws the workers' base seed from
        # the loader's generator, never from torch's global one, so dropout's random stream does
        # not depend on how many iterators were made (it must match between a run and its resume).
        generator = torch.Generator().manual_seed(self.seed * len(SPLITS) + SPLITS.index(split))
        loader_class = ResumableDataLoader if isinstance(batch_sampler, LengthBucketSampler) else DataLoader
        return loader_class(
            self.datasets[split],
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            collate_fn=self._collate,
            persistent_workers=self.num_workers > 0,
            generator=generator,
        )

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled, sharded across ranks, and resumable mid-epoch (see `ResumableDataLoader`)."""
        replicas, rank = self._replicas()
        sampler = train_batch_sampler(
            self.train_lengths(),
            self.batch_size,
            seed=self.seed,
            replicas=replicas,
            rank=rank,
            epoch=self.trainer.current_epoch if self.trainer is not None else 0,
            pool_batches=self.pool_batches,
            what=self.train_items,
        )
        return self._loader("train", sampler)

    def _eval_loader(self, split: str) -> DataLoader:
        replicas, rank = self._replicas()
        return self._loader(split, eval_batches(self.eval_order(split), self.eval_batch_size, replicas, rank))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
