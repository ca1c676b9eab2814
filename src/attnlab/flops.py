"""Analytic FLOP counts (per backend and per model) and device peaks, for MFU.

Convention (torch.utils.flop_counter's): a multiply-add is 2 FLOPs and only matmul-like work is
counted for the matmul backends, so softmax and linear attention match ``FlopCounterMode`` on the
forward pass exactly (``tests/test_flops.py``). A training step is counted as 3 × the forward (the
usual model-FLOPs convention: no recomputation, no optimizer), which is what MFU divides by.

Attention, forward, per sequence and head (T tokens, head dim D, value dim Dv):

- softmax: ``2T²D + 2T²Dv`` (q kᵀ and p v; causal counted in full, as the flop counter does);
- linear: ``4TDDv + 2TD`` (state, numerator, normaliser); causal (chunks of C, T rounded up to
  Tc = a multiple of C) adds the intra-chunk quadratic form ``2 Tc C (D + Dv)``;
- performer: linear with M features plus the feature projections ``2 · 2TDM``;
- sliced ReLU: ``8TD + 3T·log2(T)``: D-wide centring, score product, two running sums and the
  scaled two-term combination, plus sort, rank search and normaliser per token (elementwise work:
  no flop counter sees it); ReLU-bump ``16TD + 5T·log2(T)`` (three windows).

A model's forward FLOPs are counted on its real calls by ``FlopCounter`` (forward hooks): every
``nn.Linear`` (``2·in·out`` per row it maps) and every attention layer (the formula above for its
backend and the T it sees); embeddings, norms and activations are left out, as usual.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["PEAK_FLOPS", "FlopCounter", "attention_flops", "peak_flops", "precision_dtype"]


def attention_flops(
    backend: str,
    seq_len: int,
    head_dim: int,
    *,
    value_dim: int | None = None,
    causal: bool = False,
    chunk_size: int = 64,
    num_features: int | None = None,
) -> float:
    """Forward FLOPs of one head on one sequence of ``seq_len`` tokens (see the module docstring)."""
    t, d = seq_len, head_dim
    dv = head_dim if value_dim is None else value_dim
    log_t = math.log2(t) if t > 1 else 0.0
    if backend == "softmax":
        return 2.0 * t * t * (d + dv)
    if backend in ("linear", "performer"):
        m = d if backend == "linear" else (num_features or d)
        flops = 4.0 * t * m * dv + 2.0 * t * m
        if causal:
            c = min(chunk_size, t)
            padded = -(-t // c) * c
            flops = 4.0 * padded * m * dv + 2.0 * padded * m + 2.0 * padded * c * (m + dv)
        if backend == "performer":
            flops += 2 * 2.0 * t * d * m
        return flops
    if backend == "sliced_relu":
        return 8.0 * t * d + 3.0 * t * log_t
    if backend == "sliced_relu_bump":
        return 16.0 * t * d + 5.0 * t * log_t
    raise ValueError(
        f"attention_flops: no FLOP formula for backend {backend!r}; known: softmax, linear, performer, "
        "sliced_relu, sliced_relu_bump"
    )


class FlopCounter:
    """Forward FLOPs of a model's real calls, counted by forward hooks (cheap: shapes only).

    ``attach(model)``, then read ``forward_flops`` (since the last ``reset()``); ``detach()`` removes
    the hooks. Attention layers of an unknown backend count their projections only. The sliced
    layers that fold Π into their projection do not call those modules (``SlicedAttentionLayer.fold``):
    their own hook counts the folded matmuls they run instead.

    A model under ``torch.compile`` is not counted (``counting`` is False): its hooks would run
    inside the compiled graph, whose guards would then hold the running count's value (a recompile
    at every new value) and whose shapes the count's arithmetic would fix.
    """

    def __init__(self) -> None:
        self.forward_flops = 0.0
        self.counting = False
        self._handles: list = []

    def attach(self, model: nn.Module) -> FlopCounter:
        from attnlab.attention import AttentionLayer

        if any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
            return self
        self.counting = True
        for module in model.modules():
            if isinstance(module, nn.Linear):
                self._handles.append(module.register_forward_hook(self._linear))
            elif isinstance(module, AttentionLayer):
                self._handles.append(module.register_forward_hook(self._attention, with_kwargs=True))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        self.forward_flops = 0.0

    def training_flops(self) -> float:
        """Forward + backward of what was counted since the last reset: 3 × forward."""
        return 3.0 * self.forward_flops

    def _linear(self, module: nn.Linear, inputs, output) -> None:
        rows = inputs[0].numel() // module.in_features
        self.forward_flops += 2.0 * rows * module.in_features * module.out_features

    def _attention(self, module, inputs, kwargs, output) -> None:
        x = inputs[0]
        batch, length = x.shape[0], x.shape[1]
        packing = kwargs.get("packing", inputs[2] if len(inputs) > 2 else None)
        fold = getattr(module, "fold", None)
        if fold is not None and fold(batch, packed=packing is not None):  # q/k/v and Π Linear did not run
            self.forward_flops += module.folded_flops(batch, length, packed=packing is not None)
        if packing is not None and not module.attends_packed(x, packing):  # per sequence, laid out (N, M)
            batch, length = packing.unpack_index.shape
        features = getattr(getattr(module, "feature_map", None), "num_features", None)
        try:
            per_head = attention_flops(
                module.name,
                length,
                module.head_dim,
                causal=bool(module.causal),
                chunk_size=getattr(module, "chunk_size", 64),
                num_features=features,
            )
        except ValueError:
            return  # a user's backend: its projections are counted, its attention is not known
        self.forward_flops += batch * module.num_heads * per_head


# Dense peak FLOP/s per device (NVIDIA datasheets, tensor cores, no sparsity). "tf32" is float32
# matmuls with torch.backends TF32 allowed (float32_matmul_precision "high" or "medium").
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "v100": {"float16": 125e12, "float32": 15.7e12},
    "a100": {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    "h100 pcie": {"bfloat16": 756e12, "float16": 756e12, "tf32": 378e12, "float32": 51.2e12},
    "h100": {"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12},  # SXM
    "h200": {"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12},  # SXM
}


def precision_dtype(precision: str | int | None) -> str:
    """The matmul dtype of a Lightning ``precision`` setting ("bf16-mixed" → "bfloat16", ...)."""
    text = str(precision or "32")
    if text.startswith("bf16"):
        return "bfloat16"
    if text.startswith("16"):
        return "float16"
    if text.startswith("64"):
        return "float64"
    if torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "float32"


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a GPU by its name (``torch.cuda.get_device_name``) for a matmul dtype, or None."""
    name = device_name.lower()
    for chip in ("h100 pcie", "h200", "h100", "a100", "v100"):
        key = chip.split()
        if all(part in name for part in key):
            table = PEAK_FLOPS[chip]
            return table.get(dtype, table["float32"] if dtype == "tf32" else None)
    return None
