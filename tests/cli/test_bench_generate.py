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
