"""The accuracy table (backends × tasks), the throughput table (task × backend) and runs.csv.

Standard deviations are sample standard deviations (ddof = 1) over seeds, 0 for a single run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from attnlab.reporting.formats import MISSING, markdown_table, number
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
from attnlab.run.summary import SUMMARY_FIELDS  # every field a run summary carries, in runs.csv order


def _pct_cell(stat: Stat | None) -> str:
    if stat is None:
        return MISSING
    return f"{100 * stat.mean:.2f} ± {100 * stat.std:.2f}, median {100 * stat.median:.2f} ({stat.n})"


@dataclass
class AccuracyTable:
    """Accuracy per backend × task (fractions); `baseline` is the majority class per task."""

    metric: str
    tasks: list[str]
    backends: list[str]
    cells: dict[tuple[str, str], Stat | None]  # (backend, task) -> stat over distinct seeds
    baseline: dict[str, Stat | None]  # task -> stat of baseline_acc
    #: (backend, task) -> {seed: runs} for the seeds run more than once (averaged into one value)
    repeats: dict[tuple[str, str], dict[Any, int]] = field(default_factory=dict)

    def average(self, backend: str) -> tuple[float | None, int]:
        """Mean over tasks of the per-task means, and how many tasks it covers."""
        means = [s.mean for t in self.tasks if (s := self.cells[(backend, t)]) is not None]
        return (statistics.fmean(means) if means else None), len(means)

    def baseline_average(self) -> tuple[float | None, int]:
        means = [s.mean for t in self.tasks if (s := self.baseline[t]) is not None]
        return (statistics.fmean(means) if means else None), len(means)


def accuracy_table(runs: Sequence[RunSummary], metric: str = "test_acc") -> AccuracyTable:
    """Group runs by (task, attn) and summarise `metric` over seeds."""
    if metric not in METRICS:
        raise ReportError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    tasks = sorted({r.task for r in runs}, key=task_sort_key)
    backends = sorted({r.attn for r in runs}, key=backend_sort_key)
    cells, repeats = {}, {}
    for b in backends:
        for t in tasks:
            values, repeated = per_seed([r for r in runs if r.attn == b and r.task == t], metric)
            cells[(b, t)] = Stat.of(values)
            if repeated:
                repeats[(b, t)] = repeated
    baseline = {t: Stat.of(r.get("baseline_acc") for r in runs if r.task == t) for t in tasks}
    return AccuracyTable(metric, tasks, backends, cells, baseline, repeats)


def _repeats_note(repeated: dict[Any, int] | None) -> str:
    """Seeds run more than once: flagged, since their repeats are one seed's value, not more seeds."""
    if not repeated:
        return ""
    return " ⚠ repeated seed " + ", ".join(f"{seed} ×{n}" for seed, n in sorted(repeated.items(), key=str))


def _average_cell(value: float | None, covered: int, total: int) -> str:
    if value is None:
        return MISSING
    text = f"{100 * value:.2f}"
    # An average over fewer tasks than the others is not comparable: say so in the cell.
    return text if covered == total else f"{text} ({covered}/{total} tasks)"


def accuracy_markdown(table: AccuracyTable) -> str:
    header = ["backend", *table.tasks, "Average"]
    rows = []
    for b in table.backends:
        avg, covered = table.average(b)
        cells = [
            _pct_cell(table.cells[(b, t)]) + _repeats_note(table.repeats.get((b, t))) for t in table.tasks
        ]
        rows.append([b, *cells, _average_cell(avg, covered, len(table.tasks))])
    avg, covered = table.baseline_average()
    base_cells = [MISSING if (s := table.baseline[t]) is None else f"{100 * s.mean:.2f}" for t in table.tasks]
    rows.append(["majority class", *base_cells, _average_cell(avg, covered, len(table.tasks))])
    title = (
        f"## Accuracy ({table.metric}, %)\n\n"
        "Cells: mean ± sample std, and the median, over distinct seeds (number of seeds; a seed run "
        "more than once counts once, its runs averaged, and is flagged); the sliced ReLU paper "
        "reports medians of 4 runs. Runs whose configs differ in more than the seed are separate "
        "columns, `<task> [key=value, ...]`. "
        "Majority class: baseline_acc on the test split.\n\n"
    )
    return title + markdown_table(header, rows)


def accuracy_csv_rows(table: AccuracyTable) -> tuple[list[str], list[list[Any]]]:
    """Numeric CSV (percent): `<task>_mean`, `<task>_std`, `<task>_n`, `<task>_median` per task, then the
    average (of the means)."""
    header = ["backend"]
    for t in table.tasks:
        header += [f"{t}_mean", f"{t}_std", f"{t}_n", f"{t}_median"]
    header += ["average", "average_tasks"]
    rows = []
    for b in table.backends:
        row: list[Any] = [b]
        for t in table.tasks:
            row += _stat_csv(table.cells[(b, t)])
        avg, covered = table.average(b)
        rows.append([*row, number(avg, percent=True), covered])
    row = ["majority class"]
    for t in table.tasks:
        row += _stat_csv(table.baseline[t])
    avg, covered = table.baseline_average()
    rows.append([*row, number(avg, percent=True), covered])
    return header, rows


def _stat_csv(stat: Stat | None) -> list[Any]:
    if stat is None:
        return ["", "", 0, ""]
    return [
        number(stat.mean, percent=True),
        number(stat.std, percent=True),
        stat.n,
        number(stat.median, percent=True),
    ]


@dataclass(frozen=True)
class ThroughputRow:
    """One (task, seq_len, backend) group; `seq_len` is None when the task was not split by length."""

    task: str
    seq_len: int | None
    backend: str
    runs: int
    train_samples_per_sec: Stat | None
    eval_samples_per_sec: Stat | None
    peak_mem_mb: float | None  # the largest over the group's runs: what must fit on the device
    speedup: float | None  # train samples/s over the baseline backend's, same task (and length)
    seq_lens: tuple[int, ...]  # the distinct lengths the group's runs used (for display)


def throughput_table(runs: Sequence[RunSummary], baseline: str = "softmax") -> list[ThroughputRow]:
    """Summarise throughput per task × backend, with speed-up against `baseline`.

    Runs are grouped by (task, attn). When the runs of a task used several sequence lengths, the
    whole task is grouped by (task, attn, seq_len) instead, so each speed-up compares equal lengths.
    """
    out: list[ThroughputRow] = []
    for task in sorted({r.task for r in runs}, key=task_sort_key):
        for length, chunk in split_by_length([r for r in runs if r.task == task]):
            groups = {b: [r for r in chunk if r.attn == b] for b in {r.attn for r in chunk}}
            base = groups.get(baseline)
            base_stat = Stat.of(r.get("train_samples_per_sec") for r in base) if base else None
            for backend in sorted(groups, key=backend_sort_key):
                group = groups[backend]
                train = Stat.of(r.get("train_samples_per_sec") for r in group)
                speedup = None
                if train is not None and base_stat is not None and base_stat.mean > 0:
                    speedup = train.mean / base_stat.mean
                mems = [r.get("peak_mem_mb") for r in group if r.get("peak_mem_mb") is not None]
                seq_lens = tuple(
                    sorted({int(r.get("seq_len")) for r in group if r.get("seq_len") is not None})
                )
                out.append(
                    ThroughputRow(
                        task=task,
                        seq_len=length,
                        backend=backend,
                        runs=len(group),
                        train_samples_per_sec=train,
                        eval_samples_per_sec=Stat.of(r.get("eval_samples_per_sec") for r in group),
                        peak_mem_mb=max(mems) if mems else None,
                        speedup=speedup,
                        seq_lens=seq_lens,
                    )
                )
    return out


def _seq_len_text(row: ThroughputRow) -> str:
    if not row.seq_lens:
        return MISSING
    return "/".join(str(v) for v in row.seq_lens)


def throughput_markdown(rows: Sequence[ThroughputRow], baseline: str = "softmax") -> str:
    header = [
        "task",
        "seq_len",
        "backend",
        "runs",
        "train samples/s/device",
        f"speed-up vs {baseline}",
        "eval samples/s/device",
        "peak mem (MB)",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r.task,
                _seq_len_text(r),
                r.backend,
                str(r.runs),
                MISSING if r.train_samples_per_sec is None else f"{r.train_samples_per_sec.mean:.1f}",
                "n/a" if r.speedup is None else f"{r.speedup:.2f}×",
                MISSING if r.eval_samples_per_sec is None else f"{r.eval_samples_per_sec.mean:.1f}",
                MISSING if r.peak_mem_mb is None else f"{r.peak_mem_mb:.0f}",
            ]
        )
    title = (
        "## Throughput (mean over runs; per device)\n\n"
        f"Speed-up: train samples/s over {baseline}'s on the same task (and length); "
        f"n/a when {baseline} has no throughput there. Peak memory: largest over the runs.\n\n"
    )
    return title + markdown_table(header, body)


def throughput_csv_rows(rows: Sequence[ThroughputRow], baseline: str = "softmax") -> tuple[list[str], list]:
    header = [
        "task",
        "seq_len",
        "backend",
        "runs",
        "train_samples_per_sec",
        "train_samples_per_sec_std",
        f"speedup_vs_{baseline}",
        "eval_samples_per_sec",
        "peak_mem_mb",
    ]
    body = []
    for r in rows:
        train = r.train_samples_per_sec
        body.append(
            [
                r.task,
                _seq_len_text(r).replace(MISSING, ""),
                r.backend,
                r.runs,
                number(train.mean if train else None),
                number(train.std if train else None),
                number(r.speedup) if r.speedup is not None else "n/a",
                number(r.eval_samples_per_sec.mean if r.eval_samples_per_sec else None),
                number(r.peak_mem_mb, digits=1),
            ]
        )
    return header, body


def runs_csv_rows(
    runs: Sequence[RunSummary], configurations: Sequence[str] | None = None
) -> tuple[list[str], list[list[Any]]]:
    """Every field of every summary: the standard fields first, then any extra key, then the path.

    ``configurations`` (one per run, the tables' ``<task> [key=value, ...]`` label from
    `attnlab.reporting.variants.label_variants`) becomes a ``configuration`` column after the task,
    so a spreadsheet groups seeds of one configuration as the tables do."""
    extra = sorted({k for r in runs for k in r.fields} - set(SUMMARY_FIELDS))
    labels = list(configurations) if configurations is not None else None
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"runs_csv_rows: {len(labels)} configurations for {len(runs)} runs")
    fields = [*SUMMARY_FIELDS, *extra]
    at = fields.index("task") + 1 if labels is not None else None
    header = [*fields, "path"] if at is None else [*fields[:at], "configuration", *fields[at:], "path"]
    order = sorted(
        range(len(runs)),
        key=lambda i: (
            task_sort_key(runs[i].task),
            backend_sort_key(runs[i].attn),
            labels[i] if labels is not None else "",
            _seed_key(runs[i].get("seed")),
            str(runs[i].path),
        ),
    )
    body = []
    for i in order:
        row = [_csv_value(runs[i].get(k)) for k in fields]
        if at is not None:
            row.insert(at, labels[i])
        body.append([*row, str(runs[i].path)])
    return header, body


def _seed_key(seed: Any) -> tuple[int, float]:
    return (1, 0.0) if seed is None else (0, float(seed))


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return value
