"""`attnlab bench generate`: per-token time and decoding-state memory per backend and context, in one run."""

from __future__ import annotations

import csv

from attnlab.cli.main import main
from attnlab.models.causal_lm import causal_backends

SMALL = ["--contexts", "16", "64", "--dim", "32", "--depth", "1", "--heads", "2", "--repeats", "2"]


def test_one_run_covers_every_causal_backend_and_context(tmp_path, capsys):
    assert main(["bench", "generate", *SMALL, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    with open(tmp_path / "generate.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {r["backend"] for r in rows} == set(causal_backends()) and len(rows) == 2 * len(causal_backends())
    mb = {(r["backend"], int(r["context"])): float(r["state_mb"]) for r in rows}
    assert mb[("softmax", 64)] == 4 * mb[("softmax", 16)]  # a KV cache grows with the context
    assert mb[("linear", 64)] == mb[("linear", 16)] < mb[("softmax", 16)]  # (S, z) does not
    assert mb[("sliced_relu", 64)] > mb[("sliced_relu", 16)]  # the sorted runs: (D + 2) per token
    assert all(float(r["model_ms_per_token"]) > 0 and float(r["attn_us_per_token"]) > 0 for r in rows)
    assert "linear at 64: softmax's time per token / linear's = " in out and "load " in out
    assert (tmp_path / "generate.png").stat().st_size > 0


def test_a_backend_without_a_causal_form_is_named(tmp_path, capsys):
    assert main(["bench", "generate", "--backends", "nope", "--out-dir", str(tmp_path)]) == 2
    assert "no causal form: nope (known: " in capsys.readouterr().err


def test_a_failing_cell_is_marked_and_the_rest_still_written(tmp_path, capsys, monkeypatch):
    """Out of memory at one context: that row says so, the longer ones are skipped, the other
    backends run, and the CSV is written (nothing measured is lost)."""
    from attnlab.bench import generate as bench_generate

    real = bench_generate.run_cell

    def run_cell(backend, context, args):
        if backend == "softmax" and context == 16:
            raise MemoryError("can't allocate memory for the KV cache")
        return real(backend, context, args)

    monkeypatch.setattr(bench_generate, "run_cell", run_cell)
    argv = ["bench", "generate", *SMALL, "--backends", "softmax", "linear", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    with open(tmp_path / "generate.csv") as handle:
        rows = {(r["backend"], r["context"]): r["status"] for r in csv.DictReader(handle)}
    assert rows[("softmax", "16")].startswith("oom: MemoryError: can't allocate")
    assert rows[("softmax", "64")] == "skipped (after oom at a shorter context)"
    assert rows[("linear", "16")] == rows[("linear", "64")] == "ok"
    assert any(line.split()[:3] == ["softmax", "16", "oom:"] for line in capsys.readouterr().out.splitlines())
