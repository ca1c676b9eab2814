"""`attnlab bench training` and the bench's dense/sorted variants: they run and report, nothing timed
is asserted (a benchmark, not a timed test)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from attnlab.attention.sliced_common.path import crossover
from attnlab.bench import attention as bench
from attnlab.bench import training as bench_training
from attnlab.cli.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.skipif(
    not (REPO_ROOT / ".venv" / "bin" / "attnlab").exists(), reason="needs the .venv that make builds"
)
def test_make_bench_training_as_the_readme_types_it(tmp_path):
    """`make bench-training` with size overrides only (one short task, one step, two backends)."""
    out = tmp_path / "training.json"
    args = f"--tasks t64 --backends softmax sliced_relu_linear --steps 1 --warmup 0 --repeats 1 --out {out}"
    done = subprocess.run(
        ["make", "-o", ".venv/.installed", "bench-training", f"ARGS={args}"],  # -o: never reinstall the venv
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attnlab bench training: 1 threads" in done.stdout
    assert "| t64 | 64 | 128 | rope |" in done.stdout and "softmax / sliced_relu_linear FLOPs" in done.stdout
    assert [r["backend"] for r in json.loads(out.read_text())] == ["softmax", "sliced_relu_linear"]


def test_training_bench_reports_every_backend_and_the_ratios(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(bench_training.TASKS, "vit_cifar10", (9, 2, "learned"))  # tiny stand-ins
    monkeypatch.setitem(bench_training.TASKS, "pathx", (40, 1, "none"))
    out = tmp_path / "training.json"
    code = main(
        ["bench", "training", "--tasks", "vit_cifar10", "pathx", "--steps", "1", "--warmup", "0",
         "--repeats", "2", "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(out.read_text())
    assert {(r["task"], r["backend"]) for r in rows} == {
        (task, name) for task in ("vit_cifar10", "pathx") for name in bench_training.BACKENDS
    }
    assert all(r["samples_per_s"] > 0 and len(r["runs_ms"]) == 2 for r in rows)
    assert all(r["matmul_flops_per_sample"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "load average before" in printed and "load average after" in printed
    relu_crossover = crossover("relu", "cpu", torch.float32)  # 32 with the C++ kernels, 64 without
    assert f"crossover: dense up to T={relu_crossover} for sliced_relu" in printed
    assert "| vit_cifar10 | 9 | 2 | learned |" in printed and "sliced_relu_bump / softmax" in printed
    assert "| pathx | 40 | 1 | none |" in printed
    assert "sliced_relu_linear MFLOP/sample" in printed and "softmax / sliced_relu FLOPs" in printed


def test_step_flops_counts_cpu_softmax_attention_and_the_linear_projection():
    """Torch's counter skips SDPA's CPU kernel: counted here, softmax's step costs what its matmuls
    and its attention do; sliced ReLU's linear Π costs less than its MLP Π."""
    length, batch, width, depth = 16, 2, 64, 2
    inputs = bench_training.random_batch(batch, length)
    flops = {name: bench_training.step_flops(*bench_training.build(name, length, "auto"), *inputs)
             for name in ("softmax", "sliced_relu", "sliced_relu_linear")}  # fmt: skip
    # per sample, 2 FLOPs a multiply-add; a layer's backward is twice its forward, SDPA's recomputes
    # the scores (torch's formula: 2 matmuls forward, 5 backward, T² · width each)
    attention = 7 * 2 * length * length * width
    layers = 3 * 2 * length * (width * 3 * width + width * width + 2 * width * 128)  # qkv, out, MLP
    head = 3 * 2 * (width * 128 + 128 * 10)  # the pooled classifier head, 64 → 128 → 10
    assert flops["softmax"] == batch * (depth * (attention + layers) + head)
    assert flops["sliced_relu_linear"] < flops["sliced_relu"]


def test_training_bench_rows_take_their_tasks_positions_or_the_one_asked(monkeypatch, tmp_path):
    """Without RoPE the sliced layers fold Π into the projection, so the row's positions matter."""
    seen = []
    monkeypatch.setattr(bench_training, "build", lambda *a, positions, **k: seen.append(positions) or (0, 0))
    monkeypatch.setattr(bench_training, "run_steps", lambda *a: 1.0)
    monkeypatch.setattr(bench_training, "step_flops", lambda *a: 1.0)
    for choice, expected in (("task", ["learned", "rope"]), ("none", ["none", "none"])):
        seen.clear()
        argv = ["--tasks", "vit_cifar10", "t64", "--backends", "softmax", "--out", str(tmp_path / "o.json")]
        args = bench_training_args(argv, choice)
        bench_training.run(args, log=lambda *_: None)
        assert seen == expected


def bench_training_args(argv, positions):
    from attnlab.cli.main import build_parser

    return build_parser().parse_args(["bench", "training", *argv, "--positions", positions])


def test_training_bench_path_reaches_the_sliced_layers():
    model, _ = bench_training.build("sliced_relu_bump", 16, "sorted")
    assert {m.path for m in model.modules() if hasattr(m, "path")} == {"sorted"}
    model, _ = bench_training.build("softmax", 16, "dense")  # ignored by other backends
    assert not any(hasattr(m, "path") for m in model.modules())


def test_dense_and_sorted_variants_run_in_the_attention_bench(tmp_path):
    names = [
        f"{base}_{path}"
        for base in ("sliced_relu", "sliced_relu_bump_causal")
        for path in ("dense", "sorted")
    ]
    code = main(
        ["bench", "attention", "--out-dir", str(tmp_path), "--heads", "2", "--dim", "4",
         "--seq-lens", "16", "--repeats", "1", "--mode", "fwdbwd", "--backends", *names]
    )  # fmt: skip
    assert code == 0
    rows = (tmp_path / bench.CSV_NAME).read_text().splitlines()[1:]
    assert sorted(r.split(",")[0] for r in rows) == sorted(names)
    assert all(",ok," in r for r in rows)


def test_the_sliced_variants_build_their_projection():
    """The rows differ only in Π: the authors' MLP, the linear map, and the ViT preset's 16-wide MLP."""
    hidden = {}
    for name in ("sliced_relu", "sliced_relu_linear", "sliced_relu_h16"):
        model, _ = bench_training.build(name, 16, "auto")
        slicers = [m.slicer for m in model.modules() if hasattr(m, "slicer")]
        hidden[name] = {s[0].out_features if hasattr(s, "__getitem__") else None for s in slicers}
    assert hidden == {"sliced_relu": {64}, "sliced_relu_linear": {None}, "sliced_relu_h16": {16}}
    defaults = bench_training_args([], "task").backends
    assert defaults == list(bench_training.BACKENDS) and "sliced_relu_h16" not in defaults


def test_compiled_rows_run_beside_the_eager_ones_and_compare_with_compiled_softmax(
    tmp_path, capsys, monkeypatch
):
    """``--compile both``: every backend eager and through ``compile_model`` (recorded here, not
    compiled: tests/run/test_compilation.py compiles), each compiled row against compiled softmax."""
    from attnlab.run import compilation

    compiled = []
    monkeypatch.setattr(compilation, "compile_model", lambda model: compiled.append(model) or model)
    monkeypatch.setitem(bench_training.TASKS, "t64", (12, 2, "rope"))
    out = tmp_path / "training.json"
    argv = [
        "bench",
        "training",
        "--tasks",
        "t64",
        "--backends",
        "softmax",
        "sliced_relu",
        "--compile",
        "both",
    ]
    assert main([*argv, "--steps", "1", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["compiled"]) for r in rows] == [
        ("softmax", False), ("sliced_relu", False), ("softmax+compile", True), ("sliced_relu+compile", True)
    ]  # fmt: skip
    assert len(compiled) == 2 and all(r["samples_per_s"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "| sliced_relu / softmax | sliced_relu+compile / softmax+compile |" in printed


def test_packed_rows_run_beside_the_padded_ones_on_mixed_lengths(tmp_path, capsys, monkeypatch):
    """``--packing both``: each backend on the same seeded mixed-length batches, padded and packed;
    a packed row is compared with packed softmax and with its own padded row, and the fill is shown."""
    monkeypatch.setitem(bench_training.TASKS, "glue_like", (24, 6, "rope"))  # a tiny stand-in
    monkeypatch.setitem(bench_training.MIXED, "glue_like", (8, 0.6))
    out = tmp_path / "training.json"
    argv = ["bench", "training", "--tasks", "glue_like", "--backends", "softmax", "sliced_relu"]
    argv += ["--packing", "both", "--steps", "1", "--warmup", "0", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["backend"], r["packed"]) for r in rows] == [
        ("softmax", False), ("sliced_relu", False), ("softmax+packed", True), ("sliced_relu+packed", True)
    ]  # fmt: skip
    padded, packed = rows[0]["fill"], rows[2]["fill"]
    assert 0 < padded < packed <= 1
    printed = capsys.readouterr().out
    assert "| sliced_relu+packed / softmax+packed | softmax+packed / softmax |" in printed
    assert f"glue_like: rows {100 * packed:.1f}% real tokens packed" in printed


def test_packing_a_task_of_one_length_is_refused_by_name(tmp_path):
    argv = ["bench", "training", "--tasks", "t64", "--packing", "on", "--out", str(tmp_path / "t.json")]
    with pytest.raises(ValueError, match="--packing needs tasks that mix lengths .*t64 has one length"):
        main(argv)


def test_the_mixed_tasks_run_by_default_only_under_packing(tmp_path, monkeypatch):
    from attnlab.cli.main import build_parser

    assert build_parser().parse_args(["bench", "training"]).tasks is None  # the run picks
    assert not set(bench_training.MIXED) & set(bench_training.FIXED_TASKS)
    # named, the fixed tasks are taken as asked, not swapped for the mixed ones
    with pytest.raises(ValueError, match="--packing needs tasks that mix lengths"):
        main(["bench", "training", "--tasks", *bench_training.FIXED_TASKS, "--packing", "on"])
    for task in bench_training.MIXED:  # tiny stand-ins
        monkeypatch.setitem(bench_training.TASKS, task, (16, 4, "rope"))
        monkeypatch.setitem(bench_training.MIXED, task, (6, 0.6))
    out = tmp_path / "training.json"
    argv = ["bench", "training", "--backends", "softmax", "--packing", "on"]
    assert main([*argv, "--steps", "1", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    assert [r["task"] for r in json.loads(out.read_text())] == list(bench_training.MIXED)
