"""The data loaders every attnlab datamodule shares: sharded over ranks, resumable, seeded per split.

`ShardedDataModule` owns train/val/test loaders so each task's datamodule only says what is
particular to it: ``_collate`` (a list of examples -> a batch), ``train_lengths()`` (what training
batches are bucketed by; fixed-size inputs give equal lengths), ``train_items`` (what the examples
are called when the train split is too small for one batch), ``pool_batches`` (1: no length
bucketing) and ``eval_order(split)`` (evaluation order, e.g. length-sorted for little padding).
A subclass sets ``datasets`` (split -> Dataset), ``batch_size``, ``eval_batch_size``,
``num_workers`` and ``seed``.

Datasets that augment at random (images, point clouds) set ``seeded_samples = True``: their training
batches then hold `SampleDraw` keys, an index with the seed of that example's augmentation drawn from
(run seed, epoch, index), and their ``__getitem__`` draws inside `seeded_draws`. An example is then
augmented the same way whichever worker process serves it, however many there are, and whether the run
was resumed or not; no augmentation draws from, or shifts, the process's global random streams.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import random
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from attnlab.data.packing import log_packing_fill
from attnlab.data.resumable_loader import ResumableDataLoader
from attnlab.data.samplers import LengthBucketSampler, eval_batches, train_batch_sampler

SPLITS = ("train", "val", "test")
_SAMPLE_SEED_TAG = 0x5EED_D4A7  # keeps the augmentation seeds apart from other streams of the same seed


class SampleDraw(NamedTuple):
    """A training example to read, and the seed of every random draw its augmentation makes."""

    index: int
    seed: int


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters every input bit."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of example ``index`` in ``epoch`` of a run seeded ``seed`` (63 bits; a
    chained 64-bit hash, about a microsecond: it is computed for every training example)."""
    value = _mix64((_SAMPLE_SEED_TAG ^ seed) & _MASK64)
    value = _mix64((value ^ epoch) & _MASK64)
    return _mix64((value ^ index) & _MASK64) >> 1


def unpack_draw(key: int | SampleDraw) -> tuple[int, int | None]:
    """``(index, seed)`` of a dataset key: a `SampleDraw`, or a plain index (no seed: evaluation)."""
    if isinstance(key, SampleDraw):
        return int(key.index), int(key.seed)
    return int(key), None


def _seed_global_streams(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # the CPU generator only: CUDA's are left alone
    np.random.seed(seed & 0xFFFF_FFFF)
    random.seed(seed)


@contextmanager
def seeded_draws(seed: int | None) -> Iterator[None]:
    """Inside the block torch's CPU generator, numpy's global one and Python's ``random`` start from
    ``seed``. ``None``: the block draws from them as they are.

    torchvision's transforms draw from torch, timm's RandAugment from ``random`` and numpy. In the
    training process (``num_workers=0``) the states are restored after the block, since its torch
    stream also draws dropout (it must not move with the augmentation). In a loader worker nothing
    else draws from them and the next example seeds them again: restoring (numpy's state alone costs
    about 0.1 ms) is skipped there.
    """
    if seed is None:
        yield
        return
    if get_worker_info() is not None:
        _seed_global_streams(seed)
        yield
        return
    torch_state, numpy_state, python_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    _seed_global_streams(seed)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


class SeededBatchSampler(LengthBucketSampler):
    """`LengthBucketSampler` whose batches hold `SampleDraw` keys: index and augmentation seed.

    The seed depends on the run seed, the epoch and the example only, never on the worker that reads
    it or on how many examples that worker read before: a resumed run replays the same augmentations.
    """

    def __iter__(self) -> Iterator[list[SampleDraw]]:
        for batch in super().__iter__():  # the pass has started: `self.epoch` is this batch's epoch
            yield [SampleDraw(i, sample_seed(self.seed, self.epoch, i)) for i in batch]


def _worker_init(worker_id: int, rank: int) -> None:
    """Loader workers leave SIGINT and SIGTERM to the training process, which saves ``last.ckpt`` at the
    next step boundary and then shuts them down (`attnlab.callbacks.checkpoint.Interrupt`): a Ctrl-C
    reaches every process of the terminal's group, and a worker it killed would fail the next batch.
    Lightning's worker seeding, which a worker_init_fn of ours replaces, still runs.

    Since SIGTERM no longer ends them, a worker also ends when its parent is gone (`_watch_parent`),
    and the parent kills the ones still alive when its interpreter exits (`_end_workers_at_exit`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(os.getppid())
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        from lightning.fabric.utilities.seed import pl_worker_init_function

        pl_worker_init_function(worker_id, rank)


def _watch_parent(parent: int, interval_s: float = 0.5) -> None:
    """End this worker once ``parent`` is no longer its parent (killed with ``kill -9``, crashed), even
    when the worker is busy in a dataset's code and never looks at its queue again."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(0)

    threading.Thread(target=watch, name="attnlab-parent-watchdog", daemon=True).start()


def _end_workers_at_exit(grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, the daemonic children still alive at interpreter exit.

    A loader whose iterator outlives its use (held by a failing test's traceback, say) is never shut
    down; at exit multiprocessing sends its daemonic children SIGTERM, which `_worker_init`'s workers
    ignore, and waits for them forever: pytest hung at exit. This runs first (atexit runs handlers
    last-in, first-out, and it is registered after multiprocessing's); a child that does end on
    SIGTERM ends as multiprocessing would have ended it.
    """
    import multiprocessing

    children = [child for child in multiprocessing.active_children() if child.daemon]
    if not children:
        return
    # torch's SIGCHLD handler raises in this thread when a loader worker dies of a signal
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(timeout=max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(timeout=grace_s)


multiprocessing.util  # noqa: B018  imported first: its exit handler must run after ours
atexit.register(_end_workers_at_exit)


class ShardedDataModule(L.LightningDataModule):
    pool_batches = 1  # training batches drawn from pools of this many batches, sorted by length
    packing = False  # True: `_collate` packs each batch in rows (attnlab.data.packing); fill logged
    pack_length: int | None = None  # a packed row's tokens (None: the batch's longest sequence)
    pad_to_multiple_of = 1
    seeded_samples = False  # True: training keys are `SampleDraw`s (datasets that augment at random)

    # ---- what a subclass says ------------------------------------------------------------------------
    def _collate(self, examples: list) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement _collate()")

    def train_lengths(self) -> Sequence[int]:
        raise NotImplementedError(f"{type(self).__name__} must implement train_lengths()")

    def packed_sides(self) -> list[Sequence[int]]:
        """The training examples' lengths as packing sees them: one sequence of lengths per side that
        the collate packs on its own (a pair task has two)."""
        return [self.train_lengths()]

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
            worker_init_fn=partial(_worker_init, rank=self._replicas()[1]) if self.num_workers else None,
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
            sampler_class=SeededBatchSampler if self.seeded_samples else LengthBucketSampler,
        )
        if self.packing:
            self.packing_fill = log_packing_fill(
                sampler, self.packed_sides(), self.pad_to_multiple_of, self.pack_length
            )
        return self._loader("train", sampler)

    def _eval_loader(self, split: str) -> DataLoader:
        replicas, rank = self._replicas()
        return self._loader(split, eval_batches(self.eval_order(split), self.eval_batch_size, replicas, rank))

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
