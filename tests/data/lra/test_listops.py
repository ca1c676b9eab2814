from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from attnlab.data.errors import DataError, MissingDataError
from attnlab.data.examples import PAD_ID
from attnlab.data.lra import listops
from attnlab.data.lra.listops import (
    OPERATORS,
    VOCAB,
    VOCAB_SIZE,
    ensure_listops,
    evaluate,
    generate_examples,
    generate_tree,
    load_split,
    read_tsv,
    split_paths,
    tokenize,
    write_splits,
)

SMALL = {"train": 40, "val": 8, "test": 8}
SHORT = {"min_length": 10, "max_length": 40}


# --- an independent reading of a tree, used to check the generator ---------------------------------


def parse_tree(source: str):
    """Nested ``(operator, [children])`` / int, by recursive descent (the module uses a stack)."""
    tokens = [t for t in source.split() if t not in "()"]
    position = 0

    def node():
        nonlocal position
        token = tokens[position]
        position += 1
        if token.isdigit():
            return int(token)
        children = []
        while tokens[position] != "]":
            children.append(node())
        position += 1
        return (token, children)

    tree = node()
    assert position == len(tokens)
    return tree


def value_of(tree) -> int:
    """LRA's semantics, with numpy's median as LRA computes it."""
    if isinstance(tree, int):
        return tree
    operator, children = tree
    values = [value_of(child) for child in children]
    return {
        "[MIN": min,
        "[MAX": max,
        "[MED": lambda v: int(np.median(v)),
        "[SM": lambda v: int(np.sum(v) % 10),
    }[operator](values)


def lra_string(tree) -> str:
    """LRA's string: the operator and its arguments folded into left-nested pairs, then ``]``."""
    if isinstance(tree, int):
        return str(tree)
    operator, children = tree
    text = f"( {operator} {lra_string(children[0])} )"
    for child in children[1:]:
        text = f"( {text} {lra_string(child)} )"
    return f"( {text} ] )"


def nodes(tree, depth=1):
    """``(depth, arity or None for a value, operator or None)`` of every node."""
    if isinstance(tree, int):
        yield depth, None, None
        return
    operator, children = tree
    yield depth, len(children), operator
    for child in children:
        yield from nodes(child, depth + 1)


def tree_length(tree) -> int:
    if isinstance(tree, int):
        return 1
    return 2 + sum(tree_length(child) for child in tree[1])


# --- evaluator ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "label"),
    [
        ("( ( ( [MAX 2 ) 9 ) ] )", 9),
        ("[MIN 4 7 ]", 4),
        ("[MAX 2 [MIN 4 7 ] 0 ]", 4),
        ("[MED 1 2 3 4 ]", 2),  # median 2.5 truncated
        ("[MED 9 0 5 ]", 5),  # odd count, unsorted
        ("[MED 3 8 ]", 5),  # 5.5 truncated
        ("[SM 5 7 9 ]", 1),  # 21 mod 10
        ("[SM 0 0 ]", 0),
        ("[SM [MAX 1 [MIN 9 3 ] ] [MED 8 0 7 1 ] 5 ]", 2),  # 3 + 4 + 5 = 12
        ("( ( ( [SM ( ( ( [MIN 9 ) 3 ) ] ) ) 9 ) ] )", 2),
        ("7", 7),
        ("  [MAX\n1   2 ]  ", 2),
        # one argument: never generated, accepted consistently (the value of that argument)
        ("[MAX 5 ]", 5),
        ("[MED 8 ]", 8),
        ("[SM 9 ]", 9),
    ],
)
def test_evaluate_hand_worked(source, label):
    assert evaluate(source) == label


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("[FIRST 1 2 ]", r"unknown token '\[FIRST' at token 0"),
        ("[MAX 1 12 ]", r"unknown token '12' at token 2"),
        ("1 ]", r"unbalanced '\]' at token 1"),
        ("[MIN 1 ] ]", r"unbalanced '\]' at token 3"),
        ("[MIN 2 [MAX ] ]", r"operator \[MAX at token 2 has no arguments"),
        ("[MIN 1 2", r"operator \[MIN at token 0 is never closed"),
        ("1 2", r"leftover token '2' at token 1"),
        ("[MIN 1 ] [MAX 2 ]", r"leftover token '\[MAX' at token 3"),
        ("", "empty expression"),
        ("( )", "empty expression"),
    ],
)
def test_evaluate_rejects_malformed(source, message):
    with pytest.raises(ValueError, match=message):
        evaluate(source)


def test_evaluate_matches_an_independent_evaluator_on_generated_trees():
    rng = random.Random(7)
    checked = 0
    while checked < 300:
        source, label, length = generate_tree(rng, max_depth=6, max_args=6)
        tree = parse_tree(source)
        assert label == evaluate(source) == value_of(tree)
        assert length == tree_length(tree) == len(tokenize(source))
        checked += 1


# --- tokenisation ------------------------------------------------------------------------------------


def test_vocab_layout():
    assert VOCAB[PAD_ID] == "<pad>" and PAD_ID == 0
    assert VOCAB_SIZE == len(VOCAB) == 16 == len(set(VOCAB))
    assert VOCAB[1:11] == [str(d) for d in range(10)]
    assert VOCAB[11:] == ["[MIN", "[MAX", "[MED", "[SM", "]"]


def test_tokenize_drops_parentheses():
    ids = tokenize("( ( ( [MAX 2 ) 9 ) ] )")
    assert ids.dtype == np.int16
    assert ids.tolist() == [VOCAB.index(t) for t in ["[MAX", "2", "9", "]"]] == [12, 3, 10, 15]
    assert tokenize("[SM 0 [MIN 1 ] ]").tolist() == [14, 1, 11, 2, 15, 15]


def test_tokenize_rejects_unknown_tokens():
    with pytest.raises(ValueError, match=r"unknown token '\[FIRST' at token 3"):
        tokenize("( ( ( [FIRST 2 ) 9 ) ] )")
    with pytest.raises(ValueError, match=r"unknown token 'x'"):
        tokenize("x")


# --- generator ---------------------------------------------------------------------------------------


def test_string_form_is_lra_nesting_and_limits_hold():
    rng = random.Random(3)
    for _ in range(500):
        source, _, _ = generate_tree(rng, max_depth=4, max_args=3)
        tree = parse_tree(source)
        assert source == lra_string(tree)
        for depth, arity, _ in nodes(tree):
            assert depth <= 4
            if depth == 4:
                assert arity is None  # always a value at max_depth
            if arity is not None:
                assert 2 <= arity <= 3


def test_node_statistics_match_lra():
    rng = random.Random(11)
    per_depth = {1: Counter(), 2: Counter()}
    arities, operators = [], Counter()
    for _ in range(20_000):
        source, _, _ = generate_tree(rng, max_depth=3, max_args=10)
        for depth, arity, operator in nodes(parse_tree(source)):
            if depth in per_depth:
                per_depth[depth][arity is None] += 1
            if arity is not None:
                arities.append(arity)
                operators[operator] += 1
    for depth, counts in per_depth.items():
        leaf_share = counts[True] / (counts[True] + counts[False])
        assert abs(leaf_share - 0.75) < 0.015, (depth, leaf_share)  # > 5 standard deviations
    assert set(arities) == set(range(2, 11))
    assert abs(np.mean(arities) - 6.0) < 0.2
    total = sum(operators.values())
    assert set(operators) == set(OPERATORS)
    assert all(abs(count / total - 0.25) < 0.03 for count in operators.values())


def test_generate_tree_stops_at_the_length_limit():
    rng = random.Random(5)
    outcomes = [generate_tree(rng, length_limit=20) for _ in range(2_000)]
    assert any(tree is None for tree in outcomes)
    assert all(tree[2] < 20 for tree in outcomes if tree is not None)


def test_generated_examples_are_in_bounds_labelled_and_distinct():
    examples = list(generate_examples(300, seed=1, min_length=20, max_length=60))
    assert len(examples) == 300
    sources = [source for source, _ in examples]
    assert len(set(sources)) == 300
    for source, label in examples:
        assert 20 < len(tokenize(source)) < 60
        assert evaluate(source) == label
        assert source == lra_string(parse_tree(source))


def test_generation_is_deterministic_and_leaves_global_rngs_alone():
    python_state, numpy_state = random.getstate(), np.random.get_state()
    first = list(generate_examples(50, seed=4, **SHORT))
    assert first == list(generate_examples(50, seed=4, **SHORT))
    assert first != list(generate_examples(50, seed=5, **SHORT))
    assert random.getstate() == python_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_state, strict=True))


def test_generation_finds_every_distinct_tree_then_gives_up():
    # Only the ten values have length 1: all are found, an eleventh cannot be.
    assert sorted(label for _, label in generate_examples(10, min_length=0, max_length=2)) == list(range(10))
    with pytest.raises(ValueError, match="found only 10 distinct trees"):
        list(generate_examples(11, min_length=0, max_length=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_length": 10, "max_length": 11}, "min_length"),
        ({"min_length": -1}, "min_length"),
        ({"max_depth": 0}, "max_depth"),
        ({"max_args": 1}, "max_args"),
        ({"min_length": 4, "max_length": 100, "max_depth": 2, "max_args": 2}, "longest has length 4"),
    ],
)
def test_generation_rejects_impossible_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        next(generate_examples(1, **kwargs))


# --- files -------------------------------------------------------------------------------------------


def test_write_splits_writes_the_official_format(tmp_path):
    paths = write_splits(tmp_path / "listops", SMALL, seed=0, progress=False, **SHORT)
    assert paths == split_paths(tmp_path / "listops")
    assert sorted(p.name for p in (tmp_path / "listops").iterdir()) == [
        "basic_test.tsv",
        "basic_train.tsv",
        "basic_val.tsv",
    ]  # no temporary file left behind
    everything = []
    for split, path in paths.items():
        assert path.read_text().splitlines()[0] == "Source\tTarget"
        sources, labels = read_tsv(path)
        assert len(sources) == SMALL[split]
        assert labels == [evaluate(source) for source in sources]
        assert all(10 < len(tokenize(source)) < 40 for source in sources)
        everything += sources
    assert len(set(everything)) == len(everything)  # no duplicates across splits


def test_write_splits_is_deterministic(tmp_path):
    def contents(directory, seed):
        paths = write_splits(directory, SMALL, seed=seed, progress=False, **SHORT)
        return {split: path.read_bytes() for split, path in paths.items()}

    assert contents(tmp_path / "a", 3) == contents(tmp_path / "b", 3)
    assert contents(tmp_path / "a", 3) != contents(tmp_path / "c", 4)


OFFICIAL = (
    "Source\tTarget\r\n"
    "( ( ( [MAX 2 ) 9 ) ] )\t9\r\n"
    "( ( ( ( [MED 1 ) 2 ) 3 ) ] )\t2\r\n"
    "( ( ( [SM ( ( ( [MIN 9 ) 3 ) ] ) ) 9 ) ] )\t2\r\n"
)


def write_official(directory):
    directory.mkdir(parents=True, exist_ok=True)
    for path in split_paths(directory).values():
        path.write_bytes(OFFICIAL.encode())


def test_existing_files_are_used_as_they_are(tmp_path):
    write_official(tmp_path)
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in split_paths(tmp_path).values()}
    assert write_splits(tmp_path, SMALL, progress=False, **SHORT) == split_paths(tmp_path)
    assert ensure_listops(tmp_path, generate=False) == split_paths(tmp_path)
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in before} == before
    sources = [line.split("\t")[0] for line in OFFICIAL.splitlines()[1:]]
    assert read_tsv(tmp_path / "basic_val.tsv") == (sources, [9, 2, 2])


def test_crash_while_generating_leaves_no_set(tmp_path, monkeypatch):
    real = listops.generate_examples

    def crashing(*args, **kwargs):
        for count, example in enumerate(real(*args, **kwargs)):
            if count == SMALL["train"] + 3:  # in the middle of the validation split
                raise KeyboardInterrupt
            yield example

    monkeypatch.setattr(listops, "generate_examples", crashing)
    with pytest.raises(KeyboardInterrupt):
        write_splits(tmp_path, SMALL, progress=False, **SHORT)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(MissingDataError):
        ensure_listops(tmp_path, generate=False)

    monkeypatch.setattr(listops, "generate_examples", real)
    paths = write_splits(tmp_path, SMALL, progress=False, **SHORT)
    fresh = write_splits(tmp_path / "fresh", SMALL, progress=False, **SHORT)
    assert all(paths[split].read_bytes() == fresh[split].read_bytes() for split in SMALL)


def test_crash_between_renames_is_not_read_as_complete(tmp_path, monkeypatch):
    real_replace = listops.os.replace
    calls = []

    def crash_on_second(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError("simulated crash")
        real_replace(source, target)

    monkeypatch.setattr(listops.os, "replace", crash_on_second)
    with pytest.raises(OSError, match="simulated crash"):
        write_splits(tmp_path, SMALL, seed=1, progress=False, **SHORT)
    monkeypatch.setattr(listops.os, "replace", real_replace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["basic_train.tsv"]
    with pytest.raises(MissingDataError, match="basic_val.tsv, basic_test.tsv"):
        ensure_listops(tmp_path, generate=False)

    # a rerun (here with another seed) replaces the orphaned split too, so the set is consistent
    paths = ensure_listops(tmp_path, SMALL, seed=2, progress=False, **SHORT)
    fresh = write_splits(tmp_path / "fresh", SMALL, seed=2, progress=False, **SHORT)
    assert all(paths[split].read_bytes() == fresh[split].read_bytes() for split in SMALL)


def test_ensure_listops_explains_how_to_obtain_the_data(tmp_path):
    with pytest.raises(MissingDataError) as error:
        ensure_listops(tmp_path / "listops-1000", generate=False)
    message = str(error.value)
    assert str(tmp_path / "listops-1000") in message
    assert "lra_release.gz" in message and "attnlab data prepare lra --task listops" in message
    assert not (tmp_path / "listops-1000").exists()
    paths = ensure_listops(tmp_path / "listops-1000", SMALL, progress=False, **SHORT)
    assert all(path.is_file() for path in paths.values())


def test_write_splits_checks_sizes(tmp_path):
    with pytest.raises(ValueError, match="exactly the splits"):
        write_splits(tmp_path, {"train": 5, "test": 5}, progress=False, **SHORT)
    with pytest.raises(ValueError, match="'val' must be a non-negative int"):
        write_splits(tmp_path, {"train": 5, "val": -1, "test": 5}, progress=False, **SHORT)


def test_read_tsv_tolerates_trailing_newlines(tmp_path):
    path = tmp_path / "basic_test.tsv"
    path.write_text("Source\tTarget\n[MAX 2 9 ]\t9\n[MIN 2 9 ]\t2\n\n\n")
    assert read_tsv(path) == (["[MAX 2 9 ]", "[MIN 2 9 ]"], [9, 2])


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("Source\tLabel\n[MAX 2 9 ]\t9\n", 1, "expected the header"),
        ("", 1, "expected the header"),
        ("Source\tTarget\n[MAX 2 9 ]\t9\n[MIN 2 9 ]\n", 3, "expected 2 tab-separated columns"),
        ("Source\tTarget\n[MAX 2 9 ]\t9\textra\n", 2, "found 3"),
        ("Source\tTarget\n[MAX 2 9 ]\tnine\n", 2, "label 'nine' is not an integer"),
        ("Source\tTarget\n[MAX 2 9 ]\t9\n[MAX 2 19 ]\t19\n", 3, "label 19 is outside 0-9"),
        ("Source\tTarget\n[MAX 2 9 ]\t-1\n", 2, "outside 0-9"),
        ("Source\tTarget\n\t3\n", 2, "empty Source"),
        ("Source\tTarget\n[MAX 2 9 ]\t9\n\n[MIN 2 9 ]\t2\n", 3, "empty line"),
    ],
)
def test_read_tsv_errors_name_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "basic_train.tsv"
    path.write_text(text)
    with pytest.raises(DataError, match=message) as error:
        read_tsv(path)
    assert str(error.value).startswith(f"{path}:{line}: ")
    assert error.value.line == line


def test_load_split_tokenises_and_truncates(tmp_path):
    path = tmp_path / "basic_val.tsv"
    path.write_text(
        "Source\tTarget\n"
        "( ( ( [MAX 2 ) 9 ) ] )\t9\n"  # 4 tokens
        "( ( ( ( [MED 1 ) 2 ) 3 ) ] )\t2\n"  # 5 tokens
        "( ( ( [SM ( ( ( [MIN 9 ) 3 ) ] ) ) 9 ) ] )\t2\n"  # 7 tokens
    )
    full = load_split(path)
    assert full.num_truncated == 0
    assert full.lengths().tolist() == [4, 5, 7]
    assert full.labels.tolist() == [9, 2, 2]
    example = full[2]
    assert example["input_ids"].dtype == torch.long and example["label"] == 2
    assert example["input_ids"].tolist() == [14, 11, 10, 4, 15, 10, 15]

    truncated = load_split(path, max_length=5)
    assert truncated.num_truncated == 1
    assert truncated.lengths().tolist() == [4, 5, 5]
    assert truncated[2]["input_ids"].tolist() == [14, 11, 10, 4, 15]  # the first five are kept
    with pytest.raises(ValueError, match="max_length"):
        load_split(path, max_length=0)


def test_load_split_names_the_line_of_a_bad_token(tmp_path):
    path = tmp_path / "basic_val.tsv"
    path.write_text("Source\tTarget\n[MAX 2 9 ]\t9\n[FIRST 2 9 ]\t2\n")
    with pytest.raises(DataError, match=r"basic_val.tsv:3: unknown token '\[FIRST'"):
        load_split(path)


# --- strict reading ---------------------------------------------------------------------------


def test_a_split_with_no_rows_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "basic_test.tsv"
    path.write_text("Source\tTarget\n")
    with pytest.raises(DataError, match="no example") as error:
        load_split(path)
    assert str(error.value).startswith(f"{path}: ")


def test_a_non_utf8_row_names_file_and_line(tmp_path):
    path = tmp_path / "basic_train.tsv"
    path.write_bytes(b"Source\tTarget\n[MAX 2 9 ]\t9\n[MIN 2 \xff 9 ]\t2\n")
    with pytest.raises(DataError, match="not valid UTF-8") as error:
        load_split(path)
    assert str(error.value).startswith(f"{path}:3: ") and "on_bad_rows=skip" in str(error.value)


def test_on_bad_rows_skip_keeps_the_good_rows_and_counts_the_others(tmp_path, caplog):
    path = tmp_path / "basic_train.tsv"
    path.write_bytes(
        b"Source\tTarget\n[MAX 2 9 ]\t9\n[MIN 2 \xff 9 ]\t2\n[MIN 2 9 ]\tnine\n"
        b"[SM 1 2 ]\t3\n\n[MED 1 3 ]\t2\n"
    )
    with caplog.at_level("WARNING", logger="attnlab.data"):
        dataset = load_split(path, on_bad_rows="skip")
    assert dataset.labels.tolist() == [9, 3, 2] and dataset.num_skipped == 3
    message = "\n".join(r.getMessage() for r in caplog.records)
    assert "skipped 3 bad rows" in message and f"{path}:3" in message
    with pytest.raises(ValueError, match=r"on_bad_rows='drop'.*error, skip"):
        load_split(path, on_bad_rows="drop")
