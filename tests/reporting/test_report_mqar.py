"""`attnlab report` on MQAR runs: recall against width and sequence length, width read with a fallback."""

from __future__ import annotations

import json
from pathlib import Path

from attnlab.cli.main import main
from attnlab.reporting import load_runs, make_report, mqar_points, run_width

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MQAR_FILES = ("mqar_vs_width.png", "mqar_vs_seqlen.png")


def _run(
    root: Path,
    name: str,
    attn: str,
    dim: int,
    seq_len: int,
    acc: float,
    seed: int = 0,
    in_summary=False,
    config: str = "",
):
    """A run dir as the pipeline writes it: summary.json, and config.yaml holding task.model.dim (and
    `config`, more of the resolved config)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    summary = {
        "task": "mqar",
        "attn": attn,
        "seed": seed,
        "test_acc": acc,
        "val_acc": acc,
        "baseline_acc": 0.02,
        "seq_len": seq_len,
        "train_samples_per_sec": 100.0,
    }
    if in_summary:
        summary["dim"] = dim  # once the summary carries it, config.yaml is not needed
    else:
        (run_dir / "config.yaml").write_text(f"task:\n  name: mqar\n  model:\n    dim: {dim}\n{config}")
    (run_dir / "summary.json").write_text(json.dumps(summary))


def _sweep(root: Path) -> Path:
    for i, (attn, dim, seq_len, acc) in enumerate(
        [
            ("softmax", 32, 64, 0.84),
            ("softmax", 64, 64, 1.0),
            ("linear", 32, 64, 0.10),
            ("linear", 64, 64, 0.12),
            ("linear", 64, 128, 0.08),
            ("softmax", 64, 128, 0.97),
        ]
    ):
        _run(root, f"r{i}", attn, dim, seq_len, acc)
    _run(root, "seed1", "softmax", 32, 64, 0.86, seed=1, in_summary=True)
    return root


def test_points_group_seeds_per_backend_length_and_width(tmp_path):
    runs = load_runs([_sweep(tmp_path / "sweep")]).runs
    points = {(p.backend, p.seq_len, p.dim): p.acc for p in mqar_points(runs)}
    assert list(points) == [
        ("softmax", 64, 32),
        ("softmax", 64, 64),
        ("softmax", 128, 64),
        ("linear", 64, 32),
        ("linear", 64, 64),
        ("linear", 128, 64),
    ]
    two_seeds = points[("softmax", 64, 32)]
    assert two_seeds.n == 2 and abs(two_seeds.mean - 0.85) < 1e-9
    assert points[("linear", 64, 64)].mean == 0.12


def test_width_from_summary_then_config_else_the_run_is_left_out(tmp_path):
    _run(tmp_path, "a", "softmax", 48, 64, 0.5, in_summary=True)
    _run(tmp_path, "b", "softmax", 96, 64, 0.5)
    _run(tmp_path, "c", "softmax", 96, 64, 0.5)
    (tmp_path / "c" / "config.yaml").unlink()  # copied without its config: no width to plot it at
    _run(tmp_path, "d", "softmax", 96, 64, 0.5)
    (tmp_path / "d" / "config.yaml").write_text("task: [unclosed\n")  # damaged: skipped, not fatal
    runs = {r.path.parent.name: r for r in load_runs([tmp_path]).runs}
    assert [run_width(runs[n]) for n in "abcd"] == [48, 96, None, None]
    assert [(p.dim, p.acc.n) for p in mqar_points(list(runs.values()))] == [(48, 1), (96, 1)]


def test_short_conv_and_the_normaliser_are_kept_apart(tmp_path):
    """The width sweep of docs/mqar.md runs every backend with short_conv 0 and 3, and the causal bump
    with both normalisers: four different models under one backend name, never averaged together."""
    conv = "    short_conv: 3\n"
    for i, (attn, extra, acc) in enumerate(
        [
            ("sliced_relu_bump", "attn:\n  normaliser: count\n", 0.12),
            ("sliced_relu_bump", f"{conv}attn:\n  normaliser: count\n", 0.98),
            ("sliced_relu_bump", f"{conv}attn:\n  normaliser: mass\n", 0.50),
            ("sliced_relu_bump", "attn:\n  normaliser: mass\n", 0.11),
            ("softmax", "", 0.99),
            ("softmax", conv, 1.0),
        ]
    ):
        _run(tmp_path / "sweep", f"r{i}", attn, 64, 64, acc, config=extra)
    runs = load_runs([tmp_path / "sweep"]).runs
    points = [(p.backend, p.short_conv, p.acc.mean) for p in mqar_points(runs)]
    assert points == [
        ("softmax", 0, 0.99),
        ("softmax", 3, 1.0),
        ("sliced_relu_bump (count)", 0, 0.12),
        ("sliced_relu_bump (count)", 3, 0.98),
        ("sliced_relu_bump (mass)", 0, 0.11),
        ("sliced_relu_bump (mass)", 3, 0.50),
    ]
    report = make_report([tmp_path / "sweep"], tmp_path / "out")
    assert report.files["mqar_vs_width.png"].stat().st_size > 5000


def test_vocabularies_are_kept_apart_with_their_own_chance(tmp_path):
    """The width sweep's 64-token point (vocabulary 128) and the length sweep's (512) are different
    tasks: reported together they stay two points, each with its runs' best constant guess."""
    for name, vocab, acc, base in (("w", 128, 0.9, 0.02), ("l", 512, 0.5, 0.004)):
        _run(
            tmp_path / "both",
            name,
            "softmax",
            64,
            64,
            acc,
            config=f"  data:\n    source:\n      vocab_size: {vocab}\n",
        )
        path = tmp_path / "both" / name / "summary.json"
        path.write_text(path.read_text().replace('"baseline_acc": 0.02', f'"baseline_acc": {base}'))
    points = mqar_points(load_runs([tmp_path / "both"]).runs)
    assert [(p.vocab, p.acc.mean, p.baseline.mean) for p in points] == [(128, 0.9, 0.02), (512, 0.5, 0.004)]


def test_report_draws_the_mqar_plots_only_with_mqar_runs(tmp_path):
    report = make_report([_sweep(tmp_path / "sweep")], tmp_path / "out")
    for name in MQAR_FILES:
        assert report.files[name] == tmp_path / "out" / name
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    assert "mqar" in report.accuracy_md  # MQAR runs are in the usual tables too

    other = tmp_path / "listops" / "r"
    other.mkdir(parents=True)
    (other / "summary.json").write_text(json.dumps({"task": "listops", "attn": "softmax", "test_acc": 0.4}))
    plain = make_report([other], tmp_path / "plain")
    assert not set(MQAR_FILES) & set(plain.files)
    assert not any((tmp_path / "plain" / name).exists() for name in MQAR_FILES)


def test_cli_report_writes_the_mqar_plots(tmp_path, capsys):
    assert main(["report", str(_sweep(tmp_path / "sweep")), "--out-dir", str(tmp_path / "r")]) == 0
    assert all((tmp_path / "r" / name).is_file() for name in MQAR_FILES)
    assert "mqar" in capsys.readouterr().out
