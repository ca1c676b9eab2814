"""LRA Retrieval: do two ACL Anthology Network papers cite each other? (``lra_benchmarks/matching``).

Official format (the ``lra_release`` tarball, ``lra_release.gz``):
``<data_dir>/lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv``, one pair per line, no header,
five tab-separated fields ``label, id1, id2, text1, text2``. LRA reads them with
``tf.data.experimental.make_csv_dataset(field_delim='\\t', use_quote_delim=False, header=False)`` and
a float32 label column, so a label may be written ``1`` or ``1.0`` and quotes are ordinary
characters; we split on tabs the same way and accept a label whose value is exactly 0 or 1.
Sizes: 147,086 / 18,090 / 17,437 pairs (train / eval / test); our split ``val`` reads ``eval``.

Tokens: byte level like the Text task, ``token = byte + 1`` (ids 1..256, 0 = padding, vocabulary
257), each document cut to its first ``max_length`` bytes (4,000 in LRA; LRA first cut the raw text
at 10,000 bytes, which only matters for ``max_length`` above that). The two documents go into
``sequences`` and ``sequences2`` of one `TokenSequenceDataset` (the two towers of the model).
"""

from __future__ import annotations

import logging
from pathlib import Path

from attnlab.data.errors import BadRows, DataError, MissingDataError, require_examples
from attnlab.data.examples import TokenSequenceDataset
from attnlab.data.lra.release import pick_release_dir
from attnlab.data.lra.text import VOCAB_SIZE, bytes_to_tokens, check_max_length

__all__ = ["VOCAB_SIZE", "NUM_CLASSES", "aan_path", "load_aan", "load_retrieval", "describe"]

log = logging.getLogger(__name__)

NUM_CLASSES = 2
DEFAULT_MAX_LENGTH = 4000  # per document, LRA
SPLITS = ("train", "val", "test")
SPLIT_FILES = {"train": "train", "val": "eval", "test": "test"}
EXPECTED_EXAMPLES = {"train": 147_086, "val": 18_090, "test": 17_437}
FIELDS = ("label", "id1", "id2", "text1", "text2")
HOW_TO_OBTAIN = (
    "Download the Long Range Arena release lra_release.gz (linked from "
    "https://github.com/google-research/long-range-arena) and extract it into data_dir, so that "
    "data_dir/lra_release/tsv_data/ holds the new_aan_pairs.*.tsv files."
)


def _file_name(split: str) -> str:
    if split not in SPLIT_FILES:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return f"new_aan_pairs.{SPLIT_FILES[split]}.tsv"


def aan_dir(data_dir: str | Path) -> Path:
    """The ``tsv_data`` folder read: ``<data_dir>/lra_release/tsv_data``, or the same one level
    deeper (``lra_release/lra_release/tsv_data``, how the tarball is often unpacked) when the files
    are there instead."""
    return pick_release_dir(data_dir, "tsv_data", [_file_name(s) for s in SPLITS])


def aan_path(data_dir: str | Path, split: str) -> Path:
    """``<tsv_data>/new_aan_pairs.<train|eval|test>.tsv`` for split train/val/test (see `aan_dir`)."""
    return aan_dir(data_dir) / _file_name(split)


def _parse_label(field: bytes, path: Path, line: int) -> int:
    try:
        value = float(field)
    except ValueError:
        raise DataError(path, f"label {field[:40]!r} is not a number", line=line) from None
    if value not in (0.0, 1.0):
        raise DataError(path, f"label {field[:40]!r} is not 0 or 1", line=line)
    return int(value)


def load_aan(
    root: str | Path,
    split: str,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    on_bad_rows: str = "error",
) -> TokenSequenceDataset:
    """Pairs of ``split`` from the official TSV under ``root`` (the data_dir).

    Raises MissingDataError when the file is absent, and DataError naming the file and 1-based line
    for a row that is not UTF-8, does not have five fields or whose label is not 0/1 (under
    ``on_bad_rows="skip"`` such rows are skipped and counted in ``dataset.num_skipped``), or when no
    pair is left. Empty lines are skipped.
    """
    path = aan_path(root, split)
    check_max_length(max_length)
    if not path.is_file():
        raise MissingDataError(path, HOW_TO_OBTAIN)
    bad_rows = BadRows(on_bad_rows)
    first, second, labels = [], [], []
    truncated = empty = 0
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            line = raw.rstrip(b"\r\n")
            if not line:
                continue
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                bad_rows.add(DataError(path, f"not valid UTF-8 (byte {err.start} of the line)", line_no))
                continue
            fields = line.split(b"\t")
            if len(fields) != len(FIELDS):
                bad_rows.add(
                    DataError(
                        path,
                        f"expected {len(FIELDS)} tab-separated fields ({', '.join(FIELDS)}), "
                        f"found {len(fields)}",
                        line=line_no,
                    )
                )
                continue
            try:
                label = _parse_label(fields[0], path, line_no)
            except DataError as err:
                bad_rows.add(err)
                continue
            labels.append(label)
            for text, out in ((fields[3], first), (fields[4], second)):
                truncated += max_length is not None and len(text) > max_length
                empty += not text
                out.append(bytes_to_tokens(text, max_length))
    bad_rows.report(str(path))
    dataset = TokenSequenceDataset(first, labels, sequences2=second)
    require_examples(dataset, path, "pair")
    if empty:
        # an empty document has no real token for the model to pool over
        log.warning("%s: %d empty documents", path, empty)
    dataset.num_truncated = int(truncated)  # documents, not pairs
    dataset.num_skipped = bad_rows.count
    return dataset


def load_retrieval(
    data_dir: str | Path,
    split: str,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    on_bad_rows: str = "error",
) -> tuple[TokenSequenceDataset, str]:
    """One split and the ``data_source`` string (the TSV path)."""
    dataset = load_aan(data_dir, split, max_length, on_bad_rows)
    if dataset.num_truncated:
        log.info("AAN %s: %d documents truncated to %s bytes", split, dataset.num_truncated, max_length)
    return dataset, str(aan_path(data_dir, split))


def _count_lines(path: Path, chunk: int = 1 << 24) -> int:
    """Number of lines (a last line without newline counts), counting newlines in binary chunks."""
    count, last = 0, b"\n"
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def describe(data_dir: str | Path, count: bool = True) -> dict:
    """Per split: the expected file, whether it is there and (``count``) its number of lines."""
    splits = {}
    for split in SPLITS:
        path = aan_path(data_dir, split)
        present = path.is_file()
        splits[split] = {
            "path": str(path),
            "present": present,
            "num_examples": _count_lines(path) if present and count else None,
            "expected_examples": EXPECTED_EXAMPLES[split],
        }
    return {
        "task": "retrieval",
        "format": "TSV, no header: label, id1, id2, text1, text2 (val = eval file)",
        "how_to_obtain": HOW_TO_OBTAIN,
        "splits": splits,
    }
