import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.data.examples import TokenSequenceDataset, pad_collate
from attnlab.data.resumable_loader import ResumableDataLoader
from attnlab.data.samplers import LengthBucketSampler
from attnlab.files import file_lock


def test_pad_collate_masks_real_tokens_and_pairs():
    ds = TokenSequenceDataset(
        [np.array([3, 4, 5]), np.array([7])], [1, 0], sequences2=[np.array([1]), np.array([2, 2])]
    )
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
    assert torch.equal(
        TokenSequenceDataset([np.array([1, 2], dtype=np.int16)], [4])[0]["input_ids"], torch.tensor([1, 2])
    )


# ---- resuming the bucket sampler mid-epoch --------------------------------------------------------------
def _stream(sampler, passes: int) -> list[list[int]]:
    return [batch for _ in range(passes) for batch in sampler]


def test_bucket_sampler_advances_the_epoch_by_itself_each_pass():
    """Lightning never calls set_epoch on a batch sampler: each pass must reshuffle on its own."""
    sampler = LengthBucketSampler(np.arange(60), batch_size=4, seed=1, pool_batches=2)
    first, second = list(sampler), list(sampler)
    assert first != second and sorted(map(tuple, first)) != sorted(map(tuple, second))
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_bucket_sampler_len_matches_batches():
    for n, bs, pool, drop, reps in [
        (103, 5, 3, False, 1),
        (103, 5, 3, True, 2),
        (7, 10, 50, False, 1),
        (7, 10, 50, True, 1),
        (250, 16, 4, True, 3),
    ]:
        sampler = LengthBucketSampler(np.arange(n), bs, pool_batches=pool, drop_last=drop, num_replicas=reps)
        assert len(sampler) == len(list(sampler)), (n, bs, pool, drop, reps)


@pytest.mark.parametrize("stop_after", [0, 3, 11, 12, 17])
def test_bucket_sampler_state_resumes_at_the_next_batch(stop_after):
    lengths = np.random.default_rng(0).integers(1, 50, size=48)
    reference = _stream(LengthBucketSampler(lengths, 4, seed=5, pool_batches=3), passes=3)  # 12 per epoch

    sampler = LengthBucketSampler(lengths, 4, seed=5, pool_batches=3)
    iterator, seen = iter(sampler), []
    for _ in range(stop_after):
        try:
            seen.append(next(iterator))
        except StopIteration:
            iterator = iter(sampler)
            seen.append(next(iterator))
    state = sampler.state_dict()
    assert (state["epoch"], state["next_batch"]) == divmod(stop_after, 12)

    fresh = LengthBucketSampler(lengths, 4, seed=5, pool_batches=3)
    fresh.load_state_dict(state)
    resumed = seen + list(fresh)  # the interrupted epoch's remaining batches
    while len(resumed) < len(reference):
        resumed += list(fresh)  # later epochs, advancing by themselves
    assert resumed == reference


def test_resumable_loader_counts_what_the_consumer_received():
    dataset = TokenSequenceDataset([np.arange(1, n + 2) for n in range(40)], [0] * 40)
    make = lambda: ResumableDataLoader(  # noqa: E731
        dataset,
        LengthBucketSampler(dataset.lengths(), 4, seed=2, pool_batches=2),
        collate_fn=pad_collate,
        generator=torch.Generator().manual_seed(0),
    )
    loader = make()
    full = [b["input_ids"] for b in loader] + [b["input_ids"] for b in loader]
    loader = make()
    iterator = iter(loader)
    taken = [next(iterator)["input_ids"] for _ in range(7)]
    state = loader.state_dict()
    assert (state["epoch"], state["next_batch"]) == (0, 7)
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b["input_ids"] for b in resumed] + [b["input_ids"] for b in resumed]
    assert len(taken) + len(rest) == len(full) == 20
    assert all(torch.equal(a, b) for a, b in zip(taken + rest, full, strict=True))
    assert len(resumed) == 10  # the length Lightning sees stays the full epoch's


def test_iterating_a_loader_leaves_the_global_random_stream_alone():
    dataset = TokenSequenceDataset([np.arange(1, 5)] * 8, [0] * 8)
    loader = ResumableDataLoader(
        dataset,
        LengthBucketSampler(dataset.lengths(), 2),
        collate_fn=pad_collate,
        generator=torch.Generator().manual_seed(0),
    )
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in range(3):
        list(loader)
    assert torch.equal(torch.rand(3), expected)


def test_bucket_sampler_resume_on_another_world_size_skips_nothing_twice():
    lengths = np.arange(96)
    two = [LengthBucketSampler(lengths, 4, seed=0, num_replicas=2, rank=r) for r in (0, 1)]
    consumed = []
    for sampler in two:
        iterator = iter(sampler)
        consumed += [i for _ in range(3) for i in next(iterator)]  # 3 batches per rank: 6 global batches
    state = two[0].state_dict()
    one = LengthBucketSampler(lengths, 4, seed=0)
    one.load_state_dict(state)
    rest = [i for batch in one for i in batch]
    assert (one.pass_start, len(rest)) == (6, 96 - 24)
    assert sorted(consumed + rest) == list(range(96))


def test_bucket_sampler_warns_and_restarts_the_epoch_when_the_data_changed():
    state = LengthBucketSampler(np.arange(40), 4).state_dict() | {"next_batch": 5, "epoch": 2}
    other = LengthBucketSampler(np.arange(44), 4)
    with pytest.warns(UserWarning, match="num_examples"):
        other.load_state_dict(state)
    assert (other.epoch, other.pass_start) == (2, 0)


def test_bucket_sampler_and_loader_reject_bad_arguments():
    with pytest.raises(ValueError, match="rank=2"):
        LengthBucketSampler(np.arange(4), 2, num_replicas=2, rank=2)
    with pytest.raises(TypeError, match="LengthBucketSampler"):
        ResumableDataLoader(TokenSequenceDataset([np.arange(3)], [0]), [[0]])


def _hold_lock(path: str, log: str, tag: str) -> None:
    with file_lock(path):
        with open(log, "a") as handle:
            handle.write(f"{tag} in\n")
        time.sleep(0.3)
        with open(log, "a") as handle:
            handle.write(f"{tag} out\n")


def test_file_lock_makes_processes_take_turns(tmp_path):
    """What keeps DDP ranks from generating the same dataset at once."""
    context = multiprocessing.get_context("spawn")
    lock, log = str(tmp_path / "sub" / ".lock"), str(tmp_path / "log")
    workers = [context.Process(target=_hold_lock, args=(lock, log, tag)) for tag in "ab"]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    events = Path(log).read_text().splitlines()
    # never interleaved
    assert events in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])


def test_pad_collate_masks_id_zero_inside_a_sequence_too():
    """0 is padding wherever it stands: how black pixels drop out of attention (zero_pixels=padding)."""
    ds = TokenSequenceDataset([np.array([0, 4, 0, 5]), np.array([7])], [1, 0])
    batch = pad_collate([ds[0], ds[1]])
    assert batch["mask"].tolist() == [[False, True, False, True], [True, False, False, False]]
