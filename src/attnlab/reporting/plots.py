"""Accuracy against throughput and throughput against sequence length, one panel per task.

Matplotlib's object API: no pyplot, so no global backend or figure state is touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from attnlab.reporting.runs import (
    METRICS,
    ReportError,
    RunSummary,
    backend_sort_key,
    split_by_length,
    task_sort_key,
)
from attnlab.reporting.stats import Stat
from attnlab.reporting.variants import per_seed


def style_by_backend(backends: Sequence[str]) -> dict[str, tuple[str, str]]:
    """A fixed colour and marker per backend, the same in every panel and plot."""
    colours = [f"C{i}" for i in range(10)]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]
    return {b: (colours[i % 10], markers[i % len(markers)]) for i, b in enumerate(backends)}


def panel_grid(n: int, title: str):
    from matplotlib.figure import Figure

    ncols = max(1, min(3, n))
    nrows = max(1, math.ceil(n / ncols))
    fig = Figure(figsize=(4.6 * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, axes


def clipped_error(mean: float, std: float, low: float, high: float = math.inf) -> list[list[float]]:
    """Matplotlib's (lower, upper) error lengths of mean ± std, cut at [low, high]: an accuracy bar
    past 100 % or a rate bar below 0 would show values no run can have."""
    return [[max(0.0, min(std, mean - low))], [max(0.0, min(std, high - mean))]]


def plot_acc_vs_throughput(runs: Sequence[RunSummary], path: Path, metric: str = "test_acc") -> Path:
    """One panel per task: accuracy (mean ± std over seeds) vs train samples/s, one marker per backend.

    A task run at several lengths gets one point per (backend, seq_len), labelled with the length,
    so that no error bar spans different lengths. Pass runs labelled by configuration
    (`attnlab.reporting.variants.label_variants`) so that a panel holds one configuration, and a seed
    run twice counts once.
    """
    if metric not in METRICS:
        raise ReportError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    tasks = sorted({r.task for r in runs}, key=task_sort_key)
    style = style_by_backend(sorted({r.attn for r in runs}, key=backend_sort_key))
    fig, axes = panel_grid(len(tasks), f"{metric} vs train throughput (per device)")
    for ax, task in zip(axes, tasks, strict=False):
        task_runs = [r for r in runs if r.task == task]
        labelled: set[str] = set()
        for length, chunk in split_by_length(task_runs):
            for b in sorted({r.attn for r in chunk}, key=backend_sort_key):
                group = [r for r in chunk if r.attn == b]
                acc = Stat.of(per_seed(group, metric)[0])
                speed = Stat.of(per_seed(group, "train_samples_per_sec")[0])
                if acc is None or speed is None or speed.mean <= 0:
                    continue
                colour, marker = style[b]
                x, y = speed.mean, 100 * acc.mean
                ax.errorbar(
                    x,
                    y,
                    xerr=clipped_error(x, speed.std, low=0.001 * x),  # a log axis: stay above 0
                    yerr=clipped_error(y, 100 * acc.std, low=0.0, high=100.0),
                    fmt=marker,
                    color=colour,
                    markersize=8,
                    capsize=3,
                    label=None if b in labelled else b,
                )
                labelled.add(b)
                if length is not None:
                    ax.annotate(str(length), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        base = Stat.of(r.get("baseline_acc") for r in task_runs)
        if base is not None:
            ax.axhline(100 * base.mean, color="grey", linestyle="--", linewidth=1, label="majority class")
        if labelled:
            ax.set_xscale("log")
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no run with both values", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(task)
        ax.set_xlabel("train samples/s per device")
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=120)
    return path


def plot_throughput_vs_seqlen(runs: Sequence[RunSummary], path: Path) -> Path:
    """One panel per task (or configuration, as `plot_acc_vs_throughput`), one line per backend: train
    samples/s (the mean over distinct seeds) against seq_len, log-log."""
    tasks = sorted({r.task for r in runs}, key=task_sort_key)
    backends = sorted({r.attn for r in runs}, key=backend_sort_key)
    style = style_by_backend(backends)
    fig, axes = panel_grid(len(tasks), "train throughput vs sequence length (per device)")
    for ax, task in zip(axes, tasks, strict=False):
        plotted = False
        for b in backends:
            group = [r for r in runs if r.task == task and r.attn == b]
            lengths = sorted({r.get("seq_len") for r in group if r.get("seq_len") is not None})
            points = []
            for length in lengths:
                at_length = [r for r in group if r.get("seq_len") == length]
                stat = Stat.of(per_seed(at_length, "train_samples_per_sec")[0])
                if stat is not None and stat.mean > 0 and length > 0:
                    points.append((length, stat.mean))
            if not points:
                continue
            colour, marker = style[b]
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=marker, color=colour, label=b)
            plotted = True
        if plotted:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no run with both values", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(task)
        ax.set_xlabel("seq_len")
        ax.set_ylabel("train samples/s per device")
        ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=120)
    return path
