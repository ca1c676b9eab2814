"""Masked-LM (and causal-LM) data: tokenizer, corpus preparation from every file format, packing, masking."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.data.errors import DataError, MissingDataError
from attnlab.data.lm import LMDataModule
from attnlab.data.text_corpus import (
    MLMDataModule,
    PackedBlocks,
    TextCorpus,
    embedded_documents,
    mask_tokens,
    seeded_generator,
    split_of,
)
from attnlab.data.tokenizer import SPECIAL_TOKENS, load_bpe, train_bpe
from attnlab.errors import ConfigError

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Byte-level BPE encodes any text: café, naïve, 東京, emoji 🙂.",
    "Packing keeps document separators between documents.",
] * 40


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The default corpus, prepared once: tokenizer trained on pydoc_data.topics, streams written."""
    source = TextCorpus(data_dir=tmp_path_factory.mktemp("data"), tokenizer={"vocab_size": 1024})
    source.prepare()
    return source


def expected_streams(source: TextCorpus, docs: list[str]) -> dict[str, list[int]]:
    """Each split's stream built the slow way: the documents of that split, each followed by </s>."""
    tokenizer = source.tokenizer()
    split = split_of(np.arange(len(docs)), source.split_seed, source.val_fraction, source.test_fraction)
    streams = {"train": [], "val": [], "test": []}
    for doc, s in zip(docs, split, strict=True):
        ids = tokenizer.encode(doc)
        if ids:
            streams[("train", "val", "test")[s]] += ids + [tokenizer.eos_id]
    return streams


# ----------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_on_the_embedded_corpus(embedded):
    tokenizer = embedded.tokenizer()
    docs = embedded_documents()
    assert len(docs) > 1000 and sum(map(len, docs)) > 300_000  # real English prose, not a toy
    assert all(tokenizer.decode(tokenizer.encode(d)) == d for d in docs)
    ids = [tokenizer.encode(d) for d in docs[:200]]
    assert np.mean([len(d) / len(i) for d, i in zip(docs, ids, strict=False)]) > 2.5  # merges learned
    assert tokenizer.vocab_size == 1024
    assert [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id] == [0, 1, 2]  # <pad> first: attnlab's id 0


def test_saved_files_load_as_a_user_tokenizer(embedded, tmp_path):
    folder = embedded.tokenizer_dir()
    loaded = load_bpe(folder / "vocab.json", folder / "merges.txt")
    text = "Any text at all: ünïcödé and 🙂"
    assert loaded.encode(text) == embedded.tokenizer().encode(text)
    assert loaded.decode(loaded.encode(text)) == text


def test_roberta_layout_vocab_keeps_its_special_ids(tmp_path):
    """A RoBERTa vocab has <s>=0 and <pad>=1; they must be read, not assumed."""
    trained = train_bpe(iter([DOCS]), 300, tmp_path / "t", min_frequency=1)
    vocab = json.loads((tmp_path / "t" / "vocab.json").read_text())
    order = ["<s>", "<pad>", "</s>", "<unk>"] + [t for t in vocab if t not in SPECIAL_TOKENS] + ["<mask>"]
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(order)}))
    (tmp_path / "merges.txt").write_text((tmp_path / "t" / "merges.txt").read_text())
    roberta = load_bpe(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert (roberta.bos_id, roberta.pad_id, roberta.eos_id, roberta.mask_id) == (0, 1, 2, len(order) - 1)
    assert roberta.decode(roberta.encode(DOCS[1])) == DOCS[1]
    assert len(roberta.encode(DOCS[0])) == len(trained.encode(DOCS[0]))


def test_user_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(MissingDataError, match="nope.json"):
        load_bpe(tmp_path / "nope.json", tmp_path / "merges.txt")
    train_bpe(iter([DOCS]), 300, tmp_path, min_frequency=1)
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    del vocab["<mask>"]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(DataError, match=r"vocab.json.*<mask>"):
        load_bpe(tmp_path / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="at least 261"):
        train_bpe(iter([DOCS]), 100, tmp_path / "small")


# ------------------------------------------------------------------------------- preparation


def test_prepared_streams_hold_every_document_once_with_separators(embedded):
    streams = embedded.load()
    expected = expected_streams(embedded, embedded_documents())
    for split in ("train", "val", "test"):
        assert streams[split].tolist() == expected[split]
    meta = embedded.meta()
    assert sum(meta["splits"][s]["documents"] for s in meta["splits"]) == len(embedded_documents())
    assert 0.03 < meta["splits"]["test"]["tokens"] / sum(len(s) for s in streams.values()) < 0.08


def write_corpus(folder, kind: str) -> str:
    """DOCS in one of the formats `datasets` reads; returns what task.data.source.files names."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "text":
        (folder / "corpus.txt").write_text("\n\n".join(DOCS) + "\n")
        return str(folder / "*.txt")
    if kind == "json":
        (folder / "corpus.jsonl").write_text(
            "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
        )
        return str(folder / "corpus.jsonl")
    dataset = datasets.Dataset.from_dict({"body": DOCS})
    if kind == "parquet":
        dataset.to_parquet(str(folder / "corpus.parquet"))
        return str(folder / "corpus.parquet")
    dataset.save_to_disk(str(folder / "saved"))
    return str(folder / "saved")


@pytest.mark.parametrize(
    "kind,streaming",
    [("text", False), ("json", False), ("parquet", False), ("disk", False), ("text", True), ("json", True)],
)
def test_every_file_format_gives_the_same_streams(tmp_path, kind, streaming):
    files = write_corpus(tmp_path / "corpus", kind)
    source = TextCorpus(
        data_dir=tmp_path / "data",
        files=files,
        text_field="body",
        streaming=streaming,
        val_fraction=0.1,
        test_fraction=0.1,
        tokenizer={"vocab_size": 300, "min_frequency": 1},
    )
    source.prepare()
    streams = source.load()
    expected = expected_streams(source, DOCS)
    assert {s: streams[s].tolist() for s in streams} == expected
    assert (tmp_path / "data" / "mlm").is_dir() and source.tokenizer_dir().is_relative_to(tmp_path / "data")


def test_a_saved_sets_id_ignores_the_cache_files_datasets_adds_to_its_folder(tmp_path):
    """Tokenizing a ``save_to_disk`` folder writes ``cache-*.arrow`` into it, which moves the folder's
    mtime: the corpus id (its data folder) must stay what it was, or the streams are never found."""
    files = write_corpus(tmp_path / "corpus", "disk")
    source = TextCorpus(data_dir=tmp_path / "data", files=files, text_field="body")
    before = source.corpus_id()
    (Path(files) / "cache-0123456789abcdef.arrow").write_bytes(b"x")
    later = Path(files).stat().st_mtime + 5
    os.utime(files, (later, later))
    assert source.corpus_id() == before
    (Path(files) / "state.json").write_text("{}")  # the saved set itself changed: another corpus
    assert source.corpus_id() != before


def test_parallel_tokenization_matches_one_process(tmp_path):
    files = write_corpus(tmp_path / "corpus", "json")
    common = dict(files=files, text_field="body", val_fraction=0.1, test_fraction=0.1)
    one = TextCorpus(data_dir=tmp_path / "a", tokenizer={"vocab_size": 300, "min_frequency": 1}, **common)
    two = TextCorpus(
        data_dir=tmp_path / "b", num_proc=2, tokenizer={"vocab_size": 300, "min_frequency": 1}, **common
    )
    one.prepare()
    two.prepare()
    assert all(np.array_equal(one.load()[s], two.load()[s]) for s in ("train", "val", "test"))


def test_user_vocab_and_merges_are_used_as_given(tmp_path, embedded):
    folder = embedded.tokenizer_dir()
    files = write_corpus(tmp_path / "corpus", "text")
    source = TextCorpus(
        data_dir=tmp_path / "data",
        files=files,
        val_fraction=0.1,
        test_fraction=0.1,
        tokenizer={"vocab": str(folder / "vocab.json"), "merges": str(folder / "merges.txt")},
    )
    source.prepare()
    assert not any(p.name.startswith("bpe") for p in source.root.iterdir())  # nothing trained
    assert source.load()["train"].tolist() == expected_streams(source, DOCS)["train"]
    assert "user's" in source.description and "vocab.json" in source.description


def test_corpus_errors_name_the_key_or_file(tmp_path):
    with pytest.raises(MissingDataError, match="missing.txt"):
        TextCorpus(data_dir=tmp_path, files=str(tmp_path / "missing.txt")).prepare()
    (tmp_path / "notes.md").write_text("text")
    with pytest.raises(ConfigError, match=r"format=auto.*notes.md"):
        TextCorpus(data_dir=tmp_path, files=str(tmp_path / "notes.md")).prepare()
    with pytest.raises(ConfigError, match="val_fraction=0.6"):
        TextCorpus(val_fraction=0.6, test_fraction=0.5)
    with pytest.raises(ConfigError, match="give both vocab"):
        TextCorpus(tokenizer={"vocab": "v.json"})
    with pytest.raises(ConfigError, match="unknown keys"):
        TextCorpus(tokenizer={"size": 10})
    files = write_corpus(tmp_path / "c", "json")
    with pytest.raises(DataError, match="no column 'text'"):
        TextCorpus(data_dir=tmp_path / "d", files=files).prepare()


# ----------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("length", [1, 6, 7, 50])
def test_packing_loses_and_duplicates_no_token(length):
    stream = np.arange(10, 10 + length, dtype=np.uint16)
    blocks = PackedBlocks(stream, seq_len=7, bos_id=1, pad_id=0)
    tensors = [blocks[i]["input_ids"] for i in range(len(blocks))]
    assert all(t.shape == (7,) and t[0] == 1 for t in tensors)  # <s> first, fixed length
    body = torch.cat([t[1:] for t in tensors])
    assert body[body != 0].tolist() == stream.tolist()  # every token once, in order
    assert (body[len(stream) :] == 0).all() and len(body) - len(stream) < 6  # only the last block is padded


# ----------------------------------------------------------------------------------- masking


def test_masking_statistics_and_special_tokens():
    vocab, specials = 1000, torch.tensor([0, 1, 2, 3, 4])
    ids = torch.randint(5, vocab, (64, 512))
    ids[:, 0], ids[:, 100::50], ids[:, -40:] = 1, 2, 0  # <s>, separators, padding
    inputs, targets = mask_tokens(ids, specials, 4, vocab, seeded_generator("cpu", 0), rate=0.2)
    predicted = targets != -100
    special = torch.isin(ids, specials)
    assert not (predicted & special).any() and (inputs[special] == ids[special]).all()
    assert (targets[predicted] == ids[predicted]).all()
    assert abs(predicted.sum().item() / (~special).sum().item() - 0.2) < 0.005
    masked = inputs[predicted] == 4
    kept = inputs[predicted] == ids[predicted]
    replaced = ~masked & ~kept
    n = predicted.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.01
    assert abs(replaced.sum().item() / n - 0.1) < 0.01  # random ids rarely equal the original (1/995)
    assert not torch.isin(inputs[predicted][replaced], specials).any()  # random tokens are never special
    assert (inputs[~predicted] == ids[~predicted]).all()  # nothing else changes


def test_training_masks_are_a_function_of_seed_rank_and_batch_number(embedded):
    data = MLMDataModule(embedded, seq_len=64, batch_size=8, seed=3)
    data.setup()
    batch = data._collate([data.datasets["train"][i] for i in range(8)])
    first = data.mask_train_batch(batch, counter=5, rank=0)
    again = MLMDataModule(embedded, seq_len=64, batch_size=8, seed=3)
    again.setup()
    torch.manual_seed(123)  # the global generator plays no part
    assert torch.equal(again.mask_train_batch(batch, counter=5, rank=0)["labels"], first["labels"])
    for other in (data.mask_train_batch(batch, 6, 0), data.mask_train_batch(batch, 5, 1)):
        assert not torch.equal(other["labels"], first["labels"])


def test_eval_masks_are_fixed_and_the_baseline_scores_them(embedded):
    data = MLMDataModule(embedded, seq_len=64, batch_size=8, mask_seed=0)
    data.setup()
    test = data.datasets["test"]
    assert torch.equal(test[3]["labels"], test[3]["labels"]) and not torch.equal(
        test[3]["labels"], test[4]["labels"]
    )
    targets = torch.cat([test[i]["labels"] for i in range(len(test))])
    targets = targets[targets >= 0].numpy()
    counts = np.bincount(np.asarray(data.streams["train"]), minlength=1024).astype(float)
    counts[[0, 1, 2, 3, 4]] = 0
    probs = (counts + 1) / (counts.sum() + 1024)
    baseline = data.baselines("test")
    assert baseline["baseline_loss"] == pytest.approx(-np.log(probs[targets]).mean())
    assert baseline["baseline_acc"] == pytest.approx((targets == counts.argmax()).mean())
    assert 4.0 < baseline["baseline_loss"] < np.log(1024)  # a unigram beats uniform
    batch = data._collate([test[i] for i in range(4)])
    assert batch["mask"].all() and set(batch) == {"input_ids", "labels", "mask"}


@pytest.mark.parametrize("module", [MLMDataModule, LMDataModule])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(seq_len=0), "task.data.seq_len=0: expected an integer >= 1"),
        (dict(seq_len="64"), "task.data.seq_len='64': expected an integer >= 1"),
        (dict(batch_size=0), "task.data.batch_size=0: expected an integer >= 1"),
    ],
)
def test_both_text_datamodules_check_their_shape_when_built(embedded, module, kwargs, message):
    """One base (`CorpusBlocksDataModule`) checks seq_len and batch_size for task=mlm and task=lm alike,
    at construction rather than at the first batch."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        module(embedded, **{"seq_len": 64, "batch_size": 8, **kwargs})


def test_both_text_datamodules_load_the_same_corpus_once(embedded):
    masked, causal = MLMDataModule(embedded, seq_len=64), LMDataModule(embedded, seq_len=64)
    for data in (masked, causal):
        data.setup()
        datasets = data.datasets
        data.setup()  # a second call keeps what the first loaded
        assert data.datasets is datasets and data.max_length() == 64
        assert data.train_items == "blocks of 64 tokens"
        assert (data.train_lengths() == 64).all() and len(data.train_lengths()) == len(datasets["train"])
    assert causal.tokenizer.files() == masked.tokenizer.files()
    assert all(np.array_equal(causal.streams[s], masked.streams[s]) for s in ("train", "val", "test"))
    # the causal baseline: add-one unigram of the train split, pads never counted, every test token scored
    counts = np.bincount(np.asarray(causal.streams["train"]), minlength=1024).astype(float)
    counts[causal.tokenizer.pad_id] = 0
    targets = np.asarray(causal.streams["test"], dtype=np.int64)
    nats = -np.log((counts + 1) / (counts.sum() + 1024))[targets]
    baseline = causal.baselines("test")
    assert baseline["baseline_loss"] == pytest.approx(nats.mean())
    assert baseline["baseline_acc"] == pytest.approx((targets == counts.argmax()).mean())


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("empty.txt", b"", r"empty.txt: the file holds no text"),
        ("blank.txt", b"\n  \n", r"blank.txt: the train, val, test split has no text"),
        ("binary.txt", b"one line\nsecond\n\xa5\xff\x00bin", r"binary.txt:3: not UTF-8 text \(byte 0xa5\)"),
        (
            "numbers.jsonl",
            b'{"text": "hello world"}\n{"text": 42}\n',
            r"document 1: field 'text' holds int '42', expected a string",
        ),
    ],
)
def test_bad_corpus_files_are_named_in_one_line(tmp_path, name, content, expected):
    """`datasets` says only "An error occurred while generating the dataset"; the user needs the file."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=expected):
        TextCorpus(data_dir=tmp_path / "data", files=str(path)).prepare()


def test_a_truncated_parquet_file_and_a_foreign_folder_are_named(tmp_path, hf_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from attnlab.data.text_corpus import TextCorpus

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"text": ["a line of text " * 20] * 100}), whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(cut))}: cannot be read as parquet \(.*magic bytes"
    ):
        TextCorpus(data_dir=str(tmp_path / "d"), files=str(cut))._dataset()
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("not a saved dataset")
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(folder))}: not a folder written by `datasets`' save_to_disk"
    ):
        TextCorpus(data_dir=str(tmp_path / "d"), files=str(folder))._dataset()
