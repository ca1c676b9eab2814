"""Masked-LM data: a text corpus → byte-level BPE → packed blocks → BERT masking.

Corpus (`TextCorpus`): local files read with Hugging Face `datasets` (plain text, JSON lines, parquet, or
a ``save_to_disk`` folder; ``streaming`` for corpora larger than memory), or, with no files, the English
documentation text that ships with every Python (``pydoc_data.topics``). Documents are split into
train/val/test by a seeded hash of their position, tokenized with ``map(batched=True, num_proc=...)``,
and each split is written once as one flat stream of token ids, each document followed by ``</s>``
(RoBERTa's "full sentences": blocks run across documents, the separators kept). Nothing is downloaded.

Everything prepared lives under ``<data_dir>/mlm/<corpus>/``: the trained tokenizer
(``bpe<V>/vocab.json, merges.txt``) and the token streams (``tokens-<id>/{train,val,test}.bin``), reused by
later runs while the files, the tokenizer and the split settings stay the same.

Blocks (`PackedBlocks`): ``<s>`` and the next ``seq_len - 1`` tokens of the stream; the last block is
padded, so every token is in exactly one block. Masking (`mask_tokens`): ``mask_rate`` of the non-special
tokens are predicted; of those 80 % become ``<mask>``, 10 % a random token, 10 % stay. Training masks come
from a generator seeded by (seed, rank, batch counter), so a resumed run draws the masks the
uninterrupted one would have; validation and test masks are fixed per block (``mask_seed``), so every
run and backend is scored on the same tokens, and so is the unigram baseline (`MLMDataModule.baselines`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.corpus_blocks import CorpusBlocksDataModule
from attnlab.data.corpus_errors import FORMATS_HINT, document_texts, explain_load_failure
from attnlab.data.errors import DataError, MissingDataError, check_choice, read_json
from attnlab.data.loaders import SPLITS
from attnlab.data.tokenizer import MERGES_FILE, VOCAB_FILE, BPETokenizer, load_bpe, train_bpe
from attnlab.errors import ConfigError, UserError
from attnlab.files import removed_on_failure

log = logging.getLogger(__name__)
FORMATS = ("auto", "text", "json", "parquet", "disk")
SAMPLE_BY = ("line", "paragraph", "document")
EMBEDDED = "pydoc_data.topics"
_SUFFIX_FORMAT = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_MAP_BATCH = 1000


# ----------------------------------------------------------------------------------- documents


def embedded_documents() -> list[str]:
    """The standard library's documentation topics, one document per paragraph (blank-line separated).

    Paragraphs rather than the 79 topics: the held-out splits then sample the whole text evenly.
    """
    from pydoc_data.topics import topics

    return [p.strip() for key in sorted(topics) for p in topics[key].split("\n\n") if p.strip()]


def split_of(indices: np.ndarray, seed: int, val_fraction: float, test_fraction: float) -> np.ndarray:
    """0 (train), 1 (val) or 2 (test) for each document index: a seeded hash, so streaming works too."""
    x = indices.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    u = (x ^ (x >> np.uint64(31))).astype(np.float64) / 2.0**64
    return np.where(u < val_fraction, 1, np.where(u < val_fraction + test_fraction, 2, 0)).astype(np.int8)


def _digest(value) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:10]


def _stamps(path: Path) -> list[tuple[str, int, int]]:
    """(path, size, whole-second mtime) of a corpus file, or of each file of a ``save_to_disk`` folder
    except the ``cache-*.arrow`` files `datasets` adds there when it maps the set: the folder's own
    mtime moves with those, which gave the corpus a new id between tokenizing and loading it."""
    files = sorted(f for f in path.rglob("*") if f.is_file() and not f.name.startswith("cache-"))
    return [(str(f), f.stat().st_size, int(f.stat().st_mtime)) for f in (files if path.is_dir() else [path])]


class TextCorpus:
    """Where the text comes from, how it is split and tokenized; prepares and loads the token streams.

    files: null (the embedded ``pydoc_data.topics``), a path, a glob or a list of them; or a folder
    written by ``Dataset.save_to_disk``. format: ``auto`` picks by extension (.txt text, .json/.jsonl
    JSON lines, .parquet; a folder is ``disk``). text_field: the column holding the text (JSON, parquet,
    disk). sample_by: what a document is in plain text files (``paragraph``: blank-line separated).
    tokenizer: ``vocab``/``merges`` of a RoBERTa-style tokenizer, or null to train ``vocab_size`` merges
    on the train split (``min_frequency``).
    """

    def __init__(
        self,
        data_dir: str | Path = "data",
        files: str | Sequence[str] | None = None,
        format: str = "auto",
        text_field: str = "text",
        sample_by: str = "paragraph",
        hf_split: str = "train",
        streaming: bool = False,
        num_proc: int = 1,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        split_seed: int = 0,
        tokenizer: dict | None = None,
    ):
        check_choice("task.data.source.format", format, FORMATS)
        check_choice("task.data.source.sample_by", sample_by, SAMPLE_BY)
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ConfigError(
                f"task.data.source.val_fraction={val_fraction} and test_fraction={test_fraction}: each must "
                "be in (0, 1) and their sum below 1 (the rest is the train split)"
            )
        if num_proc < 1:
            raise ConfigError(f"task.data.source.num_proc={num_proc}: expected an integer >= 1")
        tokenizer = dict(tokenizer or {})
        unknown = set(tokenizer) - {"vocab", "merges", "vocab_size", "min_frequency"}
        if unknown:
            raise ConfigError(
                f"task.data.source.tokenizer has unknown keys {sorted(unknown)}; "
                "allowed: vocab, merges, vocab_size, min_frequency"
            )
        self.vocab_file, self.merges_file = tokenizer.get("vocab"), tokenizer.get("merges")
        if (self.vocab_file is None) != (self.merges_file is None):
            raise ConfigError(
                "task.data.source.tokenizer: give both vocab (vocab.json) and merges (merges.txt), "
                f"or neither to train one; got vocab={self.vocab_file!r}, merges={self.merges_file!r}"
            )
        self.vocab_size = int(tokenizer.get("vocab_size", 4096))
        self.min_frequency = int(tokenizer.get("min_frequency", 2))
        self.data_dir = Path(data_dir)
        self.files = [files] if isinstance(files, str) else (list(files) if files is not None else None)
        self.format, self.text_field, self.sample_by = format, text_field, sample_by
        self.hf_split, self.streaming, self.num_proc = hf_split, streaming, num_proc
        self.val_fraction, self.test_fraction, self.split_seed = val_fraction, test_fraction, split_seed
        self.name = "mlm"
        self._tokenizer: BPETokenizer | None = None
        self._meta: dict | None = None

    # ---- identity and layout --------------------------------------------------------------------
    def _resolved_files(self) -> list[Path]:
        import glob

        paths: list[Path] = []
        for pattern in self.files or []:
            matches = sorted(glob.glob(str(Path(pattern).expanduser()))) or [pattern]
            paths += [Path(m).resolve() for m in matches]
        missing = [p for p in paths if not p.exists()]
        if missing:
            raise MissingDataError(
                missing[0],
                "task.data.source.files names text files (plain text, JSON lines, parquet) or a "
                "save_to_disk folder; null uses the embedded pydoc_data.topics corpus.",
            )
        return paths

    def _file_format(self, paths: list[Path]) -> str:
        if self.format != "auto":
            return self.format
        if len(paths) == 1 and paths[0].is_dir():
            return "disk"
        kinds = {_SUFFIX_FORMAT.get(p.suffix.lower()) for p in paths}
        if None in kinds or len(kinds) != 1:
            raise ConfigError(
                f"task.data.source.format=auto cannot tell the format of {', '.join(p.name for p in paths)}: "
                f"extensions {', '.join(_SUFFIX_FORMAT)} (one kind) or a save_to_disk folder; "
                f"or set format to one of {', '.join(FORMATS[1:])}"
            )
        return kinds.pop()

    def corpus_id(self) -> str:
        """The folder name under ``<data_dir>/mlm/``: which text, and how it was cut into documents."""
        if self.files is None:
            return f"pydoc-topics-py{sys.version_info.major}.{sys.version_info.minor}"
        paths = self._resolved_files()
        stamp = [entry for p in paths for entry in _stamps(p)]
        options = [self._file_format(paths), self.text_field, self.sample_by, self.hf_split]
        return f"{paths[0].stem or 'corpus'}-{_digest([stamp, options])}"

    @property
    def root(self) -> Path:
        return self.data_dir / "mlm" / self.corpus_id()

    def tokenizer_dir(self) -> Path:
        return self.root / f"bpe{self.vocab_size}-min{self.min_frequency}"

    def _split_settings(self) -> dict:
        return {"val": self.val_fraction, "test": self.test_fraction, "seed": self.split_seed}

    def tokens_dir(self) -> Path:
        tokenizer = self.tokenizer()
        return self.root / f"tokens-{_digest([tokenizer.files(), self._split_settings()])}"

    # ---- reading documents ---------------------------------------------------------------------
    def _dataset(self):
        """The raw documents as a `datasets` Dataset (or IterableDataset when streaming)."""
        import datasets

        from attnlab.data.hf_cache import hf_offline

        if self.files is None:
            dataset = datasets.Dataset.from_dict({"text": embedded_documents()})
            return dataset.to_iterable_dataset() if self.streaming else dataset
        paths = self._resolved_files()
        kind = self._file_format(paths)
        cache = str(self.root / "hf_cache")
        with hf_offline(datasets):
            if kind == "disk":
                try:
                    loaded = datasets.load_from_disk(str(paths[0]))
                except FileNotFoundError as err:  # a folder, but not one that save_to_disk wrote
                    raise DataError(
                        paths[0],
                        "not a folder written by `datasets`' save_to_disk (no dataset_info.json / "
                        "state.json); give text, JSON lines or parquet files in task.data.source.files",
                    ) from err
                if isinstance(loaded, datasets.DatasetDict):
                    if self.hf_split not in loaded:
                        raise DataError(
                            paths[0],
                            f"no split {self.hf_split!r} (task.data.source.hf_split); has {list(loaded)}",
                        )
                    loaded = loaded[self.hf_split]
                dataset = loaded.to_iterable_dataset() if self.streaming else loaded
            else:
                options = {"sample_by": self.sample_by} if kind == "text" else {}
                try:
                    dataset = datasets.load_dataset(
                        kind, data_files=[str(p) for p in paths], split="train",
                        streaming=self.streaming, cache_dir=cache, **options,
                    )  # fmt: skip
                except datasets.exceptions.DatasetGenerationError as err:
                    raise explain_load_failure(err, paths, kind) or err from err
                except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
                    if isinstance(err, UserError):
                        raise
                    raise DataError(
                        paths[0], f"cannot be read as {kind} ({str(err).splitlines()[0]}); {FORMATS_HINT}"
                    ) from err
        field = "text" if kind == "text" else self.text_field
        columns = dataset.column_names
        if columns is not None and field not in columns:
            raise DataError(
                paths[0], f"no column {field!r} (task.data.source.text_field); the columns are {columns}"
            )
        return dataset if field == "text" else dataset.rename_column(field, "text")

    def _train_texts(self, dataset) -> Iterator[list[str]]:
        """Batches of the train split's non-empty documents (what the tokenizer learns from)."""
        start = 0
        for batch in dataset.iter(batch_size=_MAP_BATCH):
            texts = batch["text"]
            split = split_of(np.arange(start, start + len(texts)), *self._split_args())
            texts = document_texts(texts, range(start, start + len(texts)), self.short_name, self.text_field)
            start += len(texts)
            yield [t.strip() for t, s in zip(texts, split, strict=True) if s == 0 and t.strip()]

    def _split_args(self) -> tuple:
        return self.split_seed, self.val_fraction, self.test_fraction

    # ---- the tokenizer ---------------------------------------------------------------------------
    def tokenizer(self) -> BPETokenizer:
        """The user's vocab.json + merges.txt, or the one trained on this corpus (trained if absent)."""
        if self._tokenizer is None:
            if self.vocab_file is not None:
                self._tokenizer = load_bpe(self.vocab_file, self.merges_file)
            else:
                folder = self.tokenizer_dir()
                if not (folder / VOCAB_FILE).is_file():
                    log.info("training a byte-level BPE of %d tokens on %s", self.vocab_size, self.short_name)
                    train_bpe(self._train_texts(self._dataset()), self.vocab_size, folder, self.min_frequency)
                self._tokenizer = load_bpe(folder / VOCAB_FILE, folder / MERGES_FILE)
        return self._tokenizer

    # ---- preparing the token streams -------------------------------------------------------------
    def prepare(self) -> None:
        """Train the tokenizer if needed, then tokenize every document into the three split streams."""
        folder = self.tokens_dir()
        if (folder / "meta.json").is_file():
            return
        tokenizer = self.tokenizer()
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
        eos, args = tokenizer.eos_id, self._split_args()

        def tokenize(batch, indices):
            # a document's outer whitespace goes: the separator stands in for it
            texts = document_texts(batch["text"], indices, self.short_name, self.text_field)
            ids = tokenizer.encode_batch([t.strip() for t in texts])
            split = split_of(np.asarray(indices), *args)
            # an empty document adds nothing, not even a separator
            return {"ids": [i + [eos] if i else [] for i in ids], "split": split.tolist()}

        dataset = self._dataset()
        options = {} if self.streaming else {"num_proc": self.num_proc if self.num_proc > 1 else None}
        tokenized = dataset.map(
            tokenize,
            batched=True,
            batch_size=_MAP_BATCH,
            with_indices=True,
            remove_columns=["text"],
            **options,
        )
        folder.mkdir(parents=True, exist_ok=True)
        counts = {s: {"documents": 0, "tokens": 0} for s in SPLITS}
        partials = {s: folder / f"{s}.bin.partial" for s in SPLITS}  # gone if this does not finish
        with removed_on_failure(*partials.values()), contextlib.ExitStack() as stack:
            handles = {s: stack.enter_context(open(partials[s], "wb")) for s in SPLITS}
            for batch in tokenized.iter(batch_size=_MAP_BATCH):
                for ids, split in zip(batch["ids"], batch["split"], strict=True):
                    if ids:
                        name = SPLITS[split]
                        np.asarray(ids, dtype=dtype).tofile(handles[name])
                        counts[name]["documents"] += 1
                        counts[name]["tokens"] += len(ids)
            empty = [s for s in SPLITS if counts[s]["tokens"] == 0]
            if empty:
                documents = sum(c["documents"] for c in counts.values())
                raise DataError(
                    self.short_name,
                    f"the {', '.join(empty)} split has no text ({documents} non-empty documents in all): "
                    "give more documents or raise val_fraction/test_fraction",
                )
        for split in SPLITS:
            partials[split].replace(folder / f"{split}.bin")
        meta = {
            "dtype": np.dtype(dtype).name,
            "splits": counts,
            "corpus": self.short_name,
            "tokenizer": tokenizer.where,
            "split_settings": self._split_settings(),
        }
        (folder / "meta.json").write_text(json.dumps(meta, indent=1))  # last: the streams are complete
        log.info(
            "tokenized %s: %s", self.short_name, ", ".join(f"{s} {counts[s]['tokens']:,}" for s in SPLITS)
        )

    def meta(self) -> dict:
        if self._meta is None:
            path = self.tokens_dir() / "meta.json"
            if not path.is_file():
                raise MissingDataError(
                    path, "Run `attnlab data prepare mlm` or train once: it tokenizes the corpus."
                )
            self._meta = read_json(path, (), "the tokenized corpus's record")
        return self._meta

    def load(self) -> dict[str, np.ndarray]:
        """The three token streams, memory-mapped (a corpus larger than memory stays on disk)."""
        meta, folder = self.meta(), self.tokens_dir()
        return {s: np.memmap(folder / f"{s}.bin", dtype=meta["dtype"], mode="r") for s in SPLITS}

    # ---- what fed the run ---------------------------------------------------------------------------
    @property
    def short_name(self) -> str:
        if self.files is None:
            return f"{EMBEDDED} (Python {sys.version_info.major}.{sys.version_info.minor} documentation text)"
        return ", ".join(self.files)

    @property
    def description(self) -> str:
        tokenizer = self._tokenizer
        where = tokenizer.where if tokenizer is not None else "not loaded yet"
        kind = "user's" if self.vocab_file is not None else "trained by attnlab"
        sizes = ""
        if self._meta is not None:
            sizes = "; tokens " + ", ".join(f"{s} {self._meta['splits'][s]['tokens']:,}" for s in SPLITS)
        return f"{self.short_name}; byte-level BPE ({kind}) {where}{sizes}"

    def status(self) -> dict:
        """What `attnlab data prepare mlm` prints: each split's stream, present or not, and its tokens."""
        trained = self.tokenizer_dir() / VOCAB_FILE
        if self.vocab_file is None and not trained.is_file():  # never train here: --check-only trains nothing
            return {
                "task": f"mlm: {self.short_name} (no tokenizer trained yet)",
                "splits": {s: {"path": str(trained), "present": False} for s in SPLITS},
                "how_to_obtain": "run `attnlab data prepare mlm` (without --check-only) to train the "
                "tokenizer and tokenize the corpus",
            }
        folder = self.tokens_dir()
        meta = (
            read_json(folder / "meta.json", (), "the tokenized corpus's record")
            if (folder / "meta.json").is_file()
            else None
        )
        splits = {
            s: {
                "path": str(folder / f"{s}.bin"),
                "present": meta is not None,
                "num_examples": meta["splits"][s]["tokens"] if meta else None,
                "expected_examples": None,
            }
            for s in SPLITS
        }
        return {
            "task": f"mlm: {self.short_name}, tokenizer {self.tokenizer().where} (counts are tokens)",
            "splits": splits,
            "how_to_obtain": "run `attnlab data prepare mlm` (without --check-only) to tokenize the corpus",
        }


# ------------------------------------------------------------------------------- blocks and masks


class PackedBlocks(Dataset):
    """Blocks of ``seq_len`` tokens: ``<s>`` and the next ``seq_len - 1`` tokens of the stream.

    Every stream token lands in exactly one block; the last block is padded with ``pad_id``.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, bos_id: int, pad_id: int):
        if seq_len < 2:
            raise ConfigError(f"task.data.seq_len={seq_len}: a block needs <s> and at least one token (>= 2)")
        self.stream, self.seq_len, self.bos_id, self.pad_id = stream, seq_len, bos_id, pad_id
        self.step = seq_len - 1

    def __len__(self) -> int:
        return math.ceil(len(self.stream) / self.step)

    def block(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        chunk = np.asarray(self.stream[index * self.step : (index + 1) * self.step], dtype=np.int64)
        ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        ids[0] = self.bos_id
        ids[1 : 1 + len(chunk)] = torch.from_numpy(chunk)
        return ids

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.block(index)}


def mask_tokens(
    ids: torch.Tensor,
    special_ids: torch.Tensor,
    mask_id: int,
    vocab_size: int,
    generator: torch.Generator,
    rate: float = 0.2,
    mask_prob: float = 0.8,
    random_prob: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption: ``(inputs, targets)``, targets the original id where predicted, else -100.

    Each non-special token is predicted with probability ``rate``; a predicted token becomes ``<mask>``
    with probability ``mask_prob``, a uniformly drawn non-special token with ``random_prob``, and stays
    itself otherwise. All draws come from ``generator`` (on ``ids``' device).
    """
    device = ids.device
    special_ids = special_ids.to(device)
    predicted = (torch.rand(ids.shape, generator=generator, device=device) < rate) & ~torch.isin(
        ids, special_ids
    )
    action = torch.rand(ids.shape, generator=generator, device=device)
    keep = torch.ones(vocab_size, dtype=torch.bool, device=device)
    keep[special_ids] = False
    ordinary = keep.nonzero().squeeze(1)
    random_ids = ordinary[torch.randint(len(ordinary), ids.shape, generator=generator, device=device)]
    inputs = torch.where(predicted & (action < mask_prob), torch.full_like(ids, mask_id), ids)
    replace = predicted & (action >= mask_prob) & (action < mask_prob + random_prob)
    inputs = torch.where(replace, random_ids, inputs)
    targets = torch.where(predicted, ids, torch.full_like(ids, -100))
    return inputs, targets


def seeded_generator(device: torch.device | str, *keys: int) -> torch.Generator:
    """A generator whose state is a function of the keys alone (no hidden state to checkpoint)."""
    seed = int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(2, np.uint64)[0])
    return torch.Generator(device=device).manual_seed(seed & (2**63 - 1))


class MaskedBlocks(Dataset):
    """Validation / test blocks with fixed masks: block i's are drawn from (``mask_seed``, split, i)."""

    def __init__(self, blocks: PackedBlocks, masker, mask_seed: int, split_code: int):
        self.blocks, self.masker, self.mask_seed, self.split_code = blocks, masker, mask_seed, split_code

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        ids = self.blocks.block(index)
        generator = seeded_generator("cpu", self.mask_seed, self.split_code, index)
        inputs, targets = self.masker(ids, generator)
        return {"input_ids": inputs, "labels": targets, "raw": ids}


# ------------------------------------------------------------------------------------ datamodule


class MLMDataModule(CorpusBlocksDataModule):
    """Packed, masked blocks of a `TextCorpus` for masked-LM pretraining.

    Training batches leave the loader unmasked and are masked on their device (``on_after_batch_transfer``)
    with a generator seeded by (``seed``, rank, number of training batches drawn so far): Lightning
    checkpoints that counter, so a resumed run masks exactly as the uninterrupted one.
    """

    def __init__(
        self,
        *args,
        mask_rate: float = 0.2,
        mask_prob: float = 0.8,
        random_prob: float = 0.1,
        mask_seed: int = 0,
        **kwargs,
    ):
        """``*args``/``**kwargs``: `CorpusBlocksDataModule`'s (source, seq_len, batch sizes, workers, seed);
        the masking (`mask_tokens`) and the seed of the fixed val/test masks by keyword."""
        super().__init__(*args, **kwargs)
        if not 0 < mask_rate < 1:
            raise ConfigError(f"task.data.mask_rate={mask_rate}: expected a fraction in (0, 1)")
        if not (mask_prob >= 0 and random_prob >= 0 and mask_prob + random_prob <= 1):
            raise ConfigError(
                f"task.data.mask_prob={mask_prob}, random_prob={random_prob}: expected fractions >= 0 "
                "summing to at most 1 (the rest of the predicted tokens stay unchanged)"
            )
        self.mask_seed = mask_seed
        self.mask_rate, self.mask_prob, self.random_prob = mask_rate, mask_prob, random_prob

    def _datasets(self) -> dict[str, Dataset]:
        self.special_ids = torch.tensor(self.tokenizer.special_ids)
        bos_id, pad_id = self.tokenizer.bos_id, self.tokenizer.pad_id
        blocks = {s: PackedBlocks(self.streams[s], self.seq_len, bos_id, pad_id) for s in SPLITS}
        datasets: dict[str, Dataset] = {"train": blocks["train"]}
        for code, split in enumerate(("val", "test"), start=1):
            datasets[split] = MaskedBlocks(blocks[split], self.mask, self.mask_seed, code)
        return datasets

    def mask(self, ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return mask_tokens(
            ids,
            self.special_ids,
            self.tokenizer.mask_id,
            self.tokenizer.vocab_size,
            generator,
            self.mask_rate,
            self.mask_prob,
            self.random_prob,
        )

    def mask_train_batch(self, batch: dict, counter: int, rank: int = 0) -> dict:
        """Mask a training batch with the masks of batch number ``counter`` on ``rank``."""
        ids = batch["input_ids"]
        generator = seeded_generator(ids.device, self.seed, rank, counter)
        inputs, targets = self.mask(ids, generator)
        return {**batch, "input_ids": inputs, "labels": targets}

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        trainer = self.trainer
        if trainer is None or not trainer.training or "labels" in batch:
            return batch
        # batches received before this one, restored on resume (Lightning counts it before the step starts)
        counter = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        return self.mask_train_batch(batch, counter, trainer.global_rank)

    # ---- what the pipeline reads ---------------------------------------------------------------------
    def model_kwargs(self) -> dict[str, int]:
        self.setup()
        return {"vocab_size": self.tokenizer.vocab_size, "pad_id": self.tokenizer.pad_id}

    def baselines(self, split: str = "test") -> dict[str, float]:
        """A unigram model of the train split on ``split``'s masked tokens: its cross-entropy
        (``baseline_loss``, nats) and the accuracy of always answering the most frequent token."""
        self.setup()
        counts, log_probs = self._unigram(never=self.tokenizer.special_ids)  # never a masked target
        targets = np.concatenate(
            [
                t[t >= 0].numpy()
                for t in (self.datasets[split][i]["labels"] for i in range(len(self.datasets[split])))
            ]
        )
        if len(targets) == 0:
            raise DataError(self.source.short_name, f"the {split} split has no masked token to score")
        return {
            "baseline_loss": float(-log_probs[targets].mean()),
            "baseline_acc": float((targets == counts.argmax()).mean()),
        }

    # ---- loaders ---------------------------------------------------------------------------------
    def _collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([ex[key] for ex in examples]) for key in examples[0] if key != "raw"}
        raw = torch.stack([ex["raw"] for ex in examples]) if "raw" in examples[0] else batch["input_ids"]
        batch["mask"] = raw != self.tokenizer.pad_id
        return self._with_documents(batch, raw)
