"""Softmax (scaled dot-product) attention through PyTorch's fused kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.common import compiler
from attnlab.attention.common.checks import check_qkv
from attnlab.attention.common.packing import check_segments, run_ids, segment_mask
from attnlab.attention.common.padding import PADDED_QUERIES, check_padded_queries, query_mask
from attnlab.attention.softmax import flex


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    *,
    dropout_p: float = 0.0,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """softmax(q kᵀ / √D) v for q, k, v of shape (B, H, T, D) -> (B, H, T, Dv).

    `key_padding_mask` is a bool (B, T), True = real token; padded keys get zero weight. A query that
    sees no key at all (a fully padded sequence, or a causal row before the first real token) would
    be a 0/0 softmax, so its output is set to zero instead of NaN, and so is the output of every padded
    query (`padded_queries="attend"`: padded queries attend to the real keys; ``"lra"``: LRA's rule,
    a padded query's output is the mean of V over all T positions; ``"lra2020"``: the leaderboard-era
    LRA code's, the sum; see `attnlab.attention.common.padding` and `lra_padded_rows`). `dropout_p` is
    attention dropout (pass 0 at evaluation).

    Non-finite inputs (on the CPU; CUDA keeps its fused kernels' own rules) give the float64
    reference's NaN pattern: a kept query's output is NaN where its q, or the k of a real key it
    sees (j <= i when causal), holds a NaN, and in each value column where such a key's v does;
    exact elsewhere (the fused kernels spread or drop NaN by their own rules). A padded or future
    key has no influence whatever it holds (the reference's ``probs @ v`` multiplies a future key's
    NaN value by its zero weight, which spreads it). An inf is treated as
    a NaN (in the reference its sign decides).

    The scores q·k/√D are formed in the input dtype: in float32 they overflow once |q|·|k| nears
    about 1e38 (65504 in float16), where the float64 reference stays finite; keep q and k far from
    there (the models' LayerNorms do) or compute in float64.
    """
    check_qkv(q, k, v, key_padding_mask)
    check_padded_queries("softmax_attention", padded_queries, causal, allowed=PADDED_QUERIES)
    # on CUDA asking would stall the stream, in the baseline every speed-up is measured against;
    # under torch.compile it would break the graph: the fused kernels' own rules apply there
    if not compiler.host_reads_allowed(q):
        return _softmax_attention(q, k, v, key_padding_mask, causal, dropout_p, padded_queries)
    bad_q = ~torch.isfinite(q).all(dim=-1)  # (B, H, T)
    bad_k, bad_v = ~torch.isfinite(k).all(dim=-1), ~torch.isfinite(v)  # (B, H, T), (B, H, T, Dv)
    if not bool(bad_q.any() | bad_k.any() | bad_v.any()):
        return _softmax_attention(q, k, v, key_padding_mask, causal, dropout_p, padded_queries)
    if key_padding_mask is not None:
        bad_k = bad_k & key_padding_mask[:, None, :]
        bad_v = bad_v & key_padding_mask[:, None, :, None]
    finite = [x.masked_fill(~torch.isfinite(x), 0.0) for x in (q, k, v)]
    out = _softmax_attention(*finite, key_padding_mask, causal, dropout_p, padded_queries)
    if causal:  # the keys each query sees: j <= i
        seen_k, seen_v = bad_k.cummax(dim=2).values, bad_v.cummax(dim=2).values
    else:
        seen_k, seen_v = bad_k.any(dim=2, keepdim=True), bad_v.any(dim=2, keepdim=True)
    poison = (bad_q | seen_k)[..., None] | seen_v  # (B, H, T, Dv): what the reference makes NaN ...
    if key_padding_mask is not None:  # ... at the queries it keeps, of sequences with a key to see
        has_key = key_padding_mask.cummax(dim=-1).values if causal else key_padding_mask.any(-1, keepdim=True)
        kept = key_padding_mask if padded_queries != "attend" else torch.ones_like(key_padding_mask)
        poison = poison & (has_key & kept)[:, None, :, None]
    return out.masked_fill(poison, float("nan"))


def softmax_attention_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    causal: bool = False,
    *,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Softmax attention inside segments: q, k, v (B, H, L, D) hold several sequences end to end in
    each row, ``segments`` (B, L) says which each position belongs to, and a query attends to the
    keys of its own segment only (j <= i too when ``causal``). On CUDA without dropout through
    FlexAttention's block mask (``softmax.flex``: about M² per sequence, the blocks no sequence
    reaches skipped), elsewhere through SDPA with a block-diagonal mask (L² per row). Every query
    sees at least itself, so no row is empty; non-finite inputs follow the kernels' own rules."""
    check_qkv(q, k, v, None)
    check_segments(segments, q)
    runs = run_ids(segments)  # an id may come back later in the row: compare runs, not ids
    if q.is_cuda and dropout_p == 0.0:
        out = flex.flex_segments(q, k, v, runs, causal)
        if out is not None:
            return out
    mask = segment_mask(runs, causal)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def _softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    padded_queries: str,
) -> torch.Tensor:
    if padded_queries in ("lra", "lra2020") and key_padding_mask is not None:
        real = softmax_attention(q, k, v, key_padding_mask, dropout_p=dropout_p, padded_queries="zero")
        padded_rows = lra_padded_rows(q, k, v)
        if padded_queries == "lra2020":  # every weight 1, not 1/T: the sum, gradients T times larger
            padded_rows = padded_rows * q.shape[2]
        return torch.where(key_padding_mask[:, None, :, None], real, padded_rows.to(real.dtype))
    b, _, t, _ = q.shape
    if key_padding_mask is None:
        # No mask lets SDPA pick the flash kernel; `is_causal` keeps it on that path.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)

    allowed = key_padding_mask[:, None, None, :]  # (B, 1, 1, T): broadcast over heads and queries
    if causal:
        tril = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        allowed = allowed & tril  # (B, 1, T, T)
    # Rows with no allowed key: let them attend everywhere (finite softmax), then zero their output.
    empty_row = ~allowed.any(dim=-1, keepdim=True)
    allowed = allowed | empty_row
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
    keep = ~empty_row  # a query that saw a key, and (padded_queries="zero") is itself real
    if (queries := query_mask(key_padding_mask, padded_queries)) is not None:
        keep = keep & queries[:, None, :, None]  # (B, 1, T, 1)
    return out.masked_fill(~keep, 0.0)


def lra_padded_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What LRA's softmax gives a padded query, for every query (B, H, T, Dv), in O(T·D·Dv).

    Its logits are −1e10 + s_ij, rounded to −1e10 in float32, so the weights are uniform: the value
    is v̄, the mean of V over all T positions. JAX's gradient is still the softmax's Jacobian at that
    uniform point, applied to s_ij = q_i·k_j/√D: ∂/∂s_ij = (g_i·(v_j − v̄))/T. With δs = s − s
    (value 0, gradient that of s) the output is, to first order, v̄ + Σ_j δs_ij (v_j − v̄)/T, and
    Σ_j s_ij (v_j − v̄) = q_i·M/√D with M = Σ_j k_j (v_j − v̄)ᵀ: no T×T matrix. V enters M without
    gradient (in the exact function v_j's weight is 1/T, whatever the scores).

    The leaderboard-era code (``"lra2020"``) computes exp(x − logsumexp(x)): with logsumexp rounded to
    −1e10 every weight is 1, and its Jacobian is 1·(δ_jk − 1/T): T times this, value and gradient.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    mean = v.mean(dim=2, keepdim=True)  # (B, H, 1, Dv): every position, padding included
    moment = torch.einsum("bhtd,bhte->bhde", k, (v - mean).detach())  # M (B, H, D, Dv)
    linear = torch.einsum("bhtd,bhde->bhte", q, moment) * q.shape[-1] ** -0.5 / v.shape[2]
    return mean + (linear - linear.detach())  # the value is v̄; the gradient is LRA's
