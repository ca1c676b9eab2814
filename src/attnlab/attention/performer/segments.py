"""Performer (FAVOR+) attention on packed rows: several sequences end to end in each row, each query
summing the keys of its own sequence only, with the key stabiliser each sequence has alone.

Causal: the chunked form of ``attnlab.attention.performer.ops`` (inside a chunk the masked quadratic
form, across chunks a carried state rescaled from one chunk's end to the next) with the mask also
requiring the same sequence, the running maximum of the key logits restarting at each sequence
(`segment_cummax`), and only the sequence that runs into a chunk from before carrying a state into
it (as ``attnlab.attention.linear.chunked`` does for linear attention). Bidirectional: each
sequence's keys shifted by the maximum of that sequence's key logits, then linear attention on rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.common.checks import check_qkv
from attnlab.attention.common.packing import check_segments, run_ids
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.linear.chunked import DEFAULT_CHUNK_SIZE, linear_attention_segments_from_features
from attnlab.attention.performer.ops import check_performer_args, favor_features, favor_logits
from attnlab.attention.sliced_common.segments import segment_running_sum, segment_runs

__all__ = ["performer_attention_segments"]


def performer_attention_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    segments: torch.Tensor,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    stabilizer_eps: float = 1e-4,
) -> torch.Tensor:
    """`performer_attention` on packed rows (q, k (B, H, L, D), v (B, H, L, Dv)): a query sums only
    the keys of its own segment (``segments`` (B, L), contiguous runs; `PackedLayout.segments`), and
    every key stabiliser is its own sequence's, so each sequence gets what it gets alone. Torch code
    on every device."""
    check_qkv(q, k, v, None)
    check_segments(segments, q)
    check_performer_args(q, projection, chunk_size)
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype)
        runs = run_ids(segments)
        phi_q = favor_features(q.to(acc), projection, is_query=True, stabilizer_eps=stabilizer_eps)
        logits = favor_logits(k.to(acc), projection)
        if causal:
            out = _causal_favor_segments(phi_q, logits, v.to(acc), runs, eps, stabilizer_eps, chunk_size)
        else:
            phi_k = _segment_features(logits, runs, stabilizer_eps)
            out = linear_attention_segments_from_features(
                phi_q, phi_k, v.to(acc), runs, False, eps, chunk_size
            )
    return out.to(v.dtype)


def segment_cummax(x: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """The running maximum of ``x`` (B, H, L) along L, restarting at each segment (``runs`` (B, L),
    nondecreasing ids, `run_ids`): log₂ L steps, each combining two disjoint windows of one segment."""
    out, shift, length = x, 1, x.shape[-1]
    while shift < length:
        same = (runs[:, shift:] == runs[:, :-shift])[:, None]
        earlier = torch.where(same, out[..., :-shift], -torch.inf)
        out = torch.cat([out[..., :shift], torch.maximum(out[..., shift:], earlier)], dim=-1)
        shift *= 2
    return out


def _segment_features(logits, runs: torch.Tensor, stabilizer_eps: float) -> torch.Tensor:
    """`favor_features` of the keys with each segment's own shift (the max of its key logits)."""
    logits_k, half_sq_norm = logits
    b, h, length, m = logits_k.shape
    per_token = logits_k.amax(dim=-1)
    index = runs[:, None, :].expand(b, h, length)
    maxima = per_token.new_full((b, h, length), -torch.inf).scatter_reduce(-1, index, per_token, "amax")
    shift = torch.gather(maxima, -1, index)[..., None]
    return (torch.exp(logits_k - half_sq_norm - shift) + stabilizer_eps) * m**-0.5


def _causal_favor_segments(phi_q, logits_k, v, runs, eps, stabilizer_eps, chunk_size):
    """`_causal_favor` inside segments (no padding: every slot of a row is some segment's token).

    For query i of a segment, key j ≤ i of the same segment weighs φ_i·ψ_j e^{m_j − m_i} with
    ψ_j = exp(l_j − m_j) and m the running max of the key logits within the segment. Weights between
    different segments are exp(−inf) = 0 before any product, so no overflow meets a zero. The
    stabiliser's terms sum the segment's values and count its keys so far.
    """
    logits_k, half_sq_norm = logits_k
    b, h, t, m = logits_k.shape
    run = segment_cummax(logits_k.amax(dim=-1), runs)
    psi = torch.exp(logits_k - half_sq_norm - run[..., None])  # <= 1
    rows = segment_runs(runs, h)  # per (batch, head) row, as the sliced ops read segments
    v_sum = segment_running_sum(v.reshape(b * h, t, -1), rows).view(v.shape)
    count = (torch.arange(1, t + 1, device=v.device) - rows.start).view(b, h, t).to(run.dtype)
    q_total = phi_q.sum(dim=-1)

    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    if pad:  # zero keys past the end, in a segment of their own; their queries are cut off below
        phi_q, psi, v = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, psi, v))
        run = F.pad(run, (0, pad), mode="replicate")
        runs = F.pad(runs, (0, pad), value=-1)
    qc, kc = phi_q.reshape(b, h, n, c, m), psi.reshape(b, h, n, c, m)
    vc, rc = v.reshape(b, h, n, c, v.shape[-1]), run.reshape(b, h, n, c)
    seg = runs.reshape(b, 1, n, c)

    # Inside each chunk: (φ_i·ψ_j) e^{m_j − m_i} for j <= i of the same segment, 0 elsewhere.
    lower = torch.ones(c, c, dtype=torch.bool, device=run.device).tril()
    same = (seg[..., :, None] == seg[..., None, :]) & lower
    gap = torch.where(same, rc[..., None, :] - rc[..., :, None], -torch.inf)
    weights = torch.einsum("bhncm,bhnsm->bhncs", qc, kc) * torch.exp(gap)
    num = torch.einsum("bhncs,bhnse->bhnce", weights, vc)
    den = weights.sum(dim=-1)

    if n > 1:
        # Across chunks: chunk k's last segment carries the keys it has so far, rescaled to the
        # running max at the chunk's end (P_k); a chunk that lies wholly in the segment it received
        # passes that state on, rescaled from P_{k-1} to P_k (e^{P_{k-1} − P_k} <= 1).
        end, last = rc[..., -1], seg[..., -1]  # (b, h, n), (b, 1, n)
        tail = seg == last[..., None]  # the chunk's keys in its last segment
        to_end = kc * torch.exp(torch.where(tail, rc - end[..., None], -torch.inf))[..., None]
        tail_state = torch.einsum("bhncm,bhnce->bhnme", to_end, vc)
        tail_norm = to_end.sum(dim=3)
        whole = tail.all(dim=-1)
        states, norms = [torch.zeros_like(tail_state[:, :, 0])], [torch.zeros_like(tail_norm[:, :, 0])]
        for j in range(n - 1):  # the state chunk j + 1 receives, relative to P_j
            state, norm = tail_state[:, :, j], tail_norm[:, :, j]
            if j:
                keep = whole[:, :, j] & (last[:, :, j] == last[:, :, j - 1])
                decay = torch.exp(torch.where(keep, end[:, :, j - 1] - end[:, :, j], -torch.inf))
                state = state + decay[..., None, None] * states[-1]
                norm = norm + decay[..., None] * norms[-1]
            states.append(state)
            norms.append(norm)
        state, norm = torch.stack(states, dim=2), torch.stack(norms, dim=2)
        previous = torch.cat([torch.full_like(last[..., :1], -2), last[..., :-1]], dim=-1)
        previous_end = torch.cat([torch.zeros_like(end[..., :1]), end[..., :-1]], dim=-1)
        receives = seg == previous[..., None]  # the queries of the segment that runs in from before
        seen = torch.exp(torch.where(receives, previous_end[..., None] - rc, -torch.inf))
        q_seen = qc * seen[..., None]
        num = num + torch.einsum("bhncm,bhnme->bhnce", q_seen, state)
        den = den + torch.einsum("bhncm,bhnm->bhnc", q_seen, norm)
    num = num.reshape(b, h, n * c, v.shape[-1])[:, :, :t] + stabilizer_eps * q_total[..., None] * v_sum
    den = den.reshape(b, h, n * c)[:, :, :t] + stabilizer_eps * q_total * count
    scale = m**-0.5
    return num * scale / (den * scale + eps)[..., None]
