"""GLUE data: the official TSV layout (or the Hugging Face ``glue`` dataset in the local cache), tokenized
with the pretrained model's own tokenizer.

Files: ``<data_dir>/glue_data/<TASK>/{train,dev}.tsv`` with the task folders named as in the official
download (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE). Each file is read by its own layout: columns
by header name, except CoLA's header-less ``source, label, original label, sentence``; MNLI's dev set is
``dev_matched.tsv`` + ``dev_mismatched.tsv``. Fields are split on tabs only (no quoting: GLUE text holds
bare quotes). A row with the wrong number of fields or an unreadable label (QQP has a few in the wild) is
a bad row, stopping the run or skipped and counted by ``on_bad_rows`` (`attnlab.data.errors.BadRows`).

Splits: ``dev`` is the test split (GLUE's test labels are private, so ``test.tsv`` is never read); the
validation split is the dev set (``val_fraction=0``, as the GLUE papers select) or a seeded slice of
train (``val_fraction`` > 0), the rest trains. Examples are framed as
RoBERTa's: ``<s> A </s>`` or ``<s> A </s></s> B </s>``, the longer sentence truncated first.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.errors import ON_BAD_ROWS, BadRows, DataError, MissingDataError, check_choice
from attnlab.data.loaders import SPLITS, ShardedDataModule
from attnlab.data.packing import check_packing, pack_sequences
from attnlab.data.pretrained import read_pretrained
from attnlab.data.tokenizer import BPETokenizer
from attnlab.errors import ConfigError

log = logging.getLogger(__name__)
FORMATS = ("auto", "tsv", "hf")
NLI = ("entailment", "not_entailment")


@dataclass(frozen=True)
class GlueSpec:
    """One task's files, columns, labels (in the Hugging Face ``glue`` ids) and dev files."""

    name: str
    folder: str
    text: tuple[str, ...]  # header names of the one or two sentence columns
    label: str
    labels: tuple[str, ...] | None  # the label strings in id order; None: a regression score
    hf_text: tuple[str, ...]
    columns: tuple[str, ...] | None = None  # a file without a header: its columns, in order
    dev: tuple[str, ...] = ("dev",)
    hf_dev: tuple[str, ...] = ("validation",)
    score_range: tuple[float, float] | None = None  # a regression score's bounds (STS-B: 0 to 5)

    @property
    def num_outputs(self) -> int:
        return 1 if self.labels is None else len(self.labels)


TASKS: dict[str, GlueSpec] = {
    s.name: s
    for s in (
        GlueSpec(
            "cola", "CoLA", ("sentence",), "label", ("0", "1"), ("sentence",),
            columns=("source", "label", "original_label", "sentence"),
        ),
        GlueSpec("sst2", "SST-2", ("sentence",), "label", ("0", "1"), ("sentence",)),
        GlueSpec(
            "mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", ("0", "1"), ("sentence1", "sentence2")
        ),
        GlueSpec(
            "stsb", "STS-B", ("sentence1", "sentence2"), "score", None, ("sentence1", "sentence2"),
            score_range=(0.0, 5.0),
        ),
        GlueSpec(
            "qqp", "QQP", ("question1", "question2"), "is_duplicate", ("0", "1"), ("question1", "question2")
        ),
        GlueSpec(
            "mnli", "MNLI", ("sentence1", "sentence2"), "gold_label",
            ("entailment", "neutral", "contradiction"), ("premise", "hypothesis"),
            dev=("dev_matched", "dev_mismatched"), hf_dev=("validation_matched", "validation_mismatched"),
        ),
        GlueSpec("qnli", "QNLI", ("question", "sentence"), "label", NLI, ("question", "sentence")),
        GlueSpec("rte", "RTE", ("sentence1", "sentence2"), "label", NLI, ("sentence1", "sentence2")),
    )
}  # fmt: skip


def glue_spec(name: str) -> GlueSpec:
    check_choice("task.glue_task", name, tuple(TASKS))
    return TASKS[name]


@dataclass
class Examples:
    """Raw examples of one file: sentence(s), labels (int ids or float scores) and the file's subset."""

    first: list[str]
    second: list[str] | None
    labels: np.ndarray
    origin: str = ""  # what was read: a file, a save_to_disk folder or the cached Hub dataset

    def __len__(self) -> int:
        return len(self.first)


def read_glue_tsv(path: str | Path, spec: GlueSpec, bad_rows: BadRows) -> Examples:
    """One official GLUE TSV; bad rows go to ``bad_rows`` (raised or counted), a wrong header raises."""
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(path, _how_to_obtain(spec))
    lines = path.read_bytes().split(b"\n")  # decoded line by line: a bad byte is a bad row, named
    start = 0
    if spec.columns is None:
        header = _decode(lines[0], path, 1).rstrip("\r").split("\t")
        start = 1
    else:
        header = list(spec.columns)
    absent = [c for c in (*spec.text, spec.label) if c not in header]
    if absent:
        raise DataError(
            path,
            f"the header has no column {', '.join(map(repr, absent))} (it has {header}); "
            f"is this {spec.folder}'s file of the official GLUE download?",
            line=1,
        )
    where = [header.index(c) for c in spec.text]
    at_label = header.index(spec.label)
    first, second, labels = [], [] if len(where) == 2 else None, []
    for number, raw_line in enumerate(lines[start:], start=start + 1):
        try:
            line = _decode(raw_line, path, number).rstrip("\r")
        except DataError as err:
            bad_rows.add(err)
            continue
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            bad_rows.add(
                DataError(path, f"{len(fields)} tab-separated fields, expected {len(header)}", number)
            )
            continue
        raw = fields[at_label].strip()
        label = _parse_label(raw, spec)
        if label is None:
            allowed = "one of " + ", ".join(spec.labels) if spec.labels is not None else "a finite number"
            if spec.score_range is not None:
                allowed = "a number from {:g} to {:g}".format(*spec.score_range)
            bad_rows.add(
                DataError(path, f"label {raw!r} in column {spec.label!r}: expected {allowed}", number)
            )
            continue
        first.append(fields[where[0]])
        if second is not None:
            second.append(fields[where[1]])
        labels.append(label)
    bad_rows.report(str(path))
    if not first:
        raise DataError(path, "no example to read: this split would be empty")
    dtype = np.float32 if spec.labels is None else np.int64
    return Examples(first, second, np.asarray(labels, dtype=dtype), origin=str(path))


def _parse_label(raw: str, spec: GlueSpec) -> float | int | None:
    if spec.labels is not None:
        return spec.labels.index(raw) if raw in spec.labels else None
    try:
        value = float(raw)
    except ValueError:
        return None
    if spec.score_range is not None and not spec.score_range[0] <= value <= spec.score_range[1]:
        return None
    return value if math.isfinite(value) else None


def _decode(line: bytes, path: Path, number: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            path, f"not UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1})", number
        ) from None


def _how_to_obtain(spec: GlueSpec) -> str:
    return (
        f"Put the official GLUE download's {spec.folder} folder under <data_dir>/glue_data/ "
        f"(task.data.source.data_dir), or cache the Hugging Face dataset `{HF_NAME}` ({spec.name}) "
        "and set task.data.source.format=hf."
    )


HF_NAME = "nyu-mll/glue"  # the Hub's id; a cache under the older `glue` is found too


def read_glue_hf(
    spec: GlueSpec, split: str, hf_path: str | Path | None = None, expected: str | Path | None = None
) -> Examples:
    """The same examples from the Hugging Face GLUE dataset: the local cache (offline, nothing is
    downloaded; under `HF_NAME` or the older `glue`) or a ``save_to_disk`` folder of it (``hf_path``)."""
    import datasets

    from attnlab.data.hf_cache import hf_offline, load_hf_cached

    where = str(hf_path) if hf_path is not None else f"huggingface:{HF_NAME}/{spec.name}"
    if hf_path is not None:
        with hf_offline(datasets):
            try:
                loaded = datasets.load_from_disk(str(hf_path))
            except Exception as err:
                reason = f"not a save_to_disk folder ({type(err).__name__}: {err})"
                raise MissingDataError(hf_path, reason) from err
        if split not in loaded:
            raise DataError(where, f"no split {split!r}; it has {list(loaded)}")
        dataset = loaded[split]
    else:
        dataset = load_hf_cached(HF_NAME, split, expected or where, _how_to_obtain(spec), config=spec.name)
    absent = [c for c in (*spec.hf_text, "label") if c not in dataset.column_names]
    if absent:
        raise DataError(where, f"no column {', '.join(absent)}; the columns are {dataset.column_names}")
    labels = np.asarray(dataset["label"], dtype=np.float32 if spec.labels is None else np.int64)
    if spec.labels is not None and ((labels < 0) | (labels >= len(spec.labels))).any():
        raise DataError(where, f"labels outside 0..{len(spec.labels) - 1} (unlabelled test split?)")
    second = list(dataset[spec.hf_text[1]]) if len(spec.hf_text) == 2 else None
    return Examples(list(dataset[spec.hf_text[0]]), second, labels, origin=where)


class GlueSource:
    """Where one GLUE task's examples come from: ``<data_dir>/glue_data/<TASK>/`` or the HF cache.

    format: ``tsv`` (the official layout), ``hf`` (the ``glue`` dataset from the local cache, or the
    ``save_to_disk`` folder ``hf_path``) or ``auto`` (tsv when the task folder exists, else hf).
    """

    def __init__(
        self,
        glue_task: str,
        data_dir: str | Path = "data",
        format: str = "auto",
        hf_path: str | None = None,
    ):
        self.spec = glue_spec(glue_task)
        check_choice("task.data.source.format", format, FORMATS)
        self.data_dir, self.format, self.hf_path = Path(data_dir), format, hf_path
        self.name = f"glue_{glue_task}"
        self._used: str | None = None

    @property
    def folder(self) -> Path:
        return self.data_dir / "glue_data" / self.spec.folder

    def _kind(self) -> str:
        if self.format != "auto":
            return self.format
        return "tsv" if self.folder.is_dir() else "hf"

    def read(self, on_bad_rows: str = "error") -> tuple[Examples, list[Examples]]:
        """(train, [dev files]): MNLI has two dev sets, matched and mismatched; every other task one."""
        kind = self._kind()
        if kind == "tsv":
            self._used = str(self.folder)
            train = read_glue_tsv(self.folder / "train.tsv", self.spec, BadRows(on_bad_rows))
            dev = [
                read_glue_tsv(self.folder / f"{d}.tsv", self.spec, BadRows(on_bad_rows))
                for d in self.spec.dev
            ]
            return train, dev
        expected = self.folder if self.format == "auto" else None  # neither the folder nor the cache
        train = read_glue_hf(self.spec, "train", self.hf_path, expected)
        self._used = self.hf_path or f"{train.origin} (local cache)"
        return train, [read_glue_hf(self.spec, d, self.hf_path, expected) for d in self.spec.hf_dev]

    @property
    def description(self) -> str:
        return f"GLUE {self.spec.folder} from {self._used or self.folder}; dev is the test split"


def encode_pairs(
    tokenizer: BPETokenizer, first: list[str], second: list[str] | None, max_length: int
) -> list[np.ndarray]:
    """RoBERTa's framing: ``<s> A </s>`` or ``<s> A </s></s> B </s>``; the longer side is cut first."""
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    a_ids = tokenizer.encode_batch(first)
    if second is None:
        return [np.asarray([bos, *a[: max(0, max_length - 2)], eos], dtype=np.int64) for a in a_ids]
    out = []
    budget = max(2, max_length - 4)
    for a, b in zip(a_ids, tokenizer.encode_batch(second), strict=True):
        la, lb = len(a), len(b)
        while la + lb > budget:  # longest first, as Hugging Face's "longest_first"
            if la >= lb:
                la -= 1
            else:
                lb -= 1
        out.append(np.asarray([bos, *a[:la], eos, eos, *b[:lb], eos], dtype=np.int64))
    return out


class GlueDataset(Dataset):
    """Token ids, labels and, for the test split, which dev set each example is from (MNLI m/mm)."""

    def __init__(self, ids: list[np.ndarray], labels: np.ndarray, subset: np.ndarray | None = None):
        self.ids, self.labels = ids, labels
        self.subset = subset if subset is not None else np.zeros(len(ids), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.fromiter((len(i) for i in self.ids), dtype=np.int64, count=len(self.ids))

    def __getitem__(self, index: int) -> dict:
        return {"ids": self.ids[index], "label": self.labels[index], "subset": int(self.subset[index])}


class GlueDataModule(ShardedDataModule):
    """One GLUE task, tokenized with the tokenizer saved in the pretrained checkpoint (``pretrained``)."""

    pool_batches = 50  # sentence pairs vary in length: bucket the training batches

    def __init__(
        self,
        source: GlueSource,
        pretrained: str | None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        max_length: int | None = None,
        val_fraction: float = 0.05,
        split_seed: int = 0,
        on_bad_rows: str = "error",
        packing: bool = False,
        pack_length: int | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"task.data.batch_size={batch_size}: expected an integer >= 1")
        check_packing(packing, pack_length)
        self.packing, self.pack_length = packing, pack_length
        if not 0 <= val_fraction < 1:
            raise ConfigError(
                f"task.data.val_fraction={val_fraction}: expected a fraction in [0, 1) (0: select on the "
                "dev set, as the GLUE papers do)"
            )
        check_choice("task.data.on_bad_rows", on_bad_rows, ON_BAD_ROWS)
        self.pretrained = read_pretrained(pretrained)
        self.tokenizer = self.pretrained.tokenizer
        model_len = int(self.pretrained.shape["max_len"])
        if max_length is not None and not 4 < max_length <= model_len:
            raise ConfigError(
                f"task.data.max_length={max_length}: expected 5..{model_len} (the pretrained model's "
                "max_len) or null for the model's max_len"
            )
        self.source, self.spec = source, source.spec
        self.max_tokens = max_length or model_len
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.seed, self.split_seed = num_workers, seed, split_seed
        self.val_fraction, self.on_bad_rows = val_fraction, on_bad_rows
        self.datasets: dict[str, GlueDataset] = {}

    def prepare_data(self) -> None:
        pass  # nothing to generate: the files are read in setup

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        train, devs = self.source.read(self.on_bad_rows)
        encode = lambda ex: encode_pairs(self.tokenizer, ex.first, ex.second, self.max_tokens)  # noqa: E731
        ids = encode(train)
        test_ids, test_labels, subset = [], [], []
        for code, dev in enumerate(devs):
            test_ids += encode(dev)
            test_labels.append(dev.labels)
            subset += [code] * len(dev)
        test = GlueDataset(test_ids, np.concatenate(test_labels), np.asarray(subset, dtype=np.int64))
        if self.val_fraction == 0:  # select on dev and report dev, as the GLUE papers do (MNLI: matched)
            first = test.subset == 0
            val = GlueDataset(
                [x for x, keep in zip(test_ids, first, strict=True) if keep], test.labels[first]
            )
            train_set = GlueDataset(ids, train.labels)
        else:  # a seeded slice of train, to tune without looking at dev
            order = np.random.default_rng(self.split_seed).permutation(len(ids))
            n_val = max(1, round(self.val_fraction * len(ids)))
            if n_val >= len(ids):
                raise DataError(
                    self.source.description, f"train has {len(ids)} examples: too few to hold out val"
                )
            val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
            val = GlueDataset([ids[i] for i in val_idx], train.labels[val_idx])
            train_set = GlueDataset([ids[i] for i in train_idx], train.labels[train_idx])
        self.datasets = {"train": train_set, "val": val, "test": test}
        sizes = ", ".join(f"{s} {len(self.datasets[s]):,}" for s in SPLITS)
        log.info("data: %s (%s; at most %d tokens)", self.source.description, sizes, self.max_tokens)

    # ---- what the pipeline reads ---------------------------------------------------------------------
    def model_kwargs(self) -> dict:
        """The pretrained model's shape (the config cannot change it) and the task's number of outputs."""
        return {**self.pretrained.model_shape(), "num_outputs": self.spec.num_outputs}

    def max_length(self, split: str = "train") -> int:
        self.setup()
        return int(self.datasets[split].lengths().max())

    def baselines(self, split: str = "test") -> dict[str, float]:
        """What always answering train's most frequent class scores on ``split``'s main metric
        (``test_acc``): its accuracy (CoLA too, which Table 4 does not list); 0 for STS-B's
        Spearman (a constant has no correlation)."""
        self.setup()
        if self.spec.labels is None:
            return {"baseline_acc": 0.0}
        majority = np.bincount(self.datasets["train"].labels).argmax()
        test = self.datasets[split]
        first = test.subset == 0  # MNLI: the matched dev set, as test_acc
        return {"baseline_acc": float((test.labels[first] == majority).mean())}

    # ---- loaders -------------------------------------------------------------------------------------
    def _collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        labels = torch.as_tensor(np.asarray([e["label"] for e in examples]))
        subset = torch.tensor([e["subset"] for e in examples])
        if self.packing:  # the pairs end to end in rows (attnlab.data.packing), labels in example order
            ids = [torch.from_numpy(e["ids"]) for e in examples]
            packed = pack_sequences(ids, row_length=self.pack_length, pad_id=self.tokenizer.pad_id)
            return {**packed, "labels": labels, "subset": subset}
        length = max(len(e["ids"]) for e in examples)
        ids = torch.full((len(examples), length), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(examples), length), dtype=torch.bool)
        for row, example in enumerate(examples):
            ids[row, : len(example["ids"])] = torch.from_numpy(example["ids"])
            mask[row, : len(example["ids"])] = True
        return {"input_ids": ids, "mask": mask, "labels": labels, "subset": subset}

    def train_lengths(self) -> np.ndarray:
        return self.datasets["train"].lengths()

    @property
    def train_items(self) -> str:
        return f"{self.source.name} examples"

    def eval_order(self, split: str) -> np.ndarray:
        return np.argsort(self.datasets[split].lengths(), kind="stable")
