"""`make bench-gpu` as typed (on a machine without CUDA it stops at once, naming why) and the bench
backends it adds: the torch variants of the sliced ops and causal linear attention."""

from __future__ import annotations

import csv
import shutil
import subprocess
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
