"""Tests for `attnlab report` and `attnlab.reporting` on a fake sweep of summary.json files."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import pytest

from attnlab.cli import report as report_cli
from attnlab.cli.main import main
from attnlab.reporting import (
    ReportError,
    accuracy_table,
    backend_sort_key,
    load_runs,
    make_report,
    task_sort_key,
    throughput_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# (task, attn, seed, test_acc, seq_len, train_samples_per_sec, peak_mem_mb)
FAKE_RUNS = [
    ("listops", "softmax", 0, 0.36, 2000, 100.0, 1000.0),
    ("listops", "softmax", 1, 0.37, 2000, 110.0, 1200.0),
    ("listops", "softmax", 2, 0.38, 2000, 120.0, 1100.0),
    ("listops", "sliced_relu", 0, 0.40, 2000, 220.0, 500.0),
    ("listops", "sliced_relu", 1, 0.42, 2000, 220.0, 520.0),
    ("listops", "linear", 0, 0.30, 2000, 400.0, None),
    # image ran at two lengths: its throughput is split by seq_len
    ("image", "softmax", 0, 0.42, 1024, 80.0, 900.0),
    ("image", "softmax", 1, 0.44, 2048, 20.0, 3000.0),
    ("image", "sliced_relu", 0, 0.45, 1024, 160.0, 400.0),
    ("image", "sliced_relu", 1, None, 2048, 60.0, 800.0),  # did not test
    # a task outside LRA and backends without the softmax baseline
    ("cifar10_vit", "sliced_relu_bump", 0, 0.80, 64, 1000.0, 2000.0),
    ("cifar10_vit", "aardvark", 0, 0.70, 64, 500.0, 2100.0),
]
BASELINE_ACC = {"listops": 0.17, "image": 0.10, "cifar10_vit": 0.10}


def _summary(task, attn, seed, test_acc, seq_len, sps, mem) -> dict:
    return {
        "task": task,
        "attn": attn,
        "seed": seed,
        "val_acc": None if test_acc is None else round(test_acc - 0.01, 6),
        "test_acc": test_acc,
        "baseline_acc": BASELINE_ACC[task],
        "train_samples_per_sec": sps,
        "eval_samples_per_sec": 3 * sps,
        "peak_mem_mb": mem,
        "params": 1000,
        "wall_time_s": 12.5,
        "steps": 50,
        "seq_len": seq_len,
        "world_size": 1,
        "git_commit": "abc123",
        "data_source": "synthetic",
    }


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A multirun-like tree: sweep/<i>/summary.json, plus one broken and one incomplete file."""
    root = tmp_path / "sweep"
    for i, spec in enumerate(FAKE_RUNS):
        run_dir = root / f"{spec[0]}_{spec[1]}" / str(i)
        run_dir.mkdir(parents=True)
        data = _summary(*spec)
        if i == 0:
            data["notes"] = "extra key"  # unknown keys are kept for runs.csv
        if i == 5:
            del data["eval_samples_per_sec"], data["git_commit"]  # optional keys may be missing
        (run_dir / "summary.json").write_text(json.dumps(data))
    broken = root / "broken" / "0"
    broken.mkdir(parents=True)
    (broken / "summary.json").write_text('{"task": "listops", "attn": ')
    no_attn = root / "no_attn" / "0"
    no_attn.mkdir(parents=True)
    (no_attn / "summary.json").write_text(json.dumps({"task": "listops", "seed": 0, "test_acc": 0.9}))
    return root


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="attnlab")
    report_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _md_rows(markdown: str) -> list[list[str]]:
    """Markdown table rows as lists of cells (header first, separator dropped)."""
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows if not line.startswith("|---")]


def test_sort_keys_follow_paper_then_alphabetical():
    backends = ["zeta", "linear", "performer", "softmax", "alpha", "sliced_relu_bump", "sliced_relu"]
    assert sorted(backends, key=backend_sort_key) == [
        "softmax",
        "sliced_relu",
        "sliced_relu_bump",
        "linear",
        "performer",
        "alpha",
        "zeta",
    ]
    tasks = ["pathx", "mlm", "image", "text", "cifar10_vit", "listops", "pathfinder", "retrieval"]
    assert sorted(tasks, key=task_sort_key) == [
        "listops",
        "text",
        "retrieval",
        "image",
        "pathfinder",
        "pathx",
        "cifar10_vit",
        "mlm",
    ]


def test_load_runs_skips_invalid_files_with_reasons(sweep: Path):
    loaded = load_runs([sweep])
    assert len(loaded.runs) == len(FAKE_RUNS)
    reasons = {p.parent.parent.name: reason for p, reason in loaded.skipped}
    assert set(reasons) == {"broken", "no_attn"}
    assert (
        "not valid JSON" in reasons["broken"]
        and str(sweep / "broken" / "0" / "summary.json") in reasons["broken"]
    )
    assert "'attn'" in reasons["no_attn"] and "missing" in reasons["no_attn"]


def test_load_runs_deduplicates_overlapping_dirs(sweep: Path):
    loaded = load_runs([sweep, sweep / "listops_softmax", sweep / "listops_softmax" / "0" / "summary.json"])
    assert len(loaded.runs) == len(FAKE_RUNS)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("test_acc", 37.5, "fraction in [0, 1]"),
        ("train_samples_per_sec", "fast", "finite number or null"),
        ("seq_len", 10.5, "must be an integer"),
        ("task", "", "non-empty string"),
        ("train_samples_per_sec", -5.0, "must be >= 0"),
        ("peak_mem_mb", -1, "must be >= 0"),
        ("eval_samples_per_sec", float("nan"), "finite number or null"),
    ],
)
def test_invalid_field_values_are_skipped_with_the_field_named(tmp_path, field, value, expected):
    good = tmp_path / "good"
    good.mkdir()
    (good / "summary.json").write_text(json.dumps(_summary(*FAKE_RUNS[0])))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text(json.dumps({**_summary(*FAKE_RUNS[0]), field: value}))
    loaded = load_runs([tmp_path])
    assert len(loaded.runs) == 1
    [(path, reason)] = loaded.skipped
    assert path == bad / "summary.json" and repr(field) in reason and expected in reason


def test_accuracy_table_numbers_and_order(sweep: Path):
    table = accuracy_table(load_runs([sweep]).runs, "test_acc")
    assert table.tasks == ["listops", "image", "cifar10_vit"]
    assert table.backends == ["softmax", "sliced_relu", "sliced_relu_bump", "linear", "aardvark"]
    cell = table.cells[("softmax", "listops")]
    # by hand: mean(.36, .37, .38) = .37; sample std = sqrt((.01² + 0 + .01²) / 2) = .01
    assert cell.n == 3 and cell.mean == pytest.approx(0.37) and cell.std == pytest.approx(0.01)
    cell = table.cells[("sliced_relu", "listops")]
    assert cell.mean == pytest.approx(0.41) and cell.std == pytest.approx(math.sqrt(2) * 0.01)
    # a null test_acc is not a value: one seed left
    assert table.cells[("sliced_relu", "image")].n == 1
    assert table.cells[("softmax", "cifar10_vit")] is None
    assert table.average("softmax") == (pytest.approx((0.37 + 0.43) / 2), 2)


def test_report_files_and_tables(sweep: Path, tmp_path: Path):
    out = tmp_path / "out"
    rep = make_report([sweep], out)
    acc_rows = _md_rows(rep.accuracy_md)
    assert acc_rows[0] == ["backend", "listops", "image", "cifar10_vit", "Average"]
    by_backend = {row[0]: row[1:] for row in acc_rows[1:]}
    assert [row[0] for row in acc_rows[1:]] == [
        "softmax",
        "sliced_relu",
        "sliced_relu_bump",
        "linear",
        "aardvark",
        "majority class",
    ]
    assert by_backend["softmax"] == [
        "37.00 ± 1.00, median 37.00 (3)",
        "43.00 ± 1.41, median 43.00 (2)",
        "—",
        "40.00 (2/3 tasks)",
    ]
    assert by_backend["sliced_relu"][:2] == [
        "41.00 ± 1.41, median 41.00 (2)",
        "45.00 ± 0.00, median 45.00 (1)",
    ]
    assert by_backend["majority class"] == ["17.00", "10.00", "10.00", "12.33"]
    assert (out / "accuracy.md").read_text() == rep.accuracy_md

    acc_csv = {row["backend"]: row for row in _read_csv(out / "accuracy.csv")}
    assert acc_csv["softmax"]["listops_mean"] == "37.0000" and acc_csv["softmax"]["listops_std"] == "1.0000"
    assert acc_csv["softmax"]["listops_n"] == "3" and acc_csv["softmax"]["cifar10_vit_n"] == "0"
    assert acc_csv["softmax"]["average"] == "40.0000" and acc_csv["softmax"]["average_tasks"] == "2"
    assert acc_csv["aardvark"]["cifar10_vit_mean"] == "70.0000" and acc_csv["aardvark"]["listops_mean"] == ""

    thr = [
        (r["task"], r["seq_len"], r["backend"], r["speedup_vs_softmax"])
        for r in _read_csv(out / "throughput.csv")
    ]
    assert thr == [
        ("listops", "2000", "softmax", "1.0000"),
        ("listops", "2000", "sliced_relu", "2.0000"),
        ("listops", "2000", "linear", f"{400 / 110:.4f}"),
        ("image", "1024", "softmax", "1.0000"),
        ("image", "1024", "sliced_relu", "2.0000"),
        ("image", "2048", "softmax", "1.0000"),
        ("image", "2048", "sliced_relu", "3.0000"),
        ("cifar10_vit", "64", "sliced_relu_bump", "n/a"),
        ("cifar10_vit", "64", "aardvark", "n/a"),
    ]
    thr_csv = _read_csv(out / "throughput.csv")
    assert thr_csv[0]["train_samples_per_sec"] == "110.0000" and thr_csv[0]["peak_mem_mb"] == "1200.0"
    assert thr_csv[0]["runs"] == "3" and thr_csv[2]["peak_mem_mb"] == ""

    thr_rows = _md_rows(rep.throughput_md)
    assert thr_rows[0][5] == "speed-up vs softmax"
    assert thr_rows[1] == ["listops", "2000", "softmax", "3", "110.0", "1.00×", "330.0", "1200"]
    assert thr_rows[3][5] == "3.64×" and thr_rows[3][7] == "—"
    assert thr_rows[-1][5] == "n/a"

    runs = _read_csv(out / "runs.csv")
    assert len(runs) == len(FAKE_RUNS)
    assert list(runs[0])[:4] == ["task", "configuration", "attn", "seed"]
    assert list(runs[0])[-2:] == ["notes", "path"]
    assert [(r["task"], r["attn"], r["seed"]) for r in runs[:3]] == [
        ("listops", "softmax", str(s)) for s in range(3)
    ]
    assert runs[0]["notes"] == "extra key" and runs[0]["test_acc"] == "0.36"
    image_untested = next(
        r for r in runs if r["task"] == "image" and r["seed"] == "1" and r["attn"] == "sliced_relu"
    )
    assert image_untested["test_acc"] == ""

    for name in ("acc_vs_throughput.png", "throughput_vs_seqlen.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


@pytest.mark.slow
def test_report_is_deterministic(sweep: Path, tmp_path: Path):
    first = make_report([sweep], tmp_path / "a")
    second = make_report([sweep], tmp_path / "b")
    assert first.accuracy_md == second.accuracy_md and first.throughput_md == second.throughput_md
    for name in ("accuracy.csv", "throughput.csv"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


def test_full_average_and_other_baseline(tmp_path: Path):
    for i, spec in enumerate(FAKE_RUNS[:5] + FAKE_RUNS[6:10]):  # softmax and sliced_relu on two tasks
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "summary.json").write_text(json.dumps(_summary(*spec)))
    runs = load_runs([tmp_path]).runs
    table = accuracy_table(runs)
    assert table.average("sliced_relu") == (pytest.approx((0.41 + 0.45) / 2), 2)
    rows = throughput_table(runs, baseline="sliced_relu")
    speedups = {(r.task, r.seq_len, r.backend): r.speedup for r in rows}
    assert speedups[("listops", None, "softmax")] == pytest.approx(110 / 220)
    assert speedups[("image", 2048, "softmax")] == pytest.approx(20 / 60)
    rep = make_report([tmp_path], tmp_path / "out", metric="val_acc")
    softmax_row = next(r for r in _md_rows(rep.accuracy_md) if r[0] == "softmax")
    assert (
        softmax_row[1] == "36.00 ± 1.00, median 36.00 (3)" and softmax_row[-1] == "39.00"
    )  # no "(k/N tasks)" note


def test_cli_writes_report_and_warns(sweep: Path, tmp_path: Path, capsys):
    out = tmp_path / "rep"
    assert _run_cli(["report", str(sweep), "--out-dir", str(out), "--metric", "val_acc"]) == 0
    captured = capsys.readouterr()
    assert "## Accuracy (val_acc, %)" in captured.out and "## Throughput" in captured.out
    assert "36.00 ± 1.00, median 36.00 (3)" in captured.out
    assert str(sweep / "broken" / "0" / "summary.json") in captured.err
    assert str(sweep / "no_attn" / "0" / "summary.json") in captured.err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "accuracy.md",
            "accuracy.csv",
            "throughput.md",
            "throughput.csv",
            "runs.csv",
            "acc_vs_throughput.png",
            "throughput_vs_seqlen.png",
        ]
    )


def test_console_script_wiring(sweep: Path, tmp_path: Path, capsys):
    assert main(["report", str(sweep), "--out-dir", str(tmp_path / "r"), "--baseline", "sliced_relu"]) == 0
    assert "speed-up vs sliced_relu" in capsys.readouterr().out


def test_cli_as_the_readme_writes_it_reads_outputs_and_writes_a_new_report_there(
    sweep: Path, tmp_path: Path, monkeypatch, capsys
):
    """`attnlab report` with no argument stopped with "the following arguments are required: DIR"."""
    monkeypatch.chdir(tmp_path)
    sweep.rename(tmp_path / "outputs")
    assert main(["report"]) == 0
    (report,) = (tmp_path / "outputs" / "reports").iterdir()
    assert (report / "accuracy.md").is_file() and not (tmp_path / "report").exists()
    assert f"files written to {Path('outputs') / 'reports' / report.name}/" in capsys.readouterr().err


def test_smoke_tests_and_interrupted_runs_stay_out_of_reports(sweep: Path, tmp_path: Path, capsys):
    for name, extra in (
        ("smoke", {"smoke_test": True}),
        ("stopped", {"interrupted": True, "signal": "SIGTERM"}),
    ):
        run = sweep / name / "0"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({**_summary(*FAKE_RUNS[0]), **extra}))
    assert _run_cli(["report", str(sweep), "--out-dir", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "smoke/0/summary.json: a smoke test (trainer.fast_dev_run), not a result" in err
    assert "stopped/0/summary.json: the run was interrupted" in err


def test_cli_no_summary_found(tmp_path: Path, capsys):
    empty_a, empty_b = tmp_path / "a", tmp_path / "b"
    empty_a.mkdir()
    empty_b.mkdir()
    assert _run_cli(["report", str(empty_a), str(empty_b), "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no summary.json found" in err and str(empty_a) in err and str(empty_b) in err
    assert not (tmp_path / "o").exists()


def test_cli_missing_dir_and_only_invalid_files(tmp_path: Path, capsys):
    assert _run_cli(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("not json")
    assert _run_cli(["report", str(tmp_path), "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "none of the 1 summary.json" in err


def test_cli_rejects_unknown_metric(sweep: Path, capsys):
    with pytest.raises(SystemExit) as exc:
        _run_cli(["report", str(sweep), "--metric", "f1"])
    assert exc.value.code == 2
    assert "invalid choice: 'f1'" in capsys.readouterr().err


def test_library_rejects_unknown_metric(sweep: Path, tmp_path: Path):
    with pytest.raises(ReportError, match="unknown metric 'f1'"):
        make_report([sweep], tmp_path / "o", metric="f1")


def test_pipes_in_names_do_not_split_markdown_cells(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(BASELINE_ACC, "list|ops", 0.1)
    for i, attn in enumerate(["softmax", "my|attn"]):
        run = tmp_path / str(i)
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(_summary("list|ops", attn, 0, 0.4, 100, 10.0, 1.0)))
    make_report([tmp_path], tmp_path / "report")
    for name in ("accuracy.md", "throughput.md"):
        lines = [ln for ln in (tmp_path / "report" / name).read_text().splitlines() if ln.startswith("|")]
        widths = {len([c for c in ln.replace("\\|", "").split("|")]) for ln in lines}
        assert len(widths) == 1, f"{name}: rows with different cell counts"
        assert "my\\|attn" in (tmp_path / "report" / name).read_text()


def test_error_bars_stay_inside_what_a_run_can_measure(tmp_path: Path, monkeypatch):
    from matplotlib.axes import Axes

    from attnlab.reporting import clipped_error

    assert clipped_error(90.0, 20.0, low=0.0, high=100.0) == [[20.0], [10.0]]
    assert clipped_error(5.0, 20.0, low=0.0, high=100.0) == [[5.0], [20.0]]
    assert clipped_error(10.0, 30.0, low=0.01) == [[9.99], [30.0]]
    bars = []
    original = Axes.errorbar
    monkeypatch.setattr(
        Axes, "errorbar", lambda ax, x, y, **kw: bars.append((x, y, kw)) or original(ax, x, y, **kw)
    )
    for seed, (acc, speed) in enumerate([(0.99, 10.0), (0.50, 1000.0)]):
        run = tmp_path / str(seed)
        run.mkdir()
        (run / "summary.json").write_text(
            json.dumps(_summary("listops", "softmax", seed, acc, 100, speed, 1.0))
        )
    make_report([tmp_path], tmp_path / "report")
    ((x, y, kw),) = bars
    (y_low,), (y_high,) = kw["yerr"]
    (x_low,), _ = kw["xerr"]
    assert y - y_low >= 0.0 and y + y_high == pytest.approx(100.0)
    assert x - x_low > 0.0


def test_accuracy_gives_the_median_over_seeds_beside_the_mean(tmp_path: Path):
    """The paper reports medians of 4 runs: one diverged seed moves the mean, not the median."""
    for seed, acc in enumerate([0.90, 0.91, 0.92, 0.10]):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        (run / "summary.json").write_text(
            json.dumps(_summary("cifar10_vit", "sliced_relu", seed, acc, 64, 1.0, 1.0))
        )
    report = make_report([tmp_path], tmp_path / "out")
    row = next(r for r in _md_rows(report.accuracy_md) if r[0] == "sliced_relu")
    assert row[1] == "70.75 ± 40.51, median 90.50 (4)"
    acc_csv = {r["backend"]: r for r in _read_csv(report.files["accuracy.csv"])}
    assert acc_csv["sliced_relu"]["cifar10_vit_median"] == "90.5000"
    assert acc_csv["sliced_relu"]["cifar10_vit_mean"] == "70.7500"
