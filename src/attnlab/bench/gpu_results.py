"""`make bench-gpu`'s first and last steps: the GPU's copy bandwidth, then one results file and summary.

``python -m attnlab.cli.gpu_results probe OUT`` records the GPU's name, the versions and the bandwidth
of a device-to-device copy (the practical peak a memory-bound kernel can reach; a datasheet figure is
not what the memory system delivers) in ``OUT/gpu.json``. ``... collect OUT`` reads what the steps of
the check wrote (``OUT/ops_<dtype>/bench_attention.csv``, ``OUT/train/<task>/<attn>/csv/metrics.csv``),
puts every figure into ``OUT/results.json`` and prints one summary: per op and length the time, the
byte floor (``attnlab bench bytes``: each input, output and gradient once), the bandwidth that floor
implies at that time and its fraction of the copy bandwidth; then training throughput.
"""

from __future__ import annotations

import csv
import json
import time
from functools import cache
from pathlib import Path

TRAIN_KEYS = {
    "samples_per_sec": "perf/train_samples_per_sec",
    "tflops_per_sec": "perf/train_tflops_per_sec",
    "mfu": "perf/mfu",
    "step_ms": "perf/step_ms",
    "peak_mem_mb": "perf/peak_mem_mb",
}


def copy_bandwidth_gbps(nbytes: int = 2**30, repeats: int = 10) -> float:
    """Best GB/s (1e9 bytes/s, read + write) of copying ``nbytes`` between two CUDA buffers."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def probe(out: Path) -> dict:
    import torch

    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_gbps": round(copy_bandwidth_gbps(), 1),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def probe_line(info: dict) -> str:
    """The GPU, the versions and the copy bandwidth in one printed line."""
    versions = f"torch {info['torch']} | CUDA {info['cuda']} | Triton {info['triton']}"
    return f"GPU: {info['gpu']} | {versions} | copy {info['copy_gbps']} GB/s"


@cache
def floor_bytes_at(
    backend: str, batch: int, heads: int, length: int, dim: int, dtype: str, backward: bool
) -> int:
    """The byte floor of ``backend`` at this shape, from ``attnlab bench bytes``'s own floor.

    Every tensor of these ops is proportional to T except per-head constants, so the floor is
    affine in T: measured on real (CPU) inputs at T = 16 and 32 and extended, never materialising
    the GPU-sized tensors here.
    """
    import argparse

    from attnlab.bench.bytes_moved import BYTE_BACKENDS, floor_bytes, op_and_inputs

    name = backend if backend in BYTE_BACKENDS else None
    if name is None:
        raise KeyError(backend)
    args = argparse.Namespace(batch=batch, heads=heads, dim=dim, dtype=dtype, seed=0)
    floors = []
    for t in (16, 32):
        _, inputs = op_and_inputs(name, args, t)
        out = inputs[2].detach()  # every op's output has v's shape and dtype
        floors.append(floor_bytes(inputs, out, backward))
    return floors[0] + (floors[1] - floors[0]) * (length - 16) // 16


def _floor_name(backend: str) -> str | None:
    """The ``bench bytes`` backend with the same tensors (torch and Triton code move the same floor)."""
    from attnlab.bench.bytes_moved import BYTE_BACKENDS

    base = backend.removesuffix("_torch")
    return base if base in BYTE_BACKENDS else None


def op_rows(out: Path, copy_gbps: float | None) -> list[dict]:
    rows = []
    # one backend per folder (ops_<dtype>/<backend>/), or every backend of a dtype in one
    for path in sorted([*out.glob("ops_*/bench_attention.csv"), *out.glob("ops_*/*/bench_attention.csv")]):
        for row in csv.DictReader(path.open()):
            entry = {k: row[k] for k in ("backend", "mode", "dtype", "status", "note")}
            entry.update(seq_len=int(row["seq_len"]), batch=int(row["batch"]), heads=int(row["heads"]))
            entry.update(
                dim=int(row["dim"]), time_ms=_number(row["time_ms"]), peak_mem_mb=_number(row["peak_mem_mb"])
            )
            name = _floor_name(entry["backend"])
            if name is not None and entry["status"] == "ok" and entry["time_ms"]:
                floor = floor_bytes_at(name, entry["batch"], entry["heads"], entry["seq_len"], entry["dim"],
                                       entry["dtype"], entry["mode"] == "fwdbwd")  # fmt: skip
                entry["floor_mb"] = round(floor / 1e6, 2)
                entry["floor_gbps"] = round(floor / (entry["time_ms"] / 1e3) / 1e9, 1)
                if copy_gbps:
                    entry["of_copy_bandwidth"] = round(entry["floor_gbps"] / copy_gbps, 3)
            rows.append(entry)
    return rows


def check_rows(out: Path) -> list[dict]:
    """The correctness pass's rows (``gpu_check``: one file per Triton op)."""
    rows = []
    for path in sorted(out.glob("check/*.json")):
        rows.extend(json.loads(path.read_text()))
    return rows


def train_rows(out: Path) -> list[dict]:
    """One row per training run the check started (its log ``train/<task>/<attn>.log``) or that left
    metrics: a run stopped or failed before logging throughput is listed as ``failed`` with its
    log's last line, not left out."""
    runs = {(p.parent.name, p.stem) for p in out.glob("train/*/*.log")}
    runs |= {(p.parts[-4], p.parts[-3]) for p in out.glob("train/*/*/csv/metrics.csv")}
    rows = []
    for task, attn in sorted(runs):
        metrics = out / "train" / task / attn / "csv" / "metrics.csv"
        logged = []
        if metrics.exists():
            logged = [r for r in csv.DictReader(metrics.open()) if r.get(TRAIN_KEYS["samples_per_sec"])]
        entry = {"task": task, "attn": attn, "status": "ok" if logged else "failed"}
        if logged:
            entry.update({key: _number(logged[-1].get(column, "")) for key, column in TRAIN_KEYS.items()})
        else:
            log = out / "train" / task / f"{attn}.log"
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            entry["note"] = lines[-1][:200] if lines else "no output"
        rows.append(entry)
    return rows


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def collect(out: Path) -> dict:
    gpu_file = out / "gpu.json"
    gpu = json.loads(gpu_file.read_text()) if gpu_file.exists() else {}
    results = {
        "gpu": gpu,
        "checks": check_rows(out),
        "ops": op_rows(out, gpu.get("copy_gbps")),
        "training": train_rows(out),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_summary(results: dict, out: Path) -> None:
    gpu = results["gpu"]
    print(f"\n== {gpu.get('gpu', 'GPU ?')}: device copy {gpu.get('copy_gbps', '?')} GB/s ==")
    checks = results.get("checks", [])
    failed = [r for r in checks if not r.get("ok")]
    ops = sorted({r["backend"] for r in checks})
    agree = f"{len(checks) - len(failed)} of {len(checks)} cases agree"
    print(f"correctness: {agree} ({', '.join(ops) or 'none run'})")
    for r in failed:
        reason = r.get("error") or f"relative error {r.get('triton_err')} (torch {r.get('torch_err')})"
        print(f"  FAILED {r['backend']} {r['dtype']} T={r['seq_len']} D={r['dim']}: {reason}")
    print(
        f"{'op':<26}{'dtype':>9}{'T':>7}{'ms':>10}{'peak MiB':>10}{'floor MB':>10}{'GB/s':>8}{'of copy':>9}"
    )
    for r in results["ops"]:
        if r["status"] != "ok":
            print(f"{r['backend']:<26}{r['dtype']:>9}{r['seq_len']:>7}{r['status']:>10}  {r['note']}")
            continue
        print(
            f"{r['backend']:<26}{r['dtype']:>9}{r['seq_len']:>7}{_cell(r['time_ms'], '.2f'):>10}"
            f"{_cell(r['peak_mem_mb'], '.0f'):>10}{_cell(r.get('floor_mb'), '.1f'):>10}"
            f"{_cell(r.get('floor_gbps'), '.0f'):>8}{_cell(r.get('of_copy_bandwidth'), '.0%'):>9}"
        )
    print(
        f"\n{'task':<10}{'attn':<14}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'step ms':>9}{'peak MiB':>10}"
    )
    for r in results["training"]:
        if r["status"] != "ok":
            print(f"{r['task']:<10}{r['attn']:<14}{'failed':>11}  {r.get('note', '')}")
            continue
        print(
            f"{r['task']:<10}{r['attn']:<14}{_cell(r['samples_per_sec'], '.1f'):>11}"
            f"{_cell(r['tflops_per_sec'], '.2f'):>9}{_cell(r['mfu'], '.3f'):>7}"
            f"{_cell(r['step_ms'], '.1f'):>9}{_cell(r['peak_mem_mb'], '.0f'):>10}"
        )
    print(f"\nevery figure: {out / 'results.json'}")
