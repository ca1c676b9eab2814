"""The FAVOR+ estimator written out token by token in float64: the Performer op's reference.

Imports nothing from the ops (a reference that called their helpers would share their bugs).
"""

from __future__ import annotations

import torch

__all__ = ["performer_attention"]


def performer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    stabilizer_eps: float = 1e-4,
) -> torch.Tensor:
    """The FAVOR+ estimator written out token by token in float64, independent of the op's code
    (and slow: for small cases only).

    For query i and key j: φ(x) = (exp(w·x' − |x'|²/2 − shift) + ε)/√M with x' = x/D^¼; the query
    shift is the max of w·q_i' over features, the key shift the max of w·k_j' over the valid keys of
    the sequence (causal: over the valid keys up to i) and features. Output Σ_j φq·φk v_j / (Σ_j φq·φk
    + eps) over the valid keys (up to i when causal); zero at padded queries.
    """
    q, k, v, w = (x.to(torch.float64) for x in (q, k, v, projection))
    b, h, t, d = q.shape
    m = w.shape[0]
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        valid = [True] * t if key_padding_mask is None else key_padding_mask[bi].tolist()
        for hi in range(h):
            qs, ks = q[bi, hi] * d**-0.25, k[bi, hi] * d**-0.25
            for i in range(t):
                if not valid[i]:
                    continue
                keys = [j for j in range(t) if valid[j] and (j <= i or not causal)]
                if not keys:
                    continue
                lq = w @ qs[i]
                phi_q = (torch.exp(lq - qs[i] @ qs[i] / 2 - lq.max()) + stabilizer_eps) / m**0.5
                shift = torch.stack([(w @ ks[j]).max() for j in keys]).max()  # gradients flow through it
                num, den = 0.0, 0.0
                for j in keys:
                    phi_k = (torch.exp(w @ ks[j] - ks[j] @ ks[j] / 2 - shift) + stabilizer_eps) / m**0.5
                    weight = phi_q @ phi_k
                    num, den = num + weight * v[bi, hi, j], den + weight
                out[bi, hi, i] = num / (den + eps)
    return out
