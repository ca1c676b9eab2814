"""Which evaluation of a sliced kernel runs (``path``): dense O(T²) or sorted O(T log T).

``path="dense"`` evaluates the kernel on all T×T pairs (``attnlab.attention.sliced.dense``),
``"sorted"`` runs the sorted ops (torch or Triton, as ``impl`` says), ``"auto"`` takes dense for
``T <= crossover`` and sorted above. Both give the same function to float rounding, outputs and
gradients; only speed and memory differ (dense keeps O(B·H·T²) for the backward).

The crossovers were measured, not guessed; each entry says with what. Where none was measured
(CUDA, where the Triton kernels run the sorted path) ``auto`` always takes the sorted path.
"""

from __future__ import annotations

import torch

from attnlab.attention.triton.runtime import IMPLS

PATHS = ("auto", "dense", "sorted")

# (op, device type, accumulation dtype) -> the longest T at which ``auto`` takes the dense path.
# op: "relu" / "bump" (bidirectional), "causal_relu" / "causal_bump". Half inputs accumulate in
# float32 and share its entry.
#
# CPU: the longest measured T at which dense fwd+bwd was at least as fast as sorted, at it and at
# every shorter T (best of 9 calls, twice; 2-core VM shared with other work, load average 2.1-4.3):
#   MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 attnlab bench attention --mode fwdbwd \
#     --backends sliced_relu_dense sliced_relu_sorted sliced_relu_bump_dense sliced_relu_bump_sorted \
#     sliced_relu_causal_dense sliced_relu_causal_sorted sliced_relu_bump_causal_dense \
#     sliced_relu_bump_causal_sorted --seq-lens 32 64 96 128 192 256 -B 32 --heads 2 --dim 32 \
#     --threads 1 --repeats 9 [--dtype float64]      (causal bump: also --seq-lens 256 384 512 768)
# float32, ms dense/sorted: relu 2.1/2.6 at T=64, 4.8/7.0 at 96, 7.4/5.1 at 128; bump 4.0/7.0 at 96,
# 9.7/8.7 at 128; causal relu 3.3/9.3 at 64, 14.4/9.3 at 96; causal bump 85/138 at 384, 193/197
# at 512. float64: relu 1.8/1.8 at 32, 4.6/2.9 at 64; bump 5.3/9.2 at 64, 8.7/8.7 at 96; causal
# relu 16.5/17.5 at 96, 29/26 at 128; causal bump 114/167 at 256 (longest measured).
# More rows (B·H) amortise the sorted path's per-call overhead and move the crossover down, most
# for sliced ReLU, so its entry is the one measured at B=128 (ViT's batch; same command, -B 128,
# interleaved, best of 12, load 2.7-2.8): relu 9.7/9.6 at T=64, 14.0/9.4 at 65, 18.9/13.7 at 96
# (at B=8: 1.8/1.7 at 96). After the dense op's cheaper tie check (one min over |s - t|), same command,
# --seq-lens 64 65 72 80, --repeats 12, load 1.7-1.9, twice: 16.6/16.6 and 13.7/14.0 at 64, 14.4/14.5
# and 14.3/14.0 at 65, 16.5/19.9 and 16.8/16.6 at 72, 19.5/17.7 and 20.2/17.9 at 80: within 2% up to 72,
# so the entry stays 64; bump 10.7/17.0 at 64, 14.9/28.5 at 96, 69/40 at 128.
# The bidirectional bump entries were measured again once its dense backward was written out
# (``dense._DenseBump``; same command, bump rows only, --repeats 9, load 3.6-3.7), float32 at B=32:
# 1.5/4.3 at 64, 3.1/6.1 at 96, 5.5/7.6 at 128, 11.4/12.3 at 192, 21.9/18.4 at 256; at B=128: 7.0/16.9
# at 64, 23.5/35.9 at 128, 52/54 at 192, 89/79 at 256. Its entry is 128, not 192: at 192 dense was only
# 3-8 % faster and held three times the memory. float64, B=32: 3.8/10.3 at 64, 7.4/7.4 at 96,
# 14.0/11.3 at 128.
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


def crossover(op: str, device: torch.device, dtype: torch.dtype) -> int:
    """The longest T at which ``path="auto"`` runs ``op`` densely on ``device`` (0: never)."""
    return CROSSOVER.get((op, device.type, dtype), 0)


def choose_path(name: str, op: str, path: str, impl: str, length: int, device, dtype) -> str:
    """``"dense"`` or ``"sorted"`` for a call of the public op ``name`` (checked here, one line each).

    ``impl="triton"`` asks for the Triton kernels, which are sorted: ``auto`` then runs them and
    ``dense`` is refused.
    """
    if path not in PATHS:
        raise ValueError(f"{name}: path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if path == "dense" and impl == "triton":
        raise ValueError(
            f"{name}: path='dense' runs torch ops, impl='triton' the sorted Triton kernels; "
            "use impl='auto' or impl='torch' with path='dense'"
        )
    if path != "auto":
        return path
    if impl == "triton":
        return "sorted"
    return "dense" if length <= crossover(op, torch.device(device), dtype) else "sorted"
