"""Precision rules shared by every op: which dtype sums run in, and autocast kept out of them."""

from __future__ import annotations

import contextlib

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any input is float64, else float32: half types are never summed in half."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast would silently run the ops' float32 sums and matmuls in half precision: off locally.
    Nothing to turn off when it is not on (a decoding step saves the context switch's cost)."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)
