"""GLUE readers on fixtures in each task's exact TSV layout (as in the official download)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from attnlab.data.errors import BadRows, DataError, MissingDataError
from attnlab.data.glue import HF_NAME, TASKS, GlueSource, encode_pairs, read_glue_tsv
from hf_hub_cache import write_hub_cache

MNLI_TRAIN = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
    "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label"
)
MNLI_DEV = MNLI_TRAIN.replace("label1\tgold_label", "label1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label")
STSB = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"

# (task, file, content, expected first sentences, second sentences or None, labels)
LAYOUTS = {
    "cola": (
        "gj04\t1\t\tOur friends won't buy this analysis, let alone the next one we propose.\n"
        "gj04\t0\t*\tThey drank the pub.\n",
        ["Our friends won't buy this analysis, let alone the next one we propose.", "They drank the pub."],
        None,
        [1, 0],
    ),
    "sst2": (
        "sentence\tlabel\nhide new secretions from the parental units \t0\nthe greatest musicians \t1\n",
        ["hide new secretions from the parental units ", "the greatest musicians "],
        None,
        [0, 1],
    ),
    "mrpc": (
        "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
        '1\t702876\t702977\tAmrozi accused his brother , whom he called " the witness " .\t'
        'Referring to him as only " the witness " , Amrozi accused his brother .\n'
        "0\t2108705\t2108831\tYucaipa owned Dominick 's .\tYucaipa bought Dominick 's in 1995 .\n",
        ['Amrozi accused his brother , whom he called " the witness " .', "Yucaipa owned Dominick 's ."],
        [
            'Referring to him as only " the witness " , Amrozi accused his brother .',
            "Yucaipa bought Dominick 's in 1995 .",
        ],
        [1, 0],
    ),
    "stsb": (
        f"{STSB}\n0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\t"
        "An air plane is taking off.\t5.000\n"
        "1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a flute.\t"
        "A man is eating.\t0.500\n",
        ["A plane is taking off.", "A man is playing a flute."],
        ["An air plane is taking off.", "A man is eating."],
        [5.0, 0.5],
    ),
    "qqp": (
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
        "133273\t213221\t213222\tHow is the life of a math student?\tWhich level is enough for jlpt5?\t0\n"
        "402555\t536040\t536041\tHow do I control my horny emotions?\t"
        "How do you control your horniness?\t1\n",
        ["How is the life of a math student?", "How do I control my horny emotions?"],
        ["Which level is enough for jlpt5?", "How do you control your horniness?"],
        [0, 1],
    ),
    "mnli": (
        f"{MNLI_TRAIN}\n0\t31193\t31193n\tgovernment\t( ( x ) )\t( ( y ) )\t(ROOT x)\t(ROOT y)\t"
        "Conceptually cream skimming has two basic dimensions.\t"
        "Product and geography are what make it work.\t"
        "neutral\tneutral\n"
        "1\t101457\t101457e\ttelephone\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tyou know during the season\t"
        "You lose the things.\tentailment\tentailment\n",
        ["Conceptually cream skimming has two basic dimensions.", "you know during the season"],
        ["Product and geography are what make it work.", "You lose the things."],
        [1, 0],
    ),
    "qnli": (
        "index\tquestion\tsentence\tlabel\n0\tWhen did the third Digimon series begin?\t"
        "Unlike the two seasons "
        "before it, it was darker.\tnot_entailment\n1\tWhat is the name?\tIts name is X.\tentailment\n",
        ["When did the third Digimon series begin?", "What is the name?"],
        ["Unlike the two seasons before it, it was darker.", "Its name is X."],
        [1, 0],
    ),
    "rte": (
        "index\tsentence1\tsentence2\tlabel\n0\tNo Weapons of Mass Destruction Found in Iraq Yet.\t"
        "Weapons of Mass Destruction Found in Iraq.\tnot_entailment\n1\tA place of sorrow.\tA sad place.\t"
        "entailment\n",
        ["No Weapons of Mass Destruction Found in Iraq Yet.", "A place of sorrow."],
        ["Weapons of Mass Destruction Found in Iraq.", "A sad place."],
        [1, 0],
    ),
}


def write_task(data_dir, task: str) -> None:
    """The task's folder with train and dev files (the same two rows; MNLI's dev in the 16-column form)."""
    spec = TASKS[task]
    folder = data_dir / "glue_data" / spec.folder
    folder.mkdir(parents=True, exist_ok=True)
    content = LAYOUTS[task][0]
    (folder / "train.tsv").write_text(content, encoding="utf-8")
    for dev in spec.dev:
        text = content
        if task == "mnli":  # dev files carry five annotator labels before gold_label
            lines = content.splitlines()
            rows = [r.rsplit("\t", 1) for r in lines[1:]]
            text = "\n".join([MNLI_DEV] + [f"{a}\tx\tx\tx\tx\t{b}" for a, b in rows]) + "\n"
        (folder / f"{dev}.tsv").write_text(text, encoding="utf-8")


@pytest.mark.parametrize("task", list(TASKS))
def test_each_official_layout_reads_its_sentences_and_labels(tmp_path, task):
    write_task(tmp_path, task)
    train, devs = GlueSource(task, tmp_path, format="tsv").read()
    _, first, second, labels = LAYOUTS[task]
    assert train.first == first and train.second == second  # tabs only: bare quotes and spaces kept
    np.testing.assert_array_equal(train.labels, labels)
    assert train.labels.dtype == (np.float32 if task == "stsb" else np.int64)
    assert len(devs) == (2 if task == "mnli" else 1)
    for dev in devs:
        assert dev.first == first
        np.testing.assert_array_equal(dev.labels, labels)


def test_cola_has_no_header_so_its_first_line_is_an_example(tmp_path):
    write_task(tmp_path, "cola")
    train, _ = GlueSource("cola", tmp_path).read()
    assert len(train) == 2 and train.labels.tolist() == [1, 0]


QQP_BROKEN = (
    "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    "1\t1\t2\tHow do I read?\tHow to read?\t1\n"
    "2\t3\t4\tWhat is a question\n"  # a question with a line break inside: the row is cut in two
    "with a line break?\tWhat?\t0\n"
    "3\t5\t6\tWhy?\tWhy not?\t0\n"
)


def test_malformed_qqp_row_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text(QQP_BROKEN)
    with pytest.raises(
        DataError, match=r"train.tsv:3: 4 tab-separated fields, expected 6 .*on_bad_rows=skip"
    ):
        read_glue_tsv(path, TASKS["qqp"], BadRows("error"))


def test_malformed_qqp_rows_are_skipped_and_counted_by_option(tmp_path, caplog):
    path = tmp_path / "train.tsv"
    path.write_text(QQP_BROKEN)
    with caplog.at_level(logging.WARNING, logger="attnlab.data"):
        examples = read_glue_tsv(path, TASKS["qqp"], BadRows("skip"))
    assert examples.first == ["How do I read?", "Why?"] and examples.labels.tolist() == [1, 0]
    assert "skipped 2 bad rows" in caplog.text and "train.tsv:3" in caplog.text


def test_unreadable_label_is_a_bad_row(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailed\n1\ta\tb\tentailment\n")
    with pytest.raises(DataError, match=r"dev.tsv:2: label 'entailed' .* one of entailment, not_entailment"):
        read_glue_tsv(path, TASKS["rte"], BadRows("error"))
    assert len(read_glue_tsv(path, TASKS["rte"], BadRows("skip"))) == 1


def test_a_non_utf8_byte_is_a_bad_row_naming_file_and_line(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_bytes(b"sentence\tlabel\nfine\t1\ncaf\xe9\t0\nalso fine\t0\n")
    with pytest.raises(DataError, match=r"train.tsv:3: not UTF-8 \(byte 0xe9 at column 4\)"):
        read_glue_tsv(path, TASKS["sst2"], BadRows("error"))
    assert read_glue_tsv(path, TASKS["sst2"], BadRows("skip")).first == ["fine", "also fine"]


def test_stsb_scores_outside_zero_to_five_are_bad_rows(tmp_path):
    path = tmp_path / "dev.tsv"
    rows = [f"{i}\tg\tf\t2012\t{i}\ts\ts\ta\tb\t{score}" for i, score in enumerate(["4.2", "7.5", "-1"])]
    path.write_text("\n".join([STSB, *rows]) + "\n")
    with pytest.raises(
        DataError, match=r"dev.tsv:3: label '7.5' in column 'score': expected a number from 0 to 5"
    ):
        read_glue_tsv(path, TASKS["stsb"], BadRows("error"))
    assert read_glue_tsv(path, TASKS["stsb"], BadRows("skip")).labels.tolist() == [pytest.approx(4.2)]


def test_a_wrong_header_names_the_missing_column(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\nx\t0\n")
    with pytest.raises(DataError, match=r"no column 'sentence1', 'sentence2' .* RTE"):
        read_glue_tsv(path, TASKS["rte"], BadRows("skip"))


def test_missing_task_folder_says_where_and_how(tmp_path):
    with pytest.raises(MissingDataError, match=r"glue_data/MNLI/train.tsv.*official GLUE download"):
        GlueSource("mnli", tmp_path, format="tsv").read()


def test_unknown_task_lists_the_tasks(tmp_path):
    with pytest.raises(ValueError, match=r"task.glue_task='mnli-mm' .* cola, sst2, mrpc, stsb, qqp, mnli"):
        GlueSource("mnli-mm", tmp_path)


def test_hf_glue_saved_to_disk_reads_like_the_tsv(tmp_path):
    import datasets

    write_task(tmp_path, "mnli")
    tsv_train, tsv_devs = GlueSource("mnli", tmp_path, format="tsv").read()
    _, first, second, labels = LAYOUTS["mnli"]
    rows = {"premise": first, "hypothesis": second, "label": labels, "idx": [0, 1]}
    splits = ("train", "validation_matched", "validation_mismatched")
    datasets.DatasetDict({s: datasets.Dataset.from_dict(rows) for s in splits}).save_to_disk(tmp_path / "hf")
    train, devs = GlueSource("mnli", tmp_path / "nowhere", format="hf", hf_path=str(tmp_path / "hf")).read()
    assert train.first == tsv_train.first and train.second == tsv_train.second
    np.testing.assert_array_equal(train.labels, tsv_train.labels)
    assert [d.first for d in devs] == [d.first for d in tsv_devs]


def _hf_rows(task: str) -> dict[str, list]:
    """LAYOUTS' two examples as the Hub dataset's columns (its label ids are GLUE's own)."""
    spec = TASKS[task]
    _, first, second, labels = LAYOUTS[task]
    rows = {spec.hf_text[0]: first, "label": labels, "idx": [0, 1]}
    if second is not None:
        rows[spec.hf_text[1]] = second
    return rows


@pytest.mark.parametrize("repo_id", ["nyu-mll/glue", "glue"])  # the Hub id today; the old short name
def test_hf_cache_of_the_hub_dataset_reads_like_the_tsv(tmp_path, hf_cache, repo_id, caplog):
    write_task(tmp_path, "mnli")
    tsv_train, tsv_devs = GlueSource("mnli", tmp_path, format="tsv").read()
    splits = ("train", "validation_matched", "validation_mismatched")
    write_hub_cache(hf_cache, repo_id, "mnli", {s: _hf_rows("mnli") for s in splits})
    source = GlueSource("mnli", tmp_path / "nowhere")  # auto: no glue_data folder, so the cache
    with caplog.at_level(logging.INFO):
        train, devs = source.read()
    assert (train.first, train.second) == (tsv_train.first, tsv_train.second)
    np.testing.assert_array_equal(train.labels, tsv_train.labels)
    assert [d.first for d in devs] == [d.first for d in tsv_devs]
    assert "huggingface:nyu-mll/glue/mnli (local cache)" in source.description
    older = "read from the local cache of its older name 'glue'"
    assert (older in caplog.text) == (repo_id == "glue")  # the log says which cache was read


def test_hf_cache_without_the_asked_task_is_a_missing_data_error(tmp_path, hf_cache):
    rows = _hf_rows("sst2")
    write_hub_cache(hf_cache, HF_NAME, "sst2", {"train": rows, "validation": rows})
    missing = r"glue_data/RTE.*'nyu-mll/glue' or 'glue' \(rte\) \(split 'train'\)"
    with pytest.raises(MissingDataError, match=missing):
        GlueSource("rte", tmp_path).read()


def test_hf_without_cache_or_folder_is_a_missing_data_error(tmp_path, hf_cache):
    with pytest.raises(MissingDataError, match=r"glue_data/RTE.*not in the local cache.*format=hf"):
        GlueSource("rte", tmp_path).read()  # auto: no folder, so the HF cache, which is empty


class _Tok:
    bos_id, eos_id, pad_id = 1, 2, 0

    def encode_batch(self, texts):
        return [[10 + len(t)] * len(t) for t in texts]  # one token per character


def test_pairs_are_framed_as_roberta_and_the_longer_side_is_cut_first():
    [single] = encode_pairs(_Tok(), ["abc"], None, 16)
    assert single.tolist() == [1, 13, 13, 13, 2]
    [pair] = encode_pairs(_Tok(), ["abcdefgh"], ["xy"], 10)  # room for 6 tokens: 4 + 2
    assert pair.tolist() == [1, 18, 18, 18, 18, 2, 2, 12, 12, 2]
    [short] = encode_pairs(_Tok(), ["abcdefgh"], ["x"], 40)
    assert len(short) == 8 + 1 + 4
