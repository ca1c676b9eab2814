"""Which examples go into which batch: length-bucketed, sharded over ranks, resumable mid-epoch.

`LengthBucketSampler` cuts an epoch into batches of similar lengths (little padding) and carries its
position in a checkpoint; `train_batch_sampler` is the training batches of every datamodule and
`eval_batches` one rank's share of an evaluation split.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from attnlab.errors import ConfigError


class LengthBucketSampler(Sampler[list[int]]):
    """Batches of similar lengths, so padding wastes little compute; resumable mid-epoch.

    Shuffles, cuts the shuffled order into pools of ``pool_batches`` batches, sorts each pool by
    length, cuts it into batches and shuffles the batches. Deterministic given ``seed`` and the
    epoch, and shardable across DDP ranks (``num_replicas``, ``rank``: rank r takes global batches
    r, r + R, ...; every rank gets the same number of batches).

    Each pass over the sampler is one epoch, and a pass after the first advances the epoch by
    itself: Lightning calls ``set_epoch`` only on index samplers, never on a batch sampler, so
    without this every epoch would repeat the first one's order. ``set_epoch(e)`` makes the next
    pass epoch ``e``. ``state_dict``/``load_state_dict`` carry ``(epoch, next_batch)``: after a
    load, the next pass continues that epoch at that batch (what a resumed run needs).
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
        if pool_batches < 1:
            raise ValueError(f"pool_batches must be >= 1, got {pool_batches}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"need num_replicas >= 1 and 0 <= rank < num_replicas, "
                f"got num_replicas={num_replicas}, rank={rank}"
            )
        self.lengths = np.asarray(lengths)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.pool_batches, self.drop_last = pool_batches, drop_last
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0  # epoch of the pass in progress (or of the next pass, before it starts)
        self.pass_start = 0  # first batch of the pass in progress (non-zero when it resumed mid-epoch)
        self._position = 0  # batches of this epoch handed out so far by the pass in progress
        self._next_is_fresh = True  # the next pass uses `epoch` as is (after init, set_epoch, a load)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pass_start, self._position, self._next_is_fresh = epoch, 0, 0, True

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
        return batches[self.rank :: self.num_replicas][: len(self)]

    def epoch_batches(self) -> list[list[int]]:
        """The batches of the epoch in progress (or the next), read without moving the sampler."""
        return self._batches()

    def __iter__(self) -> Iterator[list[int]]:
        if not self._next_is_fresh:
            self.epoch, self.pass_start = self.epoch + 1, 0
        self._next_is_fresh = False
        batches = self._batches()
        self._position = self.pass_start
        for index in range(self.pass_start, len(batches)):
            self._position = index + 1  # before yielding: a checkpoint taken now resumes after this batch
            yield batches[index]

    def __len__(self) -> int:
        """Batches per epoch and rank; the same every epoch (pools are full except the last)."""
        full_pools, rest = divmod(len(self.lengths), self.batch_size * self.pool_batches)
        last = rest // self.batch_size if self.drop_last else math.ceil(rest / self.batch_size)
        return (full_pools * self.pool_batches + last) // self.num_replicas

    # ---- resuming ------------------------------------------------------------------------------------
    def _identity(self) -> dict:
        return {
            "num_examples": len(self.lengths),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "pool_batches": self.pool_batches,
            "drop_last": self.drop_last,
        }

    def position_state(self, epoch: int, next_batch: int) -> dict:
        """The state that resumes at ``next_batch`` of ``epoch`` (an epoch's end is the next one's start)."""
        if next_batch >= len(self):
            epoch, next_batch = epoch + 1, 0
        return {
            "epoch": epoch,
            "next_batch": next_batch,
            "num_replicas": self.num_replicas,
            **self._identity(),
        }

    def state_dict(self) -> dict:
        """Where this sampler's stream of batches stands: the next batch it will hand out."""
        if self._next_is_fresh:
            return self.position_state(self.epoch, self.pass_start)
        return self.position_state(self.epoch, self._position)

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass continue ``state``'s epoch at its next batch.

        A different world size maps the position through the number of global batches consumed
        (rounded up: a few batches may be skipped, none repeated). A different dataset, batch size
        or shuffling makes the position meaningless: the saved epoch then starts over, with a warning.
        """
        epoch, next_batch = int(state["epoch"]), int(state["next_batch"])
        changed = {k: (state.get(k), v) for k, v in self._identity().items() if state.get(k, v) != v}
        if changed:
            warnings.warn(
                f"LengthBucketSampler: resuming with different settings (saved, now) {changed}; "
                f"epoch {epoch} starts over from its first batch",
                stacklevel=2,
            )
            next_batch = 0
        saved_replicas = int(state.get("num_replicas", self.num_replicas))
        if saved_replicas != self.num_replicas:
            next_batch = math.ceil(next_batch * saved_replicas / self.num_replicas)
        self.set_epoch(epoch)
        self.pass_start = self._position = min(next_batch, len(self))


def train_batch_sampler(
    lengths: Sequence[int],
    batch_size: int,
    *,
    seed: int,
    replicas: int = 1,
    rank: int = 0,
    epoch: int = 0,
    pool_batches: int = 1,
    what: str = "examples",
    sampler_class: type[LengthBucketSampler] = LengthBucketSampler,
) -> LengthBucketSampler:
    """The training batches of every datamodule: shuffled, sharded over ``replicas``, resumable,
    incomplete batches dropped (``pool_batches`` > 1 buckets by length; 1 for fixed-size inputs).
    ``sampler_class`` may be a subclass (``attnlab.data.loaders.SeededBatchSampler``: seeded keys).

    A split smaller than one batch per rank would surface as a scheduler error about ``total_steps``
    naming neither: it raises `ConfigError` naming the split size and ``task.data.batch_size``.
    """
    sampler = sampler_class(
        lengths,
        batch_size,
        shuffle=True,
        seed=seed,
        pool_batches=pool_batches,
        drop_last=True,
        num_replicas=replicas,
        rank=rank,
    )
    if len(sampler) == 0:
        per_rank = f" ({len(lengths) // replicas:,} per rank over {replicas} ranks)" if replicas > 1 else ""
        raise ConfigError(
            f"the train split has {len(lengths):,} {what}{per_rank}: fewer than one batch of "
            f"task.data.batch_size={batch_size} (incomplete batches are dropped); lower the batch size "
            "or use more training data"
        )
    sampler.set_epoch(epoch)
    return sampler


def eval_batches(order: Sequence[int], batch_size: int, replicas: int = 1, rank: int = 0) -> list[list[int]]:
    """The evaluation batches of one rank: every ``replicas``-th example of ``order`` from ``rank`` on
    (disjoint shares; every rank gets some even when the split is smaller than one batch per rank; the
    metrics are reduced across ranks), cut into batches of ``batch_size``; the last may be short."""
    share = np.asarray(order)[rank::replicas]
    return [share[i : i + batch_size].tolist() for i in range(0, len(share), batch_size)]
