"""Throughput beside accuracy: per-device training/eval samples/s, tokens/s, step time, peak memory.

Timing covers the wall-clock time of each training step (forward, backward, optimizer) from
`on_train_batch_start` to `on_train_batch_end`, CUDA-synchronised when on GPU, counting only steps
after ``warmup_steps`` (the first steps pay for allocation and kernel selection). Data loading
between steps is not counted: the figure is the model's speed, comparable across backends.
Tokens are the real (unpadded) tokens of the batch; a batch without a padding mask (images) counts
``tokens_per_sample`` tokens per example when the LightningModule has that attribute. Peak memory
is CUDA's max allocated memory on GPU and the process's peak resident set size on CPU.

Under DDP every figure is per device, and at the end of training the ranks' rates are summed with
an all-reduce into ``train_samples_per_sec_total`` / ``train_tokens_per_sec_total`` (a sum of what
each rank measured, not the per-device rate times the world size: ranks differ, e.g. in lengths).

FLOPs and MFU (``attnlab.flops``): the model's forward FLOPs are counted on every training step by
forward hooks (analytic, per backend), a step counts 3 × its forward, and ``perf/train_tflops_per_sec``
and ``perf/mfu`` (achieved / peak FLOP/s) are logged when a peak is known: ``peak_flops`` (FLOP/s per
device, the override) or, on CUDA, the device table for the trainer's precision. A compiled model
(``compile=true``) is not counted: samples/s and tokens/s only.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from attnlab.flops import FlopCounter, peak_flops, precision_dtype


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def _count(batch: dict[str, torch.Tensor], tokens_per_sample: int | None = None) -> tuple[int, int]:
    """(samples, real tokens) of a batch; two-sequence tasks count both sequences' tokens.

    Batches without a mask have no padding: fixed-size point clouds count every one of their
    ``points`` (B, N, C), images ``tokens_per_sample`` patches per example (the model says how many).
    """
    samples = int(batch["labels"].shape[0])
    masks = [k for k in ("mask", "mask2") if k in batch]
    if masks:
        return samples, sum(int(batch[k].sum()) for k in masks)
    if "points" in batch:
        return samples, int(batch["points"].shape[:-1].numel())
    return samples, samples * (tokens_per_sample or 0)


class ThroughputMonitor(L.Callback):
    def __init__(self, warmup_steps: int = 10, log_every_n_steps: int = 50, peak_flops: float | None = None):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if peak_flops is not None and not (isinstance(peak_flops, int | float) and peak_flops > 0):
            raise ValueError(
                f"peak_flops must be a positive number of FLOP/s per device or null, got {peak_flops!r}"
            )
        self.peak_flops: float | None = peak_flops
        self.flop_counter: FlopCounter | None = None
        self.train_flops = 0.0
        self.warmup_steps, self.log_every_n_steps = warmup_steps, log_every_n_steps
        self.train_time = self.train_samples = self.train_tokens = self.train_steps = 0
        self.eval_time = self.eval_samples = 0
        self._t0 = self._eval_t0 = 0.0
        self._seen_steps = 0
        self.total: dict[str, float] | None = None  # summed over ranks at the end of training
        self.earlier_peak_mem_mb = 0.0  # the peak of the run's earlier attempts (from the checkpoint)
        self._device = torch.device("cpu")

    # ---- FLOPs ------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._device = trainer.strategy.root_device  # the model may not be on it yet
        if stage == "fit" and self.flop_counter is None:
            self.flop_counter = FlopCounter().attach(pl_module)
            if not self.flop_counter.counting:
                rank_zero_info("FLOPs and MFU are not counted under compile=true (attnlab.flops.FlopCounter)")
                self.flop_counter = None
            if self.peak_flops is None and pl_module.device.type == "cuda":
                name = torch.cuda.get_device_name(pl_module.device)
                self.peak_flops = peak_flops(name, precision_dtype(trainer.precision))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.flop_counter is not None:
            self.flop_counter.detach()
            self.flop_counter = None

    # ---- training -------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.flop_counter is not None:
            self.flop_counter.reset()
        _sync(pl_module.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync(pl_module.device)
        elapsed = time.perf_counter() - self._t0
        self._seen_steps += 1
        if self._seen_steps <= self.warmup_steps:
            return
        samples, tokens = _count(batch, getattr(pl_module, "tokens_per_sample", None))
        self.train_time += elapsed
        self.train_samples += samples
        self.train_tokens += tokens
        self.train_steps += 1
        if self.flop_counter is not None:
            self.train_flops += self.flop_counter.training_flops()
        if self.train_steps % self.log_every_n_steps == 0:
            pl_module.log_dict(self.train_metrics(pl_module.device), on_step=True, on_epoch=False)

    # ---- evaluation ---------------------------------------------------------------------------
    def _eval_start(self, pl_module) -> None:
        _sync(pl_module.device)
        self._eval_t0 = time.perf_counter()

    def _eval_end(self, pl_module, batch) -> None:
        _sync(pl_module.device)
        self.eval_time += time.perf_counter() - self._eval_t0
        self.eval_samples += _count(batch)[0]

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._eval_start(pl_module)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._eval_end(pl_module, batch)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._eval_start(pl_module)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval_end(pl_module, batch)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        """Each validation point carries the throughput so far, beside its accuracy."""
        if trainer.sanity_checking:
            return
        metrics = self.train_metrics(pl_module.device)
        if self.eval_time > 0:
            metrics["perf/eval_samples_per_sec"] = self.eval_samples / self.eval_time
        pl_module.log_dict(metrics)

    # ---- results ------------------------------------------------------------------------------
    def peak_mem_mb(self, device: torch.device) -> float:
        """The run's peak so far: this attempt's, or an earlier attempt's when that was higher (a
        resumed run's process has not seen the memory its first attempt took)."""
        return max(peak_memory_mb(device), self.earlier_peak_mem_mb)

    def train_metrics(self, device: torch.device) -> dict[str, float]:
        if self.train_steps == 0:
            return {"perf/peak_mem_mb": self.peak_mem_mb(device)}
        metrics = {
            "perf/train_samples_per_sec": self.train_samples / self.train_time,
            "perf/train_tokens_per_sec": self.train_tokens / self.train_time,
            "perf/step_ms": 1000.0 * self.train_time / self.train_steps,
            "perf/peak_mem_mb": self.peak_mem_mb(device),
        }
        if self.train_flops > 0:
            metrics["perf/train_tflops_per_sec"] = self.train_flops / self.train_time / 1e12
            if self.peak_flops:
                metrics["perf/mfu"] = self.train_flops / self.train_time / self.peak_flops
        return metrics

    def results(self, device: torch.device) -> dict[str, float | None]:
        """Per-device figures for the run summary, and the totals over ranks (None where not measured)."""
        metrics = self.train_metrics(device)
        total = self.total or {}
        return {
            "train_samples_per_sec": metrics.get("perf/train_samples_per_sec"),
            "train_tokens_per_sec": metrics.get("perf/train_tokens_per_sec"),
            "train_samples_per_sec_total": total.get("train_samples_per_sec_total"),
            "train_tokens_per_sec_total": total.get("train_tokens_per_sec_total"),
            "step_ms": metrics.get("perf/step_ms"),
            "eval_samples_per_sec": self.eval_samples / self.eval_time if self.eval_time > 0 else None,
            "peak_mem_mb": metrics["perf/peak_mem_mb"],
            "train_tflops_per_sec": metrics.get("perf/train_tflops_per_sec"),
            "mfu": metrics.get("perf/mfu"),
        }

    def _sum_over_ranks(self, trainer, device: torch.device) -> dict[str, float] | None:
        """All ranks' training rates added up (a collective: every rank calls it); None unless all timed."""
        measured = self.train_steps > 0 and self.train_time > 0
        local = [0.0, 0.0]
        if measured:
            local = [self.train_samples / self.train_time, self.train_tokens / self.train_time]
        summed = trainer.strategy.reduce(
            torch.tensor([*local, float(measured)], dtype=torch.float64, device=device), reduce_op="sum"
        ).tolist()
        if summed[2] < trainer.world_size:
            return None
        return {"train_samples_per_sec_total": summed[0], "train_tokens_per_sec_total": summed[1]}

    def on_train_end(self, trainer, pl_module) -> None:
        self.total = self._sum_over_ranks(trainer, pl_module.device)
        figures = self.results(pl_module.device)
        lines = [f"{'throughput (per device)':<32}{'value':>14}"]
        for key, value in figures.items():
            lines.append(f"{key:<32}{'n/a' if value is None else f'{value:,.2f}':>14}")
        lines.append(
            f"(timed {self.train_steps} steps after {self.warmup_steps} warm-up steps; "
            f"*_total: summed over {trainer.world_size} rank(s))"
        )
        rank_zero_info("\n".join(lines))

    # ---- checkpointing: counters survive a resume ---------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        keys = (
            "train_time",
            "train_samples",
            "train_tokens",
            "train_steps",
            "eval_time",
            "eval_samples",
            "_seen_steps",
            "train_flops",
        )
        state = {k: getattr(self, k) for k in keys}
        state["earlier_peak_mem_mb"] = self.peak_mem_mb(self._device)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            setattr(self, key, value)
