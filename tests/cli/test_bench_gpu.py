"""`make bench-gpu` as typed (on a machine without CUDA it stops at once, naming why) and the bench
backends it adds: the torch variants of the sliced ops and causal linear attention."""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from attnlab.cli.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark itself would run (minutes)")
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_bench_gpu_without_cuda_says_so(tmp_path):
    # -o: the venv is already built here; never let the test reinstall it
    done = subprocess.run(
        ["make", "-o", ".venv/.installed", "bench-gpu", f"OUT={tmp_path / 'gpu'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "bench-gpu: no CUDA device here; run it on a GPU machine" in done.stdout + done.stderr
    assert not (tmp_path / "gpu").exists(), "no empty results folder left behind"


def test_torch_variants_and_causal_linear_are_bench_backends(tmp_path):
    backends = ["sliced_relu_torch", "sliced_relu_bump_torch", "linear_causal", "linear_causal_torch"]
    argv = ["bench", "attention", "--out-dir", str(tmp_path), "--heads", "2", "--dim", "4"]
    assert main([*argv, "--seq-lens", "16", "--repeats", "1", "--backends", *backends]) == 0
    rows = list(csv.DictReader((tmp_path / "bench_attention.csv").open()))
    assert {r["backend"] for r in rows} == set(backends)
    assert all(r["status"] == "ok" for r in rows)


def test_the_first_cuda_call_compiles_outside_the_time_limit(monkeypatch):
    """A T=1K cell whose first call spends seconds compiling is timed, not marked `timeout`."""
    from attnlab.cli import bench

    calls = []

    def call():
        calls.append(1)
        time.sleep(0.6 if len(calls) == 1 else 0.001)  # the first call compiles

    monkeypatch.setattr(bench, "_synchronize", lambda device: None)
    monkeypatch.setattr(bench, "_measure_peak", lambda call, device: (_timed(call), 1.0))
    cell = bench.Cell("sliced_relu", "fwdbwd", 1024, 8, 8, 64, "bfloat16", "cuda")
    bench.measure_cell(cell, call, repeats=3, timeout_s=0.5, compile_first=True)
    assert cell.status == "ok" and cell.repeats == 3 and cell.time_ms < 100
    assert len(calls) == 5  # compile, warm-up, three timed


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def test_results_file_has_every_figure_against_the_byte_floor(tmp_path, capsys):
    """`gpu_results collect` on what the steps write: ops rows get the floor (as `bench bytes`
    counts it) and the bandwidth it implies; training rows their throughput."""
    from attnlab.cli import gpu_results
    from attnlab.cli.bench_bytes import floor_bytes, op_and_inputs

    out = tmp_path / "gpu"
    backends = ["softmax", "sliced_relu_torch", "linear_causal_torch"]
    argv = ["bench", "attention", "--out-dir", str(out / "ops_float32"), "--heads", "2", "--dim", "8"]
    assert (
        main([*argv, "--seq-lens", "48", "--repeats", "1", "--mode", "fwdbwd", "--backends", *backends]) == 0
    )
    (out / "gpu.json").write_text(json.dumps({"gpu": "Test GPU", "copy_gbps": 100.0}))
    metrics = out / "train" / "listops" / "softmax" / "csv" / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("step,perf/train_samples_per_sec,perf/mfu\n10,,\n20,123.5,0.25\n")

    (out / "train" / "text").mkdir(parents=True)  # started, failed before any figure
    (out / "train" / "text" / "sliced_relu.log").write_text("...\nerror: Text needs its data\n")
    (out / "train" / "listops" / "softmax.log").write_text("trained\n")

    results = gpu_results.collect(out)
    assert json.loads((out / "results.json").read_text()) == results
    rows = {r["backend"]: r for r in results["ops"]}
    assert set(rows) == set(backends)
    for backend, row in rows.items():
        args = argparse.Namespace(batch=1, heads=2, dim=8, dtype="float32", seed=0)
        _, inputs = op_and_inputs(backend.removesuffix("_torch"), args, 48)
        floor = floor_bytes(inputs, inputs[2].detach(), backward=True)
        assert row["floor_mb"] == round(floor / 1e6, 2)
        assert row["floor_gbps"] == pytest.approx(floor / (row["time_ms"] / 1e3) / 1e9, abs=0.1)
        assert row["of_copy_bandwidth"] == pytest.approx(row["floor_gbps"] / 100.0, abs=1e-3)
    none = dict.fromkeys(("tflops_per_sec", "step_ms", "peak_mem_mb"))
    logged = {"samples_per_sec": 123.5, "mfu": 0.25, **none}
    failed = {"task": "text", "attn": "sliced_relu", "status": "failed", "note": "error: Text needs its data"}
    assert results["training"] == [{"task": "listops", "attn": "softmax", "status": "ok", **logged}, failed]
    capsys.readouterr()
    assert gpu_results.main(["collect", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "Test GPU: device copy 100.0 GB/s" in summary and "123.5" in summary
    assert all(any(line.startswith(b) for line in summary.splitlines()) for b in backends)
    assert gpu_results.main(["collect", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("backend", ["softmax", "sliced_relu", "sliced_relu_bump", "linear", "linear_causal"])
def test_the_floor_at_gpu_lengths_is_the_floor_bench_bytes_counts(backend):
    from attnlab.cli import gpu_results
    from attnlab.cli.bench_bytes import floor_bytes, op_and_inputs

    args = argparse.Namespace(batch=2, heads=3, dim=8, dtype="bfloat16", seed=0)
    _, inputs = op_and_inputs(backend, args, 1000)
    for backward in (False, True):
        direct = floor_bytes(inputs, inputs[2].detach(), backward)
        assert gpu_results.floor_bytes_at(backend, 2, 3, 1000, 8, "bfloat16", backward) == direct


@pytest.mark.xdist_group("exclusive")  # processes and signals: never two at once (make test)
def test_a_stopped_bench_keeps_the_cells_it_measured(tmp_path, terminal_signals):
    """`timeout` (make bench-gpu's budget) sends SIGTERM: the CSV still holds every finished cell."""
    import os
    import signal
    import sys

    command = [sys.executable, "-m", "attnlab.cli.main", "bench", "attention", "--backends", "softmax",
               "--seq-lens", "32", "16384", "--mode", "fwdbwd", "--heads", "8", "--repeats", "20",
               "--out-dir", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.split()[:3] == ["softmax", "fwdbwd", "32"]:
                break  # the first cell is done, the 16K one is running
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, rest
    assert "stopped; the 2 cells so far" in rest
    rows = {r["seq_len"]: r for r in csv.DictReader((tmp_path / "bench_attention.csv").open())}
    assert rows["32"]["status"] == "ok" and float(rows["32"]["time_ms"]) > 0
    assert rows["16384"]["status"] == "stopped"
