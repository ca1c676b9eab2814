"""LRA Text (IMDB, byte level): the aclImdb folder layout, truncation, splits, the Hugging Face path."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from attnlab.data.errors import DataError, MissingDataError
from attnlab.data.examples import pad_collate
from attnlab.data.lra import text
from hf_hub_cache import write_hub_cache

REVIEWS = {
    # (split folder, label folder, file name): review text
    ("train", "neg", "10_2.txt"): "Awful.<br /><br />Two stars is generous.",
    ("train", "neg", "3_1.txt"): "Bad",
    ("train", "pos", "0_9.txt"): "Un film très réussi — ☕ and 🎬!",
    ("train", "pos", "7_10.txt"): "Great fun",
    ("test", "neg", "0_3.txt"): "Meh",
    ("test", "pos", "1_8.txt"): "Über gut",
}


def tokens(s: str) -> list[int]:
    return [b + 1 for b in s.encode("utf-8")]


@pytest.fixture
def data_dir(tmp_path):
    root = tmp_path / "aclImdb"
    for (split, label, name), review in REVIEWS.items():
        (root / split / label).mkdir(parents=True, exist_ok=True)
        (root / split / label / name).write_text(review, encoding="utf-8")
    # parts of the real tarball the loader must ignore
    (root / "train" / "unsup").mkdir()
    (root / "train" / "unsup" / "0_0.txt").write_text("unlabelled", encoding="utf-8")
    (root / "train" / "urls_pos.txt").write_text("http://example.invalid\n", encoding="utf-8")
    (root / "imdb.vocab").write_text("the\n", encoding="utf-8")
    return tmp_path


def test_train_tokens_labels_and_order(data_dir):
    ds = text.load_imdb(data_dir, "train")
    # neg then pos, each sorted by file name; unsup ignored
    expected = [("neg", "10_2.txt"), ("neg", "3_1.txt"), ("pos", "0_9.txt"), ("pos", "7_10.txt")]
    assert len(ds) == 4
    assert ds.labels.tolist() == [0, 0, 1, 1]
    for i, (label, name) in enumerate(expected):
        assert ds[i]["input_ids"].tolist() == tokens(REVIEWS[("train", label, name)])
        assert ds[i]["input_ids"].dtype.is_floating_point is False
    assert ds.num_truncated == 0


def test_non_ascii_is_utf8_bytes_plus_one(data_dir):
    ds = text.load_imdb(data_dir, "train")
    ids = ds[2]["input_ids"].tolist()
    # "è" is two UTF-8 bytes (0xC3 0xA8) after the 10 bytes of "Un film tr"; the clapperboard four
    assert ids[10:12] == [0xC3 + 1, 0xA8 + 1]
    assert len(ids) == len(REVIEWS[("train", "pos", "0_9.txt")].encode("utf-8"))
    assert min(ids) > 0 and max(ids) <= 256 and max(ids) == 0xF0 + 1
    assert text.VOCAB_SIZE == 257


def test_truncation_keeps_first_bytes_and_counts(data_dir):
    ds = text.load_imdb(data_dir, "train", max_length=5)
    assert [len(ds[i]["input_ids"]) for i in range(4)] == [5, 3, 5, 5]
    assert ds[0]["input_ids"].tolist() == tokens("Awful")
    assert ds.num_truncated == 3
    assert text.load_imdb(data_dir, "train", max_length=None).num_truncated == 0


def test_val_is_test_as_in_lra(data_dir):
    val, test = text.load_imdb(data_dir, "val"), text.load_imdb(data_dir, "test")
    assert len(val) == len(test) == 2
    assert val.labels.tolist() == test.labels.tolist() == [0, 1]
    assert [val[i]["input_ids"].tolist() for i in range(2)] == [tokens("Meh"), tokens("Über gut")]
    assert [test[i]["input_ids"].tolist() for i in range(2)] == [tokens("Meh"), tokens("Über gut")]


def test_batches_pad_with_zero(data_dir):
    ds = text.load_imdb(data_dir, "test")
    batch = pad_collate([ds[0], ds[1]])
    assert batch["input_ids"][0].tolist()[3:] == [0] * (len("Über gut".encode()) - 3)
    assert batch["mask"].sum(1).tolist() == [3, len("Über gut".encode())]


@pytest.mark.parametrize("split", ["validation", "unsup", "TRAIN"])
def test_unknown_split_lists_known(data_dir, split):
    with pytest.raises(ValueError, match=r"train, val, test"):
        text.load_imdb(data_dir, split)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "100", True])
def test_bad_max_length(data_dir, bad):
    with pytest.raises(ValueError, match="max_length"):
        text.load_imdb(data_dir, "train", max_length=bad)


def test_missing_folder_names_the_path(tmp_path):
    with pytest.raises(MissingDataError) as info:
        text.load_imdb(tmp_path, "train")
    assert str(tmp_path / "aclImdb" / "train" / "neg") in str(info.value)
    assert "aclImdb_v1.tar.gz" in str(info.value)


def test_empty_label_folder_is_missing_data(data_dir):
    for f in (data_dir / "aclImdb" / "test" / "pos").iterdir():
        f.unlink()
    with pytest.raises(MissingDataError, match="no review file"):
        text.load_imdb(data_dir, "test")


def test_find_and_ensure_prefer_the_folder(data_dir):
    assert text.find_imdb(data_dir) == data_dir / "aclImdb"
    assert text.ensure_text(data_dir) == str(data_dir / "aclImdb")
    ds, source = text.load_text(data_dir, "train", max_length=4)
    assert source == str(data_dir / "aclImdb") and len(ds) == 4 and ds.num_truncated == 3  # all but "Bad"


def test_no_folder_and_no_datasets_library(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    assert text.find_imdb(tmp_path) is None
    with pytest.raises(MissingDataError) as info:
        text.load_text(tmp_path, "train")
    message = str(info.value)
    assert str(tmp_path / "aclImdb") in message
    assert "`datasets` library is not installed" in message and "aclImdb_v1.tar.gz" in message
    with pytest.raises(MissingDataError, match="not installed"):
        text.load_imdb_hf("train")


class FakeHFDataset(list):
    column_names = ["text", "label"]


def fake_datasets(splits: dict, seen_offline: list) -> types.ModuleType:
    """A stand-in for the `datasets` module: load_dataset from a dict, recording the offline flag."""
    module = types.ModuleType("datasets")
    module.config = types.SimpleNamespace(HF_HUB_OFFLINE=False)

    def load_dataset(name, split):
        seen_offline.append(module.config.HF_HUB_OFFLINE)
        if (name, split) not in splits:
            raise ConnectionError(f"offline and {name} {split} is not cached")
        return splits[(name, split)]

    module.load_dataset = load_dataset
    return module


def test_hf_path_from_cache_only(tmp_path, monkeypatch):
    rows = {
        ("stanfordnlp/imdb", "train"): FakeHFDataset(
            [{"text": "Ça va", "label": 1}, {"text": "no", "label": 0}]
        ),
        ("stanfordnlp/imdb", "test"): FakeHFDataset([{"text": "bof", "label": 0}]),
    }
    seen: list = []
    module = fake_datasets(rows, seen)
    monkeypatch.setitem(sys.modules, "datasets", module)
    ds = text.load_imdb_hf("train", max_length=3)
    assert ds.labels.tolist() == [1, 0]
    assert ds[0]["input_ids"].tolist() == tokens("Ça")  # "Ç" is two bytes: 3 bytes kept
    assert ds.num_truncated == 1
    assert seen == [True] and module.config.HF_HUB_OFFLINE is False  # offline during the call only

    val, source = text.load_text(tmp_path, "val")
    assert source == "huggingface:stanfordnlp/imdb"
    assert val[0]["input_ids"].tolist() == tokens("bof")


def test_hf_not_cached_is_missing_data(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({}, []))
    with pytest.raises(MissingDataError) as info:
        text.ensure_text(tmp_path)
    assert "not in the local cache" in str(info.value) and str(tmp_path / "aclImdb") in str(info.value)


@pytest.mark.parametrize("repo_id", ["stanfordnlp/imdb", "imdb"])  # the Hub id today; the old short name
def test_hf_imdb_from_a_cache_in_the_hub_layout(tmp_path, hf_cache, repo_id):
    """The cache `datasets` leaves after `load_dataset("stanfordnlp/imdb")` (or the older "imdb"), read
    offline by the LRA Text task: same reviews, labels and byte tokens as the columns written."""
    reviews = {"train": (["Great film.", "Dull <br />plot"], [1, 0]), "test": (["Fine.", "Bad"], [1, 0])}
    splits = {s: {"text": t, "label": y} for s, (t, y) in reviews.items()}
    write_hub_cache(hf_cache, repo_id, "plain_text", splits)
    val, source = text.load_text(tmp_path, "val")  # no aclImdb folder: the cache; val is IMDB's test
    assert source == "huggingface:stanfordnlp/imdb"
    assert val.labels.tolist() == [1, 0] and val[0]["input_ids"].tolist() == tokens("Fine.")
    train = text.load_imdb_hf("train", max_length=None)
    assert train[1]["input_ids"].tolist() == tokens("Dull <br />plot")  # raw bytes, markup kept, as LRA


def test_real_hf_imdb_when_installed_and_cached(tmp_path):
    pytest.importorskip("datasets")
    try:
        ds = text.load_imdb_hf("test", max_length=64, data_dir=tmp_path)
    except MissingDataError as err:
        pytest.skip(f"IMDB is not in the local Hugging Face cache: {err}")
    assert len(ds) == 25_000 and set(np.unique(ds.labels)) == {0, 1}
    assert max(int(s.max()) for s in ds.sequences[:100]) <= 256


def test_describe(data_dir, tmp_path_factory):
    info = text.describe(data_dir)
    assert info["task"] == "text"
    assert info["splits"]["train"] == {
        "path": str(data_dir / "aclImdb" / "train"),
        "present": True,
        "num_examples": 4,
        "expected_examples": 25_000,
    }
    assert (
        info["splits"]["val"]["path"] == info["splits"]["test"]["path"] == str(data_dir / "aclImdb" / "test")
    )
    empty = text.describe(tmp_path_factory.mktemp("empty"))
    assert not empty["splits"]["test"]["present"] and empty["splits"]["test"]["num_examples"] is None


# --- strict reading and the official text pipeline -----------------------------------------------


def test_surrounding_whitespace_is_stripped_as_tfds_does(data_dir):
    path = data_dir / "aclImdb" / "train" / "neg" / "3_1.txt"
    path.write_bytes(b" \n\tBad  film\r\n \n")
    ds = text.load_imdb(data_dir, "train")
    assert ds[1]["input_ids"].tolist() == tokens("Bad  film")  # inner whitespace kept


def test_hf_reviews_are_stripped_too(tmp_path, monkeypatch):
    rows = {("stanfordnlp/imdb", "train"): FakeHFDataset([{"text": "  fine \n", "label": 1}])}
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(rows, []))
    assert text.load_imdb_hf("train")[0]["input_ids"].tolist() == tokens("fine")


def test_non_utf8_review_names_file_and_line(data_dir):
    path = data_dir / "aclImdb" / "train" / "pos" / "7_10.txt"
    path.write_bytes(b"Great\nfun \xff here")
    with pytest.raises(DataError, match="not valid UTF-8") as info:
        text.load_imdb(data_dir, "train")
    assert str(info.value).startswith(f"{path}:2: ") and "on_bad_rows=skip" in str(info.value)
    ds = text.load_imdb(data_dir, "train", on_bad_rows="skip")
    assert len(ds) == 3 and ds.num_skipped == 1 and ds.labels.tolist() == [0, 0, 1]


def test_a_split_whose_every_review_is_bad_is_an_error(data_dir):
    for path in (data_dir / "aclImdb" / "test").glob("*/*.txt"):
        path.write_bytes(b"\xff\xfe")
    with pytest.raises(DataError, match="no usable review"):
        text.load_imdb(data_dir, "test", on_bad_rows="skip")
