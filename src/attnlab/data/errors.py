"""What goes wrong with data, said once: a malformed file (`DataError`, naming the file and line), an
absent dataset (`MissingDataError`, saying how to obtain it), the ``on_bad_rows`` policy (`BadRows`),
and the checks every loader makes (a config choice, a record attnlab wrote, an empty split).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence, Sized
from pathlib import Path
from typing import Any

from attnlab.errors import ConfigError, UserError

ON_BAD_ROWS = ("error", "skip")
SKIP_HINT = "set task.data.on_bad_rows=skip to skip such rows"

log = logging.getLogger("attnlab.data")


class DataError(UserError):
    """A data file is malformed; the message names the file (and line when there is one)."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path, self.line, self.reason = Path(path), line, message


class MissingDataError(UserError):
    """A dataset is absent; the message says where it was expected and how to obtain it.

    A `UserError` (not a ``FileNotFoundError``): the user's to fix, so ``train.py`` prints the
    message alone instead of a traceback."""

    def __init__(self, expected: str | Path, how_to_obtain: str):
        super().__init__(f"dataset not found at {expected}. {how_to_obtain}")
        self.expected = Path(expected)


def read_json(path: str | Path, keys: Sequence[str] = (), what: str = "a record attnlab wrote") -> Any:
    """The JSON object in ``path``, or a `DataError` naming the file: unreadable, not JSON (a write
    cut short, an edit), not an object, or without one of ``keys``. Delete it and attnlab writes it
    again where it wrote it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(path, f"not readable as {what} ({err}); delete it to have it written again") from err
    missing = [key for key in keys if not isinstance(data, dict) or key not in data]
    if not isinstance(data, dict) or missing:
        found = f"no {', '.join(map(repr, missing))}" if isinstance(data, dict) else type(data).__name__
        raise DataError(path, f"not {what} ({found}); delete it to have it written again")
    return data


def check_choice(key: str, value, allowed: Sequence) -> None:
    """A config value outside its allowed set fails with the key, the value and the choices."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


class BadRows:
    """Applies ``on_bad_rows`` while a file is read, so no loader decides it on its own.

    ``error`` (the default) raises the first bad row's `DataError`, with a hint to skip; ``skip``
    counts bad rows and keeps the first as an example, for one warning at the end (`report`).
    Bad rows are rows of an otherwise readable file: a wrong header or an empty split stays an error.
    """

    def __init__(self, on_bad_rows: str = "error"):
        check_choice("on_bad_rows", on_bad_rows, ON_BAD_ROWS)
        self.policy, self.count, self.first = on_bad_rows, 0, None

    def add(self, error: DataError) -> None:
        if self.policy == "error":
            raise DataError(error.path, f"{error.reason} ({SKIP_HINT})", error.line) from None
        self.count += 1
        self.first = self.first or error

    def report(self, what: str, total: int | None = None) -> None:
        """One warning that counts the skipped rows of ``what`` and names the first one."""
        if self.count:
            of = f" of {total:,}" if total is not None else ""
            log.warning(
                "%s: skipped %d bad rows%s (on_bad_rows=skip), first: %s", what, self.count, of, self.first
            )


def require_examples(dataset: Sized, where: str | Path, what: str = "example") -> None:
    """An empty split is an error: training or evaluating on nothing would look like a result."""
    if len(dataset) == 0:
        raise DataError(where, f"no {what} to read: this split would be empty")
