"""The sliced ops on packed rows: several sequences (segments) end to end in each row, each query
summing the keys of its own segment only.

Sorting each row by (segment, score) puts every segment's keys in one contiguous run of the sorted
order, at the same positions its tokens hold in the row (segments are contiguous runs). Prefix sums
over the whole sorted row then give a segment's sums as differences ``P[k] - P[start]``: the sums
restart at each segment without a loop over segments. The searches use integer codes
``run · K + rank`` (``rank``: the dense rank of a score among every score and window bound of the
row), so a search never leaves its segment and ties compare exactly as the floats do.

Scores are centred per segment (``segment_centre``: the shift ``centre_scores`` makes for a padded
row, from the segment's own statistics) and values per segment (``w = v − mean``), so each segment's
running totals stay of its own order. A segment holding a non-finite score or value gives NaN at its
own tokens and nothing else: its inputs are zeroed before the shared prefix sums (a NaN there would
reach every later segment of the row).

Both ops have hand-written backward passes, as the padded ops: the keys' side sorts each segment's
queries (by descending score for sliced ReLU, ascending for ReLU-bump's windows), and the kinks take
the references' conventions (``relu'(0) = abs'(0) = 0``: tied keys in neither one-sided sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from attnlab.attention.common.packing import run_ids
from attnlab.attention.common.precision import FLOAT_DTYPES, accumulation_dtype, no_autocast
from attnlab.attention.common.triton import runtime
from attnlab.attention.sliced_common.dominance import prefix_sums_
from attnlab.attention.sliced_common.rows import take_rows


@dataclass(frozen=True)
class Runs:
    """Where each token's segment lies in its row, for rows ``(N = B·H, L)``.

    ``local``: the segment's index within its row (0, 1, ...); ``start``: the position of its first
    token; ``size``: its number of tokens, each (N, L) int64 per token.
    """

    local: torch.Tensor
    start: torch.Tensor
    size: torch.Tensor

    @property
    def end(self) -> torch.Tensor:
        return self.start + self.size

    def flat(self) -> torch.Tensor:
        """Each token's segment as an index into (N·L) per-segment slots (row n's at n·L + local)."""
        rows, length = self.local.shape
        return (self.local + torch.arange(rows, device=self.local.device)[:, None] * length).reshape(-1)


def segment_runs(segments: torch.Tensor, heads: int) -> Runs:
    """The `Runs` of packed rows ``segments`` (B, L), repeated for ``heads`` rows per batch row.

    A new segment starts wherever the id changes: ids need only differ between neighbouring
    segments (`PackedLayout.segments` gives each sequence its own, empty slots one more)."""
    batch, length = segments.shape
    change = segments[:, 1:] != segments[:, :-1]
    edge = torch.ones(batch, 1, dtype=torch.bool, device=segments.device)
    first, last = torch.cat([edge, change], dim=1), torch.cat([change, edge], dim=1)
    position = torch.arange(length, device=segments.device).expand(batch, -1)
    local = run_ids(segments)
    start = torch.where(first, position, 0).cummax(1).values
    end = torch.where(last, position + 1, length).flip(1).cummin(1).values.flip(1)
    return Runs(*(x.repeat_interleave(heads, dim=0) for x in (local, start, end - start)))


def segment_sum(x: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Each token's segment total of ``x`` (N, L[, D]), back at every token of the segment."""
    rows, length = runs.local.shape
    index = runs.flat()
    flat = x.reshape(rows * length, -1)
    totals = flat.new_zeros(flat.shape).index_add(0, index, flat)
    return totals.index_select(0, index).view(x.shape)


def segment_mean(x: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Each token's segment mean of ``x`` (N, L[, D])."""
    size = runs.size.to(x.dtype)
    return segment_sum(x, runs) / (size if x.dim() == 2 else size[..., None])


def segment_running_sum(x: torch.Tensor, runs: Runs) -> torch.Tensor:
    """``Σ_{j ≤ i} x_j`` along dim 1 of ``(N, L)`` or ``(N, L, D)`` over the token's own segment: the
    row's running sum less its value before the segment (`within_segments`), back in x's dtype.

    Taken in float64: in float32 the difference of two row totals keeps the rounding of every
    earlier sequence's sum (14x the error of each sequence alone for the causal sliced ReLU op over
    8 sequences of 512 tokens, measured). ``(N, L, D)`` adds rows (`prefix_sums_`), faster on CPU
    than ``cumsum`` over a middle dimension."""
    wide = x.to(torch.float64)
    total = (
        wide.cumsum(1) if x.dim() == 2 else prefix_sums_(wide.clone(memory_format=torch.contiguous_format))
    )
    return within_segments(total, runs).to(x.dtype)


def within_segments(total: torch.Tensor, runs: Runs) -> torch.Tensor:
    """A running total along dim 1 (``(N, L)`` or ``(N, L, D)``, inclusive) restarted at each
    segment's start: less its value just before the start (`read_at`)."""
    return total - read_at(total, runs.start - 1)


def read_at(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[n, index[n, i]]`` for ``(N, L)`` or ``(N, L, D)``, zero where the index leaves the row."""
    inside = (index >= 0) & (index < table.shape[1])
    index = index.clamp(0, table.shape[1] - 1)
    if table.dim() == 2:
        return torch.gather(table, 1, index) * inside
    return take_rows(table.contiguous(), index) * inside[..., None]


def broken_segments(runs: Runs, *tensors: torch.Tensor) -> torch.Tensor:
    """(N, L) bool: the tokens whose segment holds a non-finite entry in any of ``tensors``
    ((N, L) or (N, L, D))."""
    bad = torch.zeros_like(runs.local, dtype=torch.bool)
    for x in tensors:
        bad |= ~_finite_tokens(x)
    return segment_sum(bad.to(torch.float32), runs) > 0


def _finite_tokens(x: torch.Tensor) -> torch.Tensor:
    """(N, L) bool: every entry of the token finite. For (N, L, D), through the largest and smallest
    entry (NaN and ±inf reach them), about 5× faster on CPU than ``isfinite(x).all(-1)``."""
    if x.dim() == 2:
        return torch.isfinite(x)
    return torch.isfinite(x.amax(-1)) & torch.isfinite(x.amin(-1))


def segment_centre(s: torch.Tensor, t: torch.Tensor, runs: Runs) -> torch.Tensor:
    """The per-segment shift of ``centre_scores``: the mean of the segment's scores rounded to a power
    of two near their spread, so that subtracting it is exact and the ops see the very same
    differences s − t. (N, L), constant over each segment; no gradient flows through it."""
    s, t = s.detach(), t.detach()
    mean = segment_mean(s + t, runs) / 2
    spread = segment_mean((s - mean).square() + (t - mean).square(), runs) / 2
    step = torch.exp2(torch.floor(torch.log2(spread.sqrt())))  # 0 when all scores are equal
    ok = (step > 0) & torch.isfinite(step)
    return torch.where(ok, torch.round(mean / torch.where(ok, step, 1.0)) * step, mean)


def on_packed_rows(
    op, s: torch.Tensor, t: torch.Tensor, v: torch.Tensor, segments: torch.Tensor, acc, centre: bool = True
):
    """``op(s, t, v, runs)`` on rows (N = B·H, L[, D]) in the accumulation dtype ``acc``, back as
    (B, H, L, D) in v's dtype: scores centred per segment (`segment_centre`; not with ``centre=False``:
    the causal ops shift by each segment's first key instead, which sees no later token), every
    broken segment (`broken_segments`) zeroed on the way in and NaN at its tokens on the way out (a
    NaN inside the shared prefix sums would reach every later segment of the row)."""
    batch, heads, length, dim = v.shape
    with no_autocast(v.device):
        s, t = (x.reshape(-1, length).to(acc) for x in (s, t))
        v_rows = v.reshape(-1, length, dim).to(acc)
        runs = segment_runs(segments, heads)
        bad = broken_segments(runs, s, t, v_rows)
        # on the CPU a clean batch (the rule) skips the two passes over v; elsewhere no host read
        clean = v.device.type == "cpu" and not bool(bad.any())
        if not clean:
            s, t = s.masked_fill(bad, 0.0), t.masked_fill(bad, 0.0)
            v_rows = v_rows.masked_fill(bad[..., None], 0.0)
        if centre:
            shift = segment_centre(s, t, runs)
            s, t = s - shift, t - shift
        out = op(s, t, v_rows, runs)
        if not clean:
            out = out.masked_fill(bad[..., None], float("nan"))
    return out.view(batch, heads, length, dim).to(v.dtype)


def dense_ranks(values: torch.Tensor) -> torch.Tensor:
    """Each entry's rank among the distinct values of its row (N, K): equal values, equal rank."""
    ordered, order = torch.sort(values, dim=1)
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return torch.empty_like(order).scatter_(1, order, new.long().cumsum(1))


@dataclass(frozen=True)
class SortedKeys:
    """Keys sorted by (segment, score) and the searches among them (`sort_keys`).

    ``order`` (N, L): the sort; ``codes``: the keys' codes in that order (nondecreasing);
    ``probe_codes`` (N, P·L): the probes' codes, probe after probe, each ``width`` wide."""

    order: torch.Tensor
    codes: torch.Tensor
    probe_codes: torch.Tensor
    width: int
    base: int  # codes are run · base + rank, rank < base

    def descending(self, probe: int, runs: Runs) -> torch.Tensor:
        """Codes that order probe ``probe`` by (segment, −score): a sort of them puts each segment's
        probes in one run, largest score first."""
        return (2 * runs.local + 1) * self.base - self.probe(probe)

    def among(self, probe: int, others: list[int]) -> SortedKeys:
        """Probe ``probe`` sorted as the keys, with probes ``others`` to search among them (the same
        ranks: one sort of every score of the row serves both sides of a backward pass)."""
        codes, order = torch.sort(self.probe(probe), dim=1)
        return SortedKeys(order, codes, torch.cat([self.probe(i) for i in others], 1), self.width, self.base)

    def probe(self, probe: int) -> torch.Tensor:
        """The codes of probe ``probe`` (N, L)."""
        return self.probe_codes[:, probe * self.width : (probe + 1) * self.width]

    def rank(self, probe: int, side: str) -> torch.Tensor:
        """Sorted position of the first key of probe ``probe``'s segment with a score ``>=`` it
        (side "left": its own segment's keys ``<`` it, plus every earlier segment's keys) or
        ``>`` it (side "right")."""
        return torch.searchsorted(self.codes, self.probe(probe).contiguous(), side=side)


def sort_keys(t: torch.Tensor, probes: list[torch.Tensor], runs: Runs) -> SortedKeys:
    """Sort the keys ``t`` (N, L) by (segment, score) and code the ``probes`` (each (N, L): a score
    compared with its own token's segment) for searches among them (`SortedKeys.rank`)."""
    length = t.shape[1]
    values = torch.cat([t.detach(), *(p.detach() for p in probes)], dim=1)
    ranks = dense_ranks(values)
    base = values.shape[1] + 1
    codes = runs.local.repeat(1, 1 + len(probes)) * base + ranks
    key_codes, order = torch.sort(codes[:, :length], dim=1)
    return SortedKeys(order, key_codes, codes[:, length:], length, base)


def check_segment_inputs(name: str, s, t, v, segments) -> None:
    """s, t (B, H, L) and v (B, H, L, D) floats on one device, ``segments`` (B, L) integers."""
    for label, x in (("s", s), ("t", t), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: {label} must be a float16/bfloat16/float32/float64 tensor")
    if v.dim() != 4 or v.shape[2] == 0:
        raise ValueError(f"{name}: v must have shape (B, H, L, D) with L >= 1, got {tuple(v.shape)}")
    for label, x in (("s", s), ("t", t)):
        if tuple(x.shape) != tuple(v.shape[:3]):
            raise ValueError(
                f"{name}: {label} must have shape (B, H, L) = {tuple(v.shape[:3])}, got {tuple(x.shape)}"
            )
    if not isinstance(segments, torch.Tensor) or segments.is_floating_point() or segments.dtype == torch.bool:
        raise TypeError(f"{name}: segments must be an integer tensor (B, L) of segment ids")
    if tuple(segments.shape) != (v.shape[0], v.shape[2]):
        want = (v.shape[0], v.shape[2])
        raise ValueError(f"{name}: segments must have shape (B, L) = {want}, got {tuple(segments.shape)}")
    if not (s.device == t.device == v.device == segments.device):
        raise ValueError(f"{name}: s, t, v and segments must be on one device")


def standardise_scores_segments(
    s: torch.Tensor, t: torch.Tensor, segments: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """`standardise_scores` on packed rows: s, t (B, H, L) shifted and scaled by the pooled mean and
    std of their own segment's scores (``segments`` (B, L)), as each sequence alone would be."""
    batch, heads, length = s.shape
    acc = accumulation_dtype(s.dtype)
    runs = segment_runs(segments, heads)
    s, t = s.to(acc).reshape(-1, length), t.to(acc).reshape(-1, length)
    mean = segment_mean(s + t, runs) / 2
    var_s, var_t = segment_mean((s - mean) ** 2, runs), segment_mean((t - mean) ** 2, runs)
    std = torch.sqrt((var_s + var_t) / 2 + eps)
    return ((s - mean) / std).view(batch, heads, length), ((t - mean) / std).view(batch, heads, length)


def standardise_scores_prefix_segments(
    s: torch.Tensor, t: torch.Tensor, segments: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """`standardise_scores_prefix` on packed rows: s_i, t_i (B, H, L) shifted and scaled by the running
    pooled mean and std of their own segment's ``{s_j, t_j : j <= i}`` (``segments`` (B, L)), as each
    sequence alone would be (running sums: `segment_running_sum`)."""
    batch, heads, length = s.shape
    acc = accumulation_dtype(s.dtype)
    runs = segment_runs(segments, heads)
    s, t = s.to(acc).reshape(-1, length), t.to(acc).reshape(-1, length)
    shift = torch.gather(t, 1, runs.start)  # the segment's first key: no later token read
    ds, dt = s - shift, t - shift
    count = 2 * (torch.arange(1, length + 1, device=s.device) - runs.start).to(acc)
    mean, square = (segment_running_sum(x, runs) / count for x in (ds + dt, ds * ds + dt * dt))
    std = torch.sqrt((square - mean * mean).clamp_min(0.0) + eps)
    return ((ds - mean) / std).view(batch, heads, length), ((dt - mean) / std).view(batch, heads, length)


def triton_takes(op: str, impl: str, causal: bool, s, t, v) -> bool:
    """Whether an op on packed rows runs its Triton walks: ``impl="triton"``, or ``"auto"`` on CUDA
    where Triton runs; bidirectional only. ``impl="triton"`` where they cannot raises, naming why."""
    if impl == "torch":
        return False
    cuda = runtime.on_cuda((s, t, v))
    if impl == "auto" and not cuda:
        return False
    if causal:
        problem = "no Triton kernel takes the causal op on packed rows"
    elif not cuda and not runtime.interpret_mode():
        problem = f"the Triton kernels take CUDA tensors (or run under TRITON_INTERPRET=1), got {v.device}"
    else:
        problem = runtime.triton_problem(op, impl, v.device, cuda)
    if problem is not None and impl == "triton":
        raise runtime.TritonUnavailableError(f"{op}: impl='triton' cannot run: {problem}", problem)
    return problem is None


class SegmentTable(NamedTuple):
    """Packed rows' segments as the Triton kernels' programs (``_packed_segment``): ``table (S, 3)``
    int64, each segment's row, first position and size, and the longest size (the launch grid)."""

    table: torch.Tensor
    longest: int


def table_or(segments: SegmentTable | None, dummy: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' ``seg_ptr``: the segments' table, or any tensor where ``HAS_SEGMENTS``
    is off (one row per program)."""
    return dummy if segments is None else segments.table


def segment_table(runs: Runs) -> SegmentTable:
    """The `SegmentTable` of packed rows' `Runs` (one read from the device: the count and longest)."""
    rows, length = runs.start.shape
    position = torch.arange(length, device=runs.start.device).expand(rows, -1)
    row, start = (runs.start == position).nonzero(as_tuple=True)
    size = runs.size[row, start]
    return SegmentTable(torch.stack([row, start, size], dim=1).contiguous(), int(size.max()))


def restart_at_segment_ends_(tables: list[torch.Tensor], runs: Runs) -> list[torch.Tensor]:
    """Take each segment's total away at its last row of each ``sorted_rows`` table (rows sorted by
    segment; row ``p + 1`` holds position p), so that its running sum comes back to about 0 at
    every segment's end: read as differences inside a segment, a row-wide float32 running sum
    keeps the rounding of every earlier segment's sums (sliced ReLU's dL/dt and dL/dv 1,000x the
    float32 error of each sequence alone, ReLU-bump's 10-35x, measured), where this keeps each
    segment's own. A read at a segment's end then needs the total back (`add_back_totals_`).
    Returns each table's totals ``(N, segments, D)``."""
    rows, length = runs.start.shape
    device = runs.start.device
    slots = int(runs.local.max()) + 2  # per row: a slot for its zero row, then one per segment
    row_base = torch.arange(rows, device=device)[:, None] * slots
    index = torch.cat([row_base, row_base + runs.local + 1], dim=1).reshape(-1)  # every table row's slot
    position = torch.arange(length, device=device)
    n, p = (runs.start + runs.size - 1 == position).nonzero(as_tuple=True)  # each segment's last row
    all_totals = []
    for table in tables:
        width = table.shape[-1]
        totals = table.new_zeros(rows * slots, width).index_add_(0, index, table.view(-1, width))
        totals = totals.view(rows, slots, width)[:, 1:]
        table[n, p + 1] -= totals[n, runs.local[n, p]]
        all_totals.append(totals)
    return all_totals


def add_back_totals_(
    sums: torch.Tensor, totals: torch.Tensor, whole: torch.Tensor, runs: Runs
) -> torch.Tensor:
    """``sums`` (N, L, D) read from a table restarted at each segment's end
    (`restart_at_segment_ends_`): the reads that reach their segment's end (``whole``, (N, L))
    get its total back."""
    n, p = whole.nonzero(as_tuple=True)
    sums[n, p] += totals[n, runs.local[n, p]]
    return sums
