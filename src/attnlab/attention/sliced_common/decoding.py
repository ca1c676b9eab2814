"""Decoding for the causal sliced ops: one token at a time, in O(D log n + log² n) amortised.

Decoding (``sliced_relu_attention_step``) uses the logarithmic method: the past keys are kept as a
few sorted runs of sizes L·2^k (the binary digits of n / L), each storing, at every key, the key score
and the values of the piecewise-linear functions ``F(x) = Σ_{t_j<x} (x − t_j) [v_j, 1]`` at that key.
``F`` is linear between consecutive keys, so a run evaluates it anywhere by one binary search and a
linear interpolation. The last 1..L tokens wait unsorted in a small buffer summed directly
(Σ ReLU(x − t_j) [v_j, 1]); a full buffer is sorted into a run of L, and equal-size runs merge (each
evaluating the other's F at its keys), so merges cost O(D log n) amortised and happen once per L tokens.

Speed: all runs live one after the other in flat buffers (largest first), updated in place at their tail,
so a step searches every run with *one* ``searchsorted``: each key is stored as an int64 ``run << 32 |
order(key)`` (``order`` maps float32 bits to integers monotonically), which sorts the runs one after
another, and a query asks for ``run << 32 | order(x)`` in every run at once. A step is then a fixed
number of tensor ops whatever n is. Float64 states (the exactness tests) search each run in turn.
On the CPU a whole step (push, search, output; sliced ReLU's running score standardisation too) is
one call of a C++ kernel instead (``decode_kernels.cpp``, through ``attnlab.attention.common.native``),
summed in double: the torch code's thirty-odd small ops cost more than their arithmetic. The torch
code stays for other devices, for autograd and where no compiler is found.

Precision as in ``attnlab.attention.sliced_common.causal``: scores shifted by the first key score (and,
for sliced ReLU, values by the first value), sums in at least float32.
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.attention.common import native
from attnlab.attention.common.precision import accumulation_dtype, no_autocast
from attnlab.attention.sliced_common import step_scores
from attnlab.attention.sliced_common.scores import STANDARDISE_EPS

__all__ = [
    "SlicedAttentionState",
    "SlicedDecodeState",
    "check_step",
    "prefill_state",
    "push_token",
    "slice_one_token",
    "state_of",
]

RECENT = 32  # tokens summed directly before they are sorted into a run (L)
_FREE = torch.iinfo(torch.int64).max  # search key of unused slots: after every real one
#: every live state by its handle's key (`state_of`); an entry goes with its state
_STATES: dict[int, weakref.ref] = {}
_STATE_KEYS = itertools.count()


def _order(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64, monotone (−0 and +0 equal): the bits of a negative float count downwards."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


class SlicedDecodeState:
    """What a causal sliced decoder keeps of the past (``kind`` "relu" or "bump"; the two steps centre
    values differently and do not share states). A step updates it in place and returns it.

    ``keys (B, H, cap)`` sorted (shifted) key scores of the runs, one run after another (sizes
    ``run_sizes``, decreasing); ``tables (B, H, cap, D + 1)`` F of its run at each key; ``totals
    (B, H, R, D + 1)`` Σ [v_j, 1] per run; ``search (B, H, cap)`` int64 search keys (float32 states);
    ``recent_t``, ``recent_rows`` the buffer of the last ``recent`` tokens. ``shift_t (B, H)`` and
    ``shift_v (B, H, D)`` are the first token's key score and (sliced ReLU only) value, ``sum_v`` and
    ``sum_t`` running sums of the shifted values and keys.
    """

    def __init__(self, kind: str, shift_t: torch.Tensor, shift_v: torch.Tensor):
        b, h, d = shift_v.shape
        self.kind, self.count, self.shift_t, self.shift_v = kind, 0, shift_t, shift_v
        self.sum_v, self.sum_t = torch.zeros_like(shift_v), torch.zeros_like(shift_t)
        self.keys = shift_t.new_zeros(b, h, 0)
        self.tables = shift_v.new_zeros(b, h, 0, d + 1)
        self.totals = shift_v.new_zeros(b, h, 0, d + 1)
        fast = shift_t.dtype == torch.float32
        self.search = torch.zeros(b, h, 0, dtype=torch.int64, device=shift_t.device) if fast else None
        self.run_sizes: list[int] = []
        self.recent_t = shift_t.new_zeros(b, h, RECENT)
        self.recent_rows = shift_v.new_zeros(b, h, RECENT, d + 1)
        self.recent_rows[..., -1] = 1.0  # [v_j, 1]: the ones written once
        self.recent = 0
        self._bounds: tuple[torch.Tensor, ...] | None = None
        self._sizes: torch.Tensor | None = None
        self.mlp_maps = None  # an MLP Π's maps as its step kernel reads them (step_scores), for this state
        key = next(_STATE_KEYS)
        self.handle = torch.tensor(key)
        _STATES[key] = weakref.ref(self)
        weakref.finalize(self, _STATES.pop, key, None)

    @property
    def stored(self) -> int:
        return sum(self.run_sizes)

    def nbytes(self) -> int:
        """Bytes of tensor memory in use: (D + 2) numbers per past token (D + 4 in float32 states, the
        int64 search key), plus O(D log n) of run totals and O(L·D) of buffer."""
        n, r = self.stored, len(self.run_sizes)
        used = [self.keys[..., :n], self.tables[..., :n, :], self.totals[..., :r, :]]
        used += [self.recent_t, self.recent_rows, self.shift_t, self.shift_v, self.sum_v, self.sum_t]
        if self.search is not None:
            used.append(self.search[..., :n])
        return sum(x.numel() * x.element_size() for x in used)

    # ---- runs -------------------------------------------------------------------------------------
    def _reserve(self, size: int, runs: int) -> None:
        """Room for ``size`` stored tokens and ``runs`` runs (doubling, so appends are amortised O(1))."""
        if size > self.keys.shape[-1]:
            cap = max(size, 2 * self.keys.shape[-1], 4 * RECENT)
            self.keys = _grown(self.keys, cap, -1, 0.0)
            self.tables = _grown(self.tables, cap, -2, 0.0)
            if self.search is not None:
                self.search = _grown(self.search, cap, -1, _FREE)
        if runs > self.totals.shape[-2]:
            self.totals = _grown(self.totals, max(runs, 2 * self.totals.shape[-2], 8), -2, 0.0)

    def _write(self, start: int, index: int, run) -> None:
        keys, table, total = run
        end = start + keys.shape[-1]
        self.keys[..., start:end] = keys
        self.tables[..., start:end, :] = table
        self.totals[..., index, :] = total
        if self.search is not None:
            self.search[..., start:end] = (index << 32) + _order(keys)

    def _run(self, start: int, index: int):
        size = self.run_sizes[index]
        return (
            self.keys[..., start : start + size].contiguous(),
            self.tables[..., start : start + size, :],
            self.totals[..., index, :],
        )

    def append_run(self, run) -> None:
        """Append a sorted run at the tail, then merge equal-size tail runs (the binary counter)."""
        start = self.stored
        self._reserve(start + run[0].shape[-1], len(self.run_sizes) + 1)
        self.run_sizes.append(run[0].shape[-1])
        self._write(start, len(self.run_sizes) - 1, run)
        while len(self.run_sizes) >= 2 and self.run_sizes[-1] == self.run_sizes[-2]:
            last = len(self.run_sizes) - 1
            start = self.stored - 2 * self.run_sizes[-1]
            merged = _merge_runs(self._run(start, last - 1), self._run(start + self.run_sizes[-1], last))
            self.run_sizes[-2:] = [2 * self.run_sizes[-1]]
            self._write(start, last - 1, merged)
        self._bounds = self._sizes = None

    def _run_bounds(self) -> tuple[torch.Tensor, ...]:
        """(run << 32, first slot, last slot, end) per run, as (R, 1) tensors; rebuilt when runs change."""
        if self._bounds is None:
            sizes = torch.tensor(self.run_sizes, device=self.keys.device)[:, None]
            ends = sizes.cumsum(0)
            offsets = torch.arange(len(self.run_sizes), device=sizes.device)[:, None] << 32
            self._bounds = (offsets, ends - sizes, ends - 1, ends)
        return self._bounds

    # ---- F ----------------------------------------------------------------------------------------
    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """``F(x) = Σ_{past j, t_j < x} (x − t_j) [v_j, 1]`` at ``x (B, H, K)`` → ``(B, H, K, D + 1)``."""
        recent = F.relu(x[..., :, None] - self.recent_t[..., None, : self.recent])
        out = recent @ self.recent_rows[..., : self.recent, :]
        if not self.run_sizes:
            return out
        if self.search is None:  # float64: one binary search per run
            start = 0
            for index in range(len(self.run_sizes)):
                out = out + _evaluate_run(*self._run(start, index), x)
                start += self.run_sizes[index]
            return out
        offsets, starts, lasts, ends = self._run_bounds()
        b, h, k = x.shape
        runs, width = len(self.run_sizes), self.tables.shape[-1]
        wanted = (offsets + _order(x)[..., None, :]).view(b, h, runs * k)
        pos = torch.searchsorted(self.search, wanted, side="left").view(b, h, runs, k)  # keys[pos-1] < x
        # the keys around x in each run: lo = pos − 1 and hi = pos, kept inside the run, in one gather
        index = torch.cat([torch.maximum(pos - 1, starts), torch.minimum(pos, lasts)], dim=-1).view(b, h, -1)
        keys = self.keys.gather(-1, index).view(b, h, runs, 2 * k)
        rows = self.tables.gather(-2, index[..., None].expand(b, h, index.shape[-1], width))
        rows = rows.view(b, h, runs, 2 * k, width)
        key_lo, key_hi, f_lo, f_hi = keys[..., :k], keys[..., k:], rows[..., :k, :], rows[..., k:, :]
        # F is linear from key_lo on: slope (f_hi − f_lo)/(key_hi − key_lo) between two keys, the run's
        # total above its largest, 0 below its smallest (where f_lo = F(smallest key) = 0)
        inside = (pos > starts) & (pos < ends)
        gap = torch.where(inside, key_hi - key_lo, 1.0)[..., None]
        above = self.totals[..., :runs, None, :] * (pos == ends)[..., None]
        slope = torch.where(inside[..., None], (f_hi - f_lo) / gap, above)
        return out + (f_lo + (x[..., None, :] - key_lo)[..., None] * slope).sum(2)

    # ---- the C++ kernels (decode_kernels.cpp) ------------------------------------------------------
    def _native(self, name: str, *inputs: torch.Tensor):
        """The kernel ``name`` for this state's dtype, or None where it does not run: not the CPU, not
        float32/float64, inputs of another accumulation dtype, gradients wanted, no compiler."""
        dtype = self.keys.dtype
        if self.keys.device.type != "cpu" or any(x.dtype != dtype or x.device.type != "cpu" for x in inputs):
            return None
        if torch.is_grad_enabled() and any(x.requires_grad for x in (*inputs, self.tables, self.sum_v)):
            return None
        found = native.kernels(KERNELS, dtype, {name: _ARGTYPES[name]})
        return None if found is None else found[name]

    def _runs_arguments(self) -> list:
        if self._sizes is None:
            self._sizes = torch.tensor(self.run_sizes or [0], dtype=torch.int64)
        arrays = (self.keys, self.tables, self.totals, self._sizes)
        return [*map(native.pointer, arrays), len(self.run_sizes)]

    def _strides(self) -> tuple[int, int, int]:
        return self.keys.shape[-1], self.totals.shape[-2], self.recent_t.shape[-1]

    def relu_step_natively(self, s, t, v, eps: float, stats=None, std_eps: float = STANDARDISE_EPS):
        """Sliced ReLU's whole step (push the token, F at its query, the output) in one C++ call:
        ``o (B, H, D)`` in the state's dtype, or None where the kernel does not run (then nothing
        changed). ``s, t (B, H)`` and ``v (B, H, D)`` are the scores and value as
        ``sliced_relu_attention_step`` takes them; with ``stats`` (`standardise_step`'s running
        statistics over this state's tokens, updated in place) the scores are standardised first,
        as `standardise_step` does."""
        if stats is None:
            return self._step_natively("sliced_relu_step", s, t, v, [float(eps), None, None, None, 0.0, 0.0])
        shift, total, squares = stats
        options = [float(eps), shift, total, squares, 2.0 * self.count, float(std_eps)]
        return self._step_natively("sliced_relu_step", s, t, v, options, kept=stats)

    def bump_step_natively(self, s, t, v, bandwidth, normaliser: str, mass_eps: float):
        """Sliced ReLU-bump's whole step in one C++ call, as `relu_step_natively`; the hat's second
        difference of F is taken in double."""
        bandwidth = bandwidth.detach().to(self.keys.dtype).contiguous()
        options = [bandwidth, bandwidth.shape[0], int(normaliser == "mass"), float(mass_eps)]
        return self._step_natively("sliced_relu_bump_step", s, t, v, options, kept=(bandwidth,))

    def _step_natively(self, name: str, s, t, v, options: list, kept=()):
        """Push the token and compute its output by the kernel ``name``, whose arguments after the token
        count are ``options`` (tensors passed as pointers), or None where it does not run.
        ``kept``: tensors of ``options`` that must already be contiguous (written in place)."""
        kernel = self._native(name, s, t, v, *kept)
        if kernel is None or not all(x.is_contiguous() for x in kept):
            return None
        self._make_room()
        s, t, v = s.contiguous(), t.contiguous(), v.contiguous()
        out = torch.empty_like(v)
        options = [native.pointer(x) if isinstance(x, torch.Tensor) else x for x in options]
        buffer = (self.recent_t, self.recent_rows)
        inputs = (s, t, v, self.shift_t, self.shift_v, self.sum_v, self.sum_t)
        kernel(
            *self._runs_arguments(), *map(native.pointer, buffer), self.recent, *map(native.pointer, inputs),
            self.count + 1, *options, native.pointer(out), v.shape[0] * v.shape[1], v.shape[2],
            *self._strides(),
        )  # fmt: skip
        self.recent += 1
        self.count += 1
        return out

    def _make_room(self) -> None:
        if self.recent == RECENT:  # the buffer becomes a run of L
            self.append_run(_build_run(self.recent_t.clone(), self.recent_rows.clone()))
            self.recent = 0

    def push(self, t: torch.Tensor, v: torch.Tensor) -> None:
        """Add one token: its shifted key score ``t (B, H)`` and value ``v (B, H, D)``."""
        self._make_room()
        self.recent_t[..., self.recent] = t
        self.recent_rows[..., self.recent, :-1] = v
        self.recent += 1
        self.count += 1
        self.sum_v += v
        self.sum_t += t


KERNELS = step_scores.KERNELS  # decode_kernels.cpp: the steps below and Π's MLP (step_scores)
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
# the runs, the buffer and its fill, the token and the state's running sums, the token count
_STEP = [_POINTER] * 4 + [_INT] + [_POINTER] * 2 + [_INT] + [_POINTER] * 7 + [_INT]
_AFTER = [_POINTER] + [_INT] * 5  # out, rows, D, the strides
_ARGTYPES = {
    "sliced_relu_step": _STEP + [ctypes.c_double] + [_POINTER] * 3 + [ctypes.c_double] * 2 + _AFTER,
    "sliced_relu_bump_step": _STEP + [_POINTER, _INT, _INT, ctypes.c_double] + _AFTER,
}


def _grown(x: torch.Tensor, size: int, dim: int, fill) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    new = torch.full(shape, fill, dtype=x.dtype, device=x.device)
    new.narrow(dim, 0, x.shape[dim]).copy_(x)
    return new


def _evaluate_run(keys, table, total, x):
    """F of one run at points ``x (B, H, K)`` → ``(B, H, K, D + 1)``: 0 below the smallest key, linear
    interpolation between neighbouring keys (F is linear there), slope ``total`` above the largest."""
    size = keys.shape[-1]
    rank = torch.searchsorted(keys, x.contiguous(), side="left")  # keys[rank-1] < x <= keys[rank]
    lo, hi = (rank - 1).clamp_min(0), rank.clamp_max(size - 1)
    key_lo, key_hi = torch.gather(keys, -1, lo), torch.gather(keys, -1, hi)
    width = table.shape[-1]
    f_lo = torch.gather(table, -2, lo[..., None].expand(*lo.shape, width))
    f_hi = torch.gather(table, -2, hi[..., None].expand(*hi.shape, width))
    inside = (rank > 0) & (rank < size)
    # inside: f_lo + (x − k_lo)/(k_hi − k_lo)·(f_hi − f_lo), a fraction in (0, 1]: no cancellation
    # blows up even for nearly tied keys; above: f_lo + (x − k_lo)·total
    step = torch.where(inside, (x - key_lo) / torch.where(inside, key_hi - key_lo, 1.0), x - key_lo)
    slope = torch.where(inside[..., None], f_hi - f_lo, total[..., None, :])
    return torch.where((rank > 0)[..., None], f_lo + step[..., None] * slope, 0.0)


def _build_run(keys: torch.Tensor, rows: torch.Tensor):
    """A run from keys ``(B, H, m)`` and rows ``(B, H, m, D + 1)``: sorted keys, F at each, total."""
    keys, order = torch.sort(keys, dim=-1)
    rows = torch.gather(rows, -2, order[..., None].expand_as(rows))
    prefix = F.pad(rows.cumsum(-2), (0, 0, 1, 0))[..., :-1, :]  # Σ over smaller keys (ties add 0)
    prefix_t = F.pad((keys[..., None] * rows).cumsum(-2), (0, 0, 1, 0))[..., :-1, :]
    return keys, keys[..., None] * prefix - prefix_t, rows.sum(-2)


def _merge_runs(a, b):
    """Merge two runs: each one's F evaluated at the other's keys, then one sort."""
    (keys_a, table_a, total_a), (keys_b, table_b, total_b) = a, b
    table = torch.cat(
        [table_a + _evaluate_run(keys_b, table_b, total_b, keys_a), table_b + _evaluate_run(*a, keys_b)],
        dim=-2,
    )
    keys, order = torch.sort(torch.cat([keys_a, keys_b], dim=-1), dim=-1)
    return keys, torch.gather(table, -2, order[..., None].expand_as(table)), total_a + total_b


def state_of(handle: torch.Tensor) -> SlicedDecodeState:
    """The live state whose ``handle`` this is (the compiled steps' custom ops look their state up)."""
    found = _STATES.get(int(handle))
    state = None if found is None else found()
    if state is None:
        raise RuntimeError(f"no live sliced decoding state has handle {int(handle)}: it was freed")
    return state


def check_step(name, s_t, t_t, v_t, state, kind):
    for label, x in (("s_t", s_t), ("t_t", t_t), ("v_t", v_t)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name}: {label} must be a float tensor")
    if v_t.dim() != 3 or s_t.shape != v_t.shape[:2] or t_t.shape != v_t.shape[:2]:
        raise ValueError(
            f"{name}: expected s_t, t_t (B, H) and v_t (B, H, D); got "
            f"{tuple(s_t.shape)}, {tuple(t_t.shape)}, {tuple(v_t.shape)}"
        )
    if state is None:
        return
    if not isinstance(state, SlicedDecodeState):
        raise TypeError(f"{name}: state must be a SlicedDecodeState or None, got {type(state).__name__}")
    if state.kind != kind:
        raise ValueError(f"{name}: got a state of sliced_{state.kind} decoding; start a new one (state=None)")
    if tuple(state.sum_v.shape) != tuple(v_t.shape):
        raise ValueError(
            f"{name}: state holds (B, H, D) = {tuple(state.sum_v.shape)}, got v_t {tuple(v_t.shape)}"
        )


def push_token(state, s_t, t_t, v_t, kind):
    """The state with token (t_t, v_t) appended, and the shifted query score."""
    acc = accumulation_dtype(s_t.dtype, t_t.dtype, v_t.dtype)
    s_t, t_t, v_t = s_t.to(acc), t_t.to(acc), v_t.to(acc)
    if state is None:
        state = SlicedDecodeState(kind, t_t.clone(), v_t.clone() if kind == "relu" else torch.zeros_like(v_t))
    state.push(t_t - state.shift_t, v_t - state.shift_v if kind == "relu" else v_t)  # bump: no shift
    return state, s_t - state.shift_t


def prefill_state(t: torch.Tensor, v: torch.Tensor, kind: str) -> SlicedDecodeState:
    if t.dim() != 3 or v.dim() != 4 or tuple(t.shape) != tuple(v.shape[:3]) or t.shape[-1] < 1:
        raise ValueError(
            f"expected t (B, H, T) and v (B, H, T, D) with T >= 1; got {tuple(t.shape)}, {tuple(v.shape)}"
        )
    acc = accumulation_dtype(t.dtype, v.dtype)
    with no_autocast(v.device):
        t, v = t.to(acc).contiguous(), v.to(acc).contiguous()  # scores may arrive as a transposed view
        shift_v = v[..., 0, :] if kind == "relu" else torch.zeros_like(v[..., 0, :])
        state = SlicedDecodeState(kind, t[..., 0].clone(), shift_v.clone())
        t, v = t - state.shift_t[..., None], v - state.shift_v[..., None, :]
        rows = torch.cat([v, torch.ones_like(t)[..., None]], dim=-1)
        length = t.shape[-1]
        stored = (length - 1) // RECENT * RECENT  # what a step-by-step decoder would have sorted by now
        start = 0
        for bit in reversed(range((stored // RECENT).bit_length())):  # binary digits, largest run first
            if (stored // RECENT) >> bit & 1:
                size = RECENT << bit
                state.append_run(_build_run(t[..., start : start + size], rows[..., start : start + size, :]))
                start += size
        state.recent = length - stored
        state.recent_t[..., : state.recent] = t[..., stored:]
        state.recent_rows[..., : state.recent, :-1] = v[..., stored:, :]
        state.count, state.sum_v, state.sum_t = length, v.sum(-2), t.sum(-1)
        return state


class SlicedAttentionState(NamedTuple):
    """Decoding state of a causal sliced ReLU(-bump) layer: the op's sorted runs, the running score
    statistics of `standardise="prefix"` (shift, Σ, Σ² of the shifted scores, over the op's
    ``count`` tokens; None otherwise), tokens seen."""

    op: SlicedDecodeState
    stats: tuple[torch.Tensor, ...] | None
    position: int


def slice_one_token(layer, q, k, state: SlicedAttentionState | None = None):
    """Π of the new token's query and key (B, H, D) in one call: scores s, t (B, H). On the CPU an MLP
    Π runs as one C++ call (`step_scores`), its maps kept with the layer's decoding ``state``."""
    b = q.shape[0]
    rows = torch.cat([q.reshape(b, -1), k.reshape(b, -1)])
    found = step_scores.scores(layer.slicer, rows, None if state is None else state.op)
    return (layer.slicer(rows) if found is None else found).split(b)
