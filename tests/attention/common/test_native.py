"""The C++ CPU kernels' loader: switched off by name, and a build that fails leaves the torch code
running with one warning that says why."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.attention.common import native
from attnlab.attention.sliced_common import decoding
from attnlab.attention.sliced_common.rows import SORT_KERNELS, sort_rows
from attnlab.attention.sliced_relu.decoding import sliced_relu_attention_state, sliced_relu_attention_step


def _decode(length: int = 80):
    torch.manual_seed(0)
    s, t, v = torch.randn(1, 2, length), torch.randn(1, 2, length), torch.randn(1, 2, length, 3)
    state, outs = sliced_relu_attention_state(t[..., :5], v[..., :5, :]), []
    for i in range(5, length):
        out, state = sliced_relu_attention_step(s[..., i], t[..., i], v[..., i, :], state)
        outs.append(out)
    return torch.stack(outs)


@pytest.mark.parametrize("value", ["off", "0", "OFF"])
def test_the_switch_turns_the_kernels_off(value, monkeypatch):
    monkeypatch.setenv(native.SWITCH, value)
    assert native.library(decoding.KERNELS) is None


class _NoNinja:
    @staticmethod
    def _get_build_directory(name, verbose):
        return "/nonexistent"

    @staticmethod
    def load(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja to get it)")


def test_a_failed_build_warns_once_and_the_torch_code_gives_the_same_steps(monkeypatch, caplog):
    monkeypatch.setenv(native.SWITCH, "off")
    expected = _decode()
    monkeypatch.delenv(native.SWITCH)
    monkeypatch.setattr(native, "_cpp_extension", lambda: _NoNinja)
    native._build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            torch.testing.assert_close(_decode(), expected, rtol=0, atol=0)
            _decode()
    finally:
        native._build.cache_clear()  # the next test builds (or loads) the real library again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert (
        native.library_name(decoding.KERNELS) in warnings[0] and "not built (Ninja is required" in warnings[0]
    )
    assert "using the torch code" in warnings[0]


def test_a_compiler_without_openmp_still_builds_the_kernels_for_one_thread(tmp_path, monkeypatch, caplog):
    """Apple's clang has no ``-fopenmp``: the kernels are built without it (their rows on one thread)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    real = native._cpp_extension()
    flags = []

    class NoOpenMP:
        _get_build_directory = staticmethod(real._get_build_directory)

        @staticmethod
        def load(*args, **kwargs):
            flags.append(kwargs["extra_cflags"][-1])
            if "-fopenmp" in kwargs["extra_cflags"]:
                raise RuntimeError("clang: error: unsupported option '-fopenmp'")
            return real.load(*args, **kwargs)

    monkeypatch.setattr(native, "_cpp_extension", lambda: NoOpenMP)
    native._build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            library = native._build(str(SORT_KERNELS))
    finally:
        native._build.cache_clear()
    assert flags == ["-fopenmp", "-fopenmp-simd"]
    assert library is not None and hasattr(library, "sort_rows_f32")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "built without OpenMP (clang: error" in warnings[0], warnings


def test_large_calls_run_on_torchs_threads_and_small_ones_on_one():
    torch.set_num_threads(2)  # the autouse fixture restores the count
    assert native.threads_for(5, native.PARALLEL_FROM) == 2
    assert native.threads_for(1, native.PARALLEL_FROM) == 1  # a thread per row at most
    assert native.threads_for(5, native.PARALLEL_FROM - 1) == 1


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the loaded libraries from /proc")
def test_the_kernels_share_torchs_openmp_runtime_and_split_rows_over_its_threads():
    """A second OpenMP runtime would keep threads of its own, competing for the cores with torch's."""
    torch.set_num_threads(2)
    x = torch.randn(6, 40_000)
    sorted_1, order_1 = sort_rows(x)  # one call of the C++ radix sort, rows split over 2 threads
    assert native.threads_for(6, x.numel()) == 2
    runtimes = {
        line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line
    }
    assert len(runtimes) == 1, runtimes
    assert Path(next(iter(runtimes))).parent == Path(torch.__file__).parent / "lib"
    torch.set_num_threads(1)
    sorted_2, order_2 = sort_rows(x)
    assert torch.equal(sorted_1, sorted_2) and torch.equal(order_1, order_2)
    assert torch.equal(sorted_1, x.sort(dim=1).values)


def test_a_forked_child_runs_large_calls_on_its_one_thread():
    """libgomp's team does not survive a fork: with the parent's threads used, a parallel region in
    the child would wait for ever."""
    torch.set_num_threads(2)
    x = torch.randn(6, 40_000)
    expected = sort_rows(x)[0].numpy().copy()  # the parent's team started
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once the rows are sorted (compared in numpy: torch's large
        # ops run on the team and would hang)
        ok = native.threads_for(6, x.numel()) == 1 and np.array_equal(sort_rows(x)[0].numpy(), expected)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's call waited on threads that do not exist in it")


def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "lock_check.cpp"
    source.write_text('extern "C" int lock_check_answer() { return 42; }\n')
    lock = tmp_path / "extensions" / native.library_name(source) / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - native.STALE_LOCK_S - 10
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        library = native._build(str(source))
    if library is None:
        pytest.skip("no C++ compiler or ninja")
    assert library.lock_check_answer() == 42 and not lock.exists()
    assert any("removing the build lock" in r.getMessage() for r in caplog.records)
