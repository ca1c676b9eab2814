"""Π of a decoding step's new token in one C++ call on the CPU (``mlp_scores`` in ``decode_kernels.cpp``).

A step maps one query and one key per sequence through Π. For the MLP Π (Linear, exact GELU, Linear)
torch runs three ops whose first, a matrix product of two rows with a 512 x 512 map, takes some 40 µs
on one core: longer than the rest of the step. The kernel reads the map once for all the rows (its
transpose, kept per layer until the weights change) and returns the scores. Where it does not apply
(another Π, dropout at work, gradients wanted, other devices or dtypes, many rows, a compiler
tracing), `scores` returns None and the caller runs Π itself.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from attnlab.attention.common import compiler, native

KERNELS = Path(__file__).with_name("decode_kernels.cpp")
_ARGTYPES = {"mlp_scores": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4}
#: above this many rows torch's matrix product reads the map at its own pace (a batch of sequences)
MAX_ROWS = 8


class _Maps(NamedTuple):
    """An MLP Π's maps as the kernel reads them (the first transposed), kept while the weights last."""

    key: tuple  # the parameters' versions and storage
    dtype: torch.dtype
    tensors: tuple[torch.Tensor, ...]
    pointers: list
    sizes: tuple[int, int, int]  # in, hidden, outs


# first Linear of an MLP Π -> its _Maps
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mlp_parts(slicer: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """The two maps of an MLP Π whose middle is an exact GELU (with an idle dropout after it), or None."""
    if not (isinstance(slicer, nn.Sequential) and len(slicer) == 3):
        return None
    first, act, last = slicer
    if isinstance(act, nn.Sequential):  # GELU then dropout (the layers' "projection" dropout site)
        if len(act) != 2 or not isinstance(act[1], nn.Dropout) or (act[1].training and act[1].p > 0):
            return None
        act = act[0]
    if not (isinstance(first, nn.Linear) and isinstance(last, nn.Linear) and isinstance(act, nn.GELU)):
        return None
    if act.approximate != "none" or first.bias is None or last.bias is None:
        return None
    return first, last


def _maps(first: nn.Linear, last: nn.Linear) -> _Maps | None:
    params = (first.weight, first.bias, last.weight, last.bias)
    if any(p.is_inference() for p in params):  # made under inference_mode: no version to tell changes by
        return None
    key = tuple((p._version, p.data_ptr()) for p in params)
    kept = _KEPT.get(first)
    if kept is not None and kept.key == key:
        return kept
    dtype = first.weight.dtype
    if any(p.dtype != dtype or p.device.type != "cpu" for p in params):
        return None
    tensors = (first.weight.detach().t().contiguous(), *(p.detach().contiguous() for p in params[1:]))
    kept = _Maps(key, dtype, tensors, [native.pointer(x) for x in tensors],
                 (first.in_features, first.out_features, last.out_features))  # fmt: skip
    _KEPT[first] = kept
    return kept


def scores(slicer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``slicer(x)`` for the rows ``x (rows, in)`` by the kernel, or None where it does not run."""
    parts = _mlp_parts(slicer)
    if parts is None or x.device.type != "cpu" or x.shape[0] > MAX_ROWS or compiler.compiling():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in slicer.parameters())):
        return None
    maps = _maps(*parts)
    found = None if maps is None or maps.dtype != x.dtype else native.kernels(KERNELS, x.dtype, _ARGTYPES)
    if found is None:
        return None
    x = x.contiguous()
    out = x.new_empty(x.shape[0], maps.sizes[2])
    found["mlp_scores"](native.pointer(x), *maps.pointers, native.pointer(out), x.shape[0], *maps.sizes)
    return out
