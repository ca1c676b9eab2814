"""What a padding mask removes: keys only, or keys and queries.

Every op takes ``key_padding_mask`` (B, T), True = real token. Padded keys never receive weight.
Padded *queries* are a choice (``padded_queries``):

- ``"zero"`` (the default): a padded position outputs zeros and gets no gradient, as a padded
  token in a batch of sentences should;
- ``"attend"``: a padded position is still a query and attends to the real keys like any other
  position (every backend);
- ``"lra"`` (softmax only): the official LRA encoder's function. It passes its one mask
  (``inputs > 0``) to flax's attention as both query and key mask, so a (query, key) pair gets a
  −1e10 bias when *either* is padding: a real query attends to the real keys, and a padded query's
  row is −1e10 + score everywhere, which rounds to exactly −1e10 in float32 (|score| < 512). Its
  weights are uniform: its output is the mean of V over all T positions, padding included, and
  JAX still back-propagates through that row (the softmax's Jacobian at the uniform point).
  Image, Pathfinder and Path-X then read (CLS) or average (MEAN) those rows. This is LRA's code at
  HEAD (``flax.deprecated.nn`` with ``jax.nn.softmax``).
- ``"lra2020"`` (softmax only): the code that produced the LRA paper's leaderboard numbers (before
  2022-04, ``from flax import nn``), whose softmax is ``exp(x − logsumexp(x))``. In float32 a padded
  row's logsumexp, −1e10 + log T, rounds to −1e10 as well, so every weight is exactly 1: the row is the
  *sum* of V over all T positions (T × ``"lra"``'s), and its gradients are T times ``"lra"``'s.

For bidirectional attention a query's output depends only on its own score or vector and on the
real keys, so ``"attend"`` needs no other change than not zeroing those rows. Causal ops refuse
every mode but ``"zero"``: a causal sequence is padded at its end, where no real token ever looks.
"""

from __future__ import annotations

import torch

PADDED_QUERIES = ("zero", "attend", "lra", "lra2020")
#: the modes every op implements; "lra" and "lra2020" are softmax's alone (rules about softmax's weights)
COMMON_PADDED_QUERIES = ("zero", "attend")


def check_padded_queries(
    op: str, padded_queries: str, causal: bool = False, allowed: tuple[str, ...] = COMMON_PADDED_QUERIES
) -> None:
    """Refuse an unknown mode, one ``op`` lacks, and any but ``"zero"`` with ``causal=True``."""
    if padded_queries not in allowed:
        softmax_only = (
            f" ({padded_queries!r} is softmax's alone)" if padded_queries in ("lra", "lra2020") else ""
        )
        raise ValueError(
            f"{op}: padded_queries must be one of {', '.join(map(repr, allowed))}, "
            f"got {padded_queries!r}{softmax_only}"
        )
    if causal and padded_queries != "zero":
        raise ValueError(
            f"{op}: padded_queries={padded_queries!r} is for bidirectional attention (causal=False); "
            "a causal sequence is padded at its end, where no real query looks"
        )


def query_mask(key_padding_mask: torch.Tensor | None, padded_queries: str) -> torch.Tensor | None:
    """The mask of the queries whose output is kept: the key mask, or None when every query attends."""
    return key_padding_mask if padded_queries == "zero" else None
