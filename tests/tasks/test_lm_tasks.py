"""`task=lm` trains by name on the embedded corpus, scores per token and per byte, and beats a unigram
model's perplexity with every backend that has a causal form."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from attnlab.data.lm import IGNORE_INDEX, LMDataModule, token_bytes
from attnlab.data.packing import document_layout
from attnlab.data.text_corpus import TextCorpus
from attnlab.models.causal_lm import CausalLM, causal_backends
from attnlab.pipeline import train
from attnlab.run.resume import read_checkpoint
from attnlab.tasks.lm import CHECKPOINT_KEY, CausalLMTask
from conftest import compose_train_config

VOCAB = 512
# data-size overrides only: a small tokenizer, short blocks, a small model, a short budget
TINY_LM = [
    "task=lm",
    f"task.data.source.tokenizer.vocab_size={VOCAB}",
    "task.data.seq_len=32",
    "task.data.batch_size=16",
    "task.model.dim=32",
    "task.model.depth=2",
    "task.model.num_heads=2",
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
]


@pytest.fixture
def data_dir(corpus_data_dir):
    return corpus_data_dir


def run(tmp_path, data_dir, *overrides):
    cfg = compose_train_config([*TINY_LM, f"paths.data_dir={data_dir}", *overrides], tmp_path)
    return train(cfg), tmp_path / "run"


def first_train_loss(run_dir) -> float:
    with open(next(run_dir.rglob("metrics.csv"))) as handle:
        return next(float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss"))


def test_blocks_shift_by_one_and_bytes_add_up(data_dir):
    source = TextCorpus(data_dir=data_dir, tokenizer={"vocab_size": VOCAB})
    data = LMDataModule(source, seq_len=16, batch_size=4)
    data.prepare_data()
    data.setup()
    stream = data.streams["val"]
    first, last = data.datasets["val"][0], data.datasets["val"][len(data.datasets["val"]) - 1]
    assert first["input_ids"][0] == data.tokenizer.bos_id
    assert torch.equal(first["input_ids"][1:], first["labels"][:-1])  # targets: the next ids
    assert first["labels"].tolist() == [int(x) for x in stream[:16]]
    scored = sum(
        int((data.datasets["val"][i]["labels"] != IGNORE_INDEX).sum())
        for i in range(len(data.datasets["val"]))
    )
    assert scored == len(stream) and (last["labels"] == IGNORE_INDEX).any() == (len(stream) % 16 != 0)
    text = "Return the number of items in a container — naïve café.\n"
    ids = data.tokenizer.encode(text)
    assert int(token_bytes(data.tokenizer)[ids].sum()) == len(text.encode())  # UTF-8 bytes, exactly
    base = data.baselines("test")
    assert base["baseline_perplexity"] == pytest.approx(math.exp(base["baseline_loss"]))
    assert 0 < base["baseline_bits_per_byte"] < base["baseline_loss"] / math.log(2)  # > 1 byte per token


def test_lm_learns_and_reports_perplexity_per_token_and_per_byte(tmp_path, data_dir):
    summary, run_dir = run(
        tmp_path, data_dir, "attn=linear", "task.max_steps=80", "task.val_check_interval=40",
        "task.module.optimizer.lr=3e-3", "task.module.scheduler.warmup_steps=10",
        "trainer.log_every_n_steps=2",
    )  # fmt: skip
    assert first_train_loss(run_dir) > math.log(VOCAB) - 0.5  # starts near uniform over the vocabulary
    assert summary["test_loss"] < summary["baseline_loss"], summary  # beats the unigram model
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]), rel=1e-4)
    assert summary["test_byte_perplexity"] == pytest.approx(2 ** summary["test_bits_per_byte"], rel=1e-4)
    assert summary["test_bits_per_byte"] < summary["baseline_bits_per_byte"]
    assert summary["task"] == "lm" and summary["seq_len"] == 32 and summary["train_tokens_per_sec"] > 0
    assert "pydoc_data.topics" in summary["data_source"] and f"bpe{VOCAB}" in summary["data_source"]
    saved = read_checkpoint(summary["best_checkpoint"])[CHECKPOINT_KEY]  # weights_only: plain strings
    assert '"<s>"' in saved["tokenizer"]["vocab"] and saved["tokenizer"]["merges"]


@pytest.mark.slow
@pytest.mark.parametrize("attn", causal_backends())
def test_every_causal_backend_beats_the_unigram(tmp_path, data_dir, attn):
    """A tiny run per backend (seconds each on one thread) ends under the unigram's perplexity."""
    summary, _ = run(
        tmp_path, data_dir, f"attn={attn}", "task.max_steps=150", "task.val_check_interval=75",
        "task.module.optimizer.lr=3e-3", "task.module.scheduler.warmup_steps=10",
    )  # fmt: skip
    assert summary["steps"] == 150
    assert summary["test_perplexity"] < summary["baseline_perplexity"], summary


def test_packed_documents_train_and_beat_the_unigram(tmp_path, data_dir, caplog):
    """``task.data.packing=true``: each document attends within itself (exactness per document:
    tests/models/test_causal_lm.py), and the run learns as the plain one does."""
    with caplog.at_level("INFO", logger="attnlab.data.lm"):
        packed, _ = run(tmp_path, data_dir, "attn=linear", "task.max_steps=80", "task.val_check_interval=40",
                        "task.module.optimizer.lr=3e-3", "task.module.scheduler.warmup_steps=10",
                        "task.data.packing=true")  # fmt: skip
    assert "packing: attention within each document" in caplog.text
    assert packed["test_loss"] < packed["baseline_loss"], packed


def test_the_task_gives_the_model_a_packed_batchs_documents():
    torch.manual_seed(0)
    model = CausalLM(30, "linear", dim=16, depth=1, num_heads=2, max_len=16).eval()
    ids = torch.tensor([[1, 5, 6, 2, 7, 8, 9, 2]])  # two documents, each ending with </s> (id 2)
    layout = document_layout(ids, eos_id=2, pad_id=0)
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1), "mask": ids != 0, **layout.batch_items()}
    task = CausalLMTask(model, optimizer=torch.optim.AdamW)
    with torch.no_grad():
        _, logits, _ = task._scores(batch)
        torch.testing.assert_close(logits, model(ids, packing=layout).flatten(0, 1))
        assert not torch.allclose(logits, model(ids).flatten(0, 1))  # the second document reads the first
