"""What a padding mask removes: keys only, or keys and queries.

Every op takes ``key_padding_mask`` (B, T), True = real token. Padded keys never receive weight.
Padded *queries* are a choice (``padded_queries``):

- ``"zero"`` (the default): a padded position outputs zeros and gets no gradient, as a padded
  token in a batch of sentences should;
- ``"attend"``: a padded position is still a query and attends to the real keys like any other
  position. The official LRA encoder does this for the black pixels of Image, Pathfinder and
  Path-X (``inputs > 0`` masks keys only) and then averages every position, black ones included.

For bidirectional attention a query's output depends only on its own score or vector and on the
real keys, so ``"attend"`` needs no other change than not zeroing those rows. Causal ops refuse it:
a causal sequence is padded at its end, where no real token ever looks.
"""

from __future__ import annotations

import torch

PADDED_QUERIES = ("zero", "attend")


def check_padded_queries(op: str, padded_queries: str, causal: bool = False) -> None:
    """Refuse an unknown mode, and ``"attend"`` with ``causal=True`` (see the module docstring)."""
    if padded_queries not in PADDED_QUERIES:
        raise ValueError(
            f"{op}: padded_queries must be one of {', '.join(map(repr, PADDED_QUERIES))}, "
            f"got {padded_queries!r}"
        )
    if causal and padded_queries == "attend":
        raise ValueError(
            f"{op}: padded_queries='attend' is for bidirectional attention (causal=False); "
            "a causal sequence is padded at its end, where no real query looks"
        )


def query_mask(key_padding_mask: torch.Tensor | None, padded_queries: str) -> torch.Tensor | None:
    """The mask of the queries whose output is kept: the key mask, or None when every query attends."""
    return key_padding_mask if padded_queries == "zero" else None
