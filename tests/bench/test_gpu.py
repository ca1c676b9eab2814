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
    from attnlab.bench import attention as bench

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
    from attnlab.bench import gpu_results
    from attnlab.bench.bytes_moved import floor_bytes, op_and_inputs

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
    from attnlab.cli import gpu_results as gpu_results_cli

    assert gpu_results_cli.main(["collect", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "Test GPU: device copy 100.0 GB/s" in summary and "123.5" in summary
    assert all(any(line.startswith(b) for line in summary.splitlines()) for b in backends)
    assert gpu_results_cli.main(["collect", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("backend", ["softmax", "sliced_relu", "sliced_relu_bump", "linear", "linear_causal"])
def test_the_floor_at_gpu_lengths_is_the_floor_bench_bytes_counts(backend):
    from attnlab.bench import gpu_results
    from attnlab.bench.bytes_moved import floor_bytes, op_and_inputs

    args = argparse.Namespace(batch=2, heads=3, dim=8, dtype="bfloat16", seed=0)
    _, inputs = op_and_inputs(backend, args, 1000)
    for backward in (False, True):
        direct = floor_bytes(inputs, inputs[2].detach(), backward)
        assert gpu_results.floor_bytes_at(backend, 2, 3, 1000, 8, "bfloat16", backward) == direct


@pytest.mark.slow
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


# ---- the check's order and budget, on the CPU: a stand-in Python answers for the device ------------

FAKE_PYTHON = """#!{python}
import json, os, pathlib, subprocess, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if args[0] == "-c":
    sys.exit(0)  # "CUDA is there"
if args[:2] == ["-m", "attnlab.cli.gpu_results"]:
    if args[2] == "probe":
        pathlib.Path(args[3]).mkdir(parents=True, exist_ok=True)
        pathlib.Path(args[3], "gpu.json").write_text(json.dumps({{"gpu": "Stand-in GPU", "copy_gbps": 1.0}}))
        sys.exit(0)
    sys.exit(subprocess.call([{python!r}, *args]))  # collect: the real one, on what the steps left
if args[:2] == ["-m", "attnlab.cli.gpu_check"]:
    backend = args[args.index("--backend") + 1]
    time.sleep(float(os.environ.get("FAKE_CHECK_S") or os.environ["FAKE_STEP_S"]))
    sys.exit(1 if backend == os.environ.get("FAKE_FAIL") else 0)
time.sleep(float(os.environ["FAKE_STEP_S"]))  # a timing or training step
"""


def _fake_bench(tmp_path, budget_s: int, step_s: float, fail: str = "", check_s: float | None = None):
    import os
    import stat
    import sys

    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PY": str(fake), "OUT": str(tmp_path / "gpu"), "BUDGET_S": str(budget_s),
           "SUMMARY_S": "2", "MIN_STEP_S": "1", "FAKE_LOG": str(log), "FAKE_STEP_S": str(step_s),
           "FAKE_FAIL": fail, "FAKE_CHECK_S": "" if check_s is None else str(check_s)}  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(["scripts/bench_gpu.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=budget_s + 60)  # fmt: skip
    calls = log.read_text().splitlines()
    return done, calls, time.perf_counter() - start


def test_bench_gpu_checks_first_isolates_each_backend_and_drops_a_failed_one(tmp_path):
    done, calls, _ = _fake_bench(tmp_path, budget_s=120, step_s=0.05, fail="sliced_relu_bump")
    assert done.returncode == 0, done.stderr
    checks = [i for i, c in enumerate(calls) if "attnlab.cli.gpu_check" in c]
    timings = [c for c in calls if " bench attention " in f" {c} "]
    assert len(checks) == 3 and timings and max(checks) < calls.index(timings[0])  # values before times
    timed = [c.split("--backends ")[1].split()[0] for c in timings]
    assert all(len(c.split("--backends ")[1].split(" --")[0].split()) == 1 for c in timings)  # one each
    assert "sliced_relu_bump" not in timed and "sliced_relu_bump_torch" in timed
    assert "sliced_relu_bump failed its correctness check: not timed" in done.stdout
    assert {"softmax", "sliced_relu", "linear_causal"} <= set(timed)
    assert "bench-gpu: " in done.stdout and "s in all (budget 120 s)" in done.stdout


def test_bench_gpu_stays_inside_its_budget(tmp_path):
    """Steps of 1 s each against a 7 s budget: later steps are skipped, saying so, and the whole
    check ends within the budget (plus the stand-in's start-up)."""
    done, calls, took = _fake_bench(tmp_path, budget_s=7, step_s=1.0)
    assert done.returncode == 0, done.stderr
    assert took < 7 + 8
    assert "skipped (the 7s budget is spent)" in done.stderr + done.stdout
    assert any("gpu_results collect" in c for c in calls)  # the summary still comes


def test_bench_gpu_without_an_environment_names_make_venv(tmp_path):
    done = subprocess.run(
        ["make", "bench-gpu", f"PY={tmp_path / 'no-venv' / 'python'}", f"OUT={tmp_path / 'gpu'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "run 'make venv' first" in done.stderr
    assert not (tmp_path / "gpu").exists()


def test_the_correctness_pass_on_the_interpreter(tmp_path, monkeypatch, capsys):
    """`gpu_check` end to end on CPU tensors under TRITON_INTERPRET=1: every case agrees and is
    written; a kernel made to disagree fails its backend (exit 1) with the error it measured."""
    from attnlab.attention.sliced_relu import triton as sliced
    from attnlab.bench import gpu_check, gpu_results
    from attnlab.cli import gpu_check as gpu_check_cli

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gpu_check, "CASES", {b: [(37, 8, True), (70, 10, False)] for b in gpu_check.BACKENDS})
    out = tmp_path / "gpu"
    assert (
        gpu_check_cli.main([str(out), "--backend", "linear_causal", "--dtypes", "float32", "--device", "cpu"])
        == 0
    )
    rows = json.loads((out / "check" / "linear_causal.json").read_text())
    assert [r["seq_len"] for r in rows] == [37, 70] and all(r["ok"] for r in rows)
    assert all(r["float64_vs_definition"] < 1e-12 for r in rows)

    real = sliced.sliced_relu
    monkeypatch.setattr(sliced, "sliced_relu", lambda *args: real(*args) * 1.03)
    argv = [str(out), "--backend", "sliced_relu", "--dtypes", "bfloat16", "--device", "cpu"]
    assert gpu_check_cli.main(argv) == 1
    rows = json.loads((out / "check" / "sliced_relu.json").read_text())
    assert not any(r["ok"] for r in rows) and all(r["triton_err"] > 4 * r["torch_err"] for r in rows)
    assert "sliced_relu failed 2 of 2 cases: left out of the timings" in capsys.readouterr().out
    (out / "gpu.json").write_text(json.dumps({"gpu": "Test GPU", "copy_gbps": 1.0}))
    assert gpu_results.collect(out)["checks"] == [
        *json.loads((out / "check/linear_causal.json").read_text()),
        *rows,
    ]
    gpu_results.print_summary(gpu_results.collect(out), out)
    summary = capsys.readouterr().out
    assert "correctness: 2 of 4 cases agree (linear_causal, sliced_relu)" in summary
    assert "FAILED sliced_relu bfloat16 T=37 D=8: relative error" in summary


def test_a_new_check_summarises_nothing_stale_from_the_last(tmp_path):
    """The same OUT again: last time's checks, timings and training runs are gone before anything runs,
    so an op that fails its check now has no timing in the results, and no finished run blocks training."""
    out = tmp_path / "gpu"
    stale = [
        out / "check" / "sliced_relu_bump.json",
        out / "ops_bfloat16" / "sliced_relu_bump" / "bench_attention.csv",
        out / "train" / "listops" / "softmax" / "csv" / "metrics.csv",
    ]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("from the last check\n")
    done, _, _ = _fake_bench(tmp_path, budget_s=120, step_s=0.05, fail="sliced_relu_bump")
    assert done.returncode == 0, done.stderr
    assert not any(path.exists() for path in stale)
    results = json.loads((out / "results.json").read_text())
    assert results["ops"] == []  # the stand-in times nothing: the stale CSV is not read as a timing
    assert results["training"] and all(r["status"] == "failed" for r in results["training"])


@pytest.mark.slow
def test_a_check_stopped_at_the_budget_is_not_taken_for_a_pass(tmp_path):
    done, calls, _ = _fake_bench(tmp_path, budget_s=7, step_s=0.05, check_s=30)
    assert done.returncode == 0, done.stderr
    assert "the check of sliced_relu did not finish: not timed" in done.stdout
    timed = [c for c in calls if " bench attention " in f" {c} "]
    assert not any("--backends sliced_relu " in f"{c} " for c in timed)
