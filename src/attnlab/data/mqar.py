"""Multi-query associative recall (MQAR), the recall benchmark of the Zoology work (Arora et al. 2023).

Each sequence first binds ``num_kv_pairs`` keys to values, ``k1 v1 k2 v2 ...``, then asks for every
key once, in random order, at positions of the tail drawn with a power law (small gaps from the
bindings are likelier, as in Zoology's ``power_a``); the rest of the tail is noise. A causal model
must output, at the position holding a queried key, the value bound to it earlier: labels exist only
at query positions (`IGNORE_INDEX` elsewhere), so loss and accuracy measure recall and nothing else.

Vocabulary of size V: 0 is padding and never generated, keys are ``1 .. V//2 - 1`` and values
``V//2 .. V - 1`` (disjoint halves, as in Zoology). Noise tokens are drawn from the value half, so a
key token in the tail is always a query and every query has exactly one binding to recall.

Generated in memory, deterministically from ``seed`` (no download, no files): example ``i`` of a
split depends only on the knobs, the seed, the split and ``i``, so a larger set starts with the
examples of a smaller one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.datamodule import SPLITS, SequenceDataModule
from attnlab.errors import ConfigError

IGNORE_INDEX = -100  # label of every position that is not a query (torch's cross-entropy default)
_CHUNK = 1024  # examples per random stream: what keeps examples independent of the split size


@dataclass(frozen=True)
class MQARSpec:
    """The knobs of one MQAR set; `check` names a bad value and what is allowed."""

    vocab_size: int = 128
    seq_len: int = 64
    num_kv_pairs: int = 8
    power_a: float = 0.01

    @property
    def first_value(self) -> int:
        return self.vocab_size // 2

    @property
    def num_keys(self) -> int:
        return self.first_value - 1

    @property
    def num_values(self) -> int:
        return self.vocab_size - self.first_value

    @property
    def num_slots(self) -> int:
        """Places a query can take: every other position of the tail, as in Zoology."""
        return (self.seq_len - 2 * self.num_kv_pairs) // 2

    def check(self) -> None:
        problems = []
        for key in ("vocab_size", "seq_len", "num_kv_pairs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key}={value!r}: expected an integer >= 1")
        a = self.power_a
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a) or a <= 0:
            problems.append(f"power_a={a!r}: expected a number > 0 (0.01 in Zoology; 1 = uniform positions)")
        if problems:
            raise ConfigError("bad MQAR setting(s): " + "; ".join(problems))
        p = self.num_kv_pairs
        if self.num_keys < p:
            raise ConfigError(
                f"MQAR vocab_size={self.vocab_size} has {self.num_keys} key tokens (1 .. vocab_size//2 - 1) "
                f"for num_kv_pairs={p} distinct keys: use vocab_size >= {2 * p + 2} or fewer pairs"
            )
        if self.num_slots < p:
            raise ConfigError(
                f"MQAR seq_len={self.seq_len} cannot hold num_kv_pairs={p}: {2 * p} tokens of bindings and "
                f"{p} queries on every other tail position need seq_len >= {4 * p}"
            )


def generate_mqar(
    spec: MQARSpec, num_examples: int, seed: int, stream: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)``, both ``(num_examples, seq_len)`` int32; labels `IGNORE_INDEX` off queries.

    ``stream`` separates independent sets drawn with one seed (the splits).
    """
    spec.check()
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 0:
        raise ConfigError(f"MQAR num_examples={num_examples!r}: expected an integer >= 0")
    inputs = np.empty((num_examples, spec.seq_len), dtype=np.int32)
    labels = np.full((num_examples, spec.seq_len), IGNORE_INDEX, dtype=np.int32)
    for start in range(0, num_examples, _CHUNK):
        rng = np.random.default_rng([seed, stream, start // _CHUNK])
        # always a whole chunk, cut afterwards: the draws must not depend on how many rows are kept
        chunk_inputs = np.empty((_CHUNK, spec.seq_len), dtype=np.int32)
        chunk_labels = np.full((_CHUNK, spec.seq_len), IGNORE_INDEX, dtype=np.int32)
        _fill(spec, rng, chunk_inputs, chunk_labels)
        rows = min(_CHUNK, num_examples - start)
        inputs[start : start + rows], labels[start : start + rows] = chunk_inputs[:rows], chunk_labels[:rows]
    return inputs, labels


def _sample_without_replacement(rng: np.random.Generator, rows: int, population: int, k: int) -> np.ndarray:
    """``(rows, k)`` distinct indices in ``[0, population)`` per row, in uniformly random order."""
    scores = rng.random((rows, population))
    chosen = np.argpartition(scores, k - 1, axis=1)[:, :k]
    order = np.argsort(np.take_along_axis(scores, chosen, axis=1), axis=1)
    return np.take_along_axis(chosen, order, axis=1)


def _fill(spec: MQARSpec, rng: np.random.Generator, inputs: np.ndarray, labels: np.ndarray) -> None:
    rows, p = inputs.shape[0], spec.num_kv_pairs
    rows_idx = np.arange(rows)[:, None]
    keys = 1 + _sample_without_replacement(rng, rows, spec.num_keys, p)
    values = spec.first_value + _sample_without_replacement(rng, rows, spec.num_values, p)
    # noise everywhere, then the bindings, then the queries over it
    inputs[:] = rng.integers(spec.first_value, spec.vocab_size, size=inputs.shape)
    inputs[:, 0 : 2 * p : 2] = keys
    inputs[:, 1 : 2 * p : 2] = values
    # query slots: p distinct tail slots per row with P(slot g) ∝ (g + 1)^(power_a - 1), drawn without
    # replacement by the Gumbel top-k trick (the same law as drawing one slot at a time)
    log_w = (spec.power_a - 1.0) * np.log(np.arange(1, spec.num_slots + 1))
    perturbed = log_w + rng.gumbel(size=(rows, spec.num_slots))
    slots = np.argpartition(-perturbed, p - 1, axis=1)[:, :p]
    positions = 2 * p + 2 * slots
    asked = _sample_without_replacement(rng, rows, p, p)  # which pair each query asks for
    inputs[rows_idx, positions] = np.take_along_axis(keys, asked, axis=1)
    labels[rows_idx, positions] = np.take_along_axis(values, asked, axis=1)


class MQARDataset(Dataset):
    """Fixed-length sequences with a label per position (`IGNORE_INDEX` where nothing is asked)."""

    def __init__(self, inputs: np.ndarray, labels: np.ndarray):
        if inputs.shape != labels.shape or inputs.ndim != 2:
            raise ValueError(f"inputs {inputs.shape} and labels {labels.shape} must be the same (N, T)")
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.inputs)

    def lengths(self) -> np.ndarray:
        return np.full(len(self), self.inputs.shape[1], dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(self.inputs[index].astype(np.int64)),
            "labels": torch.from_numpy(self.labels[index].astype(np.int64)),
        }


def mqar_collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal-length examples; ``mask`` (all True) is what the throughput callback counts as tokens."""
    ids = torch.stack([ex["input_ids"] for ex in batch])
    return {
        "input_ids": ids,
        "mask": torch.ones_like(ids, dtype=torch.bool),
        "labels": torch.stack([ex["labels"] for ex in batch]),
    }


class MQARSource:
    """MQAR splits generated in memory by `generate_mqar`; nothing to download or write."""

    name = "mqar"

    def __init__(
        self,
        vocab_size: int = 128,
        seq_len: int = 64,
        num_kv_pairs: int = 8,
        power_a: float = 0.01,
        sizes: Mapping[str, int] | None = None,
        seed: int = 0,
    ):
        self.spec = MQARSpec(vocab_size, seq_len, num_kv_pairs, power_a)
        self.spec.check()
        self.sizes = dict(sizes or {"train": 100_000, "val": 3_000, "test": 3_000})
        unknown = sorted(set(self.sizes) - set(SPLITS))
        missing = [s for s in SPLITS if s not in self.sizes]
        if unknown or missing:
            raise ConfigError(
                f"MQAR sizes={self.sizes}: expected exactly the splits {', '.join(SPLITS)}"
                + (f" (unknown: {', '.join(unknown)})" if unknown else "")
                + (f" (missing: {', '.join(missing)})" if missing else "")
            )
        for split, size in self.sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"MQAR sizes.{split}={size!r}: expected an integer >= 1")
        self.seed = seed
        self.vocab_size = vocab_size

    def prepare(self) -> None:
        """Nothing to fetch: the splits are generated in `load`, in about a second."""

    def load(self, on_bad_rows: str = "error") -> dict[str, MQARDataset]:
        """``on_bad_rows`` is accepted for the datamodule's sake: generated rows are never malformed."""
        return {
            split: MQARDataset(*generate_mqar(self.spec, self.sizes[split], self.seed, stream=i))
            for i, split in enumerate(SPLITS)
        }

    @property
    def description(self) -> str:
        s = self.spec
        sizes = " / ".join(f"{split} {self.sizes[split]:,}" for split in SPLITS)
        return (
            f"generated by attnlab's MQAR generator (seed {self.seed}, vocab_size {s.vocab_size}, "
            f"seq_len {s.seq_len}, num_kv_pairs {s.num_kv_pairs}, power_a {s.power_a}; {sizes}; in memory)"
        )


class MQARDataModule(SequenceDataModule):
    """`SequenceDataModule` (seeded, resumable, sharded batches) over MQAR's per-position labels."""

    def __init__(
        self,
        source: MQARSource,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(source, batch_size, eval_batch_size, num_workers, bucket_by_length=False, seed=seed)

    def _collate(self, batch):
        return mqar_collate(batch)

    def majority_baseline(self, split: str = "test") -> float:
        """Best constant guess over the query positions of ``split`` (the most frequent value's share).

        Values are drawn uniformly, so this is about 1/num_values: what a model that ignores the
        bindings can reach.
        """
        self.setup()
        labels = self.datasets[split].labels
        asked = labels[labels != IGNORE_INDEX]
        return float(np.bincount(asked).max() / asked.size)
