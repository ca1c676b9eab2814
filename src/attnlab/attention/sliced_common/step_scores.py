"""Π of a decoding step's new token in one C++ call on the CPU (``mlp_scores`` in ``decode_kernels.cpp``).

A step maps one query and one key per sequence through Π. For the MLP Π (Linear, exact GELU, Linear)
torch runs three ops whose first, a matrix product of two rows with a 512 x 512 map, takes some 40 µs
on one core: longer than the rest of the step. The kernel reads the map once for all the rows, from
its transpose. The transpose is made once per decoding state (a generation) and kept with it, so
weights changed between generations are always read afresh; within one, a change through autograd
(an optimiser step, ``load_state_dict``) is noticed by the parameters' version counters. Where the
kernel does not apply (another Π, hooks, dropout at work, gradients wanted, autocast, other devices
or dtypes, many rows, a compiler tracing, no state to keep the transpose with), `scores` returns
None and the caller runs Π itself.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from attnlab.attention.common import compiler, native

KERNELS = Path(__file__).with_name("decode_kernels.cpp")
_ARGTYPES = {"mlp_scores": [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4}
#: above this many rows torch's matrix product reads the map at its own pace (a batch of sequences)
MAX_ROWS = 8


class Maps(NamedTuple):
    """An MLP Π's maps as the kernel reads them (the first transposed), for one decoding state."""

    key: tuple  # the Linear modules, and their parameters' versions and storage
    tensors: tuple[torch.Tensor, ...]
    pointers: list
    sizes: tuple[int, int, int]  # in, hidden, outs


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _mlp_parts(slicer: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """The two maps of an MLP Π whose middle is an exact GELU (with an idle dropout after it), exactly
    these module types and without hooks (what the kernel computes is their plain forward), or None."""
    if type(slicer) is not nn.Sequential or len(slicer) != 3:
        return None
    first, act, last = slicer
    parts = [slicer, first, act, last]
    if type(act) is nn.Sequential:  # GELU then dropout (the layers' "projection" dropout site)
        if len(act) != 2 or type(act[1]) is not nn.Dropout or (act[1].training and act[1].p > 0):
            return None
        parts += [act[0], act[1]]
        act = act[0]
    if type(first) is not nn.Linear or type(last) is not nn.Linear or type(act) is not nn.GELU:
        return None
    if act.approximate != "none" or first.bias is None or last.bias is None:
        return None
    if any(map(_hooked, parts)) or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return None
    return first, last


def _maps(first: nn.Linear, last: nn.Linear, holder) -> Maps | None:
    params = (first.weight, first.bias, last.weight, last.bias)
    if any(p.is_inference() for p in params):  # made under inference_mode: no version counter
        return None
    key = (first, last, *((p._version, p.data_ptr()) for p in params))
    kept = getattr(holder, "mlp_maps", None)
    if kept is not None and kept.key == key:
        return kept
    dtype = first.weight.dtype
    if (
        any(p.dtype != dtype or p.device.type != "cpu" for p in params)
        or last.in_features != first.out_features
    ):
        return None
    tensors = (first.weight.detach().t().contiguous(), *(p.detach().contiguous() for p in params[1:]))
    kept = Maps(key, tensors, [native.pointer(x) for x in tensors],
                (first.in_features, first.out_features, last.out_features))  # fmt: skip
    holder.mlp_maps = kept
    return kept


def scores(slicer: nn.Module, x: torch.Tensor, holder) -> torch.Tensor | None:
    """``slicer(x)`` for the rows ``x (rows, in)`` by the kernel, the transposed map kept on ``holder``
    (a decoding state, None before the first token), or None where the kernel does not run."""
    if holder is None or x.device.type != "cpu" or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return None
    parts = _mlp_parts(slicer)
    if parts is None or compiler.compiling() or torch.is_autocast_enabled("cpu"):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in slicer.parameters())):
        return None
    maps = _maps(*parts, holder)
    if maps is None or maps.tensors[0].dtype != x.dtype or x.shape[1] != maps.sizes[0]:
        return None
    found = native.kernels(KERNELS, x.dtype, _ARGTYPES)
    if found is None:
        return None
    x = x.contiguous()
    out = x.new_empty(x.shape[0], maps.sizes[2])
    found["mlp_scores"](native.pointer(x), *maps.pointers, native.pointer(out), x.shape[0], *maps.sizes)
    return out
