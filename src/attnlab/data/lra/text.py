"""LRA Text: IMDB sentiment at the byte level (Tay et al. 2020, ``lra_benchmarks/text_classification``).

Official source. LRA reads TFDS ``imdb_reviews`` (the Stanford ``aclImdb`` release: 25,000 labelled
training reviews, 25,000 test reviews, balanced) and encodes each review with a byte encoder, keeping
the first ``max_length`` bytes (4,096 in the paper; the repo's config uses 1,000). IMDB has no
validation split, so LRA validates on the test split; we do the same: ``val`` *is* ``test``.

What we read, in this order of preference:

1. The ``aclImdb`` folder as the tarball ``aclImdb_v1.tar.gz`` unpacks it, at exactly one place,
   ``<data_dir>/aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt`` (one review per file, UTF-8;
   ``pos`` is label 1, ``neg`` label 0; the ``unsup`` folder is ignored).
2. The Hugging Face dataset ``stanfordnlp/imdb`` (the same reviews, ``text``/``label`` columns with
   0 = neg, 1 = pos), only when the ``datasets`` library is installed *and* the dataset is already in
   its local cache: nothing is downloaded.

Text: as TFDS built ``imdb_reviews`` (``f.read().strip()``), each review is stripped of surrounding
ASCII whitespace (inner whitespace is kept); a review must be UTF-8 (a file that is not, or a review
that is empty once stripped, is a bad row: an error naming the file and line, or skipped under
``on_bad_rows="skip"``).

Tokens: ``token = byte + 1`` over the UTF-8 bytes of the review, so ids are 1..256 and 0 stays the
padding id (vocabulary 257). This is exactly LRA's encoding: ``tfds.deprecated.text.ByteTextEncoder()``
without additional tokens maps byte ``b`` to ``b + 1`` and keeps 0 for padding. No special token is
added: the models pool over real tokens with the padding mask.

Order: ``neg`` reviews then ``pos`` reviews, each sorted by file name, so a run is reproducible; the
training loader shuffles anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from numbers import Integral
from pathlib import Path

import numpy as np

from attnlab.data.errors import BadRows, DataError, MissingDataError, require_examples
from attnlab.data.examples import TokenSequenceDataset
from attnlab.data.hf_cache import load_hf_cached

log = logging.getLogger(__name__)

VOCAB_SIZE = 257  # 0 = padding, 1..256 = byte value + 1
NUM_CLASSES = 2
DEFAULT_MAX_LENGTH = 4096  # LRA paper
SPLITS = ("train", "val", "test")
# LRA validates on the IMDB test split (the dataset has no validation split).
SPLIT_FOLDERS = {"train": "train", "val": "test", "test": "test"}
EXPECTED_EXAMPLES = {"train": 25_000, "val": 25_000, "test": 25_000}
LABELS = {"neg": 0, "pos": 1}
HF_NAME = "stanfordnlp/imdb"
HOW_TO_OBTAIN = (
    "Download aclImdb_v1.tar.gz from https://ai.stanford.edu/~amaas/data/sentiment/ and extract it "
    "into data_dir (it creates aclImdb/), or cache the Hugging Face dataset "
    f"{HF_NAME!r} with `datasets` (installed with attnlab) on a machine with network access."
)


def _check_split(split: str) -> str:
    if split not in SPLIT_FOLDERS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return SPLIT_FOLDERS[split]


def check_max_length(max_length: int | None) -> None:
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, Integral) or max_length < 1
    ):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")


def bytes_to_tokens(data: bytes, max_length: int | None = None) -> np.ndarray:
    """Byte-level token ids (``byte + 1``) of the first ``max_length`` bytes, as compact int16."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if max_length is not None:
        raw = raw[:max_length]
    return raw.astype(np.int16) + 1


def _build(
    pairs: Iterable[tuple[bytes, int]], max_length: int | None, num_skipped: int = 0
) -> TokenSequenceDataset:
    """Tokenise (bytes, label) pairs; the dataset gets ``num_truncated`` for the run's description."""
    sequences, labels, truncated = [], [], 0
    for data, label in pairs:
        truncated += max_length is not None and len(data) > max_length
        sequences.append(bytes_to_tokens(data, max_length))
        labels.append(label)
    dataset = TokenSequenceDataset(sequences, labels)
    dataset.num_truncated, dataset.num_skipped = int(truncated), num_skipped
    return dataset


def clean_review(data: bytes, where: str | Path, bad_rows: BadRows) -> bytes | None:
    """The review as LRA saw it (surrounding whitespace stripped), or None for a bad one."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        bad_rows.add(DataError(where, f"not valid UTF-8 (byte {err.start})", line))
        return None
    data = data.strip()
    if not data:
        bad_rows.add(DataError(where, "empty review"))
        return None
    return data


# ----------------------------------------------------------------------------- aclImdb folder


def imdb_dir(data_dir: str | Path) -> Path:
    """The one documented place of the aclImdb folder: ``<data_dir>/aclImdb``."""
    return Path(data_dir) / "aclImdb"


def find_imdb(data_dir: str | Path) -> Path | None:
    """The aclImdb folder when every labelled folder it needs is there, else None."""
    root = imdb_dir(data_dir)
    folders = [root / split / label for split in ("train", "test") for label in LABELS]
    return root if all(f.is_dir() for f in folders) else None


def _review_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.txt"))


def load_imdb(
    root: str | Path,
    split: str,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    on_bad_rows: str = "error",
) -> TokenSequenceDataset:
    """Reviews of ``split`` from ``<root>/aclImdb`` (``val`` reads the test reviews, as LRA did)."""
    folder_split = _check_split(split)
    check_max_length(max_length)
    bad_rows = BadRows(on_bad_rows)
    base = imdb_dir(root) / folder_split
    pairs_from: list[tuple[Path, int]] = []
    for name, label in LABELS.items():
        folder = base / name
        if not folder.is_dir():
            raise MissingDataError(folder, HOW_TO_OBTAIN)
        files = _review_files(folder)
        if not files:
            raise MissingDataError(folder / "*.txt", f"The folder holds no review file. {HOW_TO_OBTAIN}")
        pairs_from += [(path, label) for path in files]
    pairs = []
    for path, label in pairs_from:
        review = clean_review(path.read_bytes(), path, bad_rows)
        if review is not None:
            pairs.append((review, label))
    bad_rows.report(f"IMDB {split} in {base}", len(pairs_from))
    dataset = _build(pairs, max_length, bad_rows.count)
    require_examples(dataset, base, "usable review")
    return dataset


def _hf_column(dataset, column: str, name: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is not None and column not in columns:
        raise DataError(f"huggingface:{name}", f"the cached dataset has columns {columns}, no {column!r}")


def load_imdb_hf(
    split: str,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    name: str = HF_NAME,
    data_dir: str | Path = "data",
    on_bad_rows: str = "error",
) -> TokenSequenceDataset:
    """The same reviews from the Hugging Face cache (``val`` is ``test``); nothing is downloaded.

    ``data_dir`` only serves the error message (where the aclImdb folder was expected).
    """
    hf_split = _check_split(split)
    check_max_length(max_length)
    bad_rows = BadRows(on_bad_rows)
    dataset = load_hf_cached(name, hf_split, imdb_dir(data_dir), HOW_TO_OBTAIN)
    for column in ("text", "label"):
        _hf_column(dataset, column, name)
    where = f"huggingface:{name}[{hf_split}]"
    pairs = []
    for index, row in enumerate(dataset):
        review = clean_review(row["text"].encode("utf-8"), f"{where} row {index}", bad_rows)
        if review is not None:
            pairs.append((review, int(row["label"])))
    bad_rows.report(where, len(dataset))
    built = _build(pairs, max_length, bad_rows.count)
    require_examples(built, where, "usable review")
    return built


# ----------------------------------------------------------------------------- choosing a source


def ensure_text(data_dir: str | Path, name: str = HF_NAME) -> str:
    """Where IMDB will be read from (the ``data_source``): the aclImdb path or ``huggingface:<name>``.

    Raises MissingDataError, with the expected aclImdb path and how to obtain it, when neither is there.
    """
    folder = find_imdb(data_dir)
    if folder is not None:
        return str(folder)
    load_hf_cached(name, "test", imdb_dir(data_dir), HOW_TO_OBTAIN)
    return f"huggingface:{name}"


def load_text(
    data_dir: str | Path,
    split: str,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    name: str = HF_NAME,
    on_bad_rows: str = "error",
) -> tuple[TokenSequenceDataset, str]:
    """One split from the preferred source, and the ``data_source`` string saying which was read."""
    source = ensure_text(data_dir, name)
    if source.startswith("huggingface:"):
        dataset = load_imdb_hf(split, max_length, name=name, data_dir=data_dir, on_bad_rows=on_bad_rows)
    else:
        dataset = load_imdb(data_dir, split, max_length, on_bad_rows)
    if dataset.num_truncated:
        log.info(
            "IMDB %s: %d of %d reviews truncated to %s bytes",
            split,
            dataset.num_truncated,
            len(dataset),
            max_length,
        )
    return dataset, source


def describe(data_dir: str | Path) -> dict:
    """Per split: the expected folders, whether they are there and how many reviews they hold."""
    splits = {}
    for split, folder_split in SPLIT_FOLDERS.items():
        folders = [imdb_dir(data_dir) / folder_split / label for label in LABELS]
        present = all(f.is_dir() for f in folders)
        splits[split] = {
            "path": str(imdb_dir(data_dir) / folder_split),
            "present": present,
            "num_examples": sum(len(_review_files(f)) for f in folders) if present else None,
            "expected_examples": EXPECTED_EXAMPLES[split],
        }
    return {
        "task": "text",
        "format": "aclImdb/{train,test}/{pos,neg}/*.txt (val = test, as in LRA)",
        "fallback": f"huggingface:{HF_NAME} (local cache only)",
        "how_to_obtain": HOW_TO_OBTAIN,
        "splits": splits,
    }
