"""Row helpers shared by the sliced ops' torch and Triton paths (``(N = B·H, T, ...)`` rows).

Why they look the way they do (page faults, ``index_select`` against ``gather``, centring for
precision) is in the package docstring, ``attnlab.attention.sliced_common``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.attention.common import compiler, native
from attnlab.attention.common.precision import FLOAT_DTYPES


def row_offsets(n_rows: int, row_len: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(n_rows, device=device) * row_len)[:, None]


def take_rows(table: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``table[n, index[n, m]]`` for a contiguous table ``(N, L, C)`` and ``index (N, M)``.

    One ``index_select`` on the flattened table (rows of C contiguous numbers) instead of a
    ``gather`` with an expanded index: same result, several times faster on CPU.
    """
    n_rows, row_len, width = table.shape
    flat = (index + row_offsets(n_rows, row_len, index.device)).reshape(-1)
    if out is None:
        return table.view(-1, width).index_select(0, flat).view(n_rows, -1, width)
    torch.index_select(table.view(-1, width), 0, flat, out=out.view(-1, width))
    return out


def take_difference(table: torch.Tensor, plus: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """``table[n, plus[n, m]] − table[n, minus[n, m]]`` for a contiguous table ``(N, L, C)`` and
    indices ``(N, M)``: prefix sums read as a difference (a segment's sum up to a rank, less its sum
    before its start).

    One ``embedding_bag`` of two-row bags weighted +1 and −1: each output row is written once, where
    two ``take_rows`` and a ``sub_`` write two gathered tensors and pass over them again (the same
    numbers: one rounding of the difference either way).
    """
    n_rows, row_len, width = table.shape
    offsets = row_offsets(n_rows, row_len, plus.device)
    bags = torch.stack([plus + offsets, minus + offsets], dim=-1).view(-1, 2)
    signs = torch.tensor([1.0, -1.0], dtype=table.dtype, device=table.device).expand(bags.shape[0], 2)
    out = F.embedding_bag(bags, table.view(-1, width), per_sample_weights=signs.contiguous(), mode="sum")
    return out.view(n_rows, -1, width)


def reuse_buffer(table: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A contiguous ``shape`` view on the front of ``table``'s memory, for a result that replaces it.

    Big fresh allocations are slow on CPU (page faults) and raise the peak: once a prefix table
    has been read for the last time, the gathered result is written over it.
    """
    return table.view(-1)[: shape.numel()].view(shape)


def take_scalar(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[n, index[n, m]]`` for a table ``(N, L)``."""
    return torch.gather(table, 1, index)


def sorted_rows(
    values: torch.Tensor, order: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None
) -> torch.Tensor:
    """``(values[order] - shift) · scale`` as a contiguous ``(N, T + 1, D)`` table whose row 0 is 0.

    The extra zero row makes the in-place ``cumsum_`` of the table an *exclusive* prefix sum:
    ``P[:, k] = Σ_{m<k} row_m``, so ``P[:, rank]`` is the sum over the ``rank`` smallest scores.
    ``shift`` is ``(N, D)`` (centring), ``scale`` is ``(N, T)`` in sorted order (masks, per-query
    weights); ``None`` skips the step. One row gather builds the table.
    """
    n_rows = values.shape[0]
    index = torch.cat([order.new_zeros(n_rows, 1), order], dim=1)  # row 0: any row, zeroed next
    table = take_rows(values, index)
    table[:, 0] = 0
    rows = table[:, 1:]
    if shift is not None:
        rows.sub_(shift[:, None, :])
    if scale is not None:
        rows.mul_(scale[..., None])
    return table


def times_scores(table: torch.Tensor, scores_sorted: torch.Tensor) -> torch.Tensor:
    """The table of ``score · row`` beside a table from ``sorted_rows`` (before its cumsum)."""
    out = torch.empty_like(table)
    out[:, 0] = 0
    torch.mul(table[:, 1:], scores_sorted[..., None], out=out[:, 1:])
    return out


def cumsum_rows_(table: torch.Tensor, block: int = 128) -> torch.Tensor:
    """In-place cumulative sum over dim 1 of a contiguous ``(N, L, D)`` table, cache-blocked.

    ``cumsum`` over a middle dimension scans each of the D columns separately through the whole
    table (a cache line is fetched once per column); scanning blocks of ``block`` rows that fit
    in cache, then adding each block's carried total, reads the table about twice instead.
    """
    n_rows, length, width = table.shape
    n_blocks = length // block
    if n_blocks < 2:
        return table.cumsum_(1)
    body = table[:, : n_blocks * block].view(n_rows, n_blocks, block, width)
    body.cumsum_(2)
    carry = body[:, :, -1, :].cumsum(1)  # running total at the end of each block
    body[:, 1:].add_(carry[:, :-1, None, :])
    tail = table[:, n_blocks * block :]
    if tail.shape[1]:
        tail.cumsum_(1).add_(carry[:, -1:, :])
    return table


def count_greater(rank: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """For each key j (original order): ``#{i : rank_i > position of key j in sorted order}``.

    ``rank (N, T)`` are query ranks among the sorted keys (values 0..T), ``order`` the key sort
    order. A histogram of the ranks, summed from the top, is read at every sorted position.
    """
    n_rows, length = rank.shape
    hist = torch.zeros(n_rows, length + 1, dtype=rank.dtype, device=rank.device)
    hist.scatter_add_(1, rank, torch.ones_like(rank))
    greater = length - hist.cumsum_(1)  # greater[:, r] = #{i : rank_i > r}
    return torch.empty_like(order).scatter_(1, order, greater[:, :length])


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``(N, T)`` → ``(N, T + 1)`` prefix sums starting at 0."""
    return torch.nn.functional.pad(torch.cumsum(x, dim=1), (1, 0))


def valid_rows(key_padding_mask: torch.Tensor | None, heads: int, device=None) -> torch.Tensor | None:
    """``(B, T)`` mask → one row per (batch, head), ``(B·H, T)`` (on ``device`` when given)."""
    if key_padding_mask is None:
        return None
    rows = key_padding_mask.repeat_interleave(heads, dim=0)
    return rows if device is None else rows.to(device)


def real_keys(valid: torch.Tensor | None, n_rows: int, length: int) -> torch.Tensor:
    """Number of real keys per row as an int64 count, 0 for an all-padded row: the CPU kernels walk the
    first that many of each row's keys sorted real-first."""
    return valid.sum(dim=1) if valid is not None else torch.full((n_rows,), length)


def real_counts(valid: torch.Tensor | None, n_rows: int, length: int, dtype, device) -> torch.Tensor:
    """Number of real tokens per row, at least 1 (an all-padded row then outputs zeros)."""
    if valid is None:
        return torch.full((n_rows,), float(length), dtype=dtype, device=device)
    return valid.sum(dim=1).clamp_min(1).to(dtype)


SORT_KERNELS = Path(__file__).with_name("sort_kernels.cpp")
_SORT_ARGTYPES = {"sort_rows": [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5}


def sort_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(x, dim=1)`` of ``(N, T)`` scores: on the CPU a radix sort in C++ (``sort_kernels.cpp``,
    the rows on torch's threads; torch's is a comparison sort), the same values and an order equally
    valid (ties in index order); elsewhere, with ``ATTNLAB_NATIVE=off`` or under autograd, torch's."""
    tracked = x.requires_grad and torch.is_grad_enabled()
    found = None if tracked else native.cpu_kernels(x, SORT_KERNELS, _SORT_ARGTYPES)
    if found is None or x.dim() != 2:
        return torch.sort(x, dim=1)
    x = x.contiguous()
    values, order = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int64)
    native.call_rows(found["sort_rows"], (x, values, order), (*x.shape, 1))
    return values, order


def sort_real_first(scores: torch.Tensor, valid: torch.Tensor | None):
    """Sort scores ascending with padded slots last. Returns the sorted scores with padded = +inf
    (for ``searchsorted``: no finite score ranks past a real one), the same with padded = 0 (for
    arithmetic: never inf · 0) and the sort order."""
    key = scores if valid is None else scores.masked_fill(~valid, float("inf"))
    ordered, order = sort_rows(key)
    if valid is None:
        return ordered, ordered, order
    return ordered, ordered.masked_fill(~torch.gather(valid, 1, order), 0.0), order


def masked_mean_rows(values: torch.Tensor, valid: torch.Tensor | None, count: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens of ``values (N, T, D)`` → ``(N, D)``. Padded rows may hold anything, NaN
    included, so they are zeroed in a copy rather than weighted by 0 (which keeps NaN); the copy is
    gone before the sorted ops build their prefix tables, where their memory peaks."""
    if valid is None:
        return values.mean(dim=1)
    return values.masked_fill(~valid[..., None], 0.0).sum(dim=1) / count[:, None]


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``(N, T, D)`` tensors without a T×D temporary."""
    return torch.einsum("ntd,ntd->nt", a, b)


def centre_scores(s, t, valid, count, queries):
    """Shift s and t by one constant per row, near the mean of the real scores; t at padded keys and
    s outside ``queries`` (the queries whose output is kept; None = all) come back 0.

    The kernels depend on s - t only, so the shift changes nothing in exact arithmetic (and needs
    no gradient), but it does in floating point: the prefix tables of t·v and the products s·P
    grow with the scores' offset, so at an offset of 100 float32 kept about 3 digits of a narrow
    bump window. The shift is the mean rounded to a power of two near the scores' spread, so
    that s - c is exact for any score within about |c| of c (the kernels see the very same
    differences, kinks and ties included) while the centred scores stay of the order of the spread.
    The statistics read the real positions only (padded slots may hold anything, inf included).
    """
    centre = score_centre(s, t, valid, count)
    s, t = s - centre, t - centre
    if valid is not None:
        t = t.masked_fill(~valid, 0.0)
    if queries is not None:
        s = s.masked_fill(~queries, 0.0)
    return s, t


def score_centre(s, t, valid, count):
    """The per-row constant ``centre_scores`` subtracts, ``(N, 1)`` (see there)."""
    s_real, t = (s, t) if valid is None else (s.masked_fill(~valid, 0.0), t.masked_fill(~valid, 0.0))
    mean = ((s_real.sum(dim=1) + t.sum(dim=1)) / (2 * count))[:, None]
    spread = (s_real - mean).square() + (t - mean).square()
    if valid is not None:
        spread = spread * valid.to(s.dtype)
    std = (spread.sum(dim=1, keepdim=True) / (2 * count[:, None])).sqrt()
    step = torch.exp2(torch.floor(torch.log2(std)))  # 0 when all scores are equal
    ok = (step > 0) & torch.isfinite(step)
    return torch.where(ok, torch.round(mean / torch.where(ok, step, 1.0)) * step, mean)


def finite_rows(s, t):
    """Centred scores (``centre_scores``) with every row holding a non-finite one set to 0, and
    those rows ``bad (N,)``: their outputs and gradients are NaN (``nan_rows``), the rest exact.

    A NaN or inf score (or scores whose statistics overflow) makes the centring put NaN or ±inf in
    every score of its row, and NaN has no place in an order: ``sort`` and ``searchsorted`` then
    disagree, and the Triton path's merged stream (positions from both) would leave slots unwritten
    and index out of bounds. With the bad rows' scores zeroed, every row orders finite numbers; both
    paths then write NaN over exactly the same entries. Padded keys and dropped queries are 0
    already (``centre_scores``), so whatever they held does not make a row bad.
    """
    bad = ~(torch.isfinite(s).all(dim=1) & torch.isfinite(t).all(dim=1))
    return s.masked_fill(bad[:, None], 0.0), t.masked_fill(bad[:, None], 0.0), bad


def nan_rows(x, bad, keep=None):
    """``x (N, T[, D])`` with NaN in the ``bad`` rows, at the positions ``keep (N, T)`` (None: all).

    Outputs are poisoned at the kept queries (dropped ones stay 0), gradients at the positions they
    flow to (kept queries for s, real keys for t and v); the bandwidth's ``(N, 1)`` at the bad rows.
    In place. On CPU the pass is skipped when no row is bad; on CUDA asking would stall the stream.
    """
    if compiler.host_reads_allowed(x) and not bool(bad.any()):
        return x
    where = bad[:, None] if keep is None else bad[:, None] & keep
    if x.dim() == 3:
        where = where[..., None]
    return x.masked_fill_(where, float("nan"))


def first_order_only(op_name: str, way_out: str | None = None):
    """Refuse double backward up front: the hand-written backward passes are first order only.

    Run with ``create_graph=True``, they would fail deep inside with an ``out=`` error (or, run
    without a graph, give silently wrong second derivatives); this names the op and the way out
    (``way_out``, by default the op's dense path and its reference).
    """
    if way_out is None:
        way_out = f"{op_name}(..., path='dense') or attnlab.attention.reference.{op_name} (O(T²) memory)"

    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():  # the engine enables grad mode only for create_graph=True
                raise RuntimeError(
                    f"{op_name}: double backward (create_graph=True, e.g. gradient penalties, "
                    "Hessian-vector products, gradgradcheck) is not supported: its O(T log T) "
                    "backward pass is hand-written and first order only. For higher-order "
                    f"gradients use {way_out}."
                )
            return backward(ctx, *grads)

        return checked

    return decorate


# hat windows (ReLU-bump, torch code)


def hat_windows(search: torch.Tensor, centres: torch.Tensor, width: torch.Tensor):
    """Ranks bounding the windows (c - b, c] and (c, c + b) of each centre among sorted scores."""
    lo = torch.searchsorted(search, centres - width, side="right")  # #{x <= c - b}
    mid = torch.searchsorted(search, centres, side="right")  # #{x <= c}
    hi = torch.searchsorted(search, centres + width, side="left")  # #{x < c + b}
    return lo, mid, hi


def hat_terms(lo, mid, hi, centres, width, coef):
    """Coefficients of ``Σ_{x∈(c-b, c+b)} (1 - |c - x|/b) row`` on the prefix tables P (rows) and
    P_x (score·rows): with L = P[mid] - P[lo] (window (c-b, c]) and R = P[hi] - P[mid] ((c, c+b)),
    b·Σ = (b - c) L + L_x + (b + c) R - R_x, i.e. P[lo]·-(b - c) + P[mid]·-2c + P[hi]·(b + c)
    and P_x[lo]·-1 + P_x[mid]·2 + P_x[hi]·-1; ``coef`` (per centre) multiplies everything."""
    rows = [(lo, -(width - centres) * coef), (mid, -2 * centres * coef), (hi, (width + centres) * coef)]
    scored = [(lo, -coef), (mid, 2 * coef), (hi, -coef)]
    return rows, scored


def key_windows(p_t, lo, mid, hi, dtype):
    """Key counts and key-score sums of the windows (c - b, c] and (c, c + b) of every centre c.

    ``p_t`` is the float64 exclusive prefix sum of the sorted key scores: unlike the vector tables,
    its running total is of order T·E|t| (no sign cancellation), so its differences are taken in
    float64 (an (N, T) table: cheap) before the result is rounded to ``dtype``.
    """
    left_n, right_n = (mid - lo).to(dtype), (hi - mid).to(dtype)
    at_lo, at_mid, at_hi = (torch.gather(p_t, 1, k) for k in (lo, mid, hi))
    return left_n, right_n, (at_mid - at_lo).to(dtype), (at_hi - at_mid).to(dtype)


def check_scores_inputs(name, s, t, v, key_padding_mask) -> None:
    for label, x in (("s", s), ("t", t), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {label} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: {label} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if v.dim() != 4:
        raise ValueError(f"{name}: v must have shape (B, H, T, D), got {tuple(v.shape)}")
    batch, heads, length, _ = v.shape
    for label, x in (("s", s), ("t", t)):
        if tuple(x.shape) != (batch, heads, length):
            raise ValueError(
                f"{name}: {label} must have shape (B, H, T) = {(batch, heads, length)} to match "
                f"v {tuple(v.shape)}, got {tuple(x.shape)}"
            )
    if length == 0:
        raise ValueError(
            f"{name}: sequences must hold at least one position (T >= 1), got v {tuple(v.shape)}"
        )
    if not (s.device == t.device == v.device):
        raise ValueError(f"{name}: s, t, v must be on one device, got {s.device}, {t.device}, {v.device}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{name}: key_padding_mask must be a bool tensor (True = real token)")
        if tuple(key_padding_mask.shape) != (batch, length):
            raise ValueError(
                f"{name}: key_padding_mask must have shape (B, T) = {(batch, length)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )


def as_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, T, ...)`` → contiguous ``(B·H, T, ...)`` in ``dtype``."""
    return x.reshape(-1, *x.shape[2:]).to(dtype).contiguous()
