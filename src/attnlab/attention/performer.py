"""Performer / FAVOR+ attention (Choromanski et al. 2020): positive orthogonal random features.

exp(qᵀk/√D) = E_w[φ(q)ᵀφ(k)] with φ(x) = exp(wᵀx − |x|²/2)/√M, w ~ N(0, I), x = q/D^¼. The features are
positive, so the softmax normaliser is estimated without the sign cancellations of trigonometric
features; drawing the w in orthogonal blocks lowers the variance further. Attention is then linear
attention on these features (same chunked causal form as `linear.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab.attention.linear import DEFAULT_CHUNK_SIZE, linear_attention_from_features
from attnlab.attention.precision import accumulation_dtype, no_autocast
from attnlab.attention.softmax import check_qkv


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


def favor_features(
    x: torch.Tensor,
    projection: torch.Tensor,
    is_query: bool,
    key_padding_mask: torch.Tensor | None = None,
    stabilizer_eps: float = 1e-4,
    causal: bool = False,
) -> torch.Tensor:
    """Positive random features of x (B, H, T, D) -> (B, H, T, M), in x's dtype.

    exp(·) overflows for large logits, so a maximum is subtracted inside the exponential. It must cancel
    in the ratio φ(q)ᵀS / φ(q)ᵀz: for queries any per-query constant cancels (per-row max); for keys the
    constant must be shared by all keys of a sequence and head (max over its *valid* keys, so padding
    cannot change it). `stabilizer_eps` keeps features away from exact zero, as in the reference code.
    With `causal`, that key constant must not depend on later keys either (with `stabilizer_eps` and
    the normaliser's eps it does not cancel exactly): the first valid key's maximum, raised to at
    least max_m |w_m|²/2 − 60 (every logit − |x|²/2 is below max_m |w_m|²/2, so exp stays under e^60).
    """
    d = x.shape[-1]
    x = x * d**-0.25
    logits = torch.einsum("bhtd,md->bhtm", x, projection.to(x.dtype))
    sq_norm = 0.5 * (x * x).sum(dim=-1, keepdim=True)
    if is_query:
        shift = logits.amax(dim=-1, keepdim=True)
    else:
        masked = logits
        if key_padding_mask is not None:
            masked = logits.masked_fill(~key_padding_mask[:, None, :, None], float("-inf"))
        if causal:
            first = 0 if key_padding_mask is None else key_padding_mask.to(torch.int8).argmax(dim=-1)
            first = torch.as_tensor(first, device=x.device).expand(x.shape[0])
            shift = logits[torch.arange(x.shape[0], device=x.device), :, first].amax(dim=-1)[:, :, None, None]
            bound = 0.5 * (projection.to(x.dtype) ** 2).sum(dim=-1).amax() - 60.0
            shift = torch.maximum(shift, bound)
        else:
            shift = masked.amax(dim=(-1, -2), keepdim=True)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # fully padded sequence
    shift = shift.detach()  # a constant that cancels: no gradient needed through it
    m = projection.shape[0]
    return (torch.exp(logits - sq_norm - shift) + stabilizer_eps) * m**-0.5


def performer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    projection: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """FAVOR+ estimate of softmax attention for q, k (B, H, T, D), v (B, H, T, Dv), projection (M, D).

    Features and states run in float32 (float64 for float64 inputs); output in v's dtype.
    """
    check_qkv(q, k, v, key_padding_mask)
    if projection.dim() != 2 or projection.shape[1] != q.shape[-1]:
        raise ValueError(f"projection must be (num_features, D={q.shape[-1]}); got {tuple(projection.shape)}")
    with no_autocast(q.device):
        acc = accumulation_dtype(q.dtype)
        phi_q = favor_features(q.to(acc), projection, is_query=True)
        phi_k = favor_features(
            k.to(acc), projection, is_query=False, key_padding_mask=key_padding_mask, causal=causal
        )
        out = linear_attention_from_features(
            phi_q, phi_k, v.to(acc), key_padding_mask, causal=causal, eps=eps, chunk_size=chunk_size
        )
    return out.to(v.dtype)


class PerformerFeatureMap(nn.Module):
    """Holds the random projection and redraws it every `redraw_interval` training forward calls.

    Redrawing stops the model from overfitting one particular draw. Draw number n uses a generator
    seeded with (seed, n), so a run is reproducible and a checkpoint (projection buffer, counters as
    extra state) resumes the same schedule. `redraw_interval=None` (or 0) keeps the first draw forever.
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
        self.calls = 0  # training forward calls so far; plain ints: no device sync per step
        self.draws = 0
        self.register_buffer("projection", self._draw(0))

    def _draw(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return orthogonal_gaussian_projection(self.num_features, self.head_dim, generator).float()

    @torch.no_grad()
    def redraw(self) -> None:
        """Replace the projection by the next draw of this module's seeded sequence."""
        self.draws += 1
        new = self._draw(self.draws)
        self.projection.copy_(new.to(self.projection.dtype))

    def forward(self) -> torch.Tensor:
        """Count one call (in training mode), redraw when the schedule says so, return (M, D)."""
        if self.training:
            interval = self.redraw_interval
            if interval is not None and self.calls > 0 and self.calls % interval == 0:
                self.redraw()
            self.calls += 1
        return self.projection

    def get_extra_state(self) -> dict:
        """Checkpoints keep the schedule position, so a resumed run redraws when the original would."""
        return {"calls": self.calls, "draws": self.draws, "seed": self.seed}

    def set_extra_state(self, state: dict) -> None:
        self.calls, self.draws, self.seed = int(state["calls"]), int(state["draws"]), int(state["seed"])

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, "
            f"redraw_interval={self.redraw_interval}, seed={self.seed}"
        )
