"""LRA Retrieval (AAN pairs): the official TSV format, float labels, truncation, errors with file:line."""

from __future__ import annotations

import pytest

from attnlab.data.errors import DataError, MissingDataError
from attnlab.data.examples import pad_collate
from attnlab.data.lra import retrieval

# label, id1, id2, text1, text2 -- as in new_aan_pairs.*.tsv: no header, labels written as floats
TRAIN_ROWS = [
    ("1.0", "P00-1001", "P00-1002", "We parse trees.", "Parsing, revisited"),
    ("0.0", "P00-1003", "W99-0101", 'A "quoted" title', "Résumé of métis ☃"),
    ("1", "J98-1001", "J98-1002", "x" * 50, "short"),
]


def tokens(s: str) -> list[int]:
    return [b + 1 for b in s.encode("utf-8")]


def write_tsv(path, rows, newline="\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join("\t".join(row) + newline for row in rows).encode("utf-8"))


@pytest.fixture
def data_dir(tmp_path):
    tsv = tmp_path / "lra_release" / "tsv_data"
    write_tsv(tsv / "new_aan_pairs.train.tsv", TRAIN_ROWS)
    write_tsv(tsv / "new_aan_pairs.eval.tsv", [("0.0", "a", "b", "eval one", "eval two")], newline="\r\n")
    write_tsv(tsv / "new_aan_pairs.test.tsv", [("1.0", "c", "d", "test one", "test two")] * 2)
    return tmp_path


def test_reads_pairs_and_float_labels(data_dir):
    ds = retrieval.load_aan(data_dir, "train")
    assert len(ds) == 3 and ds.labels.tolist() == [1, 0, 1]
    for i, row in enumerate(TRAIN_ROWS):
        example = ds[i]
        assert example["input_ids"].tolist() == tokens(row[3])
        assert example["input_ids2"].tolist() == tokens(row[4])
    # quotes are ordinary characters (LRA: use_quote_delim=False)
    assert ds[1]["input_ids"].tolist()[2] == ord('"') + 1
    assert ds.num_truncated == 0


def test_each_document_truncated_to_max_length(data_dir):
    ds = retrieval.load_aan(data_dir, "train", max_length=6)
    assert ds[0]["input_ids"].tolist() == tokens("We par")
    assert ds[0]["input_ids2"].tolist() == tokens("Parsin")
    assert ds[2]["input_ids2"].tolist() == tokens("short")
    assert ds.num_truncated == 5  # documents, not pairs: all but "short"
    assert ds.lengths().tolist() == [6, 6, 6]


def test_split_names_map_to_files(data_dir):
    val, test = retrieval.load_aan(data_dir, "val"), retrieval.load_aan(data_dir, "test")
    assert len(val) == 1 and val[0]["input_ids2"].tolist() == tokens("eval two")  # CRLF stripped
    assert len(test) == 2 and test.labels.tolist() == [1, 1]
    assert retrieval.aan_path(data_dir, "val").name == "new_aan_pairs.eval.tsv"
    with pytest.raises(ValueError, match="train, val, test"):
        retrieval.aan_path(data_dir, "eval")


def test_collate_gives_both_towers(data_dir):
    ds = retrieval.load_aan(data_dir, "train")
    batch = pad_collate([ds[0], ds[2]])
    assert batch["input_ids"].shape == (2, 50) and batch["input_ids2"].shape == (2, len("Parsing, revisited"))
    assert batch["mask2"].sum(1).tolist() == [len("Parsing, revisited"), len("short")]
    assert batch["labels"].tolist() == [1, 1]


def test_trailing_blank_line_is_ignored(data_dir):
    path = retrieval.aan_path(data_dir, "test")
    path.write_bytes(path.read_bytes() + b"\n")
    assert len(retrieval.load_aan(data_dir, "test")) == 2


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        (b"1.0\tid1\tid2\tonly one text\n", "expected 5 tab-separated fields"),
        (b"1.0\tid1\tid2\ta\tb\textra\n", "found 6"),
        (b"yes\tid1\tid2\ta\tb\n", "is not a number"),
        (b"2.0\tid1\tid2\ta\tb\n", "is not 0 or 1"),
        (b"0.5\tid1\tid2\ta\tb\n", "is not 0 or 1"),
    ],
)
def test_malformed_row_names_file_and_line(data_dir, bad_row, message):
    path = retrieval.aan_path(data_dir, "train")
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]) + bad_row + b"".join(lines[2:]))
    with pytest.raises(DataError, match=message) as info:
        retrieval.load_aan(data_dir, "train")
    assert str(info.value).startswith(f"{path}:3: ")
    assert info.value.line == 3 and info.value.path == path


def test_empty_file_is_data_error(data_dir):
    path = retrieval.aan_path(data_dir, "test")
    path.write_bytes(b"")
    with pytest.raises(DataError, match="no pair"):
        retrieval.load_aan(data_dir, "test")


def test_missing_file_names_path_and_release(tmp_path):
    with pytest.raises(MissingDataError) as info:
        retrieval.load_aan(tmp_path, "val")
    expected = tmp_path / "lra_release" / "tsv_data" / "new_aan_pairs.eval.tsv"
    assert str(expected) in str(info.value) and "lra_release.gz" in str(info.value)
    assert info.value.expected == expected


def test_bad_max_length(data_dir):
    with pytest.raises(ValueError, match="max_length"):
        retrieval.load_aan(data_dir, "train", max_length=0)


def test_load_retrieval_source_and_describe(data_dir, tmp_path_factory):
    ds, source = retrieval.load_retrieval(data_dir, "test")
    assert len(ds) == 2 and source == str(retrieval.aan_path(data_dir, "test"))
    info = retrieval.describe(data_dir)
    assert info["task"] == "retrieval"
    assert {s: v["num_examples"] for s, v in info["splits"].items()} == {"train": 3, "val": 1, "test": 2}
    assert info["splits"]["val"]["expected_examples"] == 18_090
    assert all(v["present"] for v in info["splits"].values())
    empty = retrieval.describe(tmp_path_factory.mktemp("empty"))
    assert not any(v["present"] for v in empty["splits"].values())
    assert empty["splits"]["train"]["path"].endswith("lra_release/tsv_data/new_aan_pairs.train.tsv")


def test_non_utf8_row_names_file_and_line_and_can_be_skipped(data_dir):
    path = retrieval.aan_path(data_dir, "test")
    path.write_bytes(b"1.0\ta\tb\tgood one\tgood two\n0.0\tc\td\tbad \xe9 text\tfine\n1.0\te\tf\tok\tok\n")
    with pytest.raises(DataError, match="not valid UTF-8") as info:
        retrieval.load_aan(data_dir, "test")
    assert str(info.value).startswith(f"{path}:2: ")
    dataset = retrieval.load_aan(data_dir, "test", on_bad_rows="skip")
    assert len(dataset) == 2 and dataset.num_skipped == 1 and dataset.labels.tolist() == [1, 1]


def test_malformed_rows_can_be_skipped_but_not_all_of_them(data_dir):
    path = retrieval.aan_path(data_dir, "test")
    path.write_bytes(b"2.0\ta\tb\tx\ty\nonly\tthree\tfields\n")
    with pytest.raises(DataError, match="no pair"):
        retrieval.load_aan(data_dir, "test", on_bad_rows="skip")
