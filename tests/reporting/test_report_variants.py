"""`attnlab report` averages seeds of one configuration only: runs whose configs differ in more than
the seed are separate columns, and a seed run twice counts once, flagged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from attnlab.reporting import make_report
from attnlab.run.summary import SUMMARY_FIELDS


def _run(root: Path, name: str, *, attn="softmax", seed=0, acc=0.5, **config) -> None:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    summary = {field: 1 for field in SUMMARY_FIELDS}
    summary.update(
        task="listops",
        attn=attn,
        seed=seed,
        val_acc=acc,
        test_acc=acc,
        baseline_acc=0.1,
        git_commit="x",
        data_source="generated",
        peak_mem_mb=1.0,
    )
    (run_dir / "summary.json").write_text(json.dumps(summary))
    cfg = {
        "seed": seed,
        "task": {"name": "listops", "max_steps": 1500, "data": {"seed": seed, "batch_size": 64}},
        "trainer": {"precision": "32-true", "default_root_dir": str(run_dir)},
        "attn": {"name": attn, **({"eps": 1e-4} if attn == "sliced_relu" else {})},
        "paths": {"run_dir": str(run_dir)},
    }
    for key, value in config.items():  # task__max_steps=5 -> cfg["task"]["max_steps"] = 5
        node = cfg
        *parents, leaf = key.split("__")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_a_short_run_is_not_averaged_with_long_ones(tmp_path):
    _run(tmp_path, "a", seed=0, acc=0.36)
    _run(tmp_path, "b", seed=1, acc=0.38)
    _run(tmp_path, "c", seed=0, acc=0.10, task__max_steps=5)
    _run(tmp_path, "d", attn="sliced_relu", seed=0, acc=0.40)  # another backend: its own row
    report = make_report([tmp_path], out_dir=tmp_path / "report")
    lines = report.accuracy_md.splitlines()
    header = next(line for line in lines if line.startswith("| backend"))
    assert "listops [task.max_steps=1500]" in header and "listops [task.max_steps=5]" in header
    softmax = next(line for line in lines if line.startswith("| softmax"))
    assert "37.00 ± 1.41, median 37.00 (2)" in softmax  # the two long runs only
    assert "10.00 ± 0.00, median 10.00 (1)" in softmax
    assert "attn.eps" not in header  # backends differ in their options: that is the row, not a column


def test_repeats_of_one_seed_count_once_and_are_flagged(tmp_path):
    for name, acc in zip("abc", (0.90, 0.92, 0.94), strict=True):
        _run(tmp_path, name, seed=0, acc=acc)
    _run(tmp_path, "bf16", seed=0, acc=0.80, trainer__precision="bf16-mixed")
    report = make_report([tmp_path], out_dir=tmp_path / "report")
    lines = report.accuracy_md.splitlines()
    header = next(line for line in lines if line.startswith("| backend"))
    assert "listops [trainer.precision=32-true]" in header
    assert "listops [trainer.precision=bf16-mixed]" in header
    softmax = next(line for line in lines if line.startswith("| softmax"))
    assert "92.00 ± 0.00, median 92.00 (1) ⚠ repeated seed 0 ×3" in softmax  # one seed, not three
    assert "80.00 ± 0.00, median 80.00 (1)" in softmax


def test_runs_of_one_configuration_stay_one_column(tmp_path):
    for seed in range(3):
        _run(tmp_path, f"s{seed}", seed=seed, acc=0.3 + seed / 100)
    report = make_report([tmp_path], out_dir=tmp_path / "report")
    header = next(line for line in report.accuracy_md.splitlines() if line.startswith("| backend"))
    assert "| listops |" in header  # the seed (and task.data.seed, its copy) makes no configuration


def test_runs_csv_names_each_runs_configuration(tmp_path):
    import csv

    _run(tmp_path, "long", seed=0, acc=0.36)
    _run(tmp_path, "short", seed=0, acc=0.10, task__max_steps=5)
    make_report([tmp_path], out_dir=tmp_path / "report")
    with (tmp_path / "report" / "runs.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    by_path = {Path(row["path"]).parent.name: row for row in rows}
    assert by_path["long"]["configuration"] == "listops [task.max_steps=1500]"
    assert by_path["short"]["configuration"] == "listops [task.max_steps=5]"
    assert by_path["short"]["task"] == "listops"  # the raw field stays


@pytest.fixture
def visible_panels(monkeypatch):
    """``visible_panels(word)``: the shown axes of the report's figure whose title holds ``word``
    (every figure's axes are kept as `attnlab.reporting.plots.panel_grid` makes them)."""
    from attnlab.reporting import plots

    figures = []
    grid = plots.panel_grid

    def keep(n, title):
        fig, axes = grid(n, title)
        figures.append((title, axes))
        return fig, axes

    monkeypatch.setattr(plots, "panel_grid", keep)
    return lambda word: [ax for title, axes in figures if word in title for ax in axes if ax.get_visible()]


def test_plots_hold_one_configuration_per_panel_and_count_a_seed_once(tmp_path, visible_panels):
    _run(tmp_path, "a", seed=0, acc=0.30)
    _run(tmp_path, "a_again", seed=0, acc=0.40)  # seed 0 twice: one value, 0.35
    _run(tmp_path, "b", seed=1, acc=0.50)
    _run(tmp_path, "short", seed=0, acc=0.10, task__max_steps=5)
    make_report([tmp_path], out_dir=tmp_path / "report")
    panels = {ax.get_title(): ax for ax in visible_panels("vs train throughput")}
    assert set(panels) == {"listops [task.max_steps=1500]", "listops [task.max_steps=5]"}
    (point,) = [line.get_ydata()[0] for line in panels["listops [task.max_steps=1500]"].lines[:1]]
    assert point == pytest.approx(100 * (0.35 + 0.50) / 2)  # over distinct seeds, not (0.3+0.4+0.5)/3


def test_a_length_sweep_is_one_line_in_the_throughput_plot(tmp_path, visible_panels):
    for length in (256, 512, 1024):
        name = f"len{length}"
        _run(tmp_path, name, task__data__seq_len=length)
        summary = tmp_path / name / "summary.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "seq_len": length}))
    report = make_report([tmp_path], out_dir=tmp_path / "report")
    panels = visible_panels("vs sequence length")
    assert [ax.get_title() for ax in panels] == ["listops"]
    assert list(panels[0].lines[0].get_xdata()) == [256, 512, 1024]
    header = next(line for line in report.accuracy_md.splitlines() if line.startswith("| backend"))
    assert "task.data.seq_len=256" in header  # the tables still keep each length apart
