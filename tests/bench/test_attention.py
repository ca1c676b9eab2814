"""`attnlab bench attention` on tiny sequence lengths: table, CSV, PNG, timeout and OOM cells."""

from __future__ import annotations

import csv
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from attnlab.bench import attention as bench
from attnlab.bench import ratios as bench_ratios
from attnlab.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_rows(out_dir: Path) -> list[dict[str, str]]:
    with (out_dir / bench.CSV_NAME).open() as handle:
        return list(csv.DictReader(handle))


def run(tmp_path: Path, *extra: str) -> int:
    return main(["bench", "attention", "--out-dir", str(tmp_path), "--heads", "2", "--dim", "4", *extra])


def test_compiled_rows_run_beside_the_eager_ones(tmp_path, monkeypatch):
    """``--compile both``: each op also under ``torch.compile`` (``+compile`` rows, its compile in an
    untimed first call), one compiled op per backend across the lengths; decoding steps stay eager.
    ``aot_eager`` stands in for inductor (the same graphs and custom ops without generating C++)."""
    compiled = []

    def compile_with_aot_eager(fn, **options):
        compiled.append(fn)
        return torch.compile.__wrapped__(fn, backend="aot_eager", **options)

    compile_with_aot_eager.__wrapped__ = torch.compile
    monkeypatch.setattr(torch, "compile", compile_with_aot_eager)
    backends = ["softmax", "sliced_relu_sorted", "linear_decode"]
    code = run(
        tmp_path, "--backends", *backends, "--seq-lens", "16", "40", "--compile", "both", "--repeats", "1"
    )
    assert code == 0
    rows = {(r["backend"], r["mode"], r["seq_len"]): r for r in read_rows(tmp_path)}
    for backend in ("softmax", "sliced_relu_sorted"):
        for mode in ("fwd", "fwdbwd"):
            for length in ("16", "40"):
                assert rows[(backend, mode, length)]["status"] == "ok"
                assert rows[(backend + "+compile", mode, length)]["status"] == "ok"
    assert rows[("linear_decode+compile", "fwd", "16")]["status"] == "n/a"
    assert len(compiled) == 2  # softmax's op and sliced ReLU's, each once for both lengths


def test_all_backends_tiny(tmp_path, capsys):
    code = run(tmp_path, "--seq-lens", "16", "33", "--repeats", "2")
    assert code == 0
    rows = read_rows(tmp_path)
    assert len(rows) == 2 * len(bench.DEFAULT_BACKENDS) * 2
    assert {r["backend"] for r in rows} == set(bench.DEFAULT_BACKENDS)
    assert {r["mode"] for r in rows} == {"fwd", "fwdbwd"}
    measured = [r for r in rows if not (r["backend"] in bench.INFERENCE_ONLY and r["mode"] == "fwdbwd")]
    for row in measured:
        assert row["status"] == "ok", row
        assert float(row["time_ms"]) > 0 and int(row["repeats"]) == 2
        # every call allocates at least its output (forward + backward: the inputs' gradients too)
        assert float(row["peak_mem_mb"]) > 0, row
    assert (tmp_path / bench.PNG_NAME).read_bytes().startswith(PNG_MAGIC)
    printed = capsys.readouterr().out
    assert "sliced_relu_concat" in printed and "peak_mem_mb" in printed
    # under the table: the official formulation's memory over sliced ReLU's, causal over bidirectional
    cell = {(r["backend"], r["mode"], r["seq_len"]): r for r in rows}
    for top, bottom, field, label in (
        ("sliced_relu_concat", "sliced_relu", "peak_mem_mb", "memory official / sliced_relu"),
        ("sliced_relu_causal", "sliced_relu", "time_ms", "time sliced_relu causal / bidir"),
        ("sliced_relu_bump_causal", "sliced_relu_bump", "time_ms", "time sliced_relu_bump causal / bidir"),
    ):
        for length in ("16", "33"):
            ratio = float(cell[(top, "fwdbwd", length)][field]) / float(
                cell[(bottom, "fwdbwd", length)][field]
            )
            line = f"{label:<44} {'fwdbwd':<7} {length:>7} {ratio:>8.2f}x"
            assert line in printed.splitlines(), (line, printed)


def test_ratio_lines_only_for_pairs_measured_in_the_run():
    def cell(backend, status="ok", **values):
        return bench.Cell(backend, "fwdbwd", 1024, 1, 8, 64, "float32", "cpu", status=status, **values)

    cells = [
        cell("sliced_relu", time_ms=10.0, peak_mem_mb=100.0),
        cell("sliced_relu_concat", time_ms=50.0, peak_mem_mb=400.0),
        cell("sliced_relu_causal", time_ms=25.0, peak_mem_mb=300.0),
        cell("sliced_relu_bump_causal", time_ms=99.0),  # its bidirectional cell did not run
        cell("sliced_relu_bump", status="oom"),
    ]
    lines = bench_ratios.ratio_lines(cells)
    assert lines[1:] == [
        f"{'memory official / sliced_relu':<44} fwdbwd     1024     4.00x",
        f"{'time sliced_relu causal / bidir':<44} fwdbwd     1024     2.50x",
    ]
    assert bench_ratios.ratio_lines(cells[2:]) == []


def test_threads_option_sets_torch_threads(tmp_path, capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(bench.torch, "set_num_threads", seen.append)
    assert (
        run(tmp_path, "--backends", "sliced_relu", "--seq-lens", "8", "--mode", "fwd", "--threads", "1") == 0
    )
    assert seen == [1]


def test_forced_timeout_skips_longer_lengths(tmp_path, capsys):
    code = run(tmp_path, "--backends", "sliced_relu", "--seq-lens", "8", "16", "--timeout-s", "1e-9")
    assert code == 0
    rows = read_rows(tmp_path)
    assert [(r["seq_len"], r["mode"], r["status"]) for r in rows] == [
        ("8", "fwd", "timeout"),
        ("8", "fwdbwd", "timeout"),
        ("16", "fwd", "timeout"),
        ("16", "fwdbwd", "timeout"),
    ]
    assert all("skipped" in r["note"] for r in rows if r["seq_len"] == "16")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sliced_relu ")]
    assert len(printed) == 4 and all("timeout" in line for line in printed)  # skipped cells shown too


def test_linear_extrapolation_skips_hopeless_lengths(tmp_path, monkeypatch):
    # Pretend every call takes 1 s: T=8 fits a 1.5 s limit, T=32 (4× longer) cannot.
    fake_clock = iter(range(0, 10_000))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: float(next(fake_clock)))
    code = run(
        tmp_path, "--backends", "sliced_relu", "--mode", "fwd", "--seq-lens", "8", "32", "--timeout-s", "1.5"
    )
    assert code == 0
    rows = read_rows(tmp_path)
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"] == "timeout" and "extrapolated to 4s" in rows[1]["note"]


def test_extrapolation_uses_observed_growth():
    assert bench._extrapolate([], 1024) == 0.0
    assert bench._extrapolate([(1024, 1.0)], 4096) == pytest.approx(4.0)  # linear from one point
    quadratic = [(1024, 1.0), (2048, 4.0)]
    assert bench._extrapolate(quadratic, 8192) == pytest.approx(64.0)
    faster_than_linear = [(1024, 1.0), (2048, 1.2)]  # noise: never extrapolate below linear
    assert bench._extrapolate(faster_than_linear, 4096) == pytest.approx(2.4)


def test_out_of_memory_is_marked_not_raised(tmp_path, monkeypatch):
    real_op = bench.op

    def fake_op(name):
        if name != "sliced_relu_attention":
            return real_op(name)

        def exhausted(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

        return exhausted

    monkeypatch.setattr(bench, "op", fake_op)
    code = run(tmp_path, "--backends", "sliced_relu", "linear", "--seq-lens", "8", "16", "--mode", "fwd")
    assert code == 0
    status = {(r["backend"], r["seq_len"]): r["status"] for r in read_rows(tmp_path)}
    assert status == {
        ("sliced_relu", "8"): "oom",
        ("sliced_relu", "16"): "oom",
        ("linear", "8"): "ok",
        ("linear", "16"): "ok",
    }


def test_other_errors_are_recorded_and_fail_the_exit_code(tmp_path, monkeypatch):
    def broken(name):
        def op(*args, **kwargs):
            raise ValueError("broken backend")

        return op

    monkeypatch.setattr(bench, "op", broken)
    code = run(tmp_path, "--backends", "sliced_relu", "--seq-lens", "8", "--mode", "fwd")
    assert code == 1
    (row,) = read_rows(tmp_path)
    assert row["status"] == "error" and "broken backend" in row["note"]


def test_backends_take_turns_at_each_length(tmp_path, monkeypatch):
    """After each cell's warm-up, the timed calls of one length go round the backends (one call of
    each per round), so a slow spell of the machine falls on all of them, not on one backend's run."""
    real_op, calls = bench.op, []

    def recording_op(name):
        inner = real_op(name)

        def recorded(*args, **kwargs):
            calls.append(name)
            return inner(*args, **kwargs)

        return recorded

    monkeypatch.setattr(bench, "op", recording_op)
    args = ["--backends", "softmax", "linear", "--seq-lens", "8", "16", "--mode", "fwd", "--repeats", "3"]
    assert run(tmp_path, *args) == 0
    warm_ups, rounds = (
        ["softmax_attention", "linear_attention"],
        ["softmax_attention", "linear_attention"] * 3,
    )
    assert calls == (warm_ups + rounds) * 2  # each length: both warm-ups, then three rounds
    assert all(row["status"] == "ok" and row["repeats"] == "3" for row in read_rows(tmp_path))


def test_unknown_backend_lists_known_ones(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["bench", "attention", "--backends", "nope"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err and "sliced_relu" in err


def test_bad_numbers_rejected(capsys):
    for argv in (["--seq-lens", "0"], ["--timeout-s", "-1"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            main(["bench", "attention", *argv])
    assert "must be" in capsys.readouterr().err


def test_cpu_peak_counts_allocations():
    # 1 MiB allocated and kept alive while a second 1 MiB is allocated and freed: peak 2 MiB.
    def allocate():
        a = torch.empty(256 * 1024)
        b = torch.empty(256 * 1024)
        del b
        return a

    assert bench._cpu_peak_bytes(allocate) == 2 * 2**20


def test_decode_row_is_inference_only_and_flat_in_memory(tmp_path):
    code = run(tmp_path, "--backends", "linear_decode", "--seq-lens", "16", "256", "--repeats", "1")
    assert code == 0
    rows = {(r["seq_len"], r["mode"]): r for r in read_rows(tmp_path)}
    assert rows[("16", "fwdbwd")]["status"] == rows[("256", "fwdbwd")]["status"] == "n/a"
    short, long = rows[("16", "fwd")], rows[("256", "fwd")]
    assert short["status"] == long["status"] == "ok"
    assert float(short["peak_mem_mb"]) == float(long["peak_mem_mb"])  # the state does not grow with T


def test_decoding_rows_report_their_state(tmp_path, capsys):
    backends = ["linear_decode", "sliced_relu_decode", "softmax_decode"]
    code = run(
        tmp_path, "--backends", *backends, "--seq-lens", "64", "256", "--repeats", "1", "--mode", "fwd"
    )
    assert code == 0
    rows = {(r["backend"], r["seq_len"]): r for r in read_rows(tmp_path)}
    assert all(r["status"] == "ok" and float(r["time_ms"]) > 0 for r in rows.values())
    state = {key: float(r["state_mb"]) * 2**20 for key, r in rows.items()}
    heads, dim = 2, 4
    for n in (64, 256):
        assert state[("softmax_decode", str(n))] == (n + 1) * heads * 2 * dim * 4  # K and V, float32
        # (D + 4) numbers per sorted past token and head (float32: with the int64 search key), the
        # 32-token buffer, O(D log n) run totals and running sums
        sorted_tokens = (n - 1) // 32 * 32
        sliced = state[("sliced_relu_decode", str(n))] - sorted_tokens * heads * (dim + 4) * 4
        assert 0 <= sliced <= heads * 4 * (8 * (dim + 1) + 32 * (dim + 2))
    assert state[("linear_decode", "64")] == state[("linear_decode", "256")]
    assert "state_mb" in capsys.readouterr().out


def test_causal_parallel_rows(tmp_path):
    code = run(tmp_path, "--backends", "sliced_relu_causal", "sliced_relu_bump_causal", "--seq-lens", "50")
    assert code == 0
    rows = read_rows(tmp_path)
    assert [(r["backend"], r["mode"], r["status"]) for r in rows] == [
        ("sliced_relu_causal", "fwd", "ok"),
        ("sliced_relu_causal", "fwdbwd", "ok"),
        ("sliced_relu_bump_causal", "fwd", "ok"),
        ("sliced_relu_bump_causal", "fwdbwd", "ok"),
    ]
    assert all(r["state_mb"] == "nan" for r in rows)


def test_packed_rows_run_beside_the_sorted_op_with_their_ratio(tmp_path, capsys):
    """The ``*_rows`` backends time the ops on packed rows of T slots (segment ids given, no gradient
    asked of them) and print their time over the sorted op's at the same T."""
    names = [
        "sliced_relu_sorted",
        "sliced_relu_rows",
        "sliced_relu_bump_causal_sorted",
        "sliced_relu_bump_causal_rows",
    ]
    assert run(tmp_path, "--backends", *names, "--seq-lens", "64", "--mode", "fwdbwd", "--repeats", "1") == 0
    assert [(r["backend"], r["status"]) for r in read_rows(tmp_path)] == [(name, "ok") for name in names]
    out = capsys.readouterr().out
    assert "time sliced_relu rows / sorted" in out and "time sliced_relu_bump_causal rows / sorted" in out


@pytest.mark.parametrize("command", [["bench", "attention"], ["bench", "bytes"], ["bench", "generate"]])
def test_an_out_dir_that_is_a_file_is_refused_by_name(tmp_path, capsys, command):
    taken = tmp_path / "results"
    taken.write_text("a file")
    with pytest.raises(SystemExit) as stop:
        main([*command, "--out-dir", str(taken)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --out-dir: {taken} is a file, not a folder" in err and "Traceback" not in err


def test_sigterm_while_measuring_keeps_the_cells_so_far_and_exits_143(tmp_path, monkeypatch, capsys):
    """A time limit's SIGTERM part way through a cell: the cells measured so far are written, the one
    being measured is marked stopped, and the command exits 143 as the signal's own exit would."""

    def terminated_while_measuring(args, log=print, cells=None):
        cells.append(bench.Cell("softmax", "fwd", 16, args.batch, args.heads, args.dim, args.dtype, "cpu"))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises SystemExit at once

    monkeypatch.setattr(bench, "run_bench", terminated_while_measuring)
    previous = signal.getsignal(signal.SIGTERM)
    assert run(tmp_path, "--seq-lens", "16") == 143
    assert signal.getsignal(signal.SIGTERM) is previous
    (row,) = read_rows(tmp_path)
    assert (row["backend"], row["status"], row["note"]) == (
        "softmax",
        "stopped",
        "interrupted while measuring",
    )
    assert "stopped; the 1 cells so far are in" in capsys.readouterr().out


def test_sliced_cells_are_printed_against_their_memory_floor(tmp_path, capsys):
    assert (
        run(tmp_path, "--backends", "sliced_relu_sorted", "softmax", "--seq-lens", "64", "--repeats", "2")
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("memory floor: copy bandwidth "))
    assert "GB/s (a 256 MiB copy, 1 threads)" in lines[head]
    below = [line for line in lines[head + 1 :] if "the floor" in line]
    assert [line.split()[:3] for line in below] == [
        ["sliced_relu_sorted", "fwd", "64"],
        ["sliced_relu_sorted", "fwdbwd", "64"],
    ]
    bandwidth = float(lines[head].split("copy bandwidth ")[1].split()[0]) * 1e9
    cell = next(
        c for c in read_rows(tmp_path) if c["backend"] == "sliced_relu_sorted" and c["mode"] == "fwdbwd"
    )
    floor_ms = 1e3 * 4 * (4 * 2 * 64 * 4 + 4 * 2 * 64) / bandwidth  # B=1, H=2, D=4, float32
    printed = float(below[1].split()[3].removesuffix("x"))  # the bandwidth is printed to 0.1 GB/s
    assert printed == pytest.approx(float(cell["time_ms"]) / floor_ms, rel=0.01)
