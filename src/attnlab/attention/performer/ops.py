"""Performer / FAVOR+ attention (Choromanski et al. 2020): positive orthogonal random features.

exp(qᵀk/√D) = E_w[φ(q)ᵀφ(k)] with φ(x) = exp(wᵀx − |x|²/2)/√M, w ~ N(0, I), x = q/D^¼. The features are
positive, so the softmax normaliser is estimated without the sign cancellations of trigonometric
features; drawing the w in orthogonal blocks lowers the variance further. Attention is then linear
attention on these features (same chunked causal form as `attnlab.attention.linear.chunked`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention.common import compiler
from attnlab.attention.common.checks import check_qkv
from attnlab.attention.common.padding import check_padded_queries
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.linear.chunked import DEFAULT_CHUNK_SIZE, linear_attention_from_features


def orthogonal_gaussian_projection(
    num_features: int, head_dim: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(M, D) matrix whose rows are orthogonal within each block of D, with Gaussian-like row norms.

    Each block is the Q of a QR decomposition of a Gaussian matrix; rows are then rescaled by the norm
    of an independent Gaussian vector so that each row is marginally N(0, I) (unbiased estimator).
    Drawn in float64 on the CPU so the result depends on the generator only, not on the device.
    """
    if num_features < 1 or head_dim < 1:
        raise ValueError(f"num_features and head_dim must be positive, got {num_features} and {head_dim}")
    blocks = []
    for _ in range(-(-num_features // head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # LAPACK's QR leaves sign(diag R) tied to the data (e.g. Q[0, 0] <= 0 always), which biases the
        # directions; fixing the signs makes Q Haar-distributed, hence every row uniform on the sphere.
        q = q * torch.sign(torch.diagonal(r))[None, :]
        blocks.append(q.T)
    rows = torch.cat(blocks, dim=0)[:num_features]
    norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return rows * norms[:, None]


def favor_logits(x: torch.Tensor, projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """wᵀx' (B, H, T, M) and |x'|²/2 (B, H, T, 1) for x' = x / D^¼: feature m is exp(wₘᵀx' − |x'|²/2).

    The stabilisers are maxima of wᵀx' alone, as in the reference implementation.
    """
    x = x * x.shape[-1] ** -0.25
    return torch.einsum("bhtd,md->bhtm", x, projection.to(x.dtype)), 0.5 * (x * x).sum(dim=-1, keepdim=True)


def favor_features(
    x: torch.Tensor,
    projection: torch.Tensor,
    is_query: bool,
    key_padding_mask: torch.Tensor | None = None,
    stabilizer_eps: float = 1e-4,
) -> torch.Tensor:
    """Positive random features of x (B, H, T, D) -> (B, H, T, M), in x's dtype (non-causal use).

    exp(·) overflows for large logits, so a maximum is subtracted inside the exponential: per query
    for queries, and for keys one shared by all keys of a sequence and head (the max over its
    *valid* keys, so padding cannot change it). Without `stabilizer_eps` the shifts cancel in the
    ratio φ(q)ᵀS / φ(q)ᵀz; `stabilizer_eps` (which keeps features away from exact zero, as in the
    reference code) is added after the shift, so the output does depend on the shifts a little:
    they are part of the estimator and gradients flow through them (exact gradients). A causal
    layer cannot use a max over all keys (future keys would move it): see `performer_attention`.
    """
    logits, half_sq_norm = favor_logits(x, projection)
    if is_query:
        shift = logits.amax(dim=-1, keepdim=True)
    else:
        masked = logits
        if key_padding_mask is not None:
            masked = logits.masked_fill(~key_padding_mask[:, None, :, None], float("-inf"))
        shift = masked.amax(dim=(-1, -2), keepdim=True)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # fully padded sequence
    m = projection.shape[0]
    return (torch.exp(logits - half_sq_norm - shift) + stabilizer_eps) * m**-0.5


def performer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    stabilizer_eps: float = 1e-4,
    padded_queries: str = "zero",
) -> torch.Tensor:
    """FAVOR+ estimate of softmax attention for q, k (B, H, T, D), v (B, H, T, Dv), projection (M, D).

    Padded keys add nothing; padded queries output zeros, or (``padded_queries="attend"``, not
    causal) attend to the real keys (`attnlab.attention.common.padding`).
    Causal: the output at position i is exactly the non-causal output of the sequence cut after i,
    key stabiliser included (the max over the keys up to i), so no future token reaches it.
    Features and states run in float32 (float64 for float64 inputs); output in v's dtype.
    """
    check_qkv(q, k, v, key_padding_mask)
    check_padded_queries("performer_attention", padded_queries, causal)
    check_performer_args(q, projection, chunk_size)
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype)
        phi_q = favor_features(q.to(acc), projection, is_query=True, stabilizer_eps=stabilizer_eps)
        if causal:
            out = _causal_favor(
                phi_q, favor_logits(k.to(acc), projection), v.to(acc), key_padding_mask,
                eps, stabilizer_eps, chunk_size,
            )  # fmt: skip
        else:
            phi_k = favor_features(k.to(acc), projection, False, key_padding_mask, stabilizer_eps)
            out = linear_attention_from_features(
                phi_q, phi_k, v.to(acc), key_padding_mask, eps=eps, padded_queries=padded_queries
            )
    return out.to(v.dtype)


def check_performer_args(q: torch.Tensor, projection: torch.Tensor, chunk_size) -> None:
    """``projection`` (M, D) for q's head dim D, ``chunk_size`` a positive integer."""
    if projection.dim() != 2 or projection.shape[1] != q.shape[-1]:
        raise ValueError(f"projection must be (num_features, D={q.shape[-1]}); got {tuple(projection.shape)}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def _causal_favor(phi_q, logits_k, v, key_padding_mask, eps, stabilizer_eps, chunk_size):
    """Causal FAVOR+ with the key stabiliser m_i = max of the key logits wᵀk' up to i (a running max).

    `logits_k` is `favor_logits` of the keys; l_j = wᵀk_j' − |k_j'|²/2. For query i every key
    j <= i gets the feature (exp(l_j − m_i) + ε)/√M, as the non-causal estimator would give it on
    the prefix. With ψ_j = exp(l_j − m_j) <= 1 (m is non-decreasing):

        num_i = φ_i · Σ_{j<=i} ψ_j e^{m_j − m_i} v_j / √M + ε (Σ φ_i) Σ_{j<=i} v_j / √M

    and den_i likewise with 1 for v_j. Inside a chunk the (chunk × chunk) form with the factors
    e^{m_j − m_i} <= 1; across chunks a state per chunk, rescaled from one chunk's end to the next
    (factors <= 1: no overflow, and contributions too small to matter underflow to 0 as they should).
    """
    logits_k, half_sq_norm = logits_k
    b, h, t, m = logits_k.shape
    if key_padding_mask is not None:
        logits_k = logits_k.masked_fill(~key_padding_mask[:, None, :, None], float("-inf"))
    run = torch.cummax(logits_k.amax(dim=-1), dim=-1).values  # m_i, -inf before the first real key
    # Before the first real key nothing is summed and any shift will do; the row's first finite
    # value keeps the running max finite and non-decreasing.
    first = torch.where(torch.isfinite(run), run, float("inf")).amin(dim=-1, keepdim=True)
    first = torch.where(torch.isfinite(first), first, torch.zeros_like(first))
    run = torch.where(torch.isfinite(run), run, first)
    psi = torch.exp(logits_k - half_sq_norm - run[..., None])  # <= 1; 0 for padded keys

    # Stabiliser terms: prefix sums of the real values and their count.
    valid = torch.ones_like(run) if key_padding_mask is None else key_padding_mask[:, None, :].to(run.dtype)
    valid = valid.expand(b, h, t)
    v_sum = torch.cumsum(v * valid[..., None], dim=2)
    count = torch.cumsum(valid, dim=2)
    q_total = phi_q.sum(dim=-1)

    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    if pad:  # zero keys past the end; their queries are cut off below
        phi_q, psi, v = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, psi, v))
        run = F.pad(run, (0, pad), mode="replicate")
    qc, kc = phi_q.reshape(b, h, n, c, m), psi.reshape(b, h, n, c, m)
    vc, rc = v.reshape(b, h, n, c, v.shape[-1]), run.reshape(b, h, n, c)  # -1: ambiguous at B = 0

    # Inside each chunk: weights (φ_i·ψ_j) e^{m_j − m_i} for j <= i.
    lower = torch.ones(c, c, dtype=torch.bool, device=run.device).tril()
    gap = (rc[..., None, :] - rc[..., :, None]).masked_fill(~lower, 0.0)  # m_j − m_i <= 0 below the diagonal
    weights = torch.einsum("bhncm,bhnsm->bhncs", qc, kc) * torch.exp(gap) * lower
    num = torch.einsum("bhncs,bhnse->bhnce", weights, vc)
    den = weights.sum(dim=-1)

    # Across chunks: S_k = Σ_{j before chunk k} ψ_j e^{m_j − P_k} v_j with P_k = m at the end of
    # chunk k − 1, so S_{k+1} = e^{P_k − P_{k+1}} S_k + (chunk k's keys rescaled to P_{k+1}).
    if n > 1:
        end = rc[..., -1]  # (b, h, n)
        to_end = kc * torch.exp(rc - end[..., None])[..., None]
        chunk_state = torch.einsum("bhncm,bhnce->bhnme", to_end, vc)
        chunk_norm = to_end.sum(dim=3)
        # One unbind each (indexing inside the loop would cost a full-size gradient per chunk).
        chunk_states, chunk_norms = chunk_state.unbind(2), chunk_norm.unbind(2)
        decays = torch.exp(end[:, :, :-1] - end[:, :, 1:])[..., None].unbind(2)  # e^{P_k − P_{k+1}}
        states, norms = [chunk_states[0]], [chunk_norms[0]]
        for k in range(1, n - 1):
            states.append(torch.addcmul(chunk_states[k], states[-1], decays[k - 1][..., None]))
            norms.append(torch.addcmul(chunk_norms[k], norms[-1], decays[k - 1]))
        prev_state = torch.stack(states, dim=2)  # (b, h, n - 1, m, e): the state for chunks 1..n-1
        prev_norm = torch.stack(norms, dim=2)
        q_seen = qc[:, :, 1:] * torch.exp(end[:, :, :-1, None] - rc[:, :, 1:])[..., None]
        num = torch.cat(
            [num[:, :, :1], num[:, :, 1:] + torch.einsum("bhncm,bhnme->bhnce", q_seen, prev_state)], 2
        )
        den = torch.cat(
            [den[:, :, :1], den[:, :, 1:] + torch.einsum("bhncm,bhnm->bhnc", q_seen, prev_norm)], 2
        )
    num = num.reshape(b, h, n * c, v.shape[-1])[:, :, :t] + stabilizer_eps * q_total[..., None] * v_sum
    den = den.reshape(b, h, n * c)[:, :, :t] + stabilizer_eps * q_total * count
    scale = m**-0.5
    out = num * scale / (den * scale + eps)[..., None]
    if key_padding_mask is not None:
        out = out * key_padding_mask[:, None, :, None].to(out.dtype)
    return out


def _seeded_draw(seed: int, index: int, num_features: int, head_dim: int) -> torch.Tensor:
    """Draw number ``index`` of the sequence seeded with ``seed``: the same (M, D) on every device."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return orthogonal_gaussian_projection(num_features, head_dim, generator).float()


def _schedule_step(projection: torch.Tensor, schedule: torch.Tensor, seed: int, interval: int) -> None:
    """One training call of a feature map: redraw ``projection`` in place when the schedule says
    so, then count the call. ``schedule`` is the (calls, draws) pair, an int64 CPU tensor."""
    calls, draws = schedule.tolist()
    if interval > 0 and calls > 0 and calls % interval == 0:
        draws += 1
        with torch.no_grad():
            projection.copy_(_seeded_draw(seed, draws, *projection.shape).to(projection.dtype))
    schedule.copy_(torch.tensor([calls + 1, draws]))


def _registered_schedule_step():
    """`_schedule_step` as the custom op ``attnlab::performer_schedule_step``: ``torch.compile``
    calls it in the graph (no break) and never reads the counters, so the graph does not depend on
    them (as plain ints on the module they were guarded: a recompile at every call)."""
    return compiler.library_op(
        "performer_schedule_step",
        _schedule_step,
        fake=lambda projection, schedule, seed, interval: None,
        mutates_args=("projection", "schedule"),
    )


_SCHEDULE_STEP = _registered_schedule_step()


class PerformerFeatureMap(nn.Module):
    """Holds the random projection and redraws it every `redraw_interval` training forward calls.

    Redrawing stops the model from overfitting one particular draw. Draw number n uses a generator
    seeded with (seed, n), so a run is reproducible and a checkpoint (projection buffer, counters as
    extra state) resumes the same schedule. `redraw_interval=None` (or 0) keeps the first draw forever.
    The counters live in a CPU tensor that a custom op advances (`_registered_schedule_step`): no
    device sync per step, and one compiled graph for every call.
    """

    def __init__(
        self,
        head_dim: int,
        num_features: int = 256,
        redraw_interval: int | None = 1000,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"num_features must be a positive integer, got {num_features}")
        if redraw_interval is not None and redraw_interval < 0:
            raise ValueError(f"redraw_interval must be None, 0 (never) or positive, got {redraw_interval}")
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # follows torch.manual_seed
        self.head_dim = head_dim
        self.num_features = num_features
        self.redraw_interval = redraw_interval or None
        self.seed = seed
        # (training calls so far, draws); not a buffer: it stays on the CPU when the model moves
        self.schedule = torch.zeros(2, dtype=torch.int64)
        self.register_buffer("projection", _seeded_draw(seed, 0, num_features, head_dim))

    @property
    def calls(self) -> int:
        """Training forward calls so far."""
        return int(self.schedule[0])

    @property
    def draws(self) -> int:
        """Redraws so far (the projection is draw number ``draws``)."""
        return int(self.schedule[1])

    @torch.no_grad()
    def redraw(self) -> None:
        """Replace the projection by the next draw of this module's seeded sequence."""
        self.schedule[1] += 1
        new = _seeded_draw(self.seed, self.draws, self.num_features, self.head_dim)
        self.projection.copy_(new.to(self.projection.dtype))

    def forward(self) -> torch.Tensor:
        """Count one call (in training mode), redraw when the schedule says so, return (M, D)."""
        if self.training:
            _SCHEDULE_STEP(self.projection, self.schedule, self.seed, self.redraw_interval or 0)
        return self.projection

    def get_extra_state(self) -> dict:
        """Checkpoints keep the schedule position, so a resumed run redraws when the original would."""
        return {"calls": self.calls, "draws": self.draws, "seed": self.seed}

    def set_extra_state(self, state: dict) -> None:
        self.schedule = torch.tensor([int(state["calls"]), int(state["draws"])])
        self.seed = int(state["seed"])

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, "
            f"redraw_interval={self.redraw_interval}, seed={self.seed}"
        )
