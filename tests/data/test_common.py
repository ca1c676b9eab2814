import numpy as np
import pytest
import torch

from attnlab.data.common import LengthBucketSampler, TokenSequenceDataset, pad_collate


def test_pad_collate_masks_real_tokens_and_pairs():
    ds = TokenSequenceDataset([np.array([3, 4, 5]), np.array([7])], [1, 0],
                              sequences2=[np.array([1]), np.array([2, 2])])
    batch = pad_collate([ds[0], ds[1]], pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[3, 4, 5, 0], [7, 0, 0, 0]]
    assert batch["mask"].tolist() == [[True, True, True, False], [True, False, False, False]]
    assert batch["labels"].tolist() == [1, 0]
    assert batch["input_ids2"].tolist() == [[1, 0, 0, 0], [2, 2, 0, 0]]
    assert batch["mask2"].sum().item() == 3


def test_bucket_sampler_covers_everything_once_and_groups_lengths():
    lengths = np.random.default_rng(0).integers(1, 1000, size=1000)
    sampler = LengthBucketSampler(lengths, batch_size=10, seed=3, pool_batches=100)
    batches = list(sampler)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(1000))
    spread = np.mean([lengths[b].max() - lengths[b].min() for b in batches])
    assert spread < 50  # random batches would spread over ~800
    assert batches == list(LengthBucketSampler(lengths, batch_size=10, seed=3, pool_batches=100))
    sampler.set_epoch(1)
    assert list(sampler) != batches


def test_bucket_sampler_shards_disjointly_with_equal_counts():
    lengths = np.arange(103)
    shards = [list(LengthBucketSampler(lengths, 5, seed=0, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(shards[0])
    seen = [i for shard in shards for b in shard for i in b]
    assert len(seen) == len(set(seen))


def test_dataset_checks_lengths():
    with pytest.raises(ValueError, match="2 sequences but 1 labels"):
        TokenSequenceDataset([np.array([1]), np.array([2])], [0])
    assert torch.equal(TokenSequenceDataset([np.array([1, 2], dtype=np.int16)], [4])[0]["input_ids"],
                       torch.tensor([1, 2]))
