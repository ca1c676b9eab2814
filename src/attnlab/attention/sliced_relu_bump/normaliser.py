"""The ReLU-bump normalisers: which ones exist and where each applies (checked in one place).

``count`` divides by the number of real keys (the authors' code's bump). In a causal model that is n_i = i + 1
at position i, so an output that copies one key shrinks like 1/i; ``mass`` divides by the hat weight
seen instead (a soft count of the keys in the query's window), implemented for the causal op and its
decoding step.
"""

from __future__ import annotations

import math

BUMP_NORMALISERS = ("count", "mass")


def check_bump_normaliser(op: str, normaliser: str, mass_eps: float, causal: bool) -> None:
    """``normaliser`` is one of BUMP_NORMALISERS, "mass" only causal, ``mass_eps`` finite and > 0."""
    if normaliser not in BUMP_NORMALISERS:
        raise ValueError(
            f"{op}: normaliser must be one of {', '.join(map(repr, BUMP_NORMALISERS))}, got {normaliser!r}"
        )
    if normaliser == "mass" and not causal:
        raise ValueError(
            f"{op}: normaliser='mass' is implemented for causal=True only (it answers the causal "
            "count's 1/position shrinkage); bidirectional bump attention divides by the count"
        )
    if isinstance(mass_eps, bool) or not isinstance(mass_eps, (int, float)) or not 0 < mass_eps < math.inf:
        raise ValueError(f"{op}: mass_eps must be a finite number > 0, got {mass_eps!r}")
