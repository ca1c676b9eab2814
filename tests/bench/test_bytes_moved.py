"""`attnlab bench bytes`: the counter charges each op and kernel the bytes it moves, and the
command prints every backend against its floor."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.bench.byte_count import count_bytes, tensor_bytes


def _only(rows):
    assert len(rows) == 1, rows
    return rows[0]


def test_an_elementwise_op_reads_its_inputs_and_writes_its_output():
    x, y = torch.randn(1000), torch.randn(1000, dtype=torch.float64)
    row = _only(count_bytes(lambda: x + y))  # x promoted inside the op: still read once
    assert (row.kind, row.name, row.calls) == ("torch", "add", 1)
    assert (row.read, row.written) == (1000 * 4 + 1000 * 8, 1000 * 8)


def test_views_and_empty_cost_nothing_and_an_expanded_input_counts_once():
    x = torch.randn(64, 1)
    assert count_bytes(lambda: (x.view(8, 8), x.t(), x.expand(64, 32), torch.empty(10**6))) == []
    row = _only(count_bytes(lambda: x.expand(64, 32) * 2.0))
    assert (row.read, row.written) == (64 * 4, 64 * 32 * 4)
    assert tensor_bytes(x.expand(64, 32)) == 64 * 4


def test_gathers_and_scatters_move_only_the_rows_they_touch():
    source = torch.randn(1000, 16)
    index = torch.tensor([3, 5, 7])
    row = _only(count_bytes(lambda: source.index_select(0, index)))
    assert (row.read, row.written) == (3 * 16 * 4 + 3 * 8, 3 * 16 * 4)
    target = torch.zeros(1000, 16)
    rows = count_bytes(lambda: target.index_add_(0, index, torch.ones(3, 16)))
    added = next(r for r in rows if r.name == "index_add_")
    assert (added.read, added.written) == (3 * 16 * 4 + 3 * 8 + 3 * 16 * 4, 3 * 16 * 4)


def test_backward_ops_are_counted_too():
    x = torch.randn(500, requires_grad=True)
    rows = count_bytes(lambda: (x * x).sum().backward())
    names = {r.name for r in rows}
    assert "mul" in names and x.grad is not None
    assert sum(r.calls for r in rows if r.name == "mul") >= 3  # forward x*x, backward 2·x·g


def test_a_triton_launch_is_charged_its_unmasked_loads_and_stores(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnlab.attention.common.triton import runtime

    x = torch.zeros(20)
    rows = count_bytes(lambda: runtime.kernels().probe_kernel[(1,)](x, 10, BLOCK=16))
    row = _only(rows)  # the interpreter's copies to and from the host are not charged
    assert (row.kind, row.name, row.calls) == ("triton", "probe_kernel", 1)
    assert (row.read, row.written) == (10 * 4, 10 * 4)  # 10 of 16 lanes unmasked, float32
    assert row.sectors == 2 * 64  # 40 bytes from an aligned start: two 32-byte sectors each way
    assert torch.equal(x[:10], torch.ones(10)) and not x[10:].any()


def test_a_gather_of_scattered_numbers_is_charged_a_sector_each(monkeypatch):
    """16 float32 numbers 32 bytes apart: 64 bytes of lanes, 16 sectors of 32 bytes."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language as tl

    @triton.jit  # decorated now, under the interpreter
    def gather(x_ptr, index_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + tl.load(index_ptr + i)))

    x, out = torch.arange(128.0), torch.zeros(16)
    index = torch.arange(16, dtype=torch.int32) * 8
    row = _only(count_bytes(lambda: gather[(1,)](x, index, out, BLOCK=16)))
    assert (row.read, row.written) == (16 * 4 + 16 * 4, 16 * 4)
    assert row.sectors == 16 * 32 + 2 * 32 + 2 * 32  # the gather; the index and the output, contiguous
    assert torch.equal(out, index.float())


def test_the_documented_command_prints_each_backend_against_its_floor(tmp_path):
    """`attnlab bench bytes --seq-lens 1024 4096` (docs/attention.md), at T = 64 only."""
    pytest.importorskip("triton")
    attnlab = Path(sys.executable).with_name("attnlab")
    command = [str(attnlab), "bench", "bytes", "--seq-lens", "64"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = {
        line.split()[0]: line.split() for line in done.stdout.splitlines() if line.split()[1:2] == ["64"]
    }
    assert set(lines) == {"softmax", "sliced_relu", "sliced_relu_bump", "linear_causal"}
    # softmax, B=1 H=2 T=64 D=64 bf16: q, k, v, o forward; q, k, v, do, dq, dk, dv backward
    v = 2 * 64 * 64 * 2
    assert float(lines["softmax"][3]) == pytest.approx(11 * v / 1e6, abs=0.006)
    for name in ("sliced_relu", "sliced_relu_bump", "linear_causal"):
        assert int(lines[name][5]) >= 2, f"{name}: its Triton kernels were not counted"
        assert float(lines[name][4]) >= 1.0  # never below the floor
    rows = list(csv.DictReader((tmp_path / "bench_results" / "bench_bytes.csv").open()))
    assert {r["backend"] for r in rows if r["kind"] == "total"} == set(lines)
    for total in (r for r in rows if r["kind"] == "total"):  # the printed sector ratio, from the CSV
        ratio = int(total["sectors"]) / int(total["floor"])
        assert ratio == pytest.approx(float(lines[total["backend"]][7]), abs=0.006)
    for name, line in lines.items():  # the CSV's contributors add up to the printed total
        parts = [r for r in rows if r["backend"] == name and r["kind"] != "total"]
        moved = sum(int(r["read"]) + int(r["written"]) for r in parts)
        assert moved / 1e6 == pytest.approx(float(line[2]), abs=0.006)
        kernels = sum(int(r["calls"]) for r in parts if r["kind"] == "triton")
        assert kernels == int(line[5])


def _measure(backend: str, length: int) -> dict:
    """fwd+bwd as `attnlab bench bytes` measures it (B=1 H=2 D=64 bf16): bytes over the floor, launches."""
    import argparse

    from attnlab.bench.bytes_moved import measure

    args = argparse.Namespace(batch=1, heads=2, dim=64, dtype="bfloat16", seed=0, mode="fwdbwd")
    return measure(backend, args, length)


# T = 4,096 runs the lines T = 1,024 runs, in four times the interpreter's time: `make test-all`
LENGTHS = [1024, pytest.param(4096, marks=pytest.mark.slow)]


@pytest.mark.parametrize("length", LENGTHS)
def test_sliced_relu_moves_at_most_two_and_a_half_floors(monkeypatch, length):
    """The Triton sliced ReLU's bound: one backward walk over the forward's stream, one totals pass."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    measured = _measure("sliced_relu", length)
    assert measured["ratio"] <= 2.5
    assert measured["torch_ops"] <= 30  # the host work around the kernels: a few sorts and searches


@pytest.mark.slow
@pytest.mark.parametrize("length", LENGTHS)
def test_relu_bump_moves_at_most_four_floors(monkeypatch, length):
    """The Triton ReLU-bump's bound: tile walks over the sorted keys, one per direction."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    measured = _measure("sliced_relu_bump", length)
    assert measured["ratio"] <= 4
    assert measured["torch_ops"] <= 30
