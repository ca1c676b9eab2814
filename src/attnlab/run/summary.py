"""``<run_dir>/summary.json``: the one file per run that `attnlab report` reads, built from what the
run measured (`run_summary`), written atomically (`write_summary`) and told in closing lines.

A run stopped by SIGTERM or SIGINT (`attnlab.callbacks.checkpoint.Interrupt`) still writes one, marked
``"interrupted": true`` with the ``"signal"`` name and no test figures; `attnlab report` skips it, and
`exit_status` gives the status ``train.py`` then exits with (128 + the signal's number).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

SUMMARY_FIELDS = (
    "task",
    "attn",
    "seed",
    "val_acc",
    "test_acc",
    "baseline_acc",
    "train_samples_per_sec",
    "eval_samples_per_sec",
    "peak_mem_mb",
    "params",
    "wall_time_s",
    "attempts",
    "steps",
    "seq_len",
    "world_size",
    "git_commit",
    "data_source",
)


def git_commit(cwd: str | Path | None = None) -> str | None:
    """The checked-out commit (with ``-dirty`` when there are local changes), None outside git."""
    try:
        run = lambda *args: subprocess.run(  # noqa: E731
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        commit = run("rev-parse", "HEAD")
        return commit + ("-dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def fields_from_test(results: list[dict[str, float]]) -> dict[str, float]:
    """Every ``test/<name>`` metric of ``trainer.test``'s results as ``test_<name>`` (``test/top5`` ->
    ``test_top5``)."""
    return {
        "test_" + key.removeprefix("test/").replace("/", "_"): float(value)
        for key, value in (results[0] if results else {}).items()
        if key.startswith("test/")
    }


def baselines(datamodule) -> dict[str, float]:
    """What a trivial predictor scores on the test split: ``baseline_acc`` (majority class) unless the
    datamodule names its own (``baselines(split)``, e.g. a unigram model's loss for masked-LM)."""
    if hasattr(datamodule, "baselines"):
        return datamodule.baselines("test")
    return {"baseline_acc": datamodule.majority_baseline("test")}


def run_summary(
    cfg,
    trainer,
    datamodule,
    *,
    perf: dict[str, Any],
    best_val: float | None,
    best_path: str,
    test_metrics: dict[str, float],
    params: int,
    seq_len: int,
    wall_time_s: float,
    attempts: int,
    signum: int | None = None,
    diverged_at: int | None = None,
) -> dict[str, Any]:
    """The summary of a run that trained: its config's names, what the trainer and the throughput
    callback (``perf``) measured, the test metrics, and how it ended (interrupted, diverged, smoke test)."""
    test_metrics = dict(test_metrics)
    return {
        "task": cfg.task.name,
        "attn": cfg.attn.name,
        "seed": cfg.seed,
        "val_acc": float(best_val) if best_val is not None else None,
        "test_acc": test_metrics.pop("test_acc", None),
        **baselines(datamodule),
        "train_samples_per_sec": perf.get("train_samples_per_sec"),
        "train_tokens_per_sec": perf.get("train_tokens_per_sec"),
        "train_samples_per_sec_total": perf.get("train_samples_per_sec_total"),
        "eval_samples_per_sec": perf.get("eval_samples_per_sec"),
        "peak_mem_mb": perf.get("peak_mem_mb"),
        "train_tflops_per_sec": perf.get("train_tflops_per_sec"),  # model FLOPs (attnlab.flops)
        "mfu": perf.get("mfu"),  # null unless the device's peak is known (callbacks.throughput.peak_flops)
        "params": params,
        "wall_time_s": wall_time_s,  # all attempts of the run, this one to its end
        "attempts": attempts,
        "steps": trainer.global_step,
        "seq_len": seq_len,
        "world_size": trainer.world_size,
        "git_commit": git_commit(Path(__file__).parent),
        "data_source": datamodule.source.description,
        # task.data.packing: the share of the packed rows' slots real tokens fill
        **({"packing_fill": datamodule.packing_fill} if getattr(datamodule, "packing_fill", None) else {}),
        "best_checkpoint": best_path or None,
        "dim": cfg.task.model.get("dim"),  # model width: the state size of recall comparisons
        **test_metrics,
        **(interrupted_fields(signum) if signum is not None else {}),
        **({"diverged": True, "diverged_at_step": diverged_at} if diverged_at is not None else {}),
        # Lightning's smoke test (a batch or a few of each stage): a check that the run works, not a result
        **({"smoke_test": True} if trainer.fast_dev_run else {}),
    }


def closing_lines(summary: dict[str, Any], path: Path) -> str:
    """What a finished run prints last: accuracy against its baselines, throughput, where the summary is."""
    pct = lambda x: "n/a" if x is None else f"{100 * x:.2f}%"  # noqa: E731
    rate = lambda x: "n/a" if x is None else f"{x:,.1f}"  # noqa: E731
    total = (
        f" ({rate(summary['train_samples_per_sec_total'])} over {summary['world_size']} devices)"
        if summary["world_size"] > 1
        else ""
    )
    loss = (  # tasks scored by a loss too (masked-LM) compare it with their trivial model's
        f"test loss {summary['test_loss']:.3f} (baseline {summary['baseline_loss']:.3f}); "
        if summary.get("test_loss") is not None and summary.get("baseline_loss") is not None
        else ""
    )
    return (
        f"\n{summary['task']} / {summary['attn']}: {loss}test accuracy {pct(summary['test_acc'])} "
        f"(majority baseline {pct(summary.get('baseline_acc'))}, best val {pct(summary['val_acc'])})\n"
        f"throughput: {rate(summary['train_samples_per_sec'])} train samples/s per device{total}, "
        f"{rate(summary['eval_samples_per_sec'])} eval samples/s, peak memory "
        f"{rate(summary['peak_mem_mb'])} MB, {summary['steps']} steps in {summary['wall_time_s']:.0f} s\n"
        f"summary: {path}"
    )


def write_summary(run_dir: str | Path, fields: dict[str, Any]) -> Path:
    """Write atomically, so a crash never leaves half a summary for the report to read."""
    missing = [f for f in SUMMARY_FIELDS if f not in fields]
    if missing:
        raise ValueError(f"summary lacks {', '.join(missing)}")
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(fields, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def interrupted_fields(signum: int) -> dict[str, Any]:
    """What marks the summary of a run stopped by a signal (SIGTERM, SIGINT)."""
    return {"interrupted": True, "signal": signal.Signals(signum).name}


def exit_status(summary: dict[str, Any]) -> int:
    """0 for a finished run; 128 + the signal's number (143 SIGTERM, 130 SIGINT) for an interrupted one."""
    if not summary.get("interrupted"):
        return 0
    return 128 + int(signal.Signals[summary["signal"]])
