"""Packed batches on the data side: the collate's rows, labels in the examples' order, pairs, what is
refused, and how full the rows of an epoch are."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from attnlab.attention import PackedLayout
from attnlab.data.datamodule import SequenceDataModule
from attnlab.data.examples import TokenSequenceDataset, pad_collate
from attnlab.data.packing import check_packing, document_layout, pack_collate, packing_fill


def _examples(lengths, pair=False, seed=0):
    rng = np.random.default_rng(seed)
    examples = []
    for n, length in enumerate(lengths):
        example = {"input_ids": torch.as_tensor(rng.integers(1, 9, length)), "label": n % 3}
        if pair:
            example["input_ids2"] = torch.as_tensor(rng.integers(1, 9, 1 + (length * 7) % 5))
        examples.append(example)
    return examples


def test_collate_packs_whole_sequences_and_unpacks_them_in_the_examples_order():
    examples = _examples([3, 8, 2, 5, 1, 4])
    batch = pack_collate(examples)
    assert batch["input_ids"].shape == (3, 8)  # 23 tokens in rows of the longest (8)
    layout = PackedLayout.from_batch(batch)
    padded = pad_collate(examples)
    torch.testing.assert_close(layout.unpack(batch["input_ids"]), padded["input_ids"])
    torch.testing.assert_close(layout.mask, padded["mask"])
    torch.testing.assert_close(batch["labels"], padded["labels"])
    assert int(batch["mask"].sum()) == 23 and batch["mask"].equal(layout.row_mask)


def test_pack_length_and_pad_to_multiple_of_set_the_row():
    examples = _examples([3, 8, 2, 5, 1, 4])
    assert pack_collate(examples, row_length=12)["input_ids"].shape == (2, 12)
    assert pack_collate(examples, pad_to_multiple_of=5)["input_ids"].shape == (3, 10)
    assert pack_collate(examples, row_length=4)["input_ids"].shape[1] == 8  # never below the longest


def test_each_side_of_a_pair_is_packed_on_its_own():
    examples = _examples([3, 8, 2, 5], pair=True)
    batch = pack_collate(examples)
    padded = pad_collate(examples)
    second = PackedLayout.from_batch(batch, "2")
    torch.testing.assert_close(second.unpack(batch["input_ids2"]), padded["input_ids2"])
    assert batch["mask2"].equal(second.row_mask)


def test_an_id_0_inside_a_sequence_is_refused_by_name():
    examples = _examples([3, 4])
    examples[1]["input_ids"][2] = 0
    with pytest.raises(
        ValueError, match="sequence 1 of the batch .* holds the padding id 0.*zero_pixels=token"
    ):
        pack_collate(examples)


@pytest.mark.parametrize(
    ("packing", "pack_length", "match"),
    [("true", None, "task.data.packing must be true or false"), (True, 0, "pack_length must be")],
)
def test_bad_packing_options_are_named(packing, pack_length, match):
    with pytest.raises(ValueError, match=match):
        check_packing(packing, pack_length)


def test_fill_counts_real_tokens_over_row_slots():
    lengths = [4, 4, 2, 2, 1]
    packed, padded = packing_fill([[0, 1, 2], [3, 4]], [lengths], 1, None)
    # rows of 4: [4], [4], [2] (10 / 12 slots); rows of 2: [2], [1] (3 / 4): nothing shares a row
    assert packed == pytest.approx((10 + 3) / (12 + 4))
    assert padded == pytest.approx((10 + 3) / (12 + 4))
    packed, padded = packing_fill([[0, 2, 3, 4]], [lengths], 1, None)  # 4 | 2+2 | 1 -> rows [4], [2, 2], [1]
    assert packed == pytest.approx(9 / 12) and padded == pytest.approx(9 / 16)


def test_fill_of_a_pair_task_counts_each_side_as_packed_on_its_own():
    # sides (3, 1) and (1, 3): each side's rows are [3], [1] of 3 slots, 4 real tokens in 6 slots
    packed, padded = packing_fill([[0, 1]], [[3, 1], [1, 3]], 1, None)
    assert packed == pytest.approx(8 / 12) and padded == pytest.approx(8 / 12)


class _Source:
    name, vocab_size, description = "lengths", 9, "sequences of varied lengths"

    def prepare(self):
        pass

    def load(self, on_bad_rows="error"):
        rng = np.random.default_rng(0)
        make = lambda n: TokenSequenceDataset(  # noqa: E731
            [rng.integers(1, 9, int(k)) for k in rng.integers(1, 40, n)], [0] * n
        )
        return {"train": make(64), "val": make(8), "test": make(8)}


def test_datamodule_packs_training_batches_and_logs_the_fill(caplog):
    dm = SequenceDataModule(_Source(), batch_size=16, packing=True, bucket_by_length=False)
    dm.setup()
    with caplog.at_level(logging.INFO, logger="attnlab.data.packing"):
        loader = dm.train_dataloader()
    batch = next(iter(loader))
    assert batch["labels"].shape == (16,) and batch["input_ids"].shape[0] < 16
    assert "packing: rows" in caplog.text and "padded batches would be" in caplog.text
    assert 0.5 < dm.packing_fill <= 1.0


def test_documents_of_a_block_start_after_each_end_of_document_and_pads_hold_none():
    eos, pad = 2, 0
    blocks = torch.tensor([[1, 5, 2, 6, 7, 2, 8], [1, 9, 9, 9, 2, 0, 0], [1, 3, 3, 3, 3, 3, 2]])
    layout = document_layout(blocks, eos, pad)
    assert layout.mask.sum(1).tolist() == [3, 3, 1, 5, 7]  # the last </s> ends its block: no empty one
    assert layout.positions[0].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert layout.row_mask[1].tolist() == [True] * 5 + [False] * 2
    torch.testing.assert_close(layout.unpack(blocks[..., None])[1, :3, 0], torch.tensor([6, 7, 2]))
