"""What is wrong with a corpus file, in one line naming the file (and line), for `TextCorpus`.

`datasets` reports a bad file as ``DatasetGenerationError: An error occurred while generating the
dataset`` with the real cause two exceptions down and no file name. Reading every file ahead of
`datasets` would cost a pass over a large corpus on every first run, so these helpers look only after
a failure: which file is empty, which one is not UTF-8 (and on which line).
"""

from __future__ import annotations

import codecs
from pathlib import Path

from attnlab.data.errors import DataError

_CHUNK = 1 << 20
FORMATS_HINT = "a corpus file is UTF-8 plain text, JSON lines or parquet (task.data.source.files)"


def explain_load_failure(error: BaseException, paths: list[Path], kind: str) -> DataError | None:
    """A `DataError` naming the file behind a failed ``datasets.load_dataset``, or None if unknown."""
    causes = _chain(error)
    if kind in ("text", "json"):
        for path in paths:
            where = first_non_utf8(path)
            if where is not None:
                line, byte = where
                return DataError(path, f"not UTF-8 text (byte 0x{byte:02x}); {FORMATS_HINT}", line)
    if any(type(c).__name__ == "SchemaInferenceError" for c in causes) or kind in ("text", "json"):
        empty = [p for p in paths if _is_blank(p)]
        if empty:
            return DataError(empty[0], "the file holds no text: no documents to read")
    if any(isinstance(c, ValueError | TypeError) for c in causes) and kind == "json":
        cause = next(c for c in causes if isinstance(c, ValueError | TypeError))
        return DataError(", ".join(map(str, paths)), f"not JSON lines with a text field ({cause})")
    return None


def document_texts(values: list, indices, where: str, field: str) -> list[str]:
    """The documents' texts, or a `DataError` for the first whose field is not a string (a JSON
    number, a list...): `datasets` would pass it on, and the tokenizer fail far from the file."""
    for value, index in zip(values, indices, strict=True):
        if value is not None and not isinstance(value, str):
            raise DataError(
                where,
                f"document {index}: field {field!r} holds {type(value).__name__} {str(value)[:40]!r}, "
                "expected a string (task.data.source.text_field names the text column)",
            )
    return [value or "" for value in values]


def first_non_utf8(path: Path) -> tuple[int, int] | None:
    """(1-based line, byte value) of the first byte that is not UTF-8 (or a NUL), or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                bad = [chunk.find(b"\0")]  # NUL decodes, but no text file holds one
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    bad.append(min(max(err.start, 0), len(chunk) - 1))
                bad = [at for at in bad if at >= 0]
                if bad:
                    at = min(bad)
                    return line + chunk.count(b"\n", 0, at), chunk[at]
                line += chunk.count(b"\n")
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:  # a file that ends inside a character
        return line, err.object[err.start] if err.object else 0
    except (OSError, IsADirectoryError):
        return None
    return None


def _is_blank(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return not handle.read(_CHUNK).strip()
    except OSError:
        return False


def _chain(error: BaseException) -> list[BaseException]:
    seen, found = set(), []
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found.append(error)
        error = error.__cause__ or error.__context__
    return found
