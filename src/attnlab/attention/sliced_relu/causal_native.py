"""Causal sliced ReLU's element-wise work around its dominance sums, in C++ on the CPU
(``causal_kernels.cpp``): one pass forward, two backward, where the torch code makes a dozen passes
over (T, D) memory each way. Each function takes the torch code's tensors and returns what it computes
from them; `kernels` says whether they run (the CPU, float32/float64, a compiler; the torch code
otherwise, and on packed rows, whose running sums restart at every segment)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from attnlab.attention.common import native

SOURCE = Path(__file__).with_name("causal_kernels.cpp")
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_ARGTYPES = {
    "causal_relu_forward": [_P] * 8 + [_D] + [_P] * 4 + [_I] * 5,
    "causal_relu_backward_queries": [_P] * 9 + [_D] + [_P] * 4 + [_I] * 5,
    "causal_relu_backward_keys": [_P] * 14 + [_I] * 5,
}


def kernels(v: torch.Tensor) -> dict | None:
    return native.cpu_kernels(v, SOURCE, _ARGTYPES)


def forward(found, s, t, v, real, sums, eps: float):
    """``out (N, T, D)`` and the per-query ``den``, ReLU mass and ``n`` (real keys j <= i, at least 1)
    from the scores, the centred values and the sums ``(A, B, C, E)``."""
    out = torch.empty_like(v)
    den, mass, n_safe = (torch.empty_like(s) for _ in range(3))
    arrays = (s, t, v, real, *sums, float(eps), out, den, mass, n_safe)
    native.call_rows(found["causal_relu_forward"], arrays, v.shape)
    return out, den, mass, n_safe


def backward_queries(found, g, out, v, real, sum_v, den, count, count_le, n_safe, eps: float):
    """``(a_scale, grad_den, a_vbar, grad_s)`` per query (``causal_kernels.cpp``)."""
    results = [torch.empty_like(den) for _ in range(4)]
    arrays = (g, out, v, real, sum_v, den, count, count_le, n_safe, float(eps), *results)
    native.call_rows(found["causal_relu_backward_queries"], arrays, v.shape)
    return results


def backward_keys(found, g, v, t, real, sum_a, sum_sa, a_scale, mass, n_safe, grad_den, den_above,
                  at_or_above, vbar_a_above):  # fmt: skip
    """``(grad_v, grad_t)``; grad_v is written over ``sum_sa``."""
    grad_t = torch.empty_like(t)
    arrays = (g, v, t, real, sum_a, sum_sa, a_scale, mass, n_safe, grad_den, den_above, at_or_above,
              vbar_a_above, grad_t)  # fmt: skip
    native.call_rows(found["causal_relu_backward_keys"], arrays, v.shape)
    return sum_sa, grad_t
