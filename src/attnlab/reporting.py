"""Turn run directories into comparison tables and plots (the paper's Tables 1-2, for any sweep).

The only input is the `summary.json` each run writes (fields: `attnlab.summary.SUMMARY_FIELDS`), so a
report can be rebuilt at any time from copied run directories, without checkpoints or loggers.

Outputs, all written by `write_report`:

- `accuracy.md` / `accuracy.csv`: backends × tasks, "mean ± std, median m (n)" over seeds in percent, an
  Average column (of the means) and a row with the majority-class baseline of each task; each cell
  also gives the median over seeds, the statistic the sliced ReLU paper reports (median of 4 runs);
- `throughput.md` / `throughput.csv`: per task × backend, train samples/s per device, speed-up
  against a baseline backend, eval samples/s and peak memory;
- `runs.csv`: one row per summary with every field, for spreadsheets;
- `acc_vs_throughput.png` and `throughput_vs_seqlen.png`;
- when MQAR runs are present, `mqar_vs_width.png` and `mqar_vs_seqlen.png`: recall accuracy against the
  model width (the state size of fixed-state backends) and against sequence length, one line per
  backend (the recall-throughput trade-off; the width comes from the summary's `dim` when it has one,
  else from `task.model.dim` in the run dir's `config.yaml`).

Standard deviations are sample standard deviations (ddof = 1) over seeds, 0 for a single run.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.summary import SUMMARY_FIELDS  # every field a run summary carries, in runs.csv order

SUMMARY_NAME = "summary.json"

#: Known backends first, in the paper's order; anything else follows alphabetically.
BACKEND_ORDER = ("softmax", "sliced_relu", "sliced_relu_bump", "linear", "performer")
#: LRA tasks in the benchmark's usual order, then the paper's other benchmarks; anything else follows
#: alphabetically.
TASK_ORDER = (
    *("listops", "text", "retrieval", "image", "pathfinder", "pathx"),
    *("cifar10_vit", "tinyimagenet_vit", "digits_vit", "modelnet40", "shapes", "mlm", "mqar"),
)

METRICS = ("test_acc", "val_acc")

_FRACTION_FIELDS = ("val_acc", "test_acc", "baseline_acc")
_NUMBER_FIELDS = (
    *_FRACTION_FIELDS,
    "train_samples_per_sec",
    "eval_samples_per_sec",
    "peak_mem_mb",
    "params",
    "wall_time_s",
    "attempts",
    "steps",
    "seq_len",
    "world_size",
)
_INTEGER_FIELDS = ("seed", "params", "attempts", "steps", "seq_len", "world_size")
# measured quantities: a negative value is a broken measurement, not a slow run
_NON_NEGATIVE_FIELDS = tuple(f for f in _NUMBER_FIELDS if f not in _FRACTION_FIELDS)

GLUE_PREFIX = "glue_"  # task=glue runs are named glue_<task>
#: Table 4's GLUE columns: (task, header, summary fields shown as a/b, in percent)
GLUE_COLUMNS = (
    ("cola", "CoLA (MCC)", ("test_mcc",)),
    ("sst2", "SST-2", ("test_accuracy",)),
    ("mrpc", "MRPC (F1/acc)", ("test_f1", "test_accuracy")),
    ("stsb", "STS-B (P/S)", ("test_pearson", "test_spearman")),
    ("qqp", "QQP (acc/F1)", ("test_accuracy", "test_f1")),
    ("mnli", "MNLI (m/mm)", ("test_accuracy", "test_accuracy_mismatched")),
    ("qnli", "QNLI", ("test_accuracy",)),
    ("rte", "RTE", ("test_accuracy",)),
)

MISSING = "—"  # a table cell with no value (the combination was not run, or did not report it)


class ReportError(ValueError):
    """Bad input for a report: the message names the path or value at fault."""


def backend_sort_key(name: str) -> tuple[int, int, str]:
    """Known backends in `BACKEND_ORDER`, then the others alphabetically."""
    return _ordered_key(name, BACKEND_ORDER)


def task_sort_key(name: str) -> tuple[int, int, str]:
    """LRA tasks in `TASK_ORDER`, then the others alphabetically."""
    return _ordered_key(name, TASK_ORDER)


def _ordered_key(name: str, known: Sequence[str]) -> tuple[int, int, str]:
    if name in known:
        return (0, known.index(name), "")
    return (1, 0, name)


# --------------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class RunSummary:
    """One run's `summary.json`, validated; `fields` keeps every key the file had."""

    path: Path
    fields: dict[str, Any]

    @property
    def task(self) -> str:
        return self.fields["task"]

    @property
    def attn(self) -> str:
        return self.fields["attn"]

    def get(self, key: str) -> Any:
        return self.fields.get(key)


@dataclass
class LoadResult:
    """The valid runs found, and the files skipped with the reason (for warnings)."""

    runs: list[RunSummary] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def find_summaries(dirs: Iterable[str | Path]) -> list[Path]:
    """All `summary.json` files under the given run or sweep dirs (a summary file itself is accepted).

    Sorted and de-duplicated, so overlapping arguments (a sweep and one of its runs) count each run once.
    """
    found: dict[Path, Path] = {}
    for entry in dirs:
        path = Path(entry)
        if not path.exists():
            raise ReportError(f"run or sweep directory {str(path)!r} does not exist")
        if path.is_file():
            if path.name != SUMMARY_NAME:
                raise ReportError(
                    f"{str(path)!r} is a file but not a {SUMMARY_NAME}; pass a run or sweep dir"
                )
            candidates = [path]
        else:
            candidates = sorted(p for p in path.rglob(SUMMARY_NAME) if p.is_file())
        for candidate in candidates:
            found.setdefault(candidate.resolve(), candidate)
    return [found[key] for key in sorted(found)]


def parse_summary(path: Path) -> RunSummary:
    """Read and check one summary; raise `ReportError` naming the file and the problem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"{path}: cannot read: {err}") from err
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key in ("task", "attn"):
        value = data.get(key)
        if not isinstance(value, str) or not value:
            found = "missing" if key not in data else f"{value!r}"
            raise ReportError(f"{path}: required key {key!r} must be a non-empty string ({found})")
    for key in _NUMBER_FIELDS + ("seed",):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ReportError(f"{path}: {key!r} must be a finite number or null, got {value!r}")
        if key in _INTEGER_FIELDS and value != int(value):
            raise ReportError(f"{path}: {key!r} must be an integer, got {value!r}")
        # GLUE's main metric is a correlation for CoLA (MCC) and STS-B (Spearman): it may be negative
        low = -1.0 if key in ("val_acc", "test_acc") and str(data["task"]).startswith(GLUE_PREFIX) else 0.0
        if key in _FRACTION_FIELDS and not low <= value <= 1.0:
            raise ReportError(f"{path}: {key!r} must be a fraction in [{low:g}, 1], got {value!r}")
        if key in _NON_NEGATIVE_FIELDS and value < 0:
            raise ReportError(f"{path}: {key!r} must be >= 0 (a measured quantity), got {value!r}")
    return RunSummary(path=Path(path), fields=data)


def load_runs(dirs: Iterable[str | Path], on_skip: Callable[[Path, str], None] | None = None) -> LoadResult:
    """Parse every summary under `dirs`; invalid files are listed in `skipped` (and passed to `on_skip`).

    One broken run must not hide a whole sweep, so invalid files are skipped rather than raised.
    Raises `ReportError` when a dir does not exist or when no valid summary remains, naming the dirs.
    """
    dirs = [Path(d) for d in dirs]
    if not dirs:
        raise ReportError("no run or sweep directory given")
    paths = find_summaries(dirs)
    searched = ", ".join(repr(str(d)) for d in dirs)
    if not paths:
        raise ReportError(f"no {SUMMARY_NAME} found under {searched}")
    result = LoadResult()
    for path in paths:
        try:
            result.runs.append(parse_summary(path))
        except ReportError as err:
            result.skipped.append((path, str(err)))
            if on_skip is not None:
                on_skip(path, str(err))
    if not result.runs:
        raise ReportError(f"none of the {len(paths)} {SUMMARY_NAME} file(s) found under {searched} is valid")
    return result


# --------------------------------------------------------------------------------------------------
# Statistics and tables


@dataclass(frozen=True)
class Stat:
    """Mean, sample standard deviation (0 when n == 1) and median of n values."""

    mean: float
    std: float
    n: int
    median: float | None = None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat | None:
        """None when no value is present: nulls are ignored (a run that did not report the field)."""
        present = [float(v) for v in values if v is not None]
        if not present:
            return None
        std = statistics.stdev(present) if len(present) > 1 else 0.0
        return cls(statistics.fmean(present), std, len(present), statistics.median(present))


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
    cells: dict[tuple[str, str], Stat | None]  # (backend, task) -> stat
    baseline: dict[str, Stat | None]  # task -> stat of baseline_acc

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
    cells = {
        (b, t): Stat.of(r.get(metric) for r in runs if r.attn == b and r.task == t)
        for b in backends
        for t in tasks
    }
    baseline = {t: Stat.of(r.get("baseline_acc") for r in runs if r.task == t) for t in tasks}
    return AccuracyTable(metric, tasks, backends, cells, baseline)


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
        cells = [_pct_cell(table.cells[(b, t)]) for t in table.tasks]
        rows.append([b, *cells, _average_cell(avg, covered, len(table.tasks))])
    avg, covered = table.baseline_average()
    base_cells = [MISSING if (s := table.baseline[t]) is None else f"{100 * s.mean:.2f}" for t in table.tasks]
    rows.append(["majority class", *base_cells, _average_cell(avg, covered, len(table.tasks))])
    title = (
        f"## Accuracy ({table.metric}, %)\n\n"
        "Cells: mean ± sample std, and the median, over seeds (number of runs); the sliced ReLU paper "
        "reports medians of 4 runs. "
        "Majority class: baseline_acc on the test split.\n\n"
    )
    return title + _markdown(header, rows)


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
        rows.append([*row, _num(avg, percent=True), covered])
    row = ["majority class"]
    for t in table.tasks:
        row += _stat_csv(table.baseline[t])
    avg, covered = table.baseline_average()
    rows.append([*row, _num(avg, percent=True), covered])
    return header, rows


def _stat_csv(stat: Stat | None) -> list[Any]:
    if stat is None:
        return ["", "", 0, ""]
    return [
        _num(stat.mean, percent=True),
        _num(stat.std, percent=True),
        stat.n,
        _num(stat.median, percent=True),
    ]


def _num(value: float | None, percent: bool = False, digits: int = 4) -> str:
    if value is None:
        return ""
    return f"{(100 * value if percent else value):.{digits}f}"


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
        for length, chunk in _split_by_length([r for r in runs if r.task == task]):
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


def _split_by_length(task_runs: Sequence[RunSummary]) -> list[tuple[int | None, list[RunSummary]]]:
    """One task's runs as [(None, all)] when they share one seq_len, else one chunk per seq_len.

    Throughput is only comparable at equal lengths, so a task run at several lengths is split.
    """
    lengths = {r.get("seq_len") for r in task_runs}
    if len(lengths) <= 1:
        return [(None, list(task_runs))]
    ordered = sorted(lengths, key=lambda v: (v is None, v or 0))
    return [(length, [r for r in task_runs if r.get("seq_len") == length]) for length in ordered]


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
    return title + _markdown(header, body)


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
                _num(train.mean if train else None),
                _num(train.std if train else None),
                _num(r.speedup) if r.speedup is not None else "n/a",
                _num(r.eval_samples_per_sec.mean if r.eval_samples_per_sec else None),
                _num(r.peak_mem_mb, digits=1),
            ]
        )
    return header, body


def runs_csv_rows(runs: Sequence[RunSummary]) -> tuple[list[str], list[list[Any]]]:
    """Every field of every summary: the standard fields first, then any extra key, then the path."""
    extra = sorted({k for r in runs for k in r.fields} - set(SUMMARY_FIELDS))
    header = [*SUMMARY_FIELDS, *extra, "path"]
    ordered = sorted(
        runs,
        key=lambda r: (
            task_sort_key(r.task),
            backend_sort_key(r.attn),
            _seed_key(r.get("seed")),
            str(r.path),
        ),
    )
    body = []
    for r in ordered:
        row = [_csv_value(r.get(k)) for k in (*SUMMARY_FIELDS, *extra)]
        body.append([*row, str(r.path)])
    return header, body


def _seed_key(seed: Any) -> tuple[int, float]:
    return (1, 0.0) if seed is None else (0, float(seed))


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return value


def _markdown_cell(text: str) -> str:
    """A backend or task name with ``|`` (or a line break) would split the row into extra columns."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = lambda values: " | ".join(_markdown_cell(v) for v in values)  # noqa: E731
    lines = ["| " + cells(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + cells(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)


# --------------------------------------------------------------------------------------------------
# GLUE (the paper's Table 4)


def best_by_validation(runs: Sequence[RunSummary]) -> RunSummary | None:
    """The run with the highest ``val_acc`` (a grid's best configuration); ties: the first path."""
    scored = [r for r in runs if r.get("val_acc") is not None]
    return max(sorted(scored, key=lambda r: str(r.path)), key=lambda r: r.get("val_acc"), default=None)


def glue_markdown(runs: Sequence[RunSummary]) -> str:
    """Table 4's shape: per backend, the MLM eval loss, then each GLUE task's dev score (percent).

    Each cell is the run with the best validation score among that task's and backend's runs (the
    grid's best configuration), reporting its dev metrics; the MLM column is the best (by validation)
    task=mlm run's ``test_loss``. Empty when no GLUE run is given.
    """
    glue = [r for r in runs if r.task.startswith(GLUE_PREFIX)]
    if not glue:
        return ""
    backends = sorted({r.attn for r in glue}, key=backend_sort_key)
    header = ["backend", "MLM eval loss", *(title for _, title, _ in GLUE_COLUMNS)]
    rows = []
    for backend in backends:
        mlm = best_by_validation([r for r in runs if r.task == "mlm" and r.attn == backend])
        loss = mlm.get("test_loss") if mlm is not None else None
        row = [backend, MISSING if loss is None else f"{loss:.3f}"]
        for task, _, keys in GLUE_COLUMNS:
            best = best_by_validation([r for r in glue if r.task == GLUE_PREFIX + task and r.attn == backend])
            values = [best.get(k) for k in keys] if best is not None else [None]
            row.append(MISSING if None in values else "/".join(f"{100 * v:.1f}" for v in values))
        rows.append(row)
    title = (
        "## GLUE dev (Table 4 shape)\n\n"
        "Per task and backend: the run with the best validation score (of a grid), its dev metrics in "
        "percent. MLM eval loss: test_loss (nats) of the best task=mlm run.\n\n"
    )
    return title + _markdown(header, rows)


# --------------------------------------------------------------------------------------------------
# Plots (matplotlib's object API: no pyplot, so no global backend or figure state is touched)


def _style(backends: Sequence[str]) -> dict[str, tuple[str, str]]:
    """A fixed colour and marker per backend, the same in every panel and plot."""
    colours = [f"C{i}" for i in range(10)]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]
    return {b: (colours[i % 10], markers[i % len(markers)]) for i, b in enumerate(backends)}


def _panels(n: int, title: str):
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
    so that no error bar spans different lengths.
    """
    if metric not in METRICS:
        raise ReportError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    tasks = sorted({r.task for r in runs}, key=task_sort_key)
    style = _style(sorted({r.attn for r in runs}, key=backend_sort_key))
    fig, axes = _panels(len(tasks), f"{metric} vs train throughput (per device)")
    for ax, task in zip(axes, tasks, strict=False):
        task_runs = [r for r in runs if r.task == task]
        labelled: set[str] = set()
        for length, chunk in _split_by_length(task_runs):
            for b in sorted({r.attn for r in chunk}, key=backend_sort_key):
                group = [r for r in chunk if r.attn == b]
                acc = Stat.of(r.get(metric) for r in group)
                speed = Stat.of(r.get("train_samples_per_sec") for r in group)
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
    """One panel per task, one line per backend: mean train samples/s against seq_len, log-log."""
    tasks = sorted({r.task for r in runs}, key=task_sort_key)
    backends = sorted({r.attn for r in runs}, key=backend_sort_key)
    style = _style(backends)
    fig, axes = _panels(len(tasks), "train throughput vs sequence length (per device)")
    for ax, task in zip(axes, tasks, strict=False):
        plotted = False
        for b in backends:
            group = [r for r in runs if r.task == task and r.attn == b]
            lengths = sorted({r.get("seq_len") for r in group if r.get("seq_len") is not None})
            points = []
            for length in lengths:
                stat = Stat.of(r.get("train_samples_per_sec") for r in group if r.get("seq_len") == length)
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


# --------------------------------------------------------------------------------------------------
# MQAR: recall against width and sequence length

MQAR_TASK = "mqar"


def _run_config(run: RunSummary) -> Any:
    """The resolved `config.yaml` the pipeline writes beside `summary.json` (None: absent, unreadable)."""
    path = run.path.parent / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(path)
    except Exception:  # a damaged config must not stop the report; the run then has no width
        return None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value) if value == int(value) and value >= 1 else None


def run_width(run: RunSummary) -> int | None:
    """Model width of a run: the summary's `dim`, else `task.model.dim` of its `config.yaml`, else None."""
    width = _positive_int(run.get("dim"))
    if width is not None:
        return width
    config = _run_config(run)
    if config is None:
        return None
    from omegaconf import OmegaConf

    return _positive_int(OmegaConf.select(config, "task.model.dim", default=None))


@dataclass(frozen=True)
class RecallPoint:
    """MQAR accuracy of one backend at one (seq_len, width), over seeds."""

    backend: str
    seq_len: int
    dim: int
    acc: Stat


def mqar_points(runs: Sequence[RunSummary], metric: str = "test_acc") -> list[RecallPoint]:
    """Group the MQAR runs by (backend, seq_len, width); runs without a width or the metric are left out."""
    groups: dict[tuple[str, int, int], list[float]] = {}
    for run in runs:
        if run.task != MQAR_TASK or run.get(metric) is None or _positive_int(run.get("seq_len")) is None:
            continue
        width = run_width(run)
        if width is not None:
            groups.setdefault((run.attn, int(run.get("seq_len")), width), []).append(run.get(metric))
    points = [RecallPoint(b, t, d, Stat.of(values)) for (b, t, d), values in groups.items()]
    return sorted(points, key=lambda p: (backend_sort_key(p.backend), p.seq_len, p.dim))


def _recall_plot(
    runs: Sequence[RunSummary], path: Path, metric: str, x: str, panel: str, title: str, xlabel: str
) -> Path:
    """One panel per value of `panel` ("seq_len" or "dim"), one line per backend along `x`."""
    points = mqar_points(runs, metric)
    panels = sorted({getattr(p, panel) for p in points})
    style = _style(sorted({p.backend for p in points}, key=backend_sort_key))
    base = Stat.of(r.get("baseline_acc") for r in runs if r.task == MQAR_TASK)
    fig, axes = _panels(max(1, len(panels)), title)
    for ax, value in zip(axes, panels, strict=False):
        for backend in style:
            line = sorted(
                (getattr(p, x), p.acc) for p in points if p.backend == backend and getattr(p, panel) == value
            )
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
        ax.set_title(f"{panel} {value}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"MQAR {metric} (%)")
        ax.grid(True, which="both", alpha=0.3)
        # below the panel: points sit anywhere from chance to 100 %, a legend inside would hide some
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
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


# --------------------------------------------------------------------------------------------------
# Whole report


@dataclass
class Report:
    """What `make_report` produced: the markdown tables, the written files and the skipped summaries."""

    accuracy_md: str
    throughput_md: str
    files: dict[str, Path]
    runs: list[RunSummary]
    skipped: list[tuple[Path, str]]
    glue_md: str = ""  # Table 4's shape when GLUE runs are present (also written to glue.md)


def write_report(
    runs: Sequence[RunSummary],
    out_dir: str | Path,
    metric: str = "test_acc",
    baseline: str = "softmax",
) -> tuple[str, str, dict[str, Path]]:
    """Write every table and plot for `runs` into `out_dir`; return both markdown tables and the paths."""
    if not runs:
        raise ReportError("no runs to report")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out-dir {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    acc = accuracy_table(runs, metric)
    thr = throughput_table(runs, baseline)
    acc_md = accuracy_markdown(acc)
    thr_md = throughput_markdown(thr, baseline)
    files = {name: out / name for name in _FILE_NAMES}
    files["accuracy.md"].write_text(acc_md, encoding="utf-8")
    files["throughput.md"].write_text(thr_md, encoding="utf-8")
    _write_csv(files["accuracy.csv"], *accuracy_csv_rows(acc))
    _write_csv(files["throughput.csv"], *throughput_csv_rows(thr, baseline))
    _write_csv(files["runs.csv"], *runs_csv_rows(runs))
    plot_acc_vs_throughput(runs, files["acc_vs_throughput.png"], metric)
    plot_throughput_vs_seqlen(runs, files["throughput_vs_seqlen.png"])
    if any(r.task == MQAR_TASK for r in runs):
        files["mqar_vs_width.png"] = plot_mqar_vs_width(runs, out / "mqar_vs_width.png", metric)
        files["mqar_vs_seqlen.png"] = plot_mqar_vs_seqlen(runs, out / "mqar_vs_seqlen.png", metric)
    return acc_md, thr_md, files


_FILE_NAMES = (
    "accuracy.md",
    "accuracy.csv",
    "throughput.md",
    "throughput.csv",
    "runs.csv",
    "acc_vs_throughput.png",
    "throughput_vs_seqlen.png",
)


def make_report(
    dirs: Iterable[str | Path],
    out_dir: str | Path = "report",
    metric: str = "test_acc",
    baseline: str = "softmax",
    on_skip: Callable[[Path, str], None] | None = None,
) -> Report:
    """Load every summary under `dirs` and write the report; `on_skip` hears about each invalid file."""
    if metric not in METRICS:
        raise ReportError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    loaded = load_runs(dirs, on_skip)
    acc_md, thr_md, files = write_report(loaded.runs, out_dir, metric, baseline)
    glue_md = glue_markdown(loaded.runs)
    if glue_md:
        files["glue.md"] = Path(out_dir) / "glue.md"
        files["glue.md"].write_text(glue_md, encoding="utf-8")
    return Report(acc_md, thr_md, files, loaded.runs, loaded.skipped, glue_md)
