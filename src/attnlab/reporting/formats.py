"""Markdown and CSV writing shared by the tables: cell escaping, number format, the empty cell."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MISSING = "—"  # a table cell with no value (the combination was not run, or did not report it)


def number(value: float | None, percent: bool = False, digits: int = 4) -> str:
    """A CSV number: fixed digits, in percent when asked; empty for a missing value."""
    if value is None:
        return ""
    return f"{(100 * value if percent else value):.{digits}f}"


def _markdown_cell(text: str) -> str:
    """A backend or task name with ``|`` (or a line break) would split the row into extra columns."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = lambda values: " | ".join(_markdown_cell(v) for v in values)  # noqa: E731
    lines = ["| " + cells(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + cells(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
