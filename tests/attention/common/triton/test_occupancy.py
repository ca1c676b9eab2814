"""Programs per SM from a compiled kernel's registers, threads and shared memory (CUDA's rules), and
sliced ReLU's chunk length from them: the arithmetic against CUDA's occupancy tables, the walks'
compile probe against the kernels' signatures, and its fallback where nothing compiles."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention.common.triton.occupancy import A100, H100, blocks_per_sm  # noqa: E402
from attnlab.attention.sliced_relu import triton as sliced  # noqa: E402


@pytest.mark.parametrize(
    ("registers", "warps", "shared", "sm", "blocks"),
    [
        (128, 8, 0, A100, 2),  # 32,768 registers a block: two in 65,536
        (129, 8, 0, A100, 1),  # 136 a thread once rounded to the warp's unit of 256: 34,816 a block
        (188, 8, 0, H100, 1),
        (64, 4, 0, H100, 8),
        (32, 8, 0, H100, 8),  # threads: 2,048 / 256
        (32, 1, 0, A100, 32),  # block slots
        (40, 4, 100_000, A100, 1),  # shared memory: 164 KiB an SM
        (40, 4, 100_000, H100, 2),  # 228 KiB
    ],
)
def test_blocks_per_sm_as_cuda_counts_them(registers, warps, shared, sm, blocks):
    assert blocks_per_sm(registers, warps, shared, sm) == blocks


def _fake_gpu(monkeypatch, sms: int, per_sm: int):
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=sms)
    )
    monkeypatch.setattr(sliced, "walk_programs_per_sm", lambda *a: per_sm)
    return types.SimpleNamespace(device=torch.device("cuda:0"), dtype=torch.bfloat16, shape=(64, 4096, 64))


@pytest.mark.parametrize(("per_sm", "chunks"), [(1, 5), (2, 9), (4, 17)])
def test_chunks_fill_whole_waves_of_what_the_gpu_runs_at_once(monkeypatch, per_sm, chunks):
    """64 rows on 132 SMs, two waves: 264, 528 or 1,056 programs by the walks' programs per SM."""
    x = _fake_gpu(monkeypatch, 132, per_sm)
    length = 2 * 65536
    chunk = sliced._chunk_len(64, length, 1, x, torch.float32)
    assert chunk == -(-length // chunks // sliced.TUNING.block) * sliced.TUNING.block
    assert -(-length // chunk) * 64 >= sliced.TUNING.waves * 132 * per_sm


def test_short_rows_keep_the_least_chunk(monkeypatch):
    x = _fake_gpu(monkeypatch, 132, 2)
    assert sliced._chunk_len(64, 4096, 1, x, torch.float32) == sliced.TUNING.min_chunk


def test_the_probe_compiles_the_walks_as_they_are_launched():
    """The probe's argument lists, read as the compile matrix reads its launches: the same kernel
    signature, argument for argument (``tests/triton_builds.py`` builds those for sm_70-90)."""
    from attnlab.attention.common.triton import runtime
    from triton_builds import KERNELS, VAL

    names = {
        torch.int32: "*i32",
        torch.int64: "*i64",
        torch.float32: "*fp32",
        torch.bool: "*i1",
        torch.bfloat16: VAL,
    }
    for name, args, options in sliced._walk_signatures(torch.bfloat16, torch.float32, 64):
        got = [names[a] if isinstance(a, torch.dtype) else "i32" for a in args]
        assert got == KERNELS[name][0], name
        constexprs = {k for k in options if k not in ("num_warps", "maxnreg")}
        assert constexprs == set(KERNELS[name][1]), name
        fn = getattr(runtime.kernels(), name)
        assert len(fn.arg_names) == len(args) + len(constexprs), name


def test_the_probe_falls_back_with_one_warning_where_nothing_compiles(monkeypatch):
    monkeypatch.setattr(sliced, "_PER_SM", {})
    broken = types.SimpleNamespace(
        stream_kernel=types.SimpleNamespace(
            warmup=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no driver"))
        ),
    )
    monkeypatch.setattr(sliced, "kernels", lambda: broken)
    device = torch.device("cuda:0")
    with pytest.warns(UserWarning, match="no register count on cuda:0 .*no driver.*2 programs per SM"):
        assert sliced.walk_programs_per_sm(torch.bfloat16, torch.float32, 64, device) == sliced.DEFAULT_PER_SM
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached: once per device and dtypes
        assert sliced.walk_programs_per_sm(torch.bfloat16, torch.float32, 64, device) == sliced.DEFAULT_PER_SM


def test_the_probe_takes_the_fewer_of_the_two_walks(monkeypatch):
    monkeypatch.setattr(sliced, "_PER_SM", {})
    compiled = {"stream_kernel": 96, "relu_backward_kernel": 128}  # registers a thread, 8 warps
    seen = []

    def kernel(name):
        def warmup(*args, grid, **options):
            seen.append((name, grid, options.get("maxnreg")))
            meta = types.SimpleNamespace(num_warps=options["num_warps"], shared=0)
            return types.SimpleNamespace(n_regs=compiled[name], metadata=meta, _init_handles=lambda: None)

        return types.SimpleNamespace(warmup=warmup)

    monkeypatch.setattr(sliced, "kernels", lambda: types.SimpleNamespace(**{n: kernel(n) for n in compiled}))
    monkeypatch.setattr("attnlab.attention.common.triton.occupancy.sm_limits", lambda device: H100)
    assert sliced.walk_programs_per_sm(torch.bfloat16, torch.float32, 64, torch.device("cuda:0")) == 2
    assert ("relu_backward_kernel", (1,), sliced.TUNING.backward_max_registers) in seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_reads_the_compiled_walks_on_a_gpu(monkeypatch, dtype):
    monkeypatch.setattr(sliced, "_PER_SM", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_sm = sliced.walk_programs_per_sm(dtype, torch.float32, 64, torch.device("cuda"))
    assert per_sm >= 2  # the backward walk's register cap leaves room for two
