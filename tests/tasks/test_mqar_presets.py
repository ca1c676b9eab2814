"""task=mqar and the MQAR sweep presets: they compose, build for every causal backend, refuse the others
by name, and the commands docs/mqar.md shows run as typed (with tiny data sizes and step counts added)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from attnlab.attention import available_backends
from attnlab.config.validation import check_config
from attnlab.models.causal_lm import NoCausalAttentionError, causal_backends
from tiny_runs import REPO_ROOT, run_train_py, train_main

CONFIGS = ["task=mqar", "experiment=mqar/sweep_width", "experiment=mqar/sweep_seqlen"]
# data and step counts only: what makes a documented command take seconds
TINY = [
    "task.data.source.sizes.train=128",
    "task.data.source.sizes.val=32",
    "task.data.source.sizes.test=32",
    "task.data.batch_size=32",
    "trainer.max_steps=2",
    "task.val_check_interval=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_progress_bar=false",
    "callbacks.throughput.warmup_steps=0",
    "logger=csv",
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("attn", available_backends())
def test_mqar_configs_build_for_causal_backends_and_refuse_others(train_config, config, attn):
    cfg = train_config(config, f"attn={attn}")
    check_config(cfg)
    assert cfg.task.name == "mqar" and cfg.task.model.max_len == cfg.task.data.source.seq_len
    datamodule = instantiate(cfg.task.data)
    vocab = datamodule.model_kwargs()["vocab_size"]
    build = lambda: instantiate(cfg.task.model, attention=instantiate(cfg.attn), vocab_size=vocab)  # noqa: E731
    if attn not in causal_backends():
        with pytest.raises(InstantiationException) as caught:
            build()
        assert isinstance(caught.value.__cause__, NoCausalAttentionError)
        assert f"backend '{attn}' cannot serve this request" in str(caught.value)
        return
    model = build().eval()
    module = instantiate(cfg.task.module, model=model)
    assert module.metrics["test_acc"].num_classes == vocab == (512 if "sweep_seqlen" in config else 128)
    with torch.no_grad():
        out = model(torch.randint(1, vocab, (2, 16)))
    assert out.shape == (2, 16, vocab) and torch.isfinite(out).all()


def _train_py(cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_train_py(*args, cwd=cwd, timeout=timeout, single_thread=True)


def test_docs_single_run_command(tmp_path):
    """`python train.py task=mqar attn=softmax` (docs/mqar.md) writes test_acc and baseline_acc."""
    done = train_main("task=mqar", "attn=softmax", *TINY, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (summary_path,) = (tmp_path / "outputs" / "mqar" / "softmax").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert 0.0 <= summary["test_acc"] <= 1.0 and 0.0 < summary["baseline_acc"] < 0.05  # 64 values
    assert summary["seq_len"] == 64 and "num_kv_pairs 8" in summary["data_source"]


def test_docs_default_command_trains_the_default_backend(tmp_path):
    """`python train.py task=mqar` alone: the default attention (sliced ReLU, in its causal form)."""
    done = train_main("task=mqar", *TINY, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (summary_path,) = (tmp_path / "outputs" / "mqar").glob("*/*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["attn"] == "sliced_relu" and summary["test_acc"] is not None and summary["dim"] == 64


SWEPT_BACKENDS = "attn=softmax,linear,performer,sliced_relu,sliced_relu_bump"
SWEPT = {"sweep_width": "task.model.dim=32,64,128", "sweep_seqlen": "task.data.source.seq_len=64,256,1024"}
POINTS = {"sweep_width": [(32, 64), (64, 64), (128, 64)], "sweep_seqlen": [(64, 64), (64, 256), (64, 1024)]}


@pytest.mark.parametrize(
    ("seq_len", "pairs", "batch", "train"), [(64, 8, 64, 20000), (256, 32, 16, 5000), (1024, 128, 4, 1250)]
)
def test_the_length_sweep_scales_pairs_and_keeps_tokens_per_batch(train_config, seq_len, pairs, batch, train):
    """Zoology's protocol: one pair per 8 tokens; 4,096 tokens a batch and 1.28M a training split at
    every length, so each point of the sweep sees as many queries."""
    cfg = train_config("experiment=mqar/sweep_seqlen", f"task.data.source.seq_len={seq_len}")
    data = cfg.task.data
    assert (data.source.num_kv_pairs, data.batch_size, data.source.sizes.train) == (pairs, batch, train)
    assert data.batch_size * seq_len == 4096 and data.source.vocab_size >= 2 * pairs + 2
    assert cfg.task.model.max_len == seq_len


def test_a_bad_length_in_the_length_sweep_is_named(tmp_path):
    """The scaled counts refuse a length they cannot scale, as a one-line error naming the key."""
    done = train_main("experiment=mqar/sweep_seqlen", "task.data.source.seq_len=0", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "error: task.data.batch_size:" in done.stderr
    assert "attnlab_scaled:64,64,0: expected three integers >= 1" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(SWEPT))
def test_docs_sweep_commands_and_report(tmp_path, preset):
    """The two sweeps of docs/mqar.md, as typed, then `attnlab report` on the sweep dir: every backend
    gives a point per swept value and the MQAR plot is drawn."""
    done = _train_py(tmp_path, "-m", f"experiment=mqar/{preset}", SWEPT_BACKENDS, SWEPT[preset], *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").iterdir()  # outputs/multirun/<time>
    summaries = [json.loads(p.read_text()) for p in sweep_dir.rglob("summary.json")]
    backends = SWEPT_BACKENDS.removeprefix("attn=").split(",")
    assert sorted((s["attn"], s["dim"], s["seq_len"]) for s in summaries) == sorted(
        (b, d, t) for b in backends for d, t in POINTS[preset]
    )
    report = subprocess.run(
        [str(Path(sys.executable).parent / "attnlab"), "report", str(sweep_dir.relative_to(tmp_path))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    name = "mqar_vs_width.png" if preset == "sweep_width" else "mqar_vs_seqlen.png"
    (report_dir,) = (sweep_dir / "reports").iterdir()  # the default --out-dir: <dir>/reports/<time>/
    assert (report_dir / name).stat().st_size > 5000


DOC = REPO_ROOT / "docs" / "mqar.md"
# every command docs/mqar.md shows, and the test that runs it
DOC_COMMANDS = {
    "python train.py task=mqar attn=softmax": "test_docs_single_run_command",
    "python train.py task=mqar": "test_docs_default_command_trains_the_default_backend",
    f"python train.py -m experiment=mqar/sweep_width {SWEPT_BACKENDS} {SWEPT['sweep_width']}": (
        "test_docs_sweep_commands_and_report"
    ),
    f"python train.py -m experiment=mqar/sweep_seqlen {SWEPT_BACKENDS} {SWEPT['sweep_seqlen']}": (
        "test_docs_sweep_commands_and_report"
    ),
    "attnlab report outputs/multirun/<time>": "test_docs_sweep_commands_and_report",
    "python train.py task=mqar attn=sliced_relu_bump task.model.short_conv=3": (
        "test_docs_short_conv_command_builds_the_convolution, test_the_short_conv_default_recalls"
    ),
}


def test_docs_short_conv_command_builds_the_convolution(tmp_path):
    done = train_main("task=mqar", "attn=sliced_relu_bump", "task.model.short_conv=3", *TINY, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (config,) = (tmp_path / "outputs" / "mqar" / "sliced_relu_bump").glob("*/config.yaml")
    assert "short_conv: 3" in config.read_text()


@pytest.mark.slow
def test_the_short_conv_default_recalls(tmp_path):
    """docs/mqar.md's command as written: ReLU-bump with 3 taps recalls (>= 60 % in 10 min)."""
    done = _train_py(tmp_path, "task=mqar", "attn=sliced_relu_bump", "task.model.short_conv=3", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (summary,) = (tmp_path / "outputs" / "mqar" / "sliced_relu_bump").glob("*/summary.json")
    assert json.loads(summary.read_text())["test_acc"] >= 0.6


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_every_command_in_the_doc_is_one_the_tests_run():
    shown = [line.strip() for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert shown and set(shown) <= set(DOC_COMMANDS), set(shown) - set(DOC_COMMANDS)
    for preset in ("sweep_width", "sweep_seqlen"):  # the presets quote the same commands
        text = (REPO_ROOT / "conf" / "experiment" / "mqar" / f"{preset}.yaml").read_text()
        assert any(command in text for command in DOC_COMMANDS if preset in command), preset


def test_the_python_example_in_the_doc_prints_what_it_says(capsys):
    (code,) = _blocks("python")
    exec(compile(code, str(DOC), "exec"), {})
    printed = capsys.readouterr().out.strip()
    promised = [line.split("#", 1)[1].strip() for line in code.splitlines() if "print(" in line]
    assert printed == "\n".join(promised)


@pytest.fixture
def bidirectional_only():
    """A registered backend with no causal form (every built-in one has one now), removed after."""
    from attnlab.attention import AttentionLayer, Capabilities, register_backend, registry

    saved = dict(registry._BACKENDS)

    @register_backend("bidirectional_only")
    class BidirectionalOnly(AttentionLayer):
        capabilities = Capabilities(causal=False, reasons={"causal": "a test backend with no causal form"})

        def attend(self, q, k, v, key_padding_mask):
            return v

    yield "bidirectional_only"
    registry._BACKENDS.clear()
    registry._BACKENDS.update(saved)


@pytest.mark.parametrize("config", CONFIGS)
def test_mqar_refuses_a_backend_without_a_causal_form(train_config, config, bidirectional_only):
    """The refusal branch above never runs with the built-in backends: it runs here."""
    from functools import partial

    from attnlab.attention import build_attention

    assert bidirectional_only not in causal_backends()
    cfg = train_config(config)
    vocab = instantiate(cfg.task.data).model_kwargs()["vocab_size"]
    with pytest.raises(InstantiationException) as caught:
        instantiate(cfg.task.model, vocab_size=vocab, attention=partial(build_attention, bidirectional_only))
    assert isinstance(caught.value.__cause__, NoCausalAttentionError)
    message = str(caught.value.__cause__)
    assert "backend 'bidirectional_only' cannot serve this request: causal: a test backend" in message
    assert "backends with a causal form: softmax" in message
