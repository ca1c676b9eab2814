"""Linear attention (Katharopoulos et al. 2020), φ(x) = elu(x) + 1: parallel, causal-chunked, recurrent.

Non-causal uses associativity: S = Σ_j φ(k_j) v_jᵀ and z = Σ_j φ(k_j) are computed once, so the cost
is O(T·D·Dv) instead of O(T²). Causal needs prefix sums S_i, z_i; materialising one (D, Dv) state per
token would cost O(T·D·Dv) memory, so the sequence is cut into chunks: inside a chunk the masked
(chunk × chunk) quadratic form, across chunks the state carried from all earlier chunks (one exclusive
cumsum over chunk states). The recurrent form `linear_attention_step` keeps only (S, z).

Precision: states are accumulated in float32 for half inputs and float64 for float64 inputs. Prefix
sums are sums of positive terms here (φ > 0), so the denominators do not cancel; the numerators can
mix signs through v and lose relative precision at very large T in float32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from attnlab.attention.padding import check_padded_queries, query_mask
from attnlab.attention.precision import accumulation_dtype, no_autocast
from attnlab.attention.softmax import check_qkv
from attnlab.attention.triton import selfcheck
from attnlab.attention.triton.runtime import launch, resolve_impl

DEFAULT_CHUNK_SIZE = 64


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1: positive, so every normaliser φ(q)ᵀz is a sum of positive terms."""
    return F.elu(x) + 1.0


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    impl: str = "auto",
    padded_queries: str = "zero",
) -> torch.Tensor:
    """o_i = φ(q_i)ᵀ S / (φ(q_i)ᵀ z + eps) for q, k of shape (B, H, T, D), v (B, H, T, Dv).

    Padded keys (`key_padding_mask` False) contribute nothing; outputs at padded queries are zero
    (`padded_queries="attend"`: they attend to the real keys, `attnlab.attention.padding`).
    With `causal`, S and z only sum keys j <= i, computed chunk by chunk (`chunk_size` tokens).
    `impl` ("auto", "triton", "torch") chooses the causal form's code: "auto" runs the Triton
    kernel (`attnlab.attention.triton.linear`, its own chunk size) on CUDA tensors other than
    float64, torch otherwise; the non-causal form is two matmuls and always runs in torch.
    """
    check_qkv(q, k, v, key_padding_mask)
    check_padded_queries("linear_attention", padded_queries, causal)
    use = resolve_impl("linear_attention", impl, q, k, v)
    if use == "triton" and causal:
        from attnlab.attention.triton.linear import MAX_HEAD_DIM

        if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:  # the kernels' state would spill registers
            if impl == "triton":
                raise ValueError(
                    f"linear_attention: impl='triton' runs head dims up to {MAX_HEAD_DIM}, got q/k "
                    f"{q.shape[-1]} and v {v.shape[-1]}; use impl='auto' or 'torch'"
                )
        elif torch.float64 not in (q.dtype, k.dtype, v.dtype):
            from attnlab.attention.triton.linear import causal_linear_attention

            out = launch(
                "linear_attention",
                impl,
                q.device,
                lambda: causal_linear_attention(q, k, v, key_padding_mask, eps),
                check=lambda: selfcheck.trusted("linear_attention", q.device, v.dtype, lambda: _case(v)),
            )
            if out is not None:  # None: `auto`, and Triton could not build a kernel here (warned)
                return out
        if impl == "triton" and torch.float64 in (q.dtype, k.dtype, v.dtype):
            raise TypeError(
                "linear_attention: impl='triton' has no float64 kernel; use impl='torch' or 'auto' "
                f"for float64 inputs (got {q.dtype}, {k.dtype}, {v.dtype})"
            )
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype)
        phi_q = elu_feature_map(q.to(acc))
        phi_k = elu_feature_map(k.to(acc))
        out = linear_attention_from_features(
            phi_q, phi_k, v.to(acc), key_padding_mask, causal, eps, chunk_size, padded_queries
        )
    return out.to(v.dtype)


def _case(like: torch.Tensor):
    """The first-use check's case (``selfcheck.trusted``) of the causal Triton kernels: two rows of
    200 tokens, one padded to 150, in ``like``'s dtype, device and head dim."""
    inputs, mask = selfcheck.random_case("qkv", 2, 2, 200, like.shape[-1], like.dtype, like.device)
    keywords = {"key_padding_mask": mask, "causal": True}
    fast = functools.partial(linear_attention, impl="triton")
    return fast, functools.partial(linear_attention, impl="torch"), inputs, keywords


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


def linear_attention_state(
    k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoding state ``(S, z)`` after a whole prefix (prefill): k (B, H, T, D), v (B, H, T, Dv).

    Stepping `linear_attention_step` from this state continues the causal sequence exactly as if
    every prefix token had been stepped through; padded keys add nothing. In float32 at least.
    """
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"expected k (B, H, T, D) and v (B, H, T, Dv); got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    with no_autocast(k.device):
        acc = accumulation_dtype(k.dtype)
        phi_k = elu_feature_map(k.to(acc))
        if key_padding_mask is not None:
            phi_k = phi_k * key_padding_mask[:, None, :, None].to(acc)
        return torch.einsum("bhtd,bhte->bhde", phi_k, v.to(acc)), phi_k.sum(dim=2)


def linear_attention_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    inplace: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding step of causal linear attention: constant memory and time per token.

    q_t, k_t (B, H, D), v_t (B, H, Dv); `state = (S, z)` of shapes (B, H, D, Dv) and (B, H, D), kept in
    float32 (float64 for float64 input), or None before the first token. Returns (o_t, new_state); the
    sequence of o_t equals `linear_attention(..., causal=True)`. ``inplace``: add the token to the given
    state's tensors instead of new ones (a decoder's loop: no allocation, fewer kernel launches).
    """
    if q_t.dim() != 3 or q_t.shape != k_t.shape or v_t.dim() != 3 or v_t.shape[:2] != k_t.shape[:2]:
        raise ValueError(
            "linear_attention_step expects q_t, k_t (B, H, D) and v_t (B, H, Dv); got "
            f"{tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}"
        )
    with no_autocast(q_t.device):
        acc = accumulation_dtype(q_t.dtype)
        phi = F.elu(torch.stack([q_t, k_t]).to(acc)).add_(1.0)  # φ(q), φ(k) = elu + 1 in one pass
        phi_q, phi_k = phi[0], phi[1]
        v = v_t.to(acc)
        b, h, d = phi_k.shape
        if state is None:
            s_prev = phi_k.new_zeros(b, h, d, v.shape[-1])
            z_prev = phi_k.new_zeros(b, h, d)
        else:
            s_prev, z_prev = state
            if s_prev.shape != (b, h, d, v.shape[-1]) or z_prev.shape != (b, h, d):
                raise ValueError(
                    f"state must be (S, z) of shapes {(b, h, d, v.shape[-1])} and {(b, h, d)}; "
                    f"got {tuple(s_prev.shape)} and {tuple(z_prev.shape)}"
                )
        if inplace and state is not None and s_prev.dtype == acc and z_prev.dtype == acc:
            # S += φ(k) vᵀ, z += φ(k), into the state's memory: no allocation
            s_new, z_new = s_prev.addcmul_(phi_k.unsqueeze(-1), v.unsqueeze(-2)), z_prev.add_(phi_k)
        else:
            s_new = s_prev + phi_k.unsqueeze(-1) * v.unsqueeze(-2)
            z_new = z_prev + phi_k
        num = torch.matmul(phi_q.unsqueeze(-2), s_new).squeeze(-2)  # φ(q)ᵀ S
        den = (phi_q * z_new).sum(-1, keepdim=True).add_(eps)
        out = num.div_(den)
    return out.to(v_t.dtype), (s_new, z_new)
