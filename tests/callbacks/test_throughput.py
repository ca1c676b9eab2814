"""ThroughputMonitor: what it counts, when it starts counting, its totals over ranks, its checkpoint state."""

from __future__ import annotations

import pytest
import torch

from attnlab.callbacks.throughput import ThroughputMonitor


class _Module:
    device = torch.device("cpu")

    def __init__(self):
        self.logged: list[dict] = []

    def log_dict(self, metrics, **kwargs):
        self.logged.append(metrics)


class _Strategy:
    """Adds what the other ranks hold, as an all-reduce with op 'sum' would."""

    def __init__(self, others: list[list[float]]):
        self.others = others

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "sum"
        return tensor + torch.tensor(self.others, dtype=tensor.dtype).sum(0) if self.others else tensor


class _Trainer:
    sanity_checking = False

    def __init__(self, others=()):
        self.strategy, self.world_size = _Strategy(list(others)), 1 + len(others)


def _batch(lengths: list[int], pair: bool = False) -> dict[str, torch.Tensor]:
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    batch = {"labels": torch.zeros(len(lengths), dtype=torch.long), "mask": mask}
    if pair:
        batch["mask2"] = mask.clone()
    return batch


def _train(monitor: ThroughputMonitor, module: _Module, batches: list[dict]) -> None:
    for index, batch in enumerate(batches):
        monitor.on_train_batch_start(_Trainer(), module, batch, index)
        monitor.on_train_batch_end(_Trainer(), module, None, batch, index)


def test_counts_samples_and_real_tokens_only_after_warmup():
    monitor, module = ThroughputMonitor(warmup_steps=2, log_every_n_steps=2), _Module()
    batches = [_batch([50, 50]), _batch([40]), _batch([3, 5, 7]), _batch([2, 2]), _batch([1], pair=True)]
    _train(monitor, module, batches)
    assert monitor.train_steps == 3 and monitor._seen_steps == 5
    assert monitor.train_samples == 3 + 2 + 1
    assert monitor.train_tokens == (3 + 5 + 7) + (2 + 2) + (1 + 1)  # padding not counted; pairs count both
    assert monitor.train_time > 0
    assert len(module.logged) == 1 and module.logged[0]["perf/train_samples_per_sec"] > 0
    figures = monitor.results(module.device)
    assert figures["train_samples_per_sec"] == pytest.approx(6 / monitor.train_time)
    assert figures["train_samples_per_sec_total"] is None  # summed only at the end of training


def test_nothing_timed_during_warmup():
    monitor, module = ThroughputMonitor(warmup_steps=10), _Module()
    _train(monitor, module, [_batch([4])] * 3)
    assert monitor.train_steps == monitor.train_samples == 0
    assert monitor.results(module.device)["train_samples_per_sec"] is None


def test_totals_are_summed_over_ranks_not_multiplied():
    monitor, module = ThroughputMonitor(warmup_steps=0), _Module()
    _train(monitor, module, [_batch([4, 4])] * 3)
    mine = monitor.train_samples / monitor.train_time
    monitor.on_train_end(_Trainer(others=[[100.0, 400.0, 1.0]]), module)
    figures = monitor.results(module.device)
    assert figures["train_samples_per_sec_total"] == pytest.approx(mine + 100.0)
    assert figures["train_tokens_per_sec_total"] == pytest.approx(4 * mine + 400.0)
    monitor.on_train_end(_Trainer(others=[[0.0, 0.0, 0.0]]), module)  # the other rank timed nothing
    assert monitor.results(module.device)["train_samples_per_sec_total"] is None
    monitor.on_train_end(_Trainer(), module)  # one process: the total is its own rate
    assert monitor.results(module.device)["train_samples_per_sec_total"] == pytest.approx(mine)


def test_state_round_trip_keeps_counters_and_skips_warmup_again():
    monitor, module = ThroughputMonitor(warmup_steps=2), _Module()
    _train(monitor, module, [_batch([3, 4])] * 4)
    restored = ThroughputMonitor(warmup_steps=2)
    restored.load_state_dict(monitor.state_dict())
    for key in (
        "train_time",
        "train_samples",
        "train_tokens",
        "train_steps",
        "eval_time",
        "eval_samples",
        "_seen_steps",
    ):
        assert getattr(restored, key) == getattr(monitor, key), key
    _train(restored, module, [_batch([5])])  # warm-up already done before the checkpoint: counted at once
    assert restored.train_steps == monitor.train_steps + 1
    assert restored.train_samples == monitor.train_samples + 1


def test_rejects_negative_warmup():
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        ThroughputMonitor(warmup_steps=-1)


def test_peak_memory_is_the_runs_over_every_attempt():
    """A resumed process has not seen the memory of the first attempt: the checkpoint carries it."""
    monitor, module = ThroughputMonitor(warmup_steps=0), _Module()
    _train(monitor, module, [_batch([3, 4])] * 2)
    state = monitor.state_dict()
    assert state["earlier_peak_mem_mb"] >= monitor.results(module.device)["peak_mem_mb"] > 0
    state["earlier_peak_mem_mb"] = 1e9  # the first attempt took far more than this process has
    resumed = ThroughputMonitor(warmup_steps=0)
    resumed.load_state_dict(state)
    assert resumed.results(module.device)["peak_mem_mb"] == 1e9
