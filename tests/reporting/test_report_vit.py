"""`attnlab report` on tiny-ViT runs: the configuration chosen per backend on the hold-out, the command
that trains it with 4 seeds, and the median test curve over seeds."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from attnlab.cli.main import main
from attnlab.reporting import make_report

HOLD_OUT = "official python pickles in d; val = 500 training images per class (split_seed 0)"
TEST_SPLIT = "official python pickles in d; val = the test split (train = all 50,000)"


def _run(root: Path, name: str, attn: str, lr: float, curve: list[float], source: str, seed: int = 0):
    """A run dir as the pipeline writes it: summary.json, config.yaml, csv/metrics.csv (val/acc rows)."""
    run_dir = root / name
    (run_dir / "csv").mkdir(parents=True)
    summary = {"task": "cifar10_vit", "attn": attn, "seed": seed, "data_source": source, "test_acc": 0.5}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.yaml").write_text(
        f"task:\n  model:\n    drop_path: 0.1\n  module:\n    optimizer:\n      lr: {lr}\n"
        "      weight_decay: 0.06\n"
    )
    with (run_dir / "csv" / "metrics.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["epoch", "step", "train/loss", "val/acc"])
        for i, acc in enumerate(curve):
            writer.writerow([0, 10 * i + 5, 1.0, ""])  # a training row: no val/acc
            writer.writerow([0, 10 * (i + 1), "", acc])


def test_selection_by_final_held_out_accuracy_and_median_test_curves(tmp_path, capsys):
    grid, final = tmp_path / "grid", tmp_path / "final"
    # sliced_relu: lr 1e-3 peaks higher but ends lower than 5.5e-4: the final weights decide
    _run(grid, "a", "sliced_relu", 0.001, [0.2, 0.9, 0.5], HOLD_OUT)
    _run(grid, "b", "sliced_relu", 0.00055, [0.2, 0.4, 0.6], HOLD_OUT)
    _run(grid, "c", "softmax", 0.001, [0.3, 0.7], HOLD_OUT)
    _run(grid, "d", "softmax", 0.00055, [0.3, 0.6], HOLD_OUT)
    for seed, curve in enumerate([[0.1, 0.5, 0.7], [0.2, 0.6, 0.8], [0.3, 0.4, 0.9], [0.9, 0.9, 0.2]]):
        _run(final, f"s{seed}", "sliced_relu", 0.00055, curve, TEST_SPLIT, seed)
    assert main(["report", str(grid), str(final), "--out-dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    text = (out / "vit_grid.md").read_text()
    assert text in printed
    rows = {
        cells[1]: cells
        for line in text.splitlines()
        if line.startswith("| cifar10_vit")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert rows["softmax"][2:7] == ["0.001", "0.06", "0.1", "70.00", "2"]
    # the selection table's sliced_relu row, then the curves table's
    selection = [line for line in text.splitlines() if line.startswith("| cifar10_vit | sliced_relu |")]
    assert selection[0].split("|")[3].strip() == "0.00055" and "60.00" in selection[0]
    assert "| cifar10_vit | sliced_relu | 0.00055 | 0.06 | 0.1 | yes | 4 | 75.00 (step 30) |" in text
    assert (
        "python train.py -m experiment=vit/cifar10 attn=sliced_relu seed=0,1,2,3 "
        "task.module.optimizer.lr=0.00055 task.module.optimizer.weight_decay=0.06 task.model.drop_path=0.1"
    ) in text
    curve = list(csv.DictReader((out / "vit_curves.csv").open()))
    assert [(r["step"], float(r["median_test_acc"])) for r in curve] == [
        ("10", 0.25),
        ("20", 0.55),
        ("30", 0.75),
    ]
    assert (out / "vit_curves.png").read_bytes().startswith(b"\x89PNG")


def test_no_vit_section_without_vit_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"task": "listops", "attn": "softmax", "test_acc": 0.3}))
    report = make_report([tmp_path], tmp_path / "out")
    assert report.vit_md == "" and not (tmp_path / "out" / "vit_grid.md").exists()
