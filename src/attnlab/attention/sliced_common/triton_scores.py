"""What both Triton sliced ops start with (``sliced_relu/triton.py``, ``sliced_relu_bump/triton.py``):
the centred scores and the two sorts of the op, which the backward passes reuse."""

from __future__ import annotations

import torch

from attnlab.attention.common.triton.runtime import kernels
from attnlab.attention.sliced_common.rows import sort_rows


def scalar_block(length: int) -> int:
    """Positions per program of the (N, T) kernels: the row's length up to a power of two, 16 to 1024."""
    return min(1024, max(16, 1 << (length - 1).bit_length()))


def sort_scores(s, t, v, valid, queries):
    """What both forwards start with, as the torch ops do: the real-key counts, the centred scores
    (rows with a NaN/inf score zeroed, ``bad``: NaN is written to their outputs at the end), the keys
    sorted real-first ``(search, sorted, order)`` and the kept queries sorted first ``(search,
    order)``: the two sorts of the op, which the backward passes reuse. The dropped queries (their
    s is 0, their scale or coefficient too) sort last as +inf: sinks at the end of every stream.

    ``s, t (N, T)`` in the accumulation dtype; ``valid``, ``queries`` (N, T) bool or None. The
    counts, centring and finiteness are one kernel (``score_prologue_kernel``), the sorts torch's
    (``rows.sort_rows``)."""
    rows, length, _ = v.shape
    s, t = s.contiguous(), t.contiguous()
    s_out, t_out, s_key, t_key = (torch.empty_like(s) for _ in range(4))
    count = torch.empty(rows, dtype=s.dtype, device=s.device)
    bad = torch.empty(rows, dtype=torch.int8, device=s.device)
    block = scalar_block(length)
    kernels().score_prologue_kernel[(rows,)](
        s, t, valid if valid is not None else s, queries if queries is not None else s,
        s_out, t_out, s_key, t_key, count, bad, length,
        HAS_VALID=valid is not None, HAS_QUERIES=queries is not None, BLOCK=block,
    )  # fmt: skip
    s_search, q_order = sort_rows(s_key)
    t_search, k_order = sort_rows(t_key)
    # padded keys sort last as +inf (no real score is infinite: bad rows are 0); for arithmetic, 0
    t_sorted = t_search if valid is None else t_search.nan_to_num(posinf=0.0)
    return count, s_out, t_out, bad.bool(), (t_search, t_sorted, k_order), (s_search, q_order)
