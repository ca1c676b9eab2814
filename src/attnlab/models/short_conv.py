"""A short depthwise convolution over time before attention: the "previous token" step of recall.

Associative recall (MQAR) needs each value to be found from the key *before* it. Softmax attention can
learn that from positions; a backend whose heads see one scalar score per token (sliced ReLU,
ReLU-bump) or a fixed-size state (linear attention, Performer) cannot. A few taps of a depthwise
convolution hand every token its predecessors' features, as H3, Hyena, Based and Zoology's models do
beside linear attention. Here it acts on each block's normalised input, before attention only.

Causal (left-padded) in causal models: position i mixes tokens i−k+1..i, so no future token leaks.
Centred in bidirectional ones (odd k): i−(k−1)/2..i+(k−1)/2. Padded positions are zeroed before the
convolution, so they leak nothing into real ones. The recurrent step keeps the last k−1 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConv(nn.Module):
    """Depthwise ``kernel_size``-tap convolution of ``(B, T, dim)`` over T, causal or centred.

    Initialised as the identity (the current token's tap 1, the others 0), so a model with it starts
    where the same model without it starts, and training decides how much of the neighbours to mix.
    """

    def __init__(self, dim: int, kernel_size: int, causal: bool):
        super().__init__()
        if not isinstance(kernel_size, int) or isinstance(kernel_size, bool) or kernel_size < 2:
            raise ValueError(f"short_conv={kernel_size!r}: a number of taps >= 2 (0 turns it off)")
        if not causal and kernel_size % 2 == 0:
            raise ValueError(
                f"short_conv={kernel_size}: a bidirectional model needs an odd number of taps (centred)"
            )
        self.kernel_size, self.causal = kernel_size, causal
        self.weight = nn.Parameter(torch.zeros(dim, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(dim))
        with torch.no_grad():
            self.weight[:, 0, kernel_size - 1 if causal else kernel_size // 2] = 1.0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        k = self.kernel_size
        pad = (k - 1, 0) if self.causal else (k // 2, k // 2)
        y = F.conv1d(F.pad(x.transpose(1, 2), pad), self.weight, self.bias, groups=x.shape[-1])
        return y.transpose(1, 2)

    def step(self, x_t: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal step: x_t (B, dim) and the last k−1 inputs (B, k−1, dim) -> (y_t, new state)."""
        if not self.causal:
            raise ValueError("a centred (bidirectional) short convolution has no recurrent step")
        if state is None:
            state = x_t.new_zeros(x_t.shape[0], self.kernel_size - 1, x_t.shape[-1])
        window = torch.cat([state, x_t[:, None]], dim=1)  # (B, k, dim), oldest first
        y = torch.einsum("bkd,dk->bd", window, self.weight[:, 0]) + self.bias
        return y, window[:, 1:]
