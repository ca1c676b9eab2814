"""`attnlab report`: comparison tables and plots from run and sweep directories.

Only the argument handling lives here; the work is in `attnlab.reporting`, usable without the CLI.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attnlab.reporting import METRICS, ReportError, make_report


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `report` sub-command to the `attnlab` parser."""
    parser = subparsers.add_parser(
        "report",
        help="accuracy and throughput tables + plots from run/sweep dirs",
        description=(
            "Collect every summary.json under the given run or sweep directories and write "
            "accuracy.{md,csv}, throughput.{md,csv}, runs.csv, acc_vs_throughput.png and "
            "throughput_vs_seqlen.png into --out-dir (with MQAR runs, also mqar_vs_width.png and "
            "mqar_vs_seqlen.png: recall accuracy against model width and sequence length; with tiny-ViT "
            "runs, vit_grid.md, vit_curves.csv and vit_curves.png: the configuration chosen per backend "
            "on the hold-out and the median test curve over seeds); the two "
            "markdown tables are also printed."
        ),
    )
    parser.add_argument(
        "dirs", nargs="*", type=Path, default=[Path("outputs")], metavar="DIR",
        help="run or sweep directories (default: outputs/, every run of this checkout)",
    )  # fmt: skip
    parser.add_argument(
        "--out-dir", type=Path, default=None,
        help="output folder (default: a new <first DIR>/reports/<time>/, so no report overwrites another)",
    )  # fmt: skip
    parser.add_argument(
        "--metric", choices=METRICS, default="test_acc", help="accuracy to tabulate (default: test_acc)"
    )
    parser.add_argument(
        "--baseline", default="softmax", help="backend the speed-ups are relative to (default: softmax)"
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Build the report; 0 on success, 2 when there is nothing valid to report (message on stderr)."""

    def warn(path: Path, reason: str) -> None:
        # `reason` starts with the file's path (see `attnlab.reporting.parse_summary`).
        print(f"attnlab report: warning: skipped {reason}", file=sys.stderr)

    if args.out_dir is None:
        args.out_dir = args.dirs[0] / "reports" / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        report = make_report(
            args.dirs, args.out_dir, metric=args.metric, baseline=args.baseline, on_skip=warn
        )
    except ReportError as err:
        print(f"attnlab report: error: {err}", file=sys.stderr)
        return 2
    print(report.accuracy_md)
    print(report.throughput_md)
    if report.glue_md:  # GLUE runs present: Table 4's tasks, then CoLA (ours)
        print(report.glue_md)
    if report.vit_md:  # ViT runs present: the chosen configuration per backend, the median test curves
        print(report.vit_md)
    summary = f"{len(report.runs)} run(s) reported, {len(report.skipped)} skipped"
    print(f"{summary}; files written to {args.out_dir}/", file=sys.stderr)
    return 0
