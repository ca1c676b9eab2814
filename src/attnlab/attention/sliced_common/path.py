"""Which evaluation of a sliced kernel runs (``path``): dense O(T²) or sorted O(T log T).

``path="dense"`` evaluates the kernel on all T×T pairs (``attnlab.attention.sliced_common.dense``),
``"sorted"`` runs the sorted ops (torch or Triton, as ``impl`` says), ``"auto"`` takes dense for
``T <= crossover`` and sorted above: the dense implementations declare the crossover as the length
range ``auto`` takes them in, and ``DENSE_MAX_LENGTH`` as the one they run at all
(``attnlab.attention.common.dispatch``). Both give the same function to float rounding, outputs and
gradients; only speed and memory differ (dense keeps O(B·H·T²) for the backward).

The crossovers were measured, not guessed (docs/benchmarks.md has the runs). Where none was measured
(CUDA, where the Triton kernels run the sorted path) ``auto`` always takes the sorted path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnlab.attention.common import native
from attnlab.attention.common.dispatch import PATHS

#: the longest T the dense path runs, whatever ``path`` says: it holds several (T × T) tensors per
#: (batch, head) row, over 1 GiB each in float32 beyond Path-X's 16,384 tokens (the longest task)
DENSE_MAX_LENGTH = 16384

# (op, device type, accumulation dtype) -> the longest T at which ``auto`` takes the dense path.
# op: "relu" / "bump" (bidirectional), "causal_relu" / "causal_bump". Half inputs accumulate in
# float32 and share its entry. Each entry is the longest measured T at which dense fwd+bwd was at least
# as fast as sorted, at it and every shorter T (docs/benchmarks.md, "CPU: dense or sorted").
CROSSOVER: dict[tuple[str, str, torch.dtype], int] = {
    ("relu", "cpu", torch.float32): 64,
    ("bump", "cpu", torch.float32): 128,
    ("causal_relu", "cpu", torch.float32): 64,
    ("causal_bump", "cpu", torch.float32): 384,
    ("relu", "cpu", torch.float64): 32,
    ("bump", "cpu", torch.float64): 96,
    ("causal_relu", "cpu", torch.float64): 96,
    ("causal_bump", "cpu", torch.float64): 256,
}


def check_path(path: str) -> str:
    """``path`` itself, or a one-line ValueError naming the allowed values (the layers' option)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
    return path


# The same where the sorted ops run C++ kernels on the CPU (``attnlab.attention.common.native``): once
# built, they overtake the dense path at shorter lengths (sliced ReLU in float64: at every length
# measured, from 8). The causal ops' kernels are the dominance sums both share.
# Without a compiler (or with ATTNLAB_NATIVE=off) the torch code runs, and CROSSOVER applies.
KERNEL_CROSSOVER: dict[tuple[str, str, torch.dtype], int] = {
    ("relu", "cpu", torch.float32): 32,
    ("relu", "cpu", torch.float64): 0,
    ("bump", "cpu", torch.float32): 112,
    ("bump", "cpu", torch.float64): 16,
    ("causal_relu", "cpu", torch.float32): 64,
    ("causal_relu", "cpu", torch.float64): 32,
    ("causal_bump", "cpu", torch.float32): 192,
    ("causal_bump", "cpu", torch.float64): 96,
}
_HERE = Path(__file__).parent
KERNEL_SOURCES = {
    "relu": _HERE.parent / "sliced_relu" / "cpu_kernels.cpp",
    "bump": _HERE.parent / "sliced_relu_bump" / "cpu_kernels.cpp",
    "causal_relu": _HERE / "dominance_kernels.cpp",
    "causal_bump": _HERE / "dominance_kernels.cpp",
}


# the same as strings: ``str(path)`` runs pathlib code that torch.compile cannot trace (a graph break
# in every layer call, and a new graph for each length)
_KERNEL_FILES = {op: str(source) for op, source in KERNEL_SOURCES.items()}


def crossover(op: str, device: torch.device | str, dtype: torch.dtype) -> int:
    """The longest T at which ``path="auto"`` runs ``op`` densely on ``device`` (a device or its
    type; 0: never)."""
    key = (op, torch.device(device).type, dtype)
    if key in KERNEL_CROSSOVER and native.built(_KERNEL_FILES[op]):
        return KERNEL_CROSSOVER[key]
    return CROSSOVER.get(key, 0)
