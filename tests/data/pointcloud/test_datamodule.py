"""The point-cloud datamodule: the seeded validation split, batches, augmentation on train only, votes,
the sampled-cloud cache (and that nothing planted in it can run code), and config errors that name
their key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.data.pointcloud.datamodule import PointCloudDataModule, split_indices
from attnlab.data.pointcloud.modelnet import MANIFEST, ModelNetSource
from attnlab.data.pointcloud.shapes import ShapesSource
from attnlab.errors import ConfigError
from pointcloud_fixtures import write_modelnet_off

AUGMENT = {"scale": [0.5, 2.0], "translate": 0.2, "rotate_degrees": 180, "point_dropout": 0.5}


def datamodule(tmp_path, **kwargs):
    source = ShapesSource(tmp_path, train_per_class=5, test_per_class=2, sample_points=32)
    options = {"num_classes": 8, "num_points": 24, "batch_size": 4, "augment": AUGMENT, **kwargs}
    dm = PointCloudDataModule(source, **options)
    dm.prepare_data()
    dm.setup()
    return dm


def test_validation_is_a_seeded_split_of_train():
    train, val = split_indices(100, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90 and not set(train) & set(val)
    again_train, again_val = split_indices(100, 0.1, seed=3)
    assert (val == again_val).all() and (split_indices(100, 0.1, seed=4)[1] != val).any()
    with pytest.raises(ConfigError, match=r"task.data.val_fraction=0.001 leaves 0 of 100"):
        split_indices(100, 0.001, seed=0)


def test_batches_and_where_augmentation_applies(tmp_path):
    dm = datamodule(tmp_path)
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [36, 4, 16]
    batch = next(iter(dm.train_dataloader()))
    assert batch["points"].shape == (4, 24, 3) and batch["labels"].shape == (4,) and "mask" not in batch
    train, test = dm.datasets["train"], dm.datasets["test"]
    first = train.points[train.indices[0], :24]
    assert not torch.allclose(train[0]["points"], first)  # augmented
    val = dm.datasets["val"]
    torch.testing.assert_close(val[0]["points"], val.points[val.indices[0], :24])  # not augmented
    torch.testing.assert_close(test[3]["points"], test.points[3, :24])
    assert dm.max_length() == 24 and dm.model_kwargs() == {"in_channels": 3}
    assert dm.majority_baseline("test") == pytest.approx(1 / 8)


def test_votes_are_deterministic_and_the_first_is_the_cloud(tmp_path):
    dm = datamodule(tmp_path, test_votes=3)
    test = dm.datasets["test"]
    a, b = test[5]["points"], test[5]["points"]
    assert a.shape == (3, 24, 3)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0], test.points[5, :24])
    assert not torch.allclose(a[1], a[0]) and not torch.allclose(a[1], a[2])
    batch = next(iter(dm.test_dataloader()))
    assert batch["points"].shape == (4, 3, 24, 3)


def test_resample_draws_a_fresh_subset(tmp_path):
    dm = datamodule(tmp_path, resample=True, augment={"scale": None, "translate": 0, "point_dropout": 0})
    train = dm.datasets["train"]
    a, b = train[0]["points"], train[0]["points"]
    assert a.shape == (24, 3) and not torch.equal(a, b)
    cached = {tuple(p.tolist()) for p in train.points[train.indices[0]]}
    assert {tuple(p.tolist()) for p in a} <= cached


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_points": 64}, r"task.data.num_points=64 exceeds the 32 points per cloud"),
        ({"num_classes": 40}, r"8 classes found, but task.num_classes=40"),
        ({"augment": {"rotation": 10}}, r"task.data.augment has unknown key\(s\) rotation"),
        ({"augment": {"scale": [2, 1]}}, r"task.data.augment: scale range needs 0 < low <= high"),
        ({"test_votes": 0}, r"task.data.test_votes must be >= 1"),
        ({"batch_size": 64}, r"fewer than one batch of task.data.batch_size=64"),
    ],
)
def test_bad_settings_name_their_key(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        dm = datamodule(tmp_path, **kwargs)
        dm.train_dataloader()


def test_cache_is_reused_and_rebuilt_when_the_meshes_change(tmp_path):
    root = write_modelnet_off(tmp_path / "ModelNet40", classes=["bed", "chair"])
    source = ModelNetSource(tmp_path, sample_points=16)
    source.prepare()
    cached = source.cache_dir / "train.npz"
    stamp = cached.stat().st_mtime_ns
    ModelNetSource(tmp_path, sample_points=16).prepare()
    assert cached.stat().st_mtime_ns == stamp  # current: read, not processed again
    first = ModelNetSource(tmp_path, sample_points=16).load()["test"].points
    (root / "bed" / "train" / "bed_0003.off").write_bytes(
        (root / "bed" / "train" / "bed_0001.off").read_bytes()
    )
    again = ModelNetSource(tmp_path, sample_points=16)
    clouds = again.load()
    assert (
        len(clouds["train"]) == 5
        and json.loads((again.cache_dir / MANIFEST).read_text())["files"]["bed"]["train"] == 3
    )
    torch.testing.assert_close(clouds["test"].points, first)  # the same seeds per file: the same test set
    assert ModelNetSource(tmp_path, sample_points=8).cache_dir != source.cache_dir


class _Payload:
    """Unpickling this writes ``marker``: a stand-in for code planted in a cache file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "the payload ran"))


def _plant(folder, marker) -> list:
    """Every file a cache folder holds or PyG's ModelNet cache would hold, replaced by a payload."""
    import pickle

    names = {"train.npz", "test.npz", "pre_transform.pt", "pre_filter.pt", "training.pt", "test.pt"}
    names |= {p.name for p in folder.iterdir() if p.name != MANIFEST} if folder.is_dir() else set()
    folder.mkdir(parents=True, exist_ok=True)
    for name in sorted(names):
        (folder / name).write_bytes(pickle.dumps(_Payload(marker)))
    return sorted(names)


@pytest.mark.parametrize("manifest", ["kept", "removed"])
def test_a_payload_planted_in_the_cache_never_runs(tmp_path, manifest):
    """torch-geometric unpickled its cache (weights_only=False); the cache is plain arrays now.
    With the manifest kept (the cache claims to be current) the planted files are refused and the
    clouds sampled again; without it the cache is rebuilt. Either way the payload never runs."""
    write_modelnet_off(tmp_path / "ModelNet40", classes=["bed", "chair"])
    first = ModelNetSource(tmp_path, sample_points=16).load()
    source = ModelNetSource(tmp_path, sample_points=16)
    marker = tmp_path / "pwned"
    planted = _plant(source.cache_dir, marker)
    _plant(source.cache_root / "processed_v1_16pts_seed0", marker)  # an old PyG-style cache beside it
    assert "train.npz" in planted and "pre_transform.pt" in planted
    if manifest == "removed":
        (source.cache_dir / MANIFEST).unlink()
    clouds = source.load()
    assert not marker.exists(), "code planted in the cache ran"
    for split in ("train", "test"):
        torch.testing.assert_close(clouds[split].points, first[split].points)


def test_the_cache_holds_no_pickles(tmp_path):
    import numpy as np

    write_modelnet_off(tmp_path / "ModelNet40", classes=["bed", "chair"])
    source = ModelNetSource(tmp_path, sample_points=16)
    source.prepare()
    for split in ("train", "test"):
        with np.load(source.cache_dir / f"{split}.npz", allow_pickle=False) as arrays:
            assert sorted(arrays.files) == ["labels", "points"]
            assert arrays["points"].dtype == np.float32 and arrays["points"].shape[1:] == (16, 3)


def test_val_fraction_zero_trains_on_every_cloud_and_validates_on_test(tmp_path, caplog):
    """The published ModelNet40 protocol (PointNet, DGCNN, PCT): all 9,843 training meshes, test = val."""
    import logging

    with caplog.at_level(logging.INFO, logger="attnlab.data"):
        dm = datamodule(tmp_path, val_fraction=0.0)
    assert len(dm.datasets["train"]) == 40 and dm.datasets["val"] is dm.datasets["test"]
    assert "train 40 of 40 training clouds, test 16; validation on the test split" in caplog.text


def test_auto_prefers_the_hdf5_copy_of_the_published_tables(tmp_path):
    from attnlab.data.pointcloud.modelnet import ModelNet40Source
    from pointcloud_fixtures import write_modelnet_h5

    write_modelnet_off(tmp_path / "ModelNet40")
    write_modelnet_h5(tmp_path / "modelnet40_ply_hdf5_2048")
    source = ModelNet40Source(tmp_path)
    assert source.chosen is source.hdf5
    meshes = ModelNet40Source(tmp_path, format="off")
    assert meshes.chosen is meshes.off
