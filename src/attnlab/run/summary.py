"""``<run_dir>/summary.json``: the one file per run that `attnlab report` reads.

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
