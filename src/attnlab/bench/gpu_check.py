"""`make bench-gpu`'s first step: every Triton op checked on the device before anything is timed.

``python -m attnlab.cli.gpu_check OUT --backend NAME`` (`run`) runs one Triton backend's op on small random
cases (odd lengths, a padded row, one and two blocks of the head dim, every dtype) through the
Triton kernels and the torch code, forward and backward, each against the torch op in float64
(``selfcheck.compare``), and at the shortest length the float64 torch op against the O(T²)
definition (``attnlab.attention.reference``). It writes ``OUT/check/<backend>.json`` and prints one
line per case; the exit code is 1 when any case fails, so the caller leaves that backend out of the
timings. One backend per process: an illegal memory access is sticky in CUDA and would fail every
later call of the process, so a faulty kernel must not take the other backends' checks with it.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: (T, head dim, padded): one tile and many, one and two blocks of D, a row padded to 3/4
CASES = {
    "sliced_relu": [(777, 64, True), (4099, 64, True), (2500, 80, False)],
    "sliced_relu_bump": [(777, 64, True), (4099, 64, True), (2500, 80, False)],
    "linear_causal": [(777, 32, True), (4099, 64, True), (2500, 64, False)],
}
BACKENDS = tuple(CASES)
#: the O(T²) float64 definition is checked at this length and below (it holds T² per row)
DENSE_UP_TO = 1024


def _op(backend: str):
    """``(op, reference, extra keywords)`` of a backend: the public op and its O(T²) definition."""
    from attnlab.attention import ops, reference

    if backend == "linear_causal":
        return ops.linear_attention, reference.linear_attention, {"causal": True}
    if backend == "sliced_relu_bump":
        return ops.sliced_relu_bump_attention, reference.sliced_relu_bump_attention, {"path": "sorted"}
    return ops.sliced_relu_attention, reference.sliced_relu_attention, {"path": "sorted"}


def check_backend(backend: str, dtypes: list[str], seed: int = 0, device: str = "cuda") -> list[dict]:
    """One row per (dtype, case): the errors of both implementations and the verdict. A CUDA error
    ends the checks (it is sticky: every later call of the process would fail too)."""
    from attnlab.attention.common.triton.selfcheck import compare, random_case

    op, definition, keywords = _op(backend)
    rows = []
    for dtype_name in dtypes:
        for length, dim, padded in CASES[backend]:
            row = {"backend": backend, "dtype": dtype_name, "seq_len": length, "dim": dim, "padded": padded}
            rows.append(row)
            start = time.perf_counter()
            try:
                kind = {"linear_causal": "qkv", "sliced_relu_bump": "bump"}.get(backend, "scores")
                inputs, mask = random_case(kind, 2, 4, length, dim, DTYPES[dtype_name], device, padded, seed)
                kw = {"key_padding_mask": mask, **keywords}
                fast, plain = (functools.partial(op, impl=impl) for impl in ("triton", "torch"))
                result = compare(fast, plain, inputs, seed=seed, **kw)
                row.update(ok=result.ok, triton_err=result.triton_err, torch_err=result.torch_err)
                row["worst"] = result.what
                if length <= DENSE_UP_TO:
                    wide = [x.double() for x in inputs]
                    causal = {k: v for k, v in kw.items() if k == "causal"}
                    exact = definition(*wide, key_padding_mask=mask, **causal)
                    ours = op(*wide, impl="torch", **kw)
                    row["float64_vs_definition"] = ((ours - exact).norm() / exact.norm()).item()
                    row["ok"] = row["ok"] and row["float64_vs_definition"] < 1e-9
            except Exception as err:  # noqa: BLE001 - a failed case is a row, the rest still run
                row.update(ok=False, error=f"{type(err).__name__}: {str(err).strip()[:300]}")
                if isinstance(err, torch.AcceleratorError) or "CUDA error" in str(err):
                    return rows
            row["seconds"] = round(time.perf_counter() - start, 2)
    return rows


def case_line(row: dict) -> str:
    """One printed line per case: the verdict and both implementations' errors."""
    case = f"{row['backend']:<18}{row['dtype']:>9}  T={row['seq_len']:<5} D={row['dim']:<3}"
    case += " padded" if row["padded"] else "       "
    if "error" in row:
        return f"{case}  FAIL  {row['error']}"
    verdict = "ok  " if row["ok"] else "FAIL"
    text = f"{case}  {verdict}  triton {row['triton_err']:.1e}  torch {row['torch_err']:.1e}"
    if "float64_vs_definition" in row:
        text += f"  float64 op vs definition {row['float64_vs_definition']:.1e}"
    return text + ("" if row["ok"] else f"  (worst: {row['worst']})")


def run(out: Path, backend: str, dtypes: list[str], device: str = "cuda") -> int:
    """Check ``backend``, print one line per case and write ``out/check/<backend>.json``; 1 when a
    case failed (the caller then leaves the backend out of the timings), else 0."""
    result = out / "check" / f"{backend}.json"
    result.unlink(missing_ok=True)  # a check that dies leaves no earlier verdict behind
    rows = check_backend(backend, dtypes, device=device)
    for row in rows:
        print(case_line(row), flush=True)
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(rows, indent=2) + "\n")
    failed = [r for r in rows if not r["ok"]]
    if failed:
        print(f"gpu_check: {backend} failed {len(failed)} of {len(rows)} cases: left out of the timings")
    return 1 if failed else 0
