"""FLOP formulas against torch's flop counter, the model counter, device peaks, and MFU in a real run."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.attention
from torch.utils.flop_counter import FlopCounterMode

from attnlab.attention import PackedLayout, build_attention
from attnlab.attention import reference as ref
from attnlab.attention.linear.ops import linear_attention
from attnlab.flops import FlopCounter, attention_flops, peak_flops, precision_dtype
from attnlab.pipeline import train
from tiny_runs import TINY_LISTOPS


def counted(fn, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as mode:
        fn(*args, **kwargs)
    return mode.get_total_flops()


@pytest.mark.parametrize("length,dim,dim_v", [(16, 8, 8), (33, 4, 12)])
def test_softmax_matches_the_flop_counter(length, dim, dim_v):
    q, k = torch.randn(2, 3, length, dim), torch.randn(2, 3, length, dim)
    v = torch.randn(2, 3, length, dim_v)
    expected = 2 * 3 * attention_flops("softmax", length, dim, value_dim=dim_v)
    assert counted(ref.softmax_attention, q, k, v) == expected
    assert counted(ref.softmax_attention, q, k, v, causal=True) == expected  # causal counted in full


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length,chunk", [(64, 16), (50, 16), (10, 64)])
def test_linear_matches_the_flop_counter(causal, length, chunk):
    q, k, v = torch.randn(2, 2, length, 8), torch.randn(2, 2, length, 8), torch.randn(2, 2, length, 6)
    formula = attention_flops("linear", length, 8, value_dim=6, causal=causal, chunk_size=chunk)
    got = counted(linear_attention, q, k, v, causal=causal, chunk_size=chunk, impl="torch")
    assert got == 2 * 2 * formula


@pytest.mark.parametrize("backend", ["softmax", "linear"])
def test_model_counter_matches_the_flop_counter_on_a_layer(backend):
    """Projections (nn.Linear) plus the attention formula: the flop counter's total, forward."""
    layer = build_attention(backend, dim=32, num_heads=4)
    x = torch.randn(3, 20, 32)
    counter = FlopCounter().attach(layer)
    # the counter has no formula for SDPA's CPU kernel: the math path shows it its two matmuls
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = counted(layer, x)
    assert counter.forward_flops == expected and counter.training_flops() == 3 * expected
    counter.detach()
    layer(x)
    assert counter.forward_flops == expected  # no hooks left behind


def test_sliced_counts_grow_like_t_log_t_plus_t_d():
    small, large = (attention_flops("sliced_relu", t, 64) for t in (1024, 65536))
    assert 64 < large / small < 64 * 1.6  # T log T + T D: about linear in T
    assert attention_flops("softmax", 65536, 64) / large > 1e3
    with pytest.raises(ValueError, match="no FLOP formula for backend 'mine'"):
        attention_flops("mine", 8, 8)


def test_device_peaks():
    assert peak_flops("NVIDIA H200", "bfloat16") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "float16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops("Tesla V100-SXM2-16GB", "float16") == 125e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bfloat16") is None  # no bf16 on Volta
    assert peak_flops("NVIDIA GeForce GTX 1080", "float32") is None
    assert precision_dtype("bf16-mixed") == "bfloat16" and precision_dtype("16-mixed") == "float16"


def test_mfu_logged_in_a_short_cpu_run_with_a_given_peak(train_config, tmp_path):
    cfg = train_config(
        *TINY_LISTOPS,
        "logger=csv",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=2",
        "task.val_check_interval=4",
        "callbacks.throughput.warmup_steps=2",
        "callbacks.throughput.peak_flops=1e12",
        "test=false",
    )
    train(cfg)
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    mfu = [float(r["perf/mfu"]) for r in rows if r.get("perf/mfu")]
    tflops = [float(r["perf/train_tflops_per_sec"]) for r in rows if r.get("perf/train_tflops_per_sec")]
    assert mfu and tflops
    # the same figure twice: achieved FLOP/s over the given peak, and a CPU is far below 1e12
    assert all(0 < m < 1 for m in mfu)
    assert mfu[-1] == pytest.approx(tflops[-1] * 1e12 / 1e12, rel=1e-6)


def test_no_mfu_on_cpu_without_a_peak(train_config, tmp_path):
    cfg = train_config(*TINY_LISTOPS, "logger=csv", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
                       "callbacks.throughput.warmup_steps=1", "test=false")  # fmt: skip
    train(cfg)
    header = (tmp_path / "run" / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "perf/train_tflops_per_sec" in header and "perf/mfu" not in header


@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
@pytest.mark.parametrize(("rope", "causal"), [(False, False), (True, False), (True, True)])
def test_model_counter_counts_a_packed_batch_as_it_runs(backend, rope, causal):
    """Under packing the projections (folded or not) run on the packed rows, and so does attention
    (the segment-aware sliced ops, causal or not): the count is the matmuls torch sees plus the
    op's formula for the (B, L) rows."""
    layer = build_attention(backend, dim=32, num_heads=4, rope=rope, causal=causal, path="sorted")
    lengths = [12, 12, 10, 14, 8, 16, 12, 12, 6, 18]  # five rows of 24: 1.5x fewer slots than (10, 18)
    layout = PackedLayout.from_rows(lengths, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]], 24)
    x = torch.randn(5, 24, 32)
    assert layer.attends_packed(x, layout)
    counter = FlopCounter().attach(layer)
    seen = counted(layer, x, packing=layout)
    s, t, v = torch.randn(5, 4, 24), torch.randn(5, 4, 24), torch.randn(5, 4, 24, 8)
    in_op = counted(layer.attend_segments, s, t, v, layout.segments)  # the op's own matmuls, if any
    counter.reset()
    layer(x, packing=layout)
    op = 5 * 4 * attention_flops(backend, 24, 8, causal=causal)
    assert counter.forward_flops - op == pytest.approx(seen - in_op, rel=1e-12)


@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
def test_model_counter_counts_sequences_laid_out_alone_per_sequence(backend):
    """Rows that save too few slots (`ROWS_PAY_FROM`): the sequences are laid out alone and attention
    is priced on (N, M)."""
    layer = build_attention(backend, dim=32, num_heads=4, causal=True, path="sorted")
    lengths = [20, 7, 13, 20]
    layout = PackedLayout.from_rows(lengths, [[0], [1, 2], [3]], 20)  # 60 slots for 80 laid out
    x = torch.randn(3, 20, 32)
    assert not layer.attends_packed(x, layout)
    counter = FlopCounter().attach(layer)
    seen = counted(layer, x, packing=layout)
    s, t, v = torch.randn(4, 4, 20), torch.randn(4, 4, 20), torch.randn(4, 4, 20, 8)
    in_op = counted(layer.attend_scores, s, t, v, layout.mask)  # the masked op's own small matmuls
    counter.reset()
    layer(x, packing=layout)
    op = 4 * 4 * attention_flops(backend, 20, 8, causal=True)
    assert counter.forward_flops - op == pytest.approx(seen - in_op, rel=1e-12)


def test_bad_peak_is_named():
    from attnlab.callbacks.throughput import ThroughputMonitor

    with pytest.raises(
        ValueError, match="peak_flops must be a positive number of FLOP/s per device or null, got -1"
    ):
        ThroughputMonitor(peak_flops=-1)


@pytest.mark.parametrize("backend", ["sliced_relu", "sliced_relu_bump"])
@pytest.mark.parametrize("rope", [False, True])
def test_model_counter_counts_the_sliced_projections_folded_or_not(backend, rope):
    """The sliced layers run Π folded into the projection and call no Linear module for it
    (`SlicedAttentionLayer.fold`): the counter still counts the matmuls they run, folded or not."""
    layer = build_attention(backend, dim=32, num_heads=4, rope=rope, path="sorted")
    x = torch.randn(3 if backend == "sliced_relu" else 5, 20, 32)  # rotated fold: batch 5 > 4 heads
    assert layer.fold(x.shape[0]) == (
        None if rope and backend == "sliced_relu" else "rotated" if rope else "plain"
    )
    counter = FlopCounter().attach(layer)
    projections = counted(layer, x)  # the sorted op runs no matmul: these are the projections
    op = x.shape[0] * 4 * attention_flops(backend, 20, 8)
    assert counter.forward_flops - op == pytest.approx(projections, rel=1e-12)
