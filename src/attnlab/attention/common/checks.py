"""Shape checks at the public entry points of the q/k/v ops (softmax, linear, Performer)."""

from __future__ import annotations

import torch


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> None:
    """Shape checks shared by the q/k/v ops, so a wrong layout fails loudly instead of broadcasting."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (B, H, T, D); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape (B, H, T, D); got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must be (B, H, T, Dv) with (B, H, T) = {tuple(k.shape[:3])}; got {tuple(v.shape)}"
        )
    if key_padding_mask is not None:
        b, _, t, _ = k.shape
        if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (b, t):
            raise ValueError(
                f"key_padding_mask must be a bool tensor of shape (B, T) = ({b}, {t}), True = real token; "
                f"got dtype {key_padding_mask.dtype} and shape {tuple(key_padding_mask.shape)}"
            )
