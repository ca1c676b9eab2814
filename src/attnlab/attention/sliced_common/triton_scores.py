"""What both Triton sliced ops start with (``sliced.py``, ``bump.py``): the centred scores and the
two sorts of the op, which the backward passes reuse."""

from __future__ import annotations

from attnlab.attention.sliced_common.rows import centre_scores, finite_rows, real_counts, sort_real_first


def sort_scores(s, t, v, valid, queries):
    """What both forwards start with, as the torch ops do: the real-key counts, the centred scores
    (rows with a NaN/inf score zeroed, ``bad``: NaN is written to their outputs at the end), the keys
    sorted real-first ``(search, sorted, order)`` and the kept queries sorted first ``(search,
    order)``: the two sorts of the op, which the backward passes reuse. The dropped queries (their
    s is 0, their scale or coefficient too) sort last as +inf: sinks at the end of every stream."""
    rows, length, _ = v.shape
    count = real_counts(valid, rows, length, s.dtype, v.device)
    s, t = centre_scores(s, t, valid, count, queries)
    s, t, bad = finite_rows(s, t)
    s_search, _, q_order = sort_real_first(s, queries)
    return count, s, t, bad, sort_real_first(t, valid), (s_search, q_order)
