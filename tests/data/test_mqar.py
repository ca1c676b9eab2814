"""The MQAR generator: bindings and queries agree, every query is answerable, labels sit at queries only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.data.mqar import (
    IGNORE_INDEX,
    MQARDataModule,
    MQARSource,
    MQARSpec,
    generate_mqar,
)
from attnlab.errors import ConfigError

SPECS = [
    MQARSpec(vocab_size=128, seq_len=64, num_kv_pairs=8),
    MQARSpec(vocab_size=20, seq_len=36, num_kv_pairs=9),  # every key and every slot used
    MQARSpec(vocab_size=8192, seq_len=256, num_kv_pairs=64, power_a=1.0),
    MQARSpec(vocab_size=6, seq_len=4, num_kv_pairs=1),  # the smallest set there is
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"V{s.vocab_size}-T{s.seq_len}-P{s.num_kv_pairs}")
def test_bindings_queries_and_labels_agree(spec):
    inputs, labels = generate_mqar(spec, 300, seed=3)
    p, half = spec.num_kv_pairs, spec.vocab_size // 2
    assert inputs.shape == labels.shape == (300, spec.seq_len)
    assert inputs.min() >= 1 and inputs.max() < spec.vocab_size  # 0 is padding and never generated
    keys, values = inputs[:, 0 : 2 * p : 2], inputs[:, 1 : 2 * p : 2]
    assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < spec.vocab_size)).all()
    assert all(len(set(row)) == p for row in keys)  # distinct keys: each binding is unambiguous
    assert (labels[:, : 2 * p] == IGNORE_INDEX).all()  # nothing is asked inside the bindings
    tail, tail_labels = inputs[:, 2 * p :], labels[:, 2 * p :]
    asked = tail_labels != IGNORE_INDEX
    # labels exactly where the tail holds a key token: the rest of the tail is value-half noise
    assert np.array_equal(asked, tail < half)
    assert (asked.sum(1) == p).all()
    assert not asked[:, 1::2].any()  # queries on every other tail position, as in Zoology
    for row in range(len(inputs)):
        binding = dict(zip(keys[row], values[row], strict=True))
        queried = tail[row][asked[row]]
        assert sorted(queried) == sorted(binding)  # every key asked exactly once
        assert all(binding[k] == v for k, v in zip(queried, tail_labels[row][asked[row]], strict=True))


def test_every_query_is_answerable_from_its_prefix_alone():
    """The token after the only earlier occurrence of the queried key is the label; nothing later matters."""
    spec = MQARSpec(vocab_size=64, seq_len=96, num_kv_pairs=12)
    inputs, labels = generate_mqar(spec, 200, seed=11)
    for row, position in zip(*np.nonzero(labels != IGNORE_INDEX), strict=True):
        prefix = inputs[row, :position]
        earlier = np.flatnonzero(prefix == inputs[row, position])
        assert len(earlier) == 1 and earlier[0] % 2 == 0 and earlier[0] < 2 * spec.num_kv_pairs
        assert prefix[earlier[0] + 1] == labels[row, position]


def test_deterministic_by_seed_and_independent_of_the_split_size():
    spec = MQARSpec()
    a = generate_mqar(spec, 2500, seed=7)
    b = generate_mqar(spec, 2500, seed=7)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(generate_mqar(spec, 2500, seed=8)[0], a[0])
    assert not np.array_equal(generate_mqar(spec, 2500, seed=7, stream=1)[0], a[0])
    small = generate_mqar(spec, 1100, seed=7)  # a smaller set is the start of the larger one
    assert np.array_equal(small[0], a[0][:1100]) and np.array_equal(small[1], a[1][:1100])


def test_splits_differ_and_reload_identically():
    source = MQARSource(sizes={"train": 50, "val": 40, "test": 40}, seed=1)
    first, second = source.load(), source.load()
    for split in ("train", "val", "test"):
        assert np.array_equal(first[split].inputs, second[split].inputs)
    assert not np.array_equal(first["val"].inputs, first["test"].inputs)
    assert not np.array_equal(first["train"].inputs[:40], first["val"].inputs)


def _slot_counts(power_a: float) -> np.ndarray:
    spec = MQARSpec(vocab_size=128, seq_len=128, num_kv_pairs=4, power_a=power_a)
    _, labels = generate_mqar(spec, 4000, seed=0)
    _, positions = np.nonzero(labels != IGNORE_INDEX)
    return np.bincount((positions - 2 * spec.num_kv_pairs) // 2, minlength=spec.num_slots)


def test_query_gaps_follow_the_power_law():
    """power_a = 0.01 (Zoology's): queries pile up right after the bindings; power_a = 1: uniform."""
    skewed, uniform = _slot_counts(0.01), _slot_counts(1.0)
    assert skewed[0] > 5 * skewed[-10:].mean()
    assert skewed[:5].sum() > 0.25 * skewed.sum()
    expected = uniform.sum() / len(uniform)
    assert np.abs(uniform - expected).max() < 0.3 * expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_kv_pairs=70, seq_len=300), "vocab_size=128 has 63 key tokens .* num_kv_pairs=70"),
        (dict(seq_len=30), "seq_len=30 cannot hold num_kv_pairs=8: .* seq_len >= 32"),
        (dict(power_a=0), "power_a=0: expected a number > 0"),
        (dict(vocab_size=1.5), "vocab_size=1.5: expected an integer >= 1"),
        (dict(sizes={"train": 10, "val": 10}), "missing: test"),
        (dict(sizes={"train": 10, "val": 0, "test": 5}), r"sizes.val=0: expected an integer >= 1"),
    ],
)
def test_bad_knobs_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MQARSource(**kwargs)


def test_datamodule_batches_baseline_and_description():
    source = MQARSource(vocab_size=32, seq_len=16, num_kv_pairs=3, sizes={"train": 40, "val": 30, "test": 50})
    dm = MQARDataModule(source, batch_size=8, eval_batch_size=16)
    dm.prepare_data()
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "mask", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (8, 16) and batch["mask"].all()
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert ((batch["labels"] != IGNORE_INDEX).sum(1) == 3).all()
    test_batches = list(dm.test_dataloader())
    assert [len(b["labels"]) for b in test_batches] == [16, 16, 16, 2]
    # the best constant guess over the test queries: the most frequent value's share
    asked = dm.datasets["test"].labels[dm.datasets["test"].labels != IGNORE_INDEX]
    assert dm.majority_baseline("test") == np.bincount(asked).max() / 150
    assert 1 / 16 <= dm.majority_baseline("test") < 0.2  # 16 values drawn uniformly
    assert dm.max_length("train") == 16 and dm.model_kwargs() == {"vocab_size": 32}
    assert "MQAR generator" in source.description and "num_kv_pairs 3" in source.description
