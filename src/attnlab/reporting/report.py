"""The whole report: every table and plot for a set of runs, written into one folder."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# from the modules, not the package: `attnlab.reporting` re-exports these names and imports this module
from attnlab.reporting.formats import write_csv
from attnlab.reporting.glue import glue_markdown
from attnlab.reporting.mqar import MQAR_TASK, plot_mqar_vs_seqlen, plot_mqar_vs_width
from attnlab.reporting.plots import plot_acc_vs_throughput, plot_throughput_vs_seqlen
from attnlab.reporting.runs import METRICS, ReportError, RunSummary, load_runs
from attnlab.reporting.tables import (
    accuracy_csv_rows,
    accuracy_markdown,
    accuracy_table,
    runs_csv_rows,
    throughput_csv_rows,
    throughput_markdown,
    throughput_table,
)
from attnlab.reporting.variants import label_variants
from attnlab.reporting.vit import vit_markdown, vit_runs, write_vit_curves


@dataclass
class Report:
    """What `make_report` produced: the markdown tables, the written files and the skipped summaries."""

    accuracy_md: str
    throughput_md: str
    files: dict[str, Path]
    runs: list[RunSummary]
    skipped: list[tuple[Path, str]]
    glue_md: str = ""  # GLUE dev scores (Table 4's tasks, then CoLA) when GLUE runs are present (glue.md)
    vit_md: str = ""  # ViT selection and median test curves when ViT runs are present (vit_grid.md)


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
    variants = label_variants(runs)  # runs of other configurations are not seeds of one result
    acc = accuracy_table(variants, metric)
    thr = throughput_table(variants, baseline)
    acc_md = accuracy_markdown(acc)
    thr_md = throughput_markdown(thr, baseline)
    files = {name: out / name for name in _FILE_NAMES}
    files["accuracy.md"].write_text(acc_md, encoding="utf-8")
    files["throughput.md"].write_text(thr_md, encoding="utf-8")
    write_csv(files["accuracy.csv"], *accuracy_csv_rows(acc))
    write_csv(files["throughput.csv"], *throughput_csv_rows(thr, baseline))
    write_csv(files["runs.csv"], *runs_csv_rows(runs, [v.task for v in variants]))
    plot_acc_vs_throughput(variants, files["acc_vs_throughput.png"], metric)
    plot_throughput_vs_seqlen(label_variants(runs, across_lengths=True), files["throughput_vs_seqlen.png"])
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
    vit = vit_runs(loaded.runs)
    vit_md = vit_markdown(vit)
    if vit_md:
        files["vit_grid.md"] = Path(out_dir) / "vit_grid.md"
        files["vit_grid.md"].write_text(vit_md, encoding="utf-8")
        files.update(write_vit_curves(vit, Path(out_dir)))
    return Report(acc_md, thr_md, files, loaded.runs, loaded.skipped, glue_md, vit_md)
