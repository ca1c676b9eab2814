"""`task=glue`: GLUE metrics against hand-computed values, the STS-B regression head, and short fine-tunes
from a short `task=mlm` checkpoint on fixture tasks in the official TSV layout."""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch
from torch import nn

from attnlab.attention import PackedLayout
from attnlab.data.packing import pack_sequences
from attnlab.errors import CheckpointError, ConfigError
from attnlab.models.mlm import SentenceClassifier
from attnlab.pipeline import train
from attnlab.run.resume import read_checkpoint
from attnlab.tasks.glue import GlueTask
from conftest import CONF_DIR, compose_train_config

# on one worker under `make test`: the module's MLM checkpoint (`pretrained`) is trained once, not per worker
pytestmark = pytest.mark.xdist_group("glue_checkpoint")

QUIET = ["trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", "logger=csv"]
TINY_MLM = [
    "task=mlm",
    "task.data.source.tokenizer.vocab_size=512",
    "task.data.seq_len=64",
    "task.data.batch_size=16",
    "task.model.dim=32",
    "task.model.mlp_dim=64",
    "task.max_steps=20",
    "task.val_check_interval=10",
    "attn=softmax",
    *QUIET,
]


class _Fixed(nn.Module):
    """Stands in for the classifier: returns the outputs it was given."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = torch.as_tensor(outputs, dtype=torch.float32)
        self.config = {}

    def forward(self, input_ids, mask):
        return self.outputs


def _scores(task: str, outputs, labels, subset=None, stage="test") -> dict[str, float]:
    module = GlueTask(_Fixed(outputs), task, None, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    logged = {}
    module.log = lambda name, value, **_: logged.__setitem__(name, float(value))
    n = len(labels)
    batch = {
        "input_ids": torch.zeros(n, 3, dtype=torch.long),
        "mask": torch.ones(n, 3, dtype=torch.bool),
        "labels": torch.as_tensor(labels),
        "subset": torch.as_tensor(subset if subset is not None else [0] * n),
    }
    module._eval_step(batch, stage)
    module._eval_epoch_end(stage)
    return logged


def _logits(classes):
    return [[0.0, 1.0] if c else [1.0, 0.0] for c in classes]


# predictions 1 1 0 0 1 against labels 1 0 0 1 1: TP 2, FP 1, FN 1, TN 1
PRED, GOLD = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]


def test_cola_scores_accuracy_as_the_other_tasks_with_matthews_correlation_beside():
    got = _scores("cola", _logits(PRED), GOLD)
    mcc = (2 * 1 - 1 * 1) / math.sqrt((2 + 1) * (2 + 1) * (1 + 1) * (1 + 1))  # = 1/6
    assert got["test/mcc"] == pytest.approx(mcc)
    assert got["test/acc"] == got["test/accuracy"] == pytest.approx(3 / 5)  # Table 4's metric for its tasks


@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_mrpc_and_qqp_score_accuracy_and_f1_of_the_positive_class(task):
    got = _scores(task, _logits(PRED), GOLD)
    assert got["test/accuracy"] == pytest.approx(3 / 5) and got["test/acc"] == pytest.approx(3 / 5)
    assert got["test/f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # 2TP / (2TP + FP + FN)


def test_stsb_scores_pearson_and_spearman_and_regresses_one_output():
    scores, gold = [[1.0], [30.0], [2.0], [4.0]], [1.0, 2.0, 3.0, 4.0]
    got = _scores("stsb", scores, gold)
    # Pearson by hand: x mean 9.25, y mean 2.5; covariance sum -9.5; sums of squares 578.75 and 5
    assert got["test/pearson"] == pytest.approx(-9.5 / math.sqrt(578.75 * 5), abs=1e-5)
    # Spearman: ranks (1, 4, 2, 3) vs (1, 2, 3, 4), d^2 = 0 + 4 + 1 + 1: 1 - 6 * 6 / (4 * 15) = 0.4
    assert got["test/spearman"] == pytest.approx(0.4, abs=1e-5) and got["test/acc"] == got["test/spearman"]
    assert got["test/loss"] == pytest.approx(
        sum((s[0] - g) ** 2 for s, g in zip(scores, gold, strict=True)) / 4
    )


def test_mnli_scores_matched_and_mismatched_dev_sets_apart():
    got = _scores("mnli", [[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]], [0, 2, 0, 0], subset=[0, 0, 1, 1])
    assert got["test/accuracy"] == 0.5 and got["test/accuracy_mismatched"] == 0.5
    assert got["test/acc"] == 0.5
    got = _scores("mnli", [[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]], [0, 1, 1, 1], subset=[0, 0, 1, 1])
    assert got["test/accuracy"] == 1.0 and got["test/accuracy_mismatched"] == 0.0


def test_regression_head_gives_one_score_per_pair_and_learns_a_target():
    torch.manual_seed(0)
    model = SentenceClassifier(vocab_size=20, num_outputs=1, attention="softmax", dim=16, mlp_dim=32)
    ids = torch.randint(5, 20, (8, 6))
    ids[:, 4:] = 0  # padding
    target = (ids[:, 0] % 5).float()  # the score depends on the text
    assert model(ids).shape == (8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss = nn.functional.mse_loss(model(ids).squeeze(-1), target)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.2 * first


# ------------------------------------------------------------------------------ fine-tuning runs


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus_data_dir):
    """A short task=mlm run on the embedded corpus; its best checkpoint."""
    root = tmp_path_factory.mktemp("glue-mlm")
    summary = train(compose_train_config([*TINY_MLM, f"paths.data_dir={corpus_data_dir}"], root))
    return summary["best_checkpoint"]


WORDS = ["the", "a", "function", "module", "class", "returns", "value", "list", "object", "string", "file"]


def _write_sst2(data_dir, n_train=400, n_dev=100) -> None:
    """SST-2's layout (header ``sentence<TAB>label``): the label is whether "good" or "bad" is said."""
    rng = random.Random(0)

    def rows(n):
        lines = ["sentence\tlabel"]
        for _ in range(n):
            label = rng.randint(0, 1)
            words = [rng.choice(WORDS) for _ in range(8)]
            words.insert(rng.randint(0, 8), "good" if label else "bad")
            lines.append(" ".join(words) + " \t" + str(label))
        return "\n".join(lines) + "\n"

    folder = data_dir / "glue_data" / "SST-2"
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text(rows(n_train))
    (folder / "dev.tsv").write_text(rows(n_dev))


def _write_stsb(data_dir, n_train=200, n_dev=60) -> None:
    """STS-B's 10-column layout; the score counts the words the two sentences share."""
    rng = random.Random(1)
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"

    def rows(n):
        lines = [header]
        for i in range(n):
            a = rng.sample(WORDS, 5)
            shared = rng.randint(0, 5)
            b = a[:shared] + rng.sample([w for w in WORDS if w not in a], 5 - shared)
            lines.append(f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{' '.join(a)}.\t"
                         f"{' '.join(b)}.\t{shared:.3f}")  # fmt: skip
        return "\n".join(lines) + "\n"

    folder = data_dir / "glue_data" / "STS-B"
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text(rows(n_train))
    (folder / "dev.tsv").write_text(rows(n_dev))


def _glue(tmp_path, task, ckpt, *overrides):
    data = tmp_path / "data"
    base = ["task=glue", f"task.glue_task={task}", f"task.pretrained={ckpt}", "attn=softmax"]
    cfg = compose_train_config([*base, *QUIET, f"paths.data_dir={data}", *overrides], tmp_path)
    return train(cfg)


#: a budget in steps instead of epochs, validating every 20 steps, for tests that must be quick
STEPS = ["task.check_val_every_n_epoch=null", "task.max_epochs=-1"]
SHORT = [
    *STEPS,
    "task.max_steps=60",
    "task.val_check_interval=20",
    "task.data.batch_size=16",
    "task.module.optimizer.lr=1e-3",
    "task.module.scheduler.warmup_fraction=0.08",
]


def test_sst2_fine_tune_from_the_mlm_checkpoint_learns(tmp_path, pretrained):
    _write_sst2(tmp_path / "data")
    summary = _glue(tmp_path, "sst2", pretrained, *SHORT)
    assert summary["task"] == "glue_sst2" and "GLUE SST-2" in summary["data_source"]
    assert 0.3 < summary["baseline_acc"] < 0.7
    assert summary["test_acc"] > 0.9 and summary["test_accuracy"] == summary["test_acc"]
    assert summary["val_acc"] > 0.9 and summary["steps"] == 60


def test_the_pretrained_encoder_is_what_fine_tuning_starts_from(tmp_path, pretrained):
    _write_sst2(tmp_path / "data")
    summary = _glue(tmp_path, "sst2", pretrained, *STEPS, "task.max_steps=1", "task.val_check_interval=1",
                    "task.module.optimizer.lr=1e-12", "task.data.batch_size=16")  # fmt: skip
    before = read_checkpoint(pretrained)["state_dict"]
    after = read_checkpoint(summary["best_checkpoint"])["state_dict"]
    name = "model.backbone.embed.weight"
    assert torch.allclose(after[name], before[name], atol=1e-6)  # one step at lr 1e-12 moves nothing
    assert any(k.startswith("model.head.") for k in after)


def test_stsb_fine_tune_reports_pearson_and_spearman(tmp_path, pretrained):
    _write_stsb(tmp_path / "data")
    summary = _glue(tmp_path, "stsb", pretrained, *SHORT)
    assert summary["test_acc"] == summary["test_spearman"] and -1 <= summary["test_pearson"] <= 1
    assert (
        summary["baseline_acc"] == 0.0 and summary["task"] == "glue_stsb" and summary["val_acc"] is not None
    )


def test_other_attention_than_the_checkpoint_is_refused(tmp_path, pretrained):
    _write_sst2(tmp_path / "data")
    with pytest.raises(Exception) as info:
        _glue(tmp_path, "sst2", pretrained, "attn=sliced_relu_bump", *SHORT)
    assert "pretrained with" in str(info.value) and "attn=" in str(info.value)


def test_missing_or_non_mlm_checkpoint_is_a_clear_error(tmp_path, pretrained):
    _write_sst2(tmp_path / "data")
    with pytest.raises(Exception, match="task.pretrained is not set"):
        train(compose_train_config(["task=glue", "task.glue_task=sst2", *QUIET], tmp_path))
    plain = read_checkpoint(pretrained)
    plain.pop("attnlab_mlm")
    torch.save(plain, tmp_path / "plain.ckpt")
    with pytest.raises(Exception, match="is not a masked-LM checkpoint"):
        _glue(tmp_path, "sst2", tmp_path / "plain.ckpt", *SHORT)


def test_errors_are_user_errors():
    """train.py prints a UserError's message alone: both refusals of a pretrained checkpoint are ones."""
    from attnlab.errors import UserError

    with pytest.raises(ConfigError, match=r"attn: the model uses None but task.pretrained p .* with X"):
        GlueTask(_Fixed([[0.0]]), "sst2", None, optimizer=None).load_pretrained(
            type("P", (), {"shape": {"attention": "X"}, "path": "p"})()
        )
    assert issubclass(CheckpointError, UserError) and issubclass(ConfigError, UserError)


def test_a_constant_prediction_scores_zero_correlation_not_nan():
    """torchmetrics gives NaN for the correlation of a constant: a NaN val/acc would never be 'best'."""
    got = _scores("stsb", [[2.5]] * 4, [0.5, 1.0, 3.0, 4.5])
    assert got["test/spearman"] == 0.0 and got["test/pearson"] == 0.0 and got["test/acc"] == 0.0
    got = _scores("cola", _logits([1, 1, 1, 1]), [1, 0, 0, 1])
    assert got["test/mcc"] == 0.0


# ------------------------------------------------------------------------------------------- report


def _summary(folder, task, attn, val, **fields):
    import json

    folder.mkdir(parents=True)
    data = {"task": task, "attn": attn, "seed": 0, "val_acc": val, "test_acc": fields.get("test_acc", val)}
    (folder / "summary.json").write_text(json.dumps({**data, **fields}))


def test_report_prints_table4_from_the_best_grid_configuration(tmp_path, capsys):
    from attnlab.cli.main import main

    _summary(tmp_path / "mlm-a", "mlm", "softmax", 0.30, test_loss=4.5)
    _summary(tmp_path / "mlm-b", "mlm", "softmax", 0.35, test_loss=4.2)  # best by validation
    # a grid of two configurations: the lower validation score loses even with the higher dev score
    _summary(tmp_path / "cola-1", "glue_cola", "softmax", 0.10, test_accuracy=0.8, test_mcc=0.4)
    _summary(tmp_path / "cola-2", "glue_cola", "softmax", 0.20, test_accuracy=0.7, test_mcc=-0.05)
    _summary(
        tmp_path / "mnli", "glue_mnli", "softmax", 0.6, test_accuracy=0.61, test_accuracy_mismatched=0.625
    )
    _summary(tmp_path / "mrpc", "glue_mrpc", "sliced_relu_bump", 0.7, test_f1=0.8, test_accuracy=0.72)
    assert main(["report", str(tmp_path), "--out-dir", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("## GLUE dev") :]
    assert "| backend | MLM eval loss | SST-2 | MRPC (acc/F1) | STS-B (S/P)" in table
    assert "| RTE | CoLA, ours (acc/MCC) |" in table and "does not list (ours)" in table
    assert "| softmax | 4.200 | — | — | — | — | 61.0/62.5 | — | — | 70.0/-5.0 |" in table  # negative MCC kept
    assert "| sliced_relu_bump | — | — | 72.0/80.0 |" in table
    assert (tmp_path / "report" / "glue.md").read_text() == table.rstrip("\n") + "\n"


def test_grid_preset_sweeps_batch_size_and_learning_rate(tmp_path):
    cfg = compose_train_config(["experiment=glue/grid", "task.glue_task=rte", "attn=softmax"], tmp_path)
    assert cfg.task.name == "glue_rte" and cfg.task.data.source.glue_task == "rte"
    from omegaconf import OmegaConf

    grid = OmegaConf.load(CONF_DIR / "experiment" / "glue" / "grid.yaml").hydra.sweeper.params
    assert grid["task.data.batch_size"] == "16,32" and grid["task.module.optimizer.lr"] == "1e-5,2e-5,3e-5"


@pytest.mark.slow
def test_documented_grid_sweep_and_report_run_as_written(tmp_path, pretrained):
    """docs/mlm.md: ``python train.py -m experiment=glue/grid task.glue_task=... task.pretrained=<mlm ckpt>
    attn=softmax`` then ``attnlab report outputs/multirun`` (only step counts added; SST-2 is the fixture),
    each through its entry point's ``main(argv)`` in this process."""
    from tiny_runs import attnlab_main, train_main

    _write_sst2(tmp_path / "data", n_train=200, n_dev=40)
    sizes = ["task.max_epochs=1", *QUIET]  # the budget in epochs, as the preset states it: one here
    sweep = train_main(
        "-m", "experiment=glue/grid", "task.glue_task=sst2", f"task.pretrained={pretrained}", "attn=softmax",
        *sizes, cwd=tmp_path,
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    summaries = list((tmp_path / "outputs" / "multirun").rglob("summary.json"))
    assert len(summaries) == 6  # batch {16, 32} x lr {1e-5, 2e-5, 3e-5}
    report = attnlab_main("report", "outputs/multirun", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "## GLUE dev" in report.stdout and "| softmax |" in report.stdout


def test_the_budget_is_in_epochs_with_roberta_warmup_and_dev_selection(tmp_path):
    """RoBERTa's fine-tuning: 10 epochs, warm-up 6 % of the steps, validation on dev once per epoch."""
    from hydra.utils import instantiate

    from attnlab.tasks.schedules import warmup_decay

    cfg = compose_train_config(["task=glue", "task.glue_task=rte", "attn=softmax"], tmp_path)
    assert (cfg.trainer.max_epochs, cfg.trainer.max_steps, cfg.trainer.check_val_every_n_epoch) == (10, -1, 1)
    assert cfg.task.data.val_fraction == 0
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = instantiate(cfg.task.module.scheduler)(optimizer, total_steps=1000)
    assert scheduler.lr_lambdas[0](0) == pytest.approx(1 / 60) and scheduler.lr_lambdas[0](59) == 1.0
    with pytest.raises(ValueError, match="warmup_fraction must be in"):
        warmup_decay(optimizer, 100, warmup_fraction=1.5)


def test_val_fraction_zero_validates_on_dev(tmp_path, pretrained):
    from attnlab.data.glue import GlueDataModule, GlueSource

    _write_sst2(tmp_path / "data", n_train=50, n_dev=12)
    dm = GlueDataModule(GlueSource("sst2", tmp_path / "data"), str(pretrained), val_fraction=0.0)
    dm.setup()
    assert len(dm.datasets["train"]) == 50 and len(dm.datasets["val"]) == len(dm.datasets["test"]) == 12
    held_out = GlueDataModule(GlueSource("sst2", tmp_path / "data"), str(pretrained), val_fraction=0.2)
    held_out.setup()
    assert (len(held_out.datasets["train"]), len(held_out.datasets["val"])) == (40, 10)


def test_a_packed_batch_gives_each_pair_the_logits_it_has_padded():
    torch.manual_seed(0)
    model = SentenceClassifier(50, 3, "sliced_relu", dim=16, depth=2, num_heads=2, mlp_dim=32, max_len=20)
    model = model.double().eval()
    ids = [torch.randint(3, 50, (n,)) for n in (7, 3, 12, 5, 9)]
    packed = pack_sequences(ids, row_length=16, pad_id=1)
    layout = PackedLayout.from_batch(packed)
    assert layout.pack_index.shape[0] < len(ids)  # several pairs share a row
    logits = model(packed["input_ids"], packing=layout)
    for n, seq in enumerate(ids):
        alone = model(seq[None])
        assert torch.allclose(logits[n], alone[0], atol=1e-10)


@pytest.mark.parametrize("task", ["sst2", "stsb"])
def test_packed_fine_tune_ends_where_the_padded_one_ends(tmp_path, pretrained, task):
    """``task.data.packing=true`` on GLUE: the same pairs in the same steps and (dropout off) the same
    outputs per pair, so the same metrics up to float rounding; the rows hold several pairs."""
    run = [*STEPS, "task.max_steps=12", "task.val_check_interval=6", "task.data.batch_size=16"]
    run += ["task.model.dropout=0.0", "task.model.head_dropout=0.0"]
    summaries = {}
    for name, extra in {
        "padded": [],
        "packed": ["task.data.packing=true", "task.data.pack_length=64"],
    }.items():
        (_write_sst2 if task == "sst2" else _write_stsb)(tmp_path / name / "data", 120, 40)
        summaries[name] = _glue(tmp_path / name, task, pretrained, *run, *extra)
    padded, packed = summaries["padded"], summaries["packed"]
    assert packed["test_acc"] == pytest.approx(padded["test_acc"], abs=1e-4)
    assert packed["val_acc"] == pytest.approx(padded["val_acc"], abs=1e-4)
    assert packed["test_loss"] == pytest.approx(padded["test_loss"], rel=1e-4)
    assert 0.7 < packed["packing_fill"] <= 1.0 and "packing_fill" not in padded
