"""What the two public sliced ops share around their implementations: the declarations of the dense
and the Triton implementations (the same limits for both families), the Triton launch with its
first-use check, results back in v's layout, and empty batches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnlab.attention.common.dispatch import Implementation, Request
from attnlab.attention.common.triton import runtime, selfcheck
from attnlab.attention.sliced_common.path import DENSE_MAX_LENGTH, crossover

#: the sorted ops' cost (time, memory), bidirectional and causal
SORTED_COST = "O(T log T) time, O(T·D) memory"
CAUSAL_COST = "O(T log² T) time, O(T·D) memory"


def like_v(rows: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An op's (B·H, T, D) rows back in v's layout and dtype."""
    return rows.view(v.shape).to(v.dtype)


def empty_batch(v: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """B, H or D = 0 (nothing to sort or reduce over, which the ops' reshapes cannot take): the
    empty output, still in the graph of every input, whose gradients come back empty (or zero)."""
    return v * 0 + sum(x.sum() for x in inputs) * 0


def dense(kind: str, run: Callable) -> Implementation:
    """The dense O(T²) evaluation of ``kind`` ("relu" or "bump"): any device and dtype, both forms;
    ``path="auto"`` takes it up to the measured crossover (``attnlab.attention.sliced_common.path``)."""

    def auto_length(request: Request) -> int:
        return crossover(("causal_" if request.causal else "") + kind, request.device_type, request.dtype)

    return Implementation(
        "dense",
        "O(T²) time and memory",
        run,
        path="dense",
        max_length=DENSE_MAX_LENGTH,
        auto_length=auto_length,
        notes={"length": "it holds T×T numbers per row"},
        traceable=True,
    )


def triton(run: Callable) -> Implementation:
    """The sorted Triton kernels: CUDA tensors (CPU ones under the interpreter), bidirectional only,
    float32 accumulation on CUDA (float64 in the interpreter, which the exactness tests use)."""
    return Implementation(
        "triton",
        "O(T log T) time, O(T·D) memory, fused",
        run,
        impl="triton",
        path="sorted",
        devices=("cuda",),
        dtypes_on={"cuda": (torch.float32,)},
        causal=(False,),
        interpreted=True,
        available=lambda r: runtime.triton_problem(r.op, r.impl, r.device, cuda=r.device_type == "cuda"),
        notes={
            # the ReLU-bump key walk spills 4-13 KB of stack per thread in float64 (sm_70-90), and
            # fp64 units are a fraction of the GPU: the torch op is the better float64 path
            "dtype": "its float64 key walk spills kilobytes of stack; the torch op runs float64 on the GPU",
            "causal": "no causal Triton kernel yet",
        },
    )


def launch_triton(op: str, impl: str, v: torch.Tensor, call, case) -> torch.Tensor | None:
    """``call()`` (the Triton launcher) under ``impl``; None when ``auto`` finds that the kernels
    cannot build here (``runtime.launch`` has warned) or fail their first-use check against the
    torch code (``selfcheck`` has warned): the torch code then runs."""
    check = lambda: selfcheck.trusted(op, v.device, v.dtype, lambda: case(v))  # noqa: E731
    return runtime.launch(op, impl, v.device, call, check=check)
