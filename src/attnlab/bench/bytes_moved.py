"""``attnlab bench bytes``: the bytes an attention op moves, against the least it could move.

A GPU kernel at long lengths is bound by memory traffic, so the figure that predicts its speed is
bytes moved, and that can be measured without a GPU. Each backend runs forward + backward (or
forward only) once on CPU tensors of shape (B, H, T, D); the Triton backends run their kernels
under Triton's interpreter (set here, ``TRITON_INTERPRET=1``), and every torch op and every kernel
launch is charged what it reads and writes (``attnlab.bench.byte_count`` says exactly how).

The **floor** is what any implementation must move: forward reads each input once and writes the
output once; backward reads each input and the output gradient once and writes each input's
gradient once (for sliced ReLU: v, s, t in, o out; v, s, t, do in, dv, ds, dt out; about 5 passes
over v). The table prints per backend the bytes, the floor, their ratio, the launches (Triton
kernels, torch ops), the ratio counted in whole 32-byte sectors (``sectors``: what gathers of
scattered small numbers cost a GPU) and the largest contributors (``--detail`` lists all).
``<out-dir>/bench_bytes.csv`` has one row per backend and contributor. Triton backends:
sliced_relu, sliced_relu_bump, linear_causal; ``*_torch`` run the torch code of the same ops.
Counts, not timings: a busy machine does not change them.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
from pathlib import Path

import torch

from attnlab.bench.backends import BACKENDS, op
from attnlab.bench.byte_count import count_bytes, tensor_bytes

#: backend -> (name in ``attnlab bench attention``, keywords forcing the code measured)
BYTE_BACKENDS: dict[str, tuple[str, dict]] = {
    "softmax": ("softmax", {}),
    "sliced_relu": ("sliced_relu", {"impl": "triton", "path": "sorted"}),
    "sliced_relu_bump": ("sliced_relu_bump", {"impl": "triton", "path": "sorted"}),
    "linear": ("linear", {}),
    "linear_causal": ("linear_causal", {"impl": "triton"}),
    "sliced_relu_torch": ("sliced_relu", {"impl": "torch", "path": "sorted"}),
    "sliced_relu_bump_torch": ("sliced_relu_bump", {"impl": "torch", "path": "sorted"}),
    "linear_causal_torch": ("linear_causal_torch", {}),
}
DEFAULT_BACKENDS = ["softmax", "sliced_relu", "sliced_relu_bump", "linear_causal"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CSV_NAME = "bench_bytes.csv"


def op_and_inputs(backend: str, args: argparse.Namespace, length: int):
    """The op (with its forced keywords) and fresh inputs, every float input requiring grad."""
    name, keywords = BYTE_BACKENDS[backend]
    op_name, make_inputs = BACKENDS[name]
    generator = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    inputs = make_inputs(args.batch, args.heads, length, args.dim, dtype, torch.device("cpu"), generator)
    for x in inputs:
        if x.is_floating_point() and x.dtype == dtype:
            x.requires_grad_(True)
    return functools.partial(op(op_name), **keywords), inputs


def floor_bytes(inputs: list[torch.Tensor], out: torch.Tensor, backward: bool) -> int:
    """Each input and the output once forward; backward each input, the output gradient and each
    input's gradient once (see the module docstring)."""
    forward = sum(map(tensor_bytes, inputs)) + tensor_bytes(out)
    if not backward:
        return forward
    trained = [x for x in inputs if x.requires_grad]
    return forward + sum(map(tensor_bytes, inputs)) + tensor_bytes(out) + sum(map(tensor_bytes, trained))


def measure(backend: str, args: argparse.Namespace, length: int) -> dict:
    """One backend at one length: its traffic rows and the floor."""
    measured_op, inputs = op_and_inputs(backend, args, length)
    grad_out = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(1)).to(inputs[2].dtype)
    backward = args.mode == "fwdbwd"
    outputs = []

    def run() -> None:
        if backward:
            out = measured_op(*inputs)
            out.backward(grad_out)
        else:
            with torch.no_grad():
                out = measured_op(*inputs)
        outputs.append(out)

    rows = count_bytes(run)
    floor = floor_bytes(inputs, outputs[0], backward)
    total = sum(r.total for r in rows)
    return {
        "backend": backend,
        "seq_len": length,
        "bytes": total,
        "floor": floor,
        "ratio": total / floor,
        "sector_ratio": sum(r.sectors for r in rows) / floor,
        "kernel_launches": sum(r.calls for r in rows if r.kind == "triton"),
        "torch_ops": sum(r.calls for r in rows if r.kind == "torch"),
        "rows": rows,
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def run(args: argparse.Namespace) -> list[dict]:
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels as the interpreter runs them, on these CPU tensors
    shape = f"B={args.batch} H={args.heads} D={args.dim} {args.dtype}"
    print(f"bytes moved, {args.mode}, {shape} (MB = 1e6 bytes)")
    columns = ("MB", "floor MB", "ratio", "kernels", "torch ops", "sectors")
    print(f"{'backend':<24}{'T':>7}" + "".join(f"{c:>11}" for c in columns) + "  largest")
    results = []
    for length in args.seq_lens:
        for backend in args.backends:
            result = measure(backend, args, length)
            results.append(result)
            largest = ", ".join(f"{r.name} {r.total / result['floor']:.2f}" for r in result["rows"][:3])
            print(
                f"{backend:<24}{length:>7}{_mb(result['bytes']):>11}{_mb(result['floor']):>11}"
                f"{result['ratio']:>11.2f}{result['kernel_launches']:>11}{result['torch_ops']:>11}"
                f"{result['sector_ratio']:>11.2f}  {largest}"
            )
            if args.detail:
                for r in result["rows"]:
                    moved = (
                        f"{_mb(r.read):>11} read{_mb(r.written):>11} written{_mb(r.sectors):>11} in sectors"
                    )
                    print(f"    {r.kind:<7}{r.name:<36}{r.calls:>5} calls{moved}")
    write_csv(results, args.out_dir / CSV_NAME)
    print(f"wrote {args.out_dir / CSV_NAME}")
    return results


def write_csv(results: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["backend", "seq_len", "kind", "name", "calls", "read", "written", "floor", "sectors"]
        )
        for result in results:
            common = [result["backend"], result["seq_len"]]
            sectors = sum(r.sectors for r in result["rows"])
            writer.writerow([*common, "total", "", result["kernel_launches"] + result["torch_ops"],
                             "", result["bytes"], result["floor"], sectors])  # fmt: skip
            for r in result["rows"]:
                writer.writerow([*common, r.kind, r.name, r.calls, r.read, r.written, "", r.sectors])
