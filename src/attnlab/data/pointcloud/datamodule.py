"""The point-cloud LightningDataModule: fixed-size clouds, a seeded validation split, augmentation, votes.

A source (`ModelNetSource`, `ModelNetH5Source`, `ShapesSource`) gives ``train`` and ``test`` clouds of
``S`` points each; this module carves a validation split from train (a seeded permutation, the same for
every run with the same seed), takes ``num_points`` of each cloud (the first ones: sampled points come in
random order, so they are a uniform sample; ``resample=true`` draws a fresh subset per training example),
augments the training clouds, and batches ``{"points": (B, N, C), "labels": (B,)}``. Clouds all have
``num_points`` points, so batches carry no mask.

Test-time voting (``test_votes`` > 1): each test cloud also comes in ``test_votes - 1`` rescaled copies
(anisotropic scale U(``vote_scale``), seeded per cloud and copy, so evaluation stays deterministic);
the batch is then ``(B, V, N, C)`` and the model averages its logits over the copies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.errors import DataError
from attnlab.data.loaders import SampleDraw, ShardedDataModule, seeded_draws, unpack_draw
from attnlab.data.pointcloud.modelnet import PointClouds
from attnlab.data.pointcloud.transforms import AnisotropicScale, augmentation
from attnlab.errors import ConfigError

log = logging.getLogger(__name__)


class PointCloudDataset(Dataset):
    """Clouds ``points[indices]``, cut to ``num_points``, with an optional transform per access."""

    def __init__(
        self,
        clouds: PointClouds,
        indices: Sequence[int] | None = None,
        num_points: int | None = None,
        transform=None,
        resample: bool = False,
        votes: int = 1,
        vote_scale: tuple[float, float] = (0.8, 1.25),
        vote_seed: int = 0,
    ):
        self.points = clouds.points
        self.indices = np.arange(len(clouds)) if indices is None else np.asarray(indices, dtype=np.int64)
        self.labels = clouds.labels.numpy()[self.indices]
        self.num_points = num_points or self.points.shape[1]
        self.transform, self.resample = transform, resample
        self.votes, self.vote_seed = votes, vote_seed
        self.vote_transform = AnisotropicScale(*vote_scale) if votes > 1 else None

    def __len__(self) -> int:
        return len(self.indices)

    def _apply(self, transform, points: torch.Tensor) -> torch.Tensor:
        from torch_geometric.data import Data

        data = Data(pos=points[:, :3])
        if points.shape[1] == 6:
            data.normal = points[:, 3:]
        data = transform(data)
        return data.pos if points.shape[1] == 3 else torch.cat([data.pos, data.normal], dim=1)

    def __getitem__(self, key: int | SampleDraw) -> dict:
        """Cloud and label; a `SampleDraw` key seeds the resampling and augmentation (exact resume)."""
        index, seed = unpack_draw(key)
        cloud = self.points[self.indices[index]]
        with seeded_draws(seed):
            if self.resample and cloud.shape[0] > self.num_points:
                cloud = cloud[torch.randperm(cloud.shape[0])[: self.num_points]]
            else:
                cloud = cloud[: self.num_points]
            if self.transform is not None:
                cloud = self._apply(self.transform, cloud)
        if self.votes > 1:
            copies = [cloud]
            for vote in range(1, self.votes):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.vote_seed * 1_000_003 + int(self.indices[index]) * 131 + vote)
                    copies.append(self._apply(self.vote_transform, cloud))
            cloud = torch.stack(copies)
        return {"points": cloud.float(), "label": int(self.labels[index])}


def collate_clouds(batch: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "points": torch.stack([ex["points"] for ex in batch]),
        "labels": torch.tensor([ex["label"] for ex in batch], dtype=torch.long),
    }


def split_indices(count: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices: a seeded permutation, val the first ``round(val_fraction * count)``."""
    num_val = round(val_fraction * count)
    if not 1 <= num_val < count:
        raise ConfigError(
            f"task.data.val_fraction={val_fraction} leaves {num_val} of {count} training clouds for "
            f"validation; choose a fraction that gives at least one cloud to each side"
        )
    order = np.random.default_rng(seed).permutation(count)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


class PointCloudDataModule(ShardedDataModule):
    """Point-cloud batches; each training cloud's resampling and augmentation is seeded by (seed, epoch,
    index) (``seeded_samples``), so a resumed run, with any number of loader workers, replays them."""

    seeded_samples = True

    def __init__(
        self,
        source,
        num_classes: int,
        num_points: int = 1024,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        val_fraction: float = 0.1,
        resample: bool = False,
        augment: dict | None = None,
        test_votes: int = 1,
        vote_scale: Sequence[float] = (0.8, 1.25),
    ):
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"task.data.batch_size must be >= 1, got {batch_size}")
        if num_points < 1:
            raise ConfigError(f"task.data.num_points must be >= 1, got {num_points}")
        if not 0 <= val_fraction < 1:
            raise ConfigError(
                f"task.data.val_fraction must be in [0, 1) (0: train on every training cloud and "
                f"validate on the test split, as the literature does), got {val_fraction}"
            )
        if test_votes < 1:
            raise ConfigError(f"task.data.test_votes must be >= 1, got {test_votes}")
        augment = dict(augment or {})
        known = {"scale", "translate", "rotate_degrees", "point_dropout"}
        unknown = sorted(set(augment) - known)
        if unknown:
            raise ConfigError(
                f"task.data.augment has unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if augment.get("scale") is not None:
            augment["scale"] = tuple(float(x) for x in augment["scale"])
        try:  # checked now; built again in setup, about the up axis of the data the source found
            augmentation(**augment)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"task.data.augment: {err}") from None
        self.augment, self.transform = augment, None
        self.source, self.num_classes, self.num_points = source, num_classes, num_points
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.seed, self.val_fraction = num_workers, seed, val_fraction
        self.resample, self.test_votes = resample, test_votes
        self.vote_scale = tuple(float(x) for x in vote_scale)
        self.datasets: dict[str, PointCloudDataset] = {}
        self.classes: list[str] = []

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        clouds = self.source.load()
        train, test = clouds["train"], clouds["test"]
        self.classes = train.classes
        if len(self.classes) != self.num_classes:
            raise ConfigError(
                f"{self.source.description}: {len(self.classes)} classes found, but task.num_classes="
                f"{self.num_classes}; set task.num_classes={len(self.classes)} (e.g. for ModelNet10)"
            )
        available = train.points.shape[1]
        if self.num_points > available:
            raise ConfigError(
                f"task.data.num_points={self.num_points} exceeds the {available} points per cloud of "
                f"the data (task.data.source.sample_points for meshes; 2048 in the HDF5 copy)"
            )
        for split, part in (("train", train), ("test", test)):
            if len(part) == 0:
                raise DataError(self.source.description, f"the {split} split is empty")
        self.transform = augmentation(**self.augment, up_axis=self.source.up_axis)
        n = self.num_points
        test_set = PointCloudDataset(test, None, n, votes=self.test_votes, vote_scale=self.vote_scale)
        if self.val_fraction > 0:  # a held-out part of the training meshes, for tuning
            train_idx, val_idx = split_indices(len(train), self.val_fraction, self.seed)
            val_set, validation = (
                PointCloudDataset(train, val_idx, n),
                f"{len(val_idx):,} held-out training clouds",
            )
        else:  # the standard protocol: every training mesh; validation = the test split
            train_idx, val_set, validation = (
                None,
                test_set,
                "the test split (val_fraction=0, as the literature)",
            )
        self.datasets = {
            "train": PointCloudDataset(train, train_idx, n, self.transform, self.resample),
            "val": val_set,
            "test": test_set,
        }
        log.info(
            "data: %s (train %s of %s training clouds, test %s; validation on %s); %d points per cloud, "
            "%d channels; train augmentation: %s%s",
            self.source.description,
            f"{len(self.datasets['train']):,}",
            f"{len(train):,}",
            f"{len(test):,}",
            validation,
            n,
            train.points.shape[2],
            self.transform or "none",
            f"; test votes: {self.test_votes} (scale U{self.vote_scale})" if self.test_votes > 1 else "",
        )

    def model_kwargs(self) -> dict[str, int]:
        return {"in_channels": self.source.channels}

    def majority_baseline(self, split: str = "test") -> float:
        self.setup()
        labels = self.datasets[split].labels
        return float(np.bincount(labels).max() / len(labels))

    def max_length(self, split: str = "train") -> int:
        """Points per cloud: the sequence length the attention sees."""
        return self.num_points

    def _collate(self, examples: list) -> dict[str, torch.Tensor]:
        return collate_clouds(examples)

    def train_lengths(self) -> np.ndarray:
        return np.full(len(self.datasets["train"]), self.num_points)

    @property
    def train_items(self) -> str:
        return "clouds"
