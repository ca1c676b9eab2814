"""SequenceDataModule: the reading policies the config sets for every task, and empty splits."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.data.datamodule import SequenceDataModule
from attnlab.data.errors import DataError
from attnlab.data.examples import TokenSequenceDataset


class ListSource:
    """A source built from lists, recording the policy it was asked to read with."""

    name, vocab_size, description = "fake", 5, "fake source"

    def __init__(self, sizes=(4, 2, 2)):
        self.sizes, self.seen = sizes, []

    def prepare(self):
        pass

    def load(self, on_bad_rows="error"):
        self.seen.append(on_bad_rows)
        return {
            split: TokenSequenceDataset([np.array([1, 2])] * n, [0] * n)
            for split, n in zip(("train", "val", "test"), self.sizes, strict=True)
        }


def test_on_bad_rows_reaches_the_source_and_is_checked():
    source = ListSource()
    SequenceDataModule(source, on_bad_rows="skip").setup()
    assert source.seen == ["skip"]
    with pytest.raises(ValueError, match=r"task.data.on_bad_rows='ignore'.*error, skip"):
        SequenceDataModule(ListSource(), on_bad_rows="ignore")


def test_an_empty_split_stops_the_run():
    with pytest.raises(DataError, match="fake source: the val split is empty"):
        SequenceDataModule(ListSource((4, 0, 2))).setup()


def test_zero_pixels_only_for_pixel_sources_and_only_known_rules(tmp_path):
    from attnlab.data.lra.sources import ImageSource, TextSource

    with pytest.raises(ValueError, match=r"task.data.zero_pixels applies to pixel tasks.*'text'"):
        SequenceDataModule(TextSource(tmp_path), zero_pixels="padding")
    with pytest.raises(ValueError, match=r"task.data.zero_pixels='mask'.*padding, token"):
        SequenceDataModule(ImageSource(tmp_path), zero_pixels="mask")
