"""The feature-map core of linear attention, shared with Performer: φ(q), φ(k) and v in, outputs out.

Non-causal: two matmuls. Causal: chunked, inside a chunk the masked (chunk × chunk) quadratic form,
across chunks the state carried from all earlier chunks (one exclusive cumsum over chunk states),
so no T×T tensor and no Python loop over T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.common.padding import query_mask

DEFAULT_CHUNK_SIZE = 64


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1: positive, so every normaliser φ(q)ᵀz is a sum of positive terms."""
    return F.elu(x) + 1.0


def linear_attention_from_features(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """The kernel-agnostic core shared with Performer: features (B, H, T, M), values (B, H, T, Dv).

    Its keywords mirror `linear_attention`'s and `performer_attention`'s on purpose: each public op
    takes the options its callers set, and all three hand them here, where the work is done once.

    Runs in the dtype of its inputs (callers pass float32/float64 tensors).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    if key_padding_mask is not None:
        phi_k = phi_k * key_padding_mask[:, None, :, None].to(phi_k.dtype)
    if causal:
        num, den = _causal_chunked(phi_q, phi_k, v, chunk_size)
    else:
        state = torch.einsum("bhtm,bhte->bhme", phi_k, v)
        norm = phi_k.sum(dim=2)
        num = torch.einsum("bhtm,bhme->bhte", phi_q, state)
        den = torch.einsum("bhtm,bhm->bht", phi_q, norm)
    out = num / (den + eps).unsqueeze(-1)
    if (queries := query_mask(key_padding_mask, padded_queries)) is not None:
        out = out * queries[:, None, :, None].to(out.dtype)
    return out


def _causal_chunked(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal numerators (B, H, T, Dv) and denominators (B, H, T) without any T×T tensor."""
    b, h, t, m = phi_q.shape
    dv = v.shape[-1]
    c = min(chunk_size, t)
    n = -(-t // c)  # number of chunks
    pad = n * c - t
    if pad:
        # Zero features past the end: padded keys add nothing, padded queries are cut off below.
        phi_q = F.pad(phi_q, (0, 0, 0, pad))
        phi_k = F.pad(phi_k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
    qc = phi_q.reshape(b, h, n, c, m)
    kc = phi_k.reshape(b, h, n, c, m)
    vc = v.reshape(b, h, n, c, dv)

    # Inside each chunk: the masked quadratic form (chunk × chunk only).
    scores = torch.einsum("bhncm,bhnsm->bhncs", qc, kc)
    scores = scores * torch.ones(c, c, dtype=torch.bool, device=scores.device).tril()
    num = torch.einsum("bhncs,bhnse->bhnce", scores, vc)
    den = scores.sum(dim=-1)

    # Across chunks: state of all *earlier* chunks = exclusive cumsum of per-chunk states.
    chunk_state = torch.einsum("bhncm,bhnce->bhnme", kc, vc)
    chunk_norm = kc.sum(dim=3)
    prev_state = torch.cumsum(chunk_state, dim=2)[:, :, :-1]
    prev_norm = torch.cumsum(chunk_norm, dim=2)[:, :, :-1]
    prev_state = F.pad(prev_state, (0, 0, 0, 0, 1, 0))  # chunk 0 has no past
    prev_norm = F.pad(prev_norm, (0, 0, 1, 0))
    num = num + torch.einsum("bhncm,bhnme->bhnce", qc, prev_state)
    den = den + torch.einsum("bhncm,bhnm->bhnc", qc, prev_norm)
    return num.reshape(b, h, n * c, dv)[:, :, :t], den.reshape(b, h, n * c)[:, :, :t]


def linear_attention_segments_from_features(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """`linear_attention_from_features` on packed rows: features (B, H, L, M), values (B, H, L, Dv),
    ``segments`` (B, L) the sequence of each slot (contiguous runs; `PackedLayout.segments`). A query
    sums only the keys of its own segment, so each sequence gets what it gets alone, with no sequence
    laid out on a row of its own. Non-causal: the causal sums forwards plus the causal sums of the
    reversed row, less the query's own key (counted by both)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    num, den = _causal_chunked_segments(phi_q, phi_k, v, segments, chunk_size)
    if not causal:
        flip = lambda x: x.flip(2)  # noqa: E731
        back_num, back_den = _causal_chunked_segments(
            flip(phi_q), flip(phi_k), flip(v), segments.flip(1), chunk_size
        )
        own = (phi_q * phi_k).sum(-1)  # φ(q_i)ᵀφ(k_i): the diagonal, in both sums
        num = num + flip(back_num) - own.unsqueeze(-1) * v
        den = den + flip(back_den) - own
    return num / (den + eps).unsqueeze(-1)


def _causal_chunked_segments(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_causal_chunked` with a state that restarts at each segment: inside a chunk the quadratic form
    masked to (causal and same segment); across chunks only the segment that runs into a chunk from
    before carries a state, the keys of that segment in the earlier chunks (a loop over chunks adds
    them up, restarting where a new segment begins, so nothing is subtracted and nothing cancels)."""
    b, h, t, m = phi_q.shape
    dv = v.shape[-1]
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    if pad:  # zero features past the end, in a segment of their own
        phi_q, phi_k, v = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v))
        segments = F.pad(segments, (0, pad), value=-1)
    qc, kc, vc = phi_q.reshape(b, h, n, c, m), phi_k.reshape(b, h, n, c, m), v.reshape(b, h, n, c, dv)
    seg = segments.reshape(b, 1, n, c)

    causal = torch.ones(c, c, dtype=torch.bool, device=phi_q.device).tril()
    scores = torch.einsum("bhncm,bhnsm->bhncs", qc, kc)
    scores = scores * ((seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal).to(scores.dtype)
    num = torch.einsum("bhncs,bhnse->bhnce", scores, vc)
    den = scores.sum(dim=-1)

    last = seg[..., -1]  # (b, 1, n): the segment each chunk ends in, which may run on into the next
    tail = (seg == last.unsqueeze(-1)).to(kc.dtype).unsqueeze(-1)  # the chunk's keys in that segment
    tail_state = torch.einsum("bhncm,bhnce->bhnme", kc * tail, vc)
    tail_norm = (kc * tail).sum(dim=3)
    # chunk j carries on the state it received when it lies wholly in the segment it received
    whole = tail.squeeze(-1).all(dim=-1)
    carried_state = [torch.zeros_like(tail_state[:, :, 0])]
    carried_norm = [torch.zeros_like(tail_norm[:, :, 0])]
    for j in range(n - 1):  # the state chunk j + 1 receives: segment last[j]'s keys so far
        keep = (
            whole[:, :, j] & (last[:, :, j] == last[:, :, j - 1]) if j else torch.zeros_like(whole[:, :, 0])
        )
        keep = keep.to(kc.dtype)[..., None]  # (b, 1, 1): over heads and the state's rows
        carried_state.append(tail_state[:, :, j] + keep[..., None] * carried_state[-1])
        carried_norm.append(tail_norm[:, :, j] + keep * carried_norm[-1])
    state, norm = torch.stack(carried_state, dim=2), torch.stack(carried_norm, dim=2)
    previous = torch.cat([torch.full_like(last[..., :1], -2), last[..., :-1]], dim=-1)  # -2: none before
    receives = (seg == previous.unsqueeze(-1)).to(qc.dtype).unsqueeze(-1)  # queries of that segment
    num = num + torch.einsum("bhncm,bhnme->bhnce", qc * receives, state)
    den = den + torch.einsum("bhncm,bhnm->bhnc", qc * receives, norm)
    return num.reshape(b, h, n * c, dv)[:, :, :t], den.reshape(b, h, n * c)[:, :, :t]
