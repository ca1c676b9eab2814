"""MQAR recall against model width and against sequence length, one line per backend.

The width comes from the summary's `dim` when it has one, else from `task.model.dim` in the run dir's
`config.yaml`. Options that change what a run computes without changing its backend's name come from
`config.yaml` too: `task.model.short_conv` and the vocabulary `task.data.source.vocab_size` (one panel
per value: recall with and without the short convolution, or over 64 or 256 values, are different
questions; each panel draws its own chance level) and the causal bump's `attn.normaliser` (one line
per value, named ``sliced_relu_bump (mass)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.reporting.plots import clipped_error, panel_grid, style_by_backend
from attnlab.reporting.runs import RunSummary, backend_sort_key, load_run_config
from attnlab.reporting.stats import Stat

MQAR_TASK = "mqar"


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value) if value == int(value) and value >= 1 else None


def run_width(run: RunSummary) -> int | None:
    """Model width of a run: the summary's `dim`, else `task.model.dim` of its `config.yaml`, else None."""
    width = _positive_int(run.get("dim"))
    if width is not None:
        return width
    config = load_run_config(run)
    if config is None:
        return None
    from omegaconf import OmegaConf

    return _positive_int(OmegaConf.select(config, "task.model.dim", default=None))


def run_options(run: RunSummary) -> tuple[str, int, int | None]:
    """The line, short convolution and vocabulary of a run: ``(backend[ (normaliser)], short_conv,
    vocab_size)``.

    The normaliser is named only where the backend has one (ReLU-bump); a run without a config (or
    from before these options) counts as the defaults, ``short_conv`` 0, vocabulary unknown (None).
    """
    config = load_run_config(run)
    if config is None:
        return run.attn, 0, None
    from omegaconf import OmegaConf

    normaliser = OmegaConf.select(config, "attn.normaliser", default=None)
    taps = _positive_int(OmegaConf.select(config, "task.model.short_conv", default=None)) or 0
    vocab = _positive_int(OmegaConf.select(config, "task.data.source.vocab_size", default=None))
    return (f"{run.attn} ({normaliser})" if isinstance(normaliser, str) else run.attn), taps, vocab


@dataclass(frozen=True)
class RecallPoint:
    """MQAR accuracy of one backend (with its normaliser, if any) at one (seq_len, width, short_conv,
    vocabulary), over seeds, and the runs' chance level (``baseline_acc``)."""

    backend: str
    seq_len: int
    dim: int
    acc: Stat
    short_conv: int = 0
    vocab: int | None = None
    baseline: Stat | None = None


def _line_sort_key(line: str) -> tuple:
    backend, _, option = line.partition(" (")
    return (*backend_sort_key(backend), option)


def mqar_points(runs: Sequence[RunSummary], metric: str = "test_acc") -> list[RecallPoint]:
    """Group the MQAR runs by (backend and normaliser, seq_len, width, short_conv, vocabulary); runs
    without a width or the metric are left out."""
    groups: dict[tuple, tuple[list[float], list[float]]] = {}
    for run in runs:
        if run.task != MQAR_TASK or run.get(metric) is None or _positive_int(run.get("seq_len")) is None:
            continue
        width = run_width(run)
        if width is not None:
            line, taps, vocab = run_options(run)
            values, baselines = groups.setdefault(
                (line, int(run.get("seq_len")), width, taps, vocab), ([], [])
            )
            values.append(run.get(metric))
            if run.get("baseline_acc") is not None:
                baselines.append(run.get("baseline_acc"))
    points = [
        RecallPoint(b, t, d, Stat.of(values), k, vocab, Stat.of(base) if base else None)
        for (b, t, d, k, vocab), (values, base) in groups.items()
    ]
    return sorted(
        points, key=lambda p: (_line_sort_key(p.backend), p.short_conv, p.vocab or 0, p.seq_len, p.dim)
    )


def _recall_plot(
    runs: Sequence[RunSummary], path: Path, metric: str, x: str, panel: str, title: str, xlabel: str
) -> Path:
    """One panel per value of `panel` ("seq_len" or "dim"), of short_conv and of the vocabulary, one
    line per backend, and the panel's chance level."""
    points = mqar_points(runs, metric)
    panels = sorted({(getattr(p, panel), p.short_conv, p.vocab or 0) for p in points})
    with_conv = any(taps for _, taps, _ in panels)
    with_vocab = len({vocab for _, _, vocab in panels}) > 1
    style = style_by_backend(sorted({p.backend for p in points}, key=_line_sort_key))
    fig, axes = panel_grid(max(1, len(panels)), title)
    for ax, key in zip(axes, panels, strict=False):
        value, taps, vocab = key
        mine = [p for p in points if (getattr(p, panel), p.short_conv, p.vocab or 0) == key]
        base = Stat.of(p.baseline.mean for p in mine if p.baseline is not None)
        for backend in style:
            line = sorted((getattr(p, x), p.acc) for p in mine if p.backend == backend)
            if not line:
                continue
            colour, marker = style[backend]
            xs = [v for v, _ in line]
            ys = [100 * s.mean for _, s in line]
            bars = [clipped_error(y, 100 * s.std, 0.0, 100.0) for y, (_, s) in zip(ys, line, strict=True)]
            ax.errorbar(
                xs,
                ys,
                yerr=[[low for (low,), _ in bars], [high for _, (high,) in bars]],
                marker=marker,
                color=colour,
                capsize=3,
                label=backend,
            )
        if base is not None:
            ax.axhline(
                100 * base.mean, color="grey", linestyle="--", linewidth=1, label="chance (best constant)"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted({getattr(p, x) for p in points}), [str(v) for v in sorted({getattr(p, x) for p in points})]
        )
        ax.set_ylim(-2, 102)
        ax.set_title(
            f"{panel} {value}"
            + (f", short_conv {taps}" if with_conv else "")
            + (f", vocab {vocab or '?'}" if with_vocab else "")
        )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"MQAR {metric} (%)")
        ax.grid(True, which="both", alpha=0.3)
        # below the panel: points sit anywhere from chance to 100 %, a legend inside would hide some
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    if not panels:
        axes[0].text(
            0.5, 0.5, "no MQAR run with a width", ha="center", va="center", transform=axes[0].transAxes
        )
    fig.savefig(path, dpi=120)
    return path


def plot_mqar_vs_width(runs: Sequence[RunSummary], path: Path, metric: str = "test_acc") -> Path:
    """MQAR accuracy against model width, one panel per sequence length.

    The width sets the state of fixed-state backends (linear, performer: num_heads × head_dim² numbers
    per layer), while softmax keeps every past token: the recall-state trade-off of Arora et al.
    """
    return _recall_plot(
        runs,
        path,
        metric,
        x="dim",
        panel="seq_len",
        title="MQAR recall vs model width",
        xlabel="model width (task.model.dim)",
    )


def plot_mqar_vs_seqlen(runs: Sequence[RunSummary], path: Path, metric: str = "test_acc") -> Path:
    """MQAR accuracy against sequence length, one panel per model width."""
    return _recall_plot(
        runs,
        path,
        metric,
        x="seq_len",
        panel="dim",
        title="MQAR recall vs sequence length",
        xlabel="seq_len",
    )
