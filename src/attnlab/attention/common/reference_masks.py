"""The masks the float64 references share: which keys are real (and, causal, not in the future), and
which queries keep their output.

Used by the references alone (``<family>/reference.py``), never by the ops: a reference that called
an op's helpers would share its bugs.
"""

from __future__ import annotations

import torch


def key_mask(key_padding_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, 1, T)`` (broadcasts over heads) of real tokens; all True without a mask."""
    batch, _, length = like.shape[:3]
    if key_padding_mask is None:
        return torch.ones(batch, 1, length, dtype=torch.bool, device=like.device)
    return key_padding_mask.to(device=like.device, dtype=torch.bool)[:, None, :]


def kept_queries(
    key_padding_mask: torch.Tensor | None, like: torch.Tensor, padded_queries: str
) -> torch.Tensor:
    """Bool ``(B, 1, T, 1)``: the queries whose output is kept (all of them under ``"attend"``)."""
    if padded_queries == "attend":
        key_padding_mask = None
    return key_mask(key_padding_mask, like)[..., None]


def allowed_keys(key_padding_mask: torch.Tensor | None, like: torch.Tensor, causal: bool) -> torch.Tensor:
    """Bool ``(B, 1, T_query, T_key)`` (or ``(B, 1, 1, T_key)``): key j is real, and j <= i if causal."""
    allowed = key_mask(key_padding_mask, like)[:, :, None, :]
    if causal:
        length = like.shape[2]
        allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=like.device).tril()
    return allowed
