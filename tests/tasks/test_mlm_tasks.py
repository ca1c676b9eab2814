"""`task=mlm` trains by name on the embedded corpus, resumes with the same masks (the GLUE
fine-tune from its checkpoint is in tests/tasks/test_glue_tasks.py)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from attnlab.attention import PackedLayout
from attnlab.data.packing import document_layout
from attnlab.data.text_corpus import MLMDataModule, TextCorpus
from attnlab.models.mlm import MaskedLanguageModel
from attnlab.pipeline import train
from attnlab.run.resume import read_checkpoint
from attnlab.tasks.mlm import CHECKPOINT_KEY, MaskedLMTask
from conftest import compose_train_config
from tiny_runs import REPO_ROOT, run_train_py

VOCAB = 512
# data-size overrides only: a small tokenizer, short blocks, a small model, a short budget
TINY_MLM = [
    "task=mlm",
    f"task.data.source.tokenizer.vocab_size={VOCAB}",
    "task.data.seq_len=64",
    "task.data.batch_size=16",
    "task.model.dim=32",
    "task.model.mlp_dim=64",
    "trainer.enable_progress_bar=false",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
]


@pytest.fixture
def data_dir(corpus_data_dir):
    return corpus_data_dir


def run(tmp_path, data_dir, *overrides):
    cfg = compose_train_config([*TINY_MLM, f"paths.data_dir={data_dir}", *overrides], tmp_path)
    return train(cfg), tmp_path / "run"


def metric_rows(run_dir, key):
    with open(next(run_dir.rglob("metrics.csv"))) as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key)]


# softmax: make test-all (it runs no line that the ReLU-bump run and the other softmax tests leave out)
@pytest.mark.parametrize("attn", ["sliced_relu_bump", pytest.param("softmax", marks=pytest.mark.slow)])
def test_mlm_learns_on_the_embedded_corpus(tmp_path, data_dir, attn):
    summary, run_dir = run(
        tmp_path,
        data_dir,
        f"attn={attn}",
        "task.max_steps=60",
        "task.val_check_interval=30",
        "task.module.optimizer.lr=3e-3",
        "task.module.scheduler.warmup_steps=10",
        "trainer.log_every_n_steps=2",
    )
    train_loss = metric_rows(run_dir, "train/loss")
    assert train_loss[0] > math.log(VOCAB) - 0.5  # starts near uniform over the vocabulary
    assert summary["test_loss"] < train_loss[0] - 0.6  # and drops
    assert summary["test_loss"] < summary["baseline_loss"] + 0.3  # reaches the unigram level at least
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]), rel=1e-4)
    assert 0 < summary["baseline_acc"] < summary["test_acc"] + 0.05
    assert summary["seq_len"] == 64 and summary["task"] == "mlm"
    assert "pydoc_data.topics" in summary["data_source"] and f"bpe{VOCAB}" in summary["data_source"]
    assert summary["train_tokens_per_sec"] > 0
    checkpoint = read_checkpoint(summary["best_checkpoint"])  # weights_only: the tokenizer is plain text
    saved = checkpoint[CHECKPOINT_KEY]
    assert saved["model"]["vocab_size"] == VOCAB and saved["model"]["dim"] == 32
    assert '"<mask>"' in saved["tokenizer"]["vocab"] and saved["tokenizer"]["merges"]


@pytest.mark.slow
def test_the_readme_mlm_command_ends_well_below_the_unigram(tmp_path):
    """Exactly `python train.py task=mlm attn=sliced_relu_bump` (the README's CPU figure), data and run in
    tmp dirs: about 4 minutes on 2 quiet cores."""
    run_dir = tmp_path / "run"
    done = run_train_py(
        "task=mlm", "attn=sliced_relu_bump",
        f"paths.data_dir={tmp_path / 'data'}", f"hydra.run.dir={run_dir}", timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1000, summary  # the whole budget, not cut by the time limit
    assert summary["test_loss"] < summary["baseline_loss"] - 0.7, summary
    assert summary["test_acc"] > 3 * summary["baseline_acc"], summary


def test_resumed_run_draws_the_same_masks(tmp_path, data_dir, monkeypatch):
    """Masks come from (seed, rank, batch number): resuming at step 3 replays steps 4-6 exactly."""
    seen: list[tuple[int, torch.Tensor]] = []
    original = MLMDataModule.mask_train_batch

    def record(self, batch, counter, rank=0):
        out = original(self, batch, counter, rank)
        seen.append((counter, out["labels"].clone()))
        return out

    monkeypatch.setattr(MLMDataModule, "mask_train_batch", record)
    common = [
        "task.max_steps=6",
        "task.val_check_interval=3",
        "callbacks.periodic_checkpoint.every_n_train_steps=3",
        "attn=softmax",
    ]
    run(tmp_path / "a", data_dir, *common)
    full = list(seen)
    seen.clear()
    step3 = tmp_path / "a" / "run" / "checkpoints" / "step3.ckpt"
    run(tmp_path / "b", data_dir, *common, f"ckpt_path={step3}")
    assert [c for c, _ in full] == list(range(6)) and [c for c, _ in seen] == [3, 4, 5]
    for (_, a), (_, b) in zip(full[3:], seen, strict=True):
        assert torch.equal(a, b)  # same blocks, same masked positions, same targets
    assert not torch.equal(full[3][1], full[4][1])


def test_data_prepare_mlm_trains_the_tokenizer_once_and_the_run_reuses_it(tmp_path, capsys):
    from attnlab.cli.main import main

    size = [f"task.data.source.tokenizer.vocab_size={VOCAB}"]
    check = ["data", "prepare", "mlm", "--check-only", "--data-dir", str(tmp_path / "data"), *size]
    assert main(check) == 1
    assert "MISSING" in capsys.readouterr().out and not (tmp_path / "data" / "mlm").exists()
    assert main(["data", "prepare", "mlm", "--data-dir", str(tmp_path / "data"), *size]) == 0
    out = capsys.readouterr().out
    assert "pydoc_data.topics" in out and "train  ok" in out and "counts are tokens" in out
    vocab = next((tmp_path / "data" / "mlm").rglob("vocab.json"))
    stamp = vocab.stat().st_mtime_ns
    assert main(check) == 0
    summary, _ = run(tmp_path, tmp_path / "data", "task.max_steps=2", "task.val_check_interval=2")
    assert vocab.stat().st_mtime_ns == stamp and str(vocab) in summary["data_source"]  # reused, not retrained
    assert main(["data", "prepare", "lra", "--data-dir", str(tmp_path)]) == 2  # lra still needs --task


@pytest.mark.parametrize(
    "attn,trainer,devices,heads,accumulate",
    [
        ("softmax", "gpu", 1, 16, 32),
        ("sliced_relu_bump", "ddp", 2, 64, 16),
        ("sliced_relu_bump", "ddp", 8, 64, 4),
    ],
)
def test_paper_preset_keeps_the_global_batch_and_the_paper_model(
    tmp_path, attn, trainer, devices, heads, accumulate
):
    from hydra.utils import instantiate

    cfg = compose_train_config(
        [
            "experiment=mlm/paper",
            f"attn={attn}",
            f"trainer={trainer}",
            "task.data.source.files=/data/corpus/*.jsonl",  # docs/mlm.md's command
            f"trainer.devices={devices}",
        ],
        tmp_path,
    )
    assert cfg.task.model.num_heads == heads and cfg.task.data.seq_len == 512
    assert cfg.trainer.accumulate_grad_batches == accumulate
    assert cfg.task.data.batch_size * devices * accumulate == 1024
    assert cfg.trainer.precision == "bf16-mixed" and cfg.task.module.optimizer.eps == 1e-6
    with torch.device("meta"):  # the 24 × 1024 model's shape, without allocating it
        model = instantiate(cfg.task.model, attention=instantiate(cfg.attn), vocab_size=50265, pad_id=1)
    assert model.config["depth"] == 24 and model.config["dim"] == 1024 and model.config["mlp_dim"] == 4096
    assert 300e6 < sum(p.numel() for p in model.parameters()) < 360e6  # BERT-large size, tied embeddings


def test_paper_preset_refuses_a_global_batch_it_cannot_keep(tmp_path):
    cfg = compose_train_config(["experiment=mlm/paper", "trainer=ddp", "trainer.devices=3"], tmp_path)
    with pytest.raises(Exception, match=r"trainer.devices=3 .* do not split evenly over 3 devices"):
        _ = cfg.trainer.accumulate_grad_batches


def test_paper_preset_claims_only_what_the_paper_states():
    """Warm-up and bf16 are not in the paper; its corpus is FineWeb + Wikipedia + BookCorpus, and the
    preset's tokenizer is the paper's only when RoBERTa's files are given."""
    text = (REPO_ROOT / "conf" / "experiment" / "mlm" / "paper.yaml").read_text()
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if ":" in line and "#" in line}
    for key in ("warmup_steps", "precision"):
        assert "ours (not stated in the paper)" in lines[key] and "[P]" not in lines[key], key
    assert "FineWeb, Wikipedia, BookCorpus" in text and "trains a new byte-level BPE" in text


def test_packed_documents_are_exact_alone_and_pretrain(tmp_path, data_dir):
    """``task.data.packing=true``: each document of a block attends within itself (exact per document,
    float64), and a run with it learns."""
    torch.manual_seed(0)
    model = MaskedLanguageModel(40, "sliced_relu", dim=16, depth=2, num_heads=2, mlp_dim=32).double().eval()
    eos, pad = 2, 0  # the model's pad_id
    docs = [[1, 5, 9, eos], [11, 4, 6, 8, eos], [13, 7]]
    layout = document_layout(torch.tensor([sum(docs, [])]), eos, pad)
    with torch.no_grad():
        out = model(torch.tensor([sum(docs, [])]), packing=layout)[0]
        for start, doc in zip((0, 4, 9), docs, strict=True):
            alone = model(torch.tensor([doc]))[0]
            torch.testing.assert_close(out[start : start + len(doc)], alone, atol=1e-9, rtol=1e-9)
    packed, run_dir = run(tmp_path, data_dir, "attn=sliced_relu_bump", "task.max_steps=30",
                          "task.val_check_interval=30", "task.module.optimizer.lr=3e-3",
                          "task.module.scheduler.warmup_steps=10", "trainer.log_every_n_steps=2",
                          "task.data.packing=true")  # fmt: skip
    assert packed["test_loss"] < metric_rows(run_dir, "train/loss")[0] - 0.5  # it learns


def test_documents_are_read_from_the_unmasked_blocks_and_reach_the_model(data_dir):
    """Evaluation blocks arrive masked (``raw`` beside them): a ``</s>`` under a mask still ends its
    document, and the task scores the model's packed outputs."""
    source = TextCorpus(data_dir=data_dir, tokenizer={"vocab_size": VOCAB})
    data = MLMDataModule(source, seq_len=32, batch_size=4, packing=True)
    data.prepare_data()
    data.setup()
    tok = data.tokenizer
    raw = torch.tensor([tok.bos_id, 40, 41, tok.eos_id, 42, 43, tok.eos_id, 44])
    masked = raw.clone()
    masked[3] = tok.mask_id
    labels = torch.full_like(raw, -100)
    labels[3] = tok.eos_id
    batch = data._collate([{"input_ids": masked, "labels": labels, "raw": raw}])
    layout = PackedLayout.from_batch(batch)
    assert layout.mask.sum(1).tolist() == [4, 3, 1]
    torch.manual_seed(0)
    model = MaskedLanguageModel(tok.vocab_size, "softmax", dim=16, depth=1, num_heads=2, mlp_dim=32)
    task = MaskedLMTask(model.eval(), optimizer=torch.optim.AdamW)
    with torch.no_grad():
        loss, _, count = task._losses(batch)
        logits = model(masked[None], positions=labels[None] != -100, packing=layout)
        assert count == 1 and loss == pytest.approx(
            float(torch.nn.functional.cross_entropy(logits, labels[3:4]))
        )
