"""Causal sliced ReLU / ReLU-bump attention: exact O(T log² T) parallel ops (what both share).

The ops are ``attnlab.attention.sliced_relu.causal`` and ``attnlab.attention.sliced_relu_bump.causal``;
this module holds their row helpers (score shift, tied pairs, prefix and suffix sums).

The causal ops are the bidirectional ones (``attnlab.attention.sliced_common``) restricted to keys
``j ≤ i``, with every statistic over that prefix: value mean ``vbar_i``, normaliser
``Σ_{j≤i} |s_i − t_j|``, bump count ``n_i``. Both kernels are piecewise linear in ``s_i − t_j``, so
every output is a combination of *dominance sums* ``Σ_{j≤i, t_j<x_i} w_j`` (x_i = s_i, or s_i ± b
for the bump) of a few weight columns ``w``: a two-dimensional query (time and score).

``attnlab.attention.sliced_common.dominance`` answers them for all i at once, vectorised over rows and
columns, with a Python loop over log₂(T / chunk) levels only (divide and conquer over time: dense
masked products inside chunks, sorted left halves and binary searches across them). On the CPU the
same functions run C++ kernels instead (``attnlab.attention.sliced_common.dominance_native``: the
pairs inside chunks directly, those across chunks in one walk up the sorted scores with a Fenwick
tree over the chunks), and the notes on levels below describe the torch code that runs elsewhere. The backward
passes (hand-written ``autograd.Function``s) sum over the same pairs the other way (``j ≥ i``, queries
and keys exchanged). What keeps them within a few times the bidirectional ops (``attnlab bench
attention`` prints the ratio):

- sliced ReLU: one merged sort of keys and queries per level (``attnlab.attention.sliced_common.merged``;
  a radix sort of integer codes for float32) gives both passes their orders and counts, so the
  backward pass neither sorts nor searches, and the levels are read up to five at a time (one gather
  and one add per group instead of per level);
- ReLU-bump: the hat window is a combination of four window sums; each level reads the prefix rows
  of all of it in one fused gather-and-weigh (``combined_sums``), and the window sums the score
  and bandwidth gradients need (they do not depend on the output's gradient) are taken in the
  forward pass over the same sorts, so the backward pass only runs the keys' side (time reversed);
- tied scores (``t_j = s_i``: kinks of both kernels) are taken apart from a list of the tied pairs
  (``tied_pairs``) instead of one more pass over every level, unless there are many;
- prefix sums over a middle dimension add rows instead of calling ``cumsum`` (``prefix_sums_``).

Packed rows (several sequences end to end, ``attnlab.attention.sliced_common.segments``) run the same
ops over the whole row: keys and thresholds are compared by ``segment_codes``, which order (sequence,
score) with a later sequence below an earlier one, so no query counts a key of an earlier sequence
(causality already excludes the later ones), and every running statistic restarts at its sequence's
start (``running_sum``, ``later_sum``). Scores are shifted by each sequence's first key score.

Precision. Sums accumulate in float32 for half/float32 inputs and float64 for float64. Scores are
shifted by the key score of the row's first real token (and, for sliced ReLU, whose output does
not depend on a common shift of the values, values by that token's value): a per-row constant that
cancels exactly in ``s_i − t_j`` and in ``v_j − vbar_i``, removes large offsets, and depends on no
future token. Cancellation can still bite where the formulas subtract: ``s_i · Σ w − Σ t w``
(loses about |s_i|·|Σ w| / |result| ulps, growing with T and the score spread), the prefix mean
``vbar_i · (s_i C_i − E_i)`` subtracted from the uncentred sum (values with a mean far from the first
token's value), and the bump's window sums for bandwidths narrow next to the score spread. Measured
figures are in ``tests/attention/sliced_common/test_causal.py``.
"""

from __future__ import annotations

import torch

from attnlab.attention.sliced_common import dominance_native
from attnlab.attention.sliced_common.dominance import prefix_sums_, suffix_sums_
from attnlab.attention.sliced_common.merged import merge_rows
from attnlab.attention.sliced_common.segments import Runs, read_at, segment_running_sum

#: the causal ops' default ``chunk``: each evaluation's own local block (the torch code's
#: ``dominance.TORCH_CHUNK``, the C++ kernels' ``dominance_native.BLOCK``)
DEFAULT_CHUNK = None


def suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{i ≥ j} x_i`` along dim 1 (``(N, T)``, or ``(N, T, D)``: in place, ``suffix_sums_``)."""
    return x.flip(1).cumsum(1).flip(1) if x.dim() == 2 else suffix_sums_(x.contiguous())


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """``Σ_{j ≤ i} x_j`` along dim 1 of ``(N, T, D)`` (``prefix_sums_``: faster than ``cumsum`` there)."""
    return prefix_sums_(x.clone(memory_format=torch.contiguous_format))


def first_real(valid: torch.Tensor | None, n_rows: int, device) -> torch.Tensor:
    """Index of each row's first real token (0 for an all-padded row)."""
    if valid is None:
        return torch.zeros(n_rows, dtype=torch.long, device=device)
    return valid.to(torch.int8).argmax(dim=1)


def shift_scores(s, t, valid, runs: Runs | None = None):
    """Scores minus the first real key score of the row, or on packed rows (``runs``) of each
    token's segment (exact in ``s − t``; see the module docstring). Also returns where that key is:
    ``(N, 1)``, or ``(N, T)`` per token on packed rows."""
    first = first_real(valid, s.shape[0], s.device)[:, None] if runs is None else runs.start
    shift = torch.gather(t, 1, first)
    s, t = s - shift, t - shift
    if valid is not None:
        s, t = s.masked_fill(~valid, 0.0), t.masked_fill(~valid, 0.0)
    return s, t, first


def running_sum(x: torch.Tensor, runs: Runs | None = None) -> torch.Tensor:
    """``Σ_{j ≤ i} x_j`` along dim 1 of ``(N, T)`` or ``(N, T, D)``; on packed rows (``runs``) over
    the token's own segment (`segment_running_sum`, in float64)."""
    if runs is None:
        return x.cumsum(1) if x.dim() == 2 else prefix_sum(x)
    return segment_running_sum(x, runs)


def later_sum(x: torch.Tensor, runs: Runs | None = None) -> torch.Tensor:
    """``Σ_{i ≥ j} x_i`` along dim 1 (``suffix_sum``); on packed rows (``runs``) over the token's
    own segment: the row's sum less its value at the next segment's start, in float64 for the
    reason `segment_running_sum` gives."""
    if runs is None:
        return suffix_sum(x)
    total = suffix_sum(x.to(torch.float64))
    return (total - read_at(total, runs.end)).to(x.dtype)


def segment_codes(values: list[torch.Tensor], runs: Runs, later_first: bool) -> list[torch.Tensor]:
    """Scores of packed rows as codes that compare as (segment, score) pairs: equal codes for equal
    scores of one segment, and a segment's codes all below or all above another's.

    The causal ops compare keys with thresholds by their codes and compute with the scores, so a
    comparison never counts a key of another segment: with ``later_first`` (the dominance sums
    over earlier keys, ``j ≤ i``) an earlier segment's keys lie above every threshold of a later
    one; without it (time reversed, ``i ≥ j``) a later segment's lie above. Each code is the dense
    rank of its pair among all of ``values`` (``(N, T)`` each, finite): exact small integers, kept
    in float32 where they fit (the merged sort's radix path) and float64 beyond 2²⁴.
    """
    length = values[0].shape[1]
    flat = torch.cat([x.detach() for x in values], dim=1)
    group = runs.local.repeat(1, len(values))
    by_score = torch.sort(flat, dim=1).indices
    group = torch.gather(-group if later_first else group, 1, by_score)
    group, by_group = torch.sort(group, dim=1, stable=True)
    order = torch.gather(by_score, 1, by_group)
    ordered = torch.gather(flat, 1, order)
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[:, 1:] = (ordered[:, 1:] != ordered[:, :-1]) | (group[:, 1:] != group[:, :-1])
    ranks = torch.empty_like(order).scatter_(1, order, new.long().cumsum(1))
    dtype = torch.float32 if flat.shape[1] < 2**24 else torch.float64
    return list(ranks.to(dtype).split(length, dim=1))


TIE_PAIR_BUDGET = 4  # tied (query, key) pairs listed per position at most; beyond, an exact extra pass


def tied_pairs(s: torch.Tensor, t: torch.Tensor, valid: torch.Tensor | None, orders=None):
    """The pairs ``j <= i`` of real positions with ``s_i == t_j`` exactly, as flat indices
    ``(n·T + i, n·T + j)``; None when there are more than ``TIE_PAIR_BUDGET · N · T`` of them.
    ``orders``: the ascending orders of ``t`` and ``s`` a dominance sum took already
    (``dominance_native.Orders``), used where there is no padding (its masking reorders them).

    The ops need sums over ``t_j <= s_i`` beside those over ``t_j < s_i`` (kinks: relu'(0) = 0,
    hat'(0) = 0). They differ by the tied pairs only, which scores from real data have by accident
    (float32 at T = 16K: a few dozen per row), so the difference is added from this list instead
    of one more dominance pass over every level. Many ties (quantised scores, constant rows) return
    None and the caller takes that exact pass. One merged sort of each row's keys and queries
    (``merge_rows``: the keys' order and every query's rank among them) and a scan of the runs; on
    the CPU one walk in C++ over both rows' radix-sorted orders (``dominance_native.tied_pairs``).
    """
    n_rows, length = s.shape
    if valid is not None:  # padded positions never tie: -inf queries against +inf keys
        s, t = s.masked_fill(~valid, -float("inf")), t.masked_fill(~valid, float("inf"))
        orders = None
    found = dominance_native.kernels(s, t)
    if found is not None:  # the CPU: one merged walk of both radix-sorted rows (dominance_kernels.cpp)
        return dominance_native.tied_pairs(found, s, t, TIE_PAIR_BUDGET * s.numel(), orders)
    key_order, lo, _, _ = merge_rows(s, t)
    keys = torch.gather(t, 1, key_order)
    # the end of the run of equal keys at each sorted position (instead of a second binary search)
    last = torch.arange(length, device=s.device).expand(n_rows, -1)
    run_end = torch.where(keys[:, 1:] != keys[:, :-1], last[:, :-1] + 1, length)
    run_end = torch.cat([run_end, run_end.new_full((n_rows, 1), length)], dim=1)
    run_end = run_end.flip(1).cummin(1).values.flip(1)
    at = lo.clamp_max(length - 1)
    tied = torch.gather(keys, 1, at) == s
    counts = torch.where(tied, torch.gather(run_end, 1, at) - lo, 0).view(-1)
    total = int(counts.sum())
    if total > TIE_PAIR_BUDGET * s.numel():
        return None
    query = torch.repeat_interleave(torch.arange(s.numel(), device=s.device), counts)
    run_start = torch.cumsum(counts, 0) - counts  # where each query's pairs start in the list
    position = lo.reshape(-1)[query] + torch.arange(total, device=s.device) - run_start[query]
    row_start = query - query % length
    key = key_order.view(-1)[row_start + position] + row_start
    keep = key <= query  # j <= i (same row)
    return query[keep], key[keep]


def check_chunk(chunk: int | None) -> None:
    if chunk is not None and (type(chunk) is not int or chunk < 1):
        raise ValueError(f"chunk must be a positive integer or None (each evaluation's own), got {chunk!r}")
