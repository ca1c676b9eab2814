"""What every dataset in attnlab agrees on: the example format, padding, length buckets, errors.

An example is a dict with ``input_ids`` (1-D LongTensor of token ids, 0 is always padding),
``label`` (int) and, for two-sequence tasks (Retrieval), ``input_ids2``. `pad_collate` turns a
list of examples into a batch with ``mask`` (bool, True = real token) next to each id tensor,
which is the ``key_padding_mask`` the attention layers take. Id 0 is masked wherever it stands,
inside a sequence too: that is how ``zero_pixels="padding"`` keeps black pixels out of attention.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from attnlab.errors import ConfigError, UserError

PAD_ID = 0
ON_BAD_ROWS = ("error", "skip")
#: What pixel value 0 is in Image / Pathfinder / Path-X. ``padding``: LRA's rule; the pixel value is
#: the token, so black pixels are id 0 and masked out of attention (LRA's encoder masks ``inputs > 0``).
#: ``token``: every pixel is a real token, ``pixel + 1``, attended like any other.
ZERO_PIXELS = ("padding", "token")
SKIP_HINT = "set task.data.on_bad_rows=skip to skip such rows"

log = logging.getLogger("attnlab.data")


class DataError(UserError):
    """A data file is malformed; the message names the file (and line when there is one)."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path, self.line, self.reason = Path(path), line, message


def read_json(path: str | Path, keys: Sequence[str] = (), what: str = "a record attnlab wrote") -> Any:
    """The JSON object in ``path``, or a `DataError` naming the file: unreadable, not JSON (a write
    cut short, an edit), not an object, or without one of ``keys``. Delete it and attnlab writes it
    again where it wrote it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(path, f"not readable as {what} ({err}); delete it to have it written again") from err
    missing = [key for key in keys if not isinstance(data, dict) or key not in data]
    if not isinstance(data, dict) or missing:
        found = f"no {', '.join(map(repr, missing))}" if isinstance(data, dict) else type(data).__name__
        raise DataError(path, f"not {what} ({found}); delete it to have it written again")
    return data


def check_choice(key: str, value, allowed: Sequence) -> None:
    """A config value outside its allowed set fails with the key, the value and the choices."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


class BadRows:
    """Applies ``on_bad_rows`` while a file is read, so no loader decides it on its own.

    ``error`` (the default) raises the first bad row's `DataError`, with a hint to skip; ``skip``
    counts bad rows and keeps the first as an example, for one warning at the end (`report`).
    Bad rows are rows of an otherwise readable file: a wrong header or an empty split stays an error.
    """

    def __init__(self, on_bad_rows: str = "error"):
        check_choice("on_bad_rows", on_bad_rows, ON_BAD_ROWS)
        self.policy, self.count, self.first = on_bad_rows, 0, None

    def add(self, error: DataError) -> None:
        if self.policy == "error":
            raise DataError(error.path, f"{error.reason} ({SKIP_HINT})", error.line) from None
        self.count += 1
        self.first = self.first or error

    def report(self, what: str, total: int | None = None) -> None:
        """One warning that counts the skipped rows of ``what`` and names the first one."""
        if self.count:
            of = f" of {total:,}" if total is not None else ""
            log.warning(
                "%s: skipped %d bad rows%s (on_bad_rows=skip), first: %s", what, self.count, of, self.first
            )


def pixel_offset(zero_pixels: str) -> int:
    """What is added to a pixel value to make its token id under the ``zero_pixels`` rule."""
    check_choice("zero_pixels", zero_pixels, ZERO_PIXELS)
    return 0 if zero_pixels == "padding" else 1


def describe_zero_pixels(zero_pixels: str) -> str:
    """The rule in words, for ``data_source``."""
    if zero_pixels == "padding":
        return "pixel 0 = padding (black pixels masked out of attention, as LRA's inputs > 0)"
    return "pixel 0 = token (tokens are pixel + 1; every pixel attended)"


def require_examples(dataset: TokenSequenceDataset, where: str | Path, what: str = "example") -> None:
    """An empty split is an error: training or evaluating on nothing would look like a result."""
    if len(dataset) == 0:
        raise DataError(where, f"no {what} to read: this split would be empty")


class MissingDataError(UserError):
    """A dataset is absent; the message says where it was expected and how to obtain it.

    A `UserError` (not a ``FileNotFoundError``): the user's to fix, so ``train.py`` prints the
    message alone instead of a traceback."""

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


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `LengthBucketSampler` whose position survives a checkpoint.

    Lightning saves ``state_dict()`` of every training dataloader that has one into the checkpoint
    (``loops.fit_loop.state_dict.combined_loader``) and calls ``load_state_dict`` on resume, before
    it starts iterating; the next pass then yields only the batches the interrupted epoch had left.
    The position counted here is what the training loop *received*, not what the sampler handed
    out: worker processes prefetch batches ahead of the loop.

    Give it a ``generator``: the DataLoader then draws its workers' base seed from it rather than
    from torch's global generator, so creating an iterator (every epoch, every validation) does
    not shift the random stream that dropout uses, and a resumed run sees the same stream.
    """

    def __init__(self, dataset: Dataset, batch_sampler: LengthBucketSampler, **kwargs):
        if not isinstance(batch_sampler, LengthBucketSampler):
            raise TypeError(
                f"ResumableDataLoader needs a LengthBucketSampler, got {type(batch_sampler).__name__}"
            )
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._consumed: tuple[int, int] | None = None  # (epoch, next batch) as the consumer saw it

    def __iter__(self) -> Iterator:
        self._consumed = None
        for batch in super().__iter__():
            if self._consumed is None:  # the sampler's pass has started: its epoch and start are known
                self._consumed = (self.batch_sampler.epoch, self.batch_sampler.pass_start)
            epoch, position = self._consumed
            self._consumed = (epoch, position + 1)
            yield batch

    def state_dict(self) -> dict:
        if self._consumed is None:
            return self.batch_sampler.state_dict()
        return self.batch_sampler.position_state(*self._consumed)

    def load_state_dict(self, state: dict) -> None:
        self._consumed = None
        self.batch_sampler.load_state_dict(state)


@contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the duration of the block.

    Several processes preparing the same dataset (DDP ranks started together by ``srun``) take
    turns: the first generates the files, the others then find them complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where files are being written (`sigterm_raises`) so that `removed_on_failure`
    removes them; a KeyboardInterrupt, so the entry points end it as they end a Ctrl-C."""

    signal_name = "SIGTERM"


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block SIGTERM raises `Terminated` instead of killing the process outright, which
    left half-written files (``.tmp``) in the data dir. Main thread only (where handlers run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def removed_on_failure(*paths: Path) -> Iterator[None]:
    """Files or folders being written: removed when the block does not finish (an error, Ctrl-C, a
    SIGTERM that raises), so the next run finds nothing half-written."""
    try:
        yield
    except BaseException:
        for path in paths:
            if Path(path).is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                Path(path).unlink(missing_ok=True)
        raise


def remove_orphans(folder: Path, pattern: str) -> list[Path]:
    """Remove the entries of ``folder`` matching ``pattern`` (a regex whose group ``pid`` is the
    writer's process id) whose writer is gone: what a kill -9 left behind. A live writer's are kept."""
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = re.fullmatch(pattern, entry.name)
        if match is None or _process_alive(int(match.group("pid"))):
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        log.info("removed %d leftover(s) of interrupted writers in %s", len(removed), folder)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
