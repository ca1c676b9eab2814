"""The augmentation seed is built where the real sampler hands out training keys: from the run seed,
the epoch and the example, so each epoch augments each example anew."""

from __future__ import annotations

import torch
from hydra.utils import instantiate

from attnlab.data.loaders import SampleDraw, sample_seed

AUGMENTED_DIGITS = [
    "task=digits_vit",
    "seed=7",
    "task.data.batch_size=32",
    "task.data.num_workers=0",
    "task.data.crop_padding=1",
    "task.data.hflip=0.5",
    "task.data.randaugment=rand-m9-mstd0.5-inc1",
]


def test_every_draw_is_seeded_by_seed_epoch_and_index_through_the_real_loader(train_config, monkeypatch):
    datamodule = instantiate(train_config(*AUGMENTED_DIGITS).task.data)
    datamodule.prepare_data()
    datamodule.setup()
    dataset = datamodule.datasets["train"]
    seen: list[tuple[int, SampleDraw, torch.Tensor]] = []
    epoch = {"now": 0}
    read = type(dataset).__getitem__

    def recording(self, key):
        example = read(self, key)
        seen.append((epoch["now"], key, example["image"].clone()))
        return example

    monkeypatch.setattr(type(dataset), "__getitem__", recording)
    loader = datamodule.train_dataloader()
    for epoch["now"] in (0, 1):  # two passes: the sampler moves to the next epoch by itself
        batches = sum(1 for _ in loader)
        assert batches > 1
    assert {e for e, _, _ in seen} == {0, 1}
    for at_epoch, key, _ in seen:
        assert isinstance(key, SampleDraw), "training keys carry their augmentation seed"
        assert key.seed == sample_seed(7, at_epoch, key.index), (at_epoch, key)
    images = {(e, key.index): image for e, key, image in seen}
    index = seen[0][1].index
    assert not torch.equal(images[(0, index)], images[(1, index)]), "the same augmentation every epoch"
