"""Cross products of test parameters, thinned for `make test`.

A backend × task (or kernel × input) product multiplies the time of a test without adding a line of
`src/` it runs: `make test` takes a diagonal, so that every value of every axis is still tried once,
and `make test-all` the whole product (the rest is marked `slow`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest


def each_value_once(*axes: Sequence) -> list:
    """``pytest.param`` for every combination of ``axes``; all but the diagonal (the i-th value of
    every axis, wrapping round the shorter ones) marked ``slow``."""
    longest = max(len(axis) for axis in axes)
    diagonal = {tuple(axis[i % len(axis)] for axis in axes) for i in range(longest)}
    return [
        pytest.param(*combination, marks=() if combination in diagonal else pytest.mark.slow)
        for combination in itertools.product(*axes)
    ]
