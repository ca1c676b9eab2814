"""Lines a run prints that nobody can act on are dropped: Lightning's warning about an epoch shorter than
its logging interval (it logs by global step, so nothing is lost) and, on resume, its claim that the
earlier metric rows will be deleted (attnlab's CSV logger keeps them)."""

from __future__ import annotations

import warnings

import pytest

from attnlab.pipeline import _route_lightning_logs_to_root


@pytest.mark.parametrize(
    "message",
    [
        "The number of training batches (19) is smaller than the logging interval "
        "Trainer(log_every_n_steps=50). Set a lower value for log_every_n_steps if you want to see logs.",
        "Experiment logs directory /x/csv exists and is not empty. Previous log files in this directory "
        "will be deleted when the new ones are saved!",
    ],
)
def test_noise_is_dropped_and_other_warnings_are_not(message):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _route_lightning_logs_to_root()
        warnings.warn(message, UserWarning, stacklevel=1)
        warnings.warn("a warning someone can act on", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning someone can act on"]
