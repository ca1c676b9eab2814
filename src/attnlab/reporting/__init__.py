"""Turn run directories into comparison tables and plots (the paper's Tables 1-2, for any sweep).

The only input is the `summary.json` each run writes (fields: `attnlab.run.summary.SUMMARY_FIELDS`), so a
report can be rebuilt at any time from copied run directories, without checkpoints or loggers.

Outputs, all written by `make_report` (one module per kind of output):

- `accuracy.md` / `accuracy.csv` (`tables`): backends × tasks, "mean ± std, median m (n)" over seeds in
  percent, an Average column (of the means) and a row with the majority-class baseline of each task;
  each cell also gives the median over seeds, the statistic the sliced ReLU paper reports (median of
  4 runs);
- `throughput.md` / `throughput.csv` (`tables`): per task × backend, train samples/s per device,
  speed-up against a baseline backend, eval samples/s and peak memory;
- `runs.csv` (`tables`): one row per summary with every field and its configuration label, for
  spreadsheets;
- `acc_vs_throughput.png` and `throughput_vs_seqlen.png` (`plots`);
- when MQAR runs are present, `mqar_vs_width.png` and `mqar_vs_seqlen.png` (`mqar`): recall accuracy
  against the model width (the state size of fixed-state backends) and against sequence length, one
  line per backend (the recall-throughput trade-off);
- when GLUE runs are present, `glue.md` (`glue`): dev scores of the paper's Table 4 tasks, then CoLA (ours);
- when tiny-ViT runs are present, `vit_grid.md`, `vit_curves.csv` and `vit_curves.png` (`vit`): the
  configuration `experiment=vit/grid` chose per backend on the hold-out, the command that trains it
  with 4 seeds, and the median test curve over seeds (the paper's Fig. 2 plots a median over 4 runs of
  "validation accuracy" without naming the split).

`runs` finds and checks the summaries, `stats` holds the one statistic (mean, sample std, median),
`formats` the markdown/CSV writing, and `report` puts the whole report together.

Standard deviations are sample standard deviations (ddof = 1) over seeds, 0 for a single run.
"""

# The package's public names, each defined once in its module and re-exported here so callers import
# from `attnlab.reporting`; `report` imports the same names from the modules themselves (importing
# the package from inside it would be a circle), hence the two similar import lists.

from attnlab.reporting.formats import MISSING
from attnlab.reporting.glue import GLUE_COLUMNS, best_by_validation, glue_markdown
from attnlab.reporting.mqar import (
    MQAR_TASK,
    RecallPoint,
    mqar_points,
    plot_mqar_vs_seqlen,
    plot_mqar_vs_width,
    run_width,
)
from attnlab.reporting.plots import clipped_error, plot_acc_vs_throughput, plot_throughput_vs_seqlen
from attnlab.reporting.report import Report, make_report, write_report
from attnlab.reporting.runs import (
    BACKEND_ORDER,
    GLUE_PREFIX,
    METRICS,
    SUMMARY_NAME,
    TASK_ORDER,
    LoadResult,
    ReportError,
    RunSummary,
    backend_sort_key,
    find_summaries,
    load_runs,
    parse_summary,
    split_by_length,
    task_sort_key,
)
from attnlab.reporting.stats import Stat
from attnlab.reporting.tables import (
    AccuracyTable,
    ThroughputRow,
    accuracy_csv_rows,
    accuracy_markdown,
    accuracy_table,
    runs_csv_rows,
    throughput_csv_rows,
    throughput_markdown,
    throughput_table,
)

__all__ = [
    "BACKEND_ORDER",
    "GLUE_COLUMNS",
    "GLUE_PREFIX",
    "METRICS",
    "MISSING",
    "MQAR_TASK",
    "SUMMARY_NAME",
    "TASK_ORDER",
    "AccuracyTable",
    "LoadResult",
    "RecallPoint",
    "Report",
    "ReportError",
    "RunSummary",
    "Stat",
    "ThroughputRow",
    "accuracy_csv_rows",
    "accuracy_markdown",
    "accuracy_table",
    "backend_sort_key",
    "best_by_validation",
    "clipped_error",
    "find_summaries",
    "glue_markdown",
    "load_runs",
    "make_report",
    "mqar_points",
    "parse_summary",
    "plot_acc_vs_throughput",
    "plot_mqar_vs_seqlen",
    "plot_mqar_vs_width",
    "plot_throughput_vs_seqlen",
    "run_width",
    "runs_csv_rows",
    "split_by_length",
    "task_sort_key",
    "throughput_csv_rows",
    "throughput_markdown",
    "throughput_table",
    "write_report",
]
