"""Image classification data for the tiny ViT: CIFAR-10, Tiny ImageNet and scikit-learn's 8x8 digits.

Each *source* reads one dataset from its official layout (nothing is ever downloaded) and returns
``train`` / ``val`` / ``test`` datasets of ``(C, H, W)`` uint8 images; `ImageDataModule` adds the
augmentations (torchvision transforms v2 on uint8 tensors), batches ``{"images", "labels"}`` and
answers the pipeline's questions (``model_kwargs``, ``max_length``, ``majority_baseline``).

Splits. None of these datasets has an official validation split that is also labelled apart from the
test split, so ``val`` is always a seeded, class-stratified hold-out of the training images
(``split_seed``, the same for every run seed so runs stay comparable):

``val_per_class: 0`` holds nothing out: train = every training image and val = the test split, so the
validation curve is the test curve (the paper presets, with CCT's recipe: train on the training set,
report the test curve; they select no checkpoint on it). Selection runs on a hold-out
(``experiment=vit/grid``).

- CIFAR-10 (``<data_dir>/cifar-10-batches-py/``, the official python pickles read with the LRA Image
  reader's restricted unpickler): train = data_batch_1..5 minus ``val_per_class`` images per class
  (default 500: 45,000 / 5,000), test = test_batch (10,000).
- Tiny ImageNet (``<data_dir>/tiny-imagenet-200/``): the official test images have no labels, so test =
  the official val split (10,000 images, labels from ``val/val_annotations.txt``), val = ``val_per_class``
  training images per class (default 50: 90,000 / 10,000). Images are decoded when read.
- Digits (scikit-learn's bundled copy of the UCI 8x8 handwritten digits, 1,797 images, grey levels
  0-16 scaled to 0-255): ``test_per_class`` and ``val_per_class`` images per class held out.

CIFAR-10 and Tiny ImageNet also come from the Hugging Face cache (``datasets``)
when the official folder is absent: ``uoft-cs/cifar10`` and ``zh-plus/tiny-imagenet`` (its ``valid``
split as test), with the same hold-out rule.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from timm.data.auto_augment import rand_augment_transform
from torch.utils.data import Dataset
from torchvision.transforms import v2

from attnlab.data.errors import DataError
from attnlab.data.hf_cache import load_hf_cached
from attnlab.data.loaders import SPLITS, SampleDraw, ShardedDataModule, seeded_draws, unpack_draw
from attnlab.data.lra import image as lra_image
from attnlab.errors import ConfigError

log = logging.getLogger(__name__)
_RANDAUGMENT_SECTION = re.compile(r"^(?:(?:mstd|mmax|inc|m|n|p)\d[\d.]*|t\w+)$")

# ------------------------------------------------------------------------------------------------
# Datasets


class ImageDataset(Dataset):
    """Labelled images; ``image(i)`` gives image i as uint8 ``(C, H, W)``, ``transform`` maps it."""

    def __init__(self, labels: Sequence[int], transform: Callable | None = None):
        self.labels, self.transform = np.asarray(labels, dtype=np.int64), transform

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def subset(self, indices: np.ndarray) -> ImageDataset:
        raise NotImplementedError

    def __getitem__(self, key: int | SampleDraw) -> dict:
        """Image and label; a `SampleDraw` key seeds the transform's random draws (exact resume)."""
        index, seed = unpack_draw(key)
        image = self.image(index)
        if self.transform is not None:
            with seeded_draws(seed):
                image = self.transform(image)
        return {"image": image, "label": int(self.labels[index])}


class ImageArrayDataset(ImageDataset):
    """Images held in memory as one uint8 array ``(N, C, H, W)``."""

    def __init__(self, images: np.ndarray, labels: Sequence[int], transform: Callable | None = None):
        if images.ndim != 4 or images.dtype != np.uint8:
            raise ValueError(f"expected uint8 images (N, C, H, W), got {images.dtype} {images.shape}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        super().__init__(labels, transform)
        self.images = images

    def image(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.images[index])

    def subset(self, indices: np.ndarray) -> ImageArrayDataset:
        return ImageArrayDataset(self.images[indices], self.labels[indices], self.transform)


class ImageFileDataset(ImageDataset):
    """Image files decoded when read (Tiny ImageNet's 120,000 JPEGs); errors name the file."""

    def __init__(self, paths: Sequence[Path], labels: Sequence[int], size: int, transform=None):
        if len(paths) != len(labels):
            raise ValueError(f"{len(paths)} files but {len(labels)} labels")
        super().__init__(labels, transform)
        self.paths, self.size = list(paths), size

    def image(self, index: int) -> torch.Tensor:
        path = self.paths[index]
        try:
            with Image.open(path) as img:
                pixels = np.asarray(img.convert("RGB"), dtype=np.uint8)
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(path, f"cannot decode the image ({type(err).__name__}: {err})") from err
        if pixels.shape[:2] != (self.size, self.size):
            raise DataError(
                path, f"image is {pixels.shape[1]}x{pixels.shape[0]}, expected {self.size}x{self.size}"
            )
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy())

    def subset(self, indices: np.ndarray) -> ImageFileDataset:
        return ImageFileDataset(
            [self.paths[i] for i in indices], self.labels[indices], self.size, self.transform
        )


class HFImageDataset(ImageDataset):
    """Rows of a cached Hugging Face dataset, decoded when read."""

    def __init__(
        self, dataset, rows: np.ndarray, image_column: str, labels: np.ndarray, name: str, size: int
    ):
        super().__init__(labels)
        self.dataset, self.rows, self.column, self.name, self.size = dataset, rows, image_column, name, size

    def image(self, index: int) -> torch.Tensor:
        row = int(self.rows[index])
        pixels = np.asarray(self.dataset[row][self.column].convert("RGB"), dtype=np.uint8)
        if pixels.shape != (self.size, self.size, 3):
            raise DataError(
                f"huggingface:{self.name}",
                f"row {row} has shape {pixels.shape}, expected ({self.size}, {self.size}, 3)",
            )
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy())

    def subset(self, indices: np.ndarray) -> HFImageDataset:
        subset = HFImageDataset(
            self.dataset, self.rows[indices], self.column, self.labels[indices], self.name, self.size
        )
        subset.transform = self.transform
        return subset


def split_per_class(
    labels: np.ndarray, counts: dict[str, int], seed: int, what: str
) -> dict[str, np.ndarray]:
    """Indices of a class-stratified split: ``counts[name]`` examples of every class per held-out name,
    the rest under ``"train"``; seeded, so every run (any run seed) gets the same split."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in ("train", *counts)}
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        need = sum(counts.values())
        if len(members) <= need:
            raise ConfigError(
                f"{what}: class {label} has {len(members)} training images, too few to hold out "
                f"{' + '.join(f'{n} for {k}' for k, n in counts.items())} and keep some for training"
            )
        start = 0
        for name, count in counts.items():
            parts[name].append(members[start : start + count])
            start += count
        parts["train"].append(members[start:])
    return {name: np.sort(np.concatenate(chunks)) for name, chunks in parts.items()}


#: how `ImageSource.description` (and so ``data_source`` in summary.json) marks a run whose val is the test
#: split: its validation curve is a test curve (`attnlab.reporting.vit` reads it)
VAL_IS_TEST = "val = the test split"


def hold_out(
    train: ImageDataset, test: ImageDataset, val_per_class: int, split_seed: int, what: str, origin: str
) -> tuple[dict[str, ImageDataset], str]:
    """The train / val / test splits of a source and their description.

    ``val_per_class`` > 0: val = that many training images per class (seeded by ``split_seed``), train =
    the rest. 0: train = every training image and val = the test split (nothing to select on).
    """
    if isinstance(val_per_class, bool) or not isinstance(val_per_class, int) or val_per_class < 0:
        raise ConfigError(
            f"task.data.source.val_per_class={val_per_class!r} must be an integer >= 0 "
            "(0: train on every training image, val = the test split)"
        )
    if val_per_class == 0:
        return {
            "train": train,
            "val": test,
            "test": test,
        }, f"{origin}; {VAL_IS_TEST} (train = all {len(train):,})"
    splits = split_per_class(train.labels, {"val": val_per_class}, split_seed, what)
    description = f"{origin}; val = {val_per_class} training images per class (split_seed {split_seed})"
    return {
        "train": train.subset(splits["train"]),
        "val": train.subset(splits["val"]),
        "test": test,
    }, description


# ------------------------------------------------------------------------------------------------
# Sources


class ImageSource:
    """What every source provides: name, classes, image size and channels, normalisation, splits."""

    name = ""
    num_classes = 0
    image_size = 0
    channels = 3
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def __init__(self) -> None:
        self._origin = ""

    def prepare(self) -> None:
        """Check the data is there (MissingDataError naming the expected path and layout otherwise)."""

    def load(self) -> dict[str, ImageDataset]:
        raise NotImplementedError

    @property
    def description(self) -> str:
        return f"{self.name}: {self._origin or 'not loaded'}"


class Cifar10Source(ImageSource):
    """CIFAR-10 from ``<data_dir>/cifar-10-batches-py`` (or the cached Hugging Face ``uoft-cs/cifar10``)."""

    name = "cifar10"
    num_classes = 10
    image_size = 32
    mean = (0.4914, 0.4822, 0.4465)  # per-channel statistics of the 50,000 training images
    std = (0.2470, 0.2435, 0.2616)

    def __init__(
        self,
        data_dir: str | Path,
        val_per_class: int = 500,
        split_seed: int = 0,
        hf_name: str = lra_image.HF_NAME,
    ):
        super().__init__()
        self.data_dir, self.val_per_class, self.split_seed, self.hf_name = (
            Path(data_dir),
            val_per_class,
            split_seed,
            hf_name,
        )

    def prepare(self) -> None:
        if lra_image.find_cifar10(self.data_dir) is None:
            load_hf_cached(self.hf_name, "test", lra_image.cifar_dir(self.data_dir), lra_image.HOW_TO_OBTAIN)

    def _read(self, files: Sequence[str]) -> ImageArrayDataset:
        batches = [lra_image.read_batch(lra_image.cifar_dir(self.data_dir) / name) for name in files]
        data = np.concatenate([d for d, _ in batches])  # (N, 3072): red plane, green plane, blue plane
        labels = np.concatenate([lab for _, lab in batches])
        return ImageArrayDataset(data.reshape(len(data), 3, 32, 32), labels)

    def load(self) -> dict[str, ImageDataset]:
        folder = lra_image.find_cifar10(self.data_dir)
        if folder is not None:
            train, test = self._read(lra_image.TRAIN_FILES), self._read(lra_image.TEST_FILES)
            origin = f"official python pickles in {folder}"
        else:
            expected = lra_image.cifar_dir(self.data_dir)
            train, test = (
                _hf_split(self.hf_name, split, "img", "label", expected, lra_image.HOW_TO_OBTAIN, 32)
                for split in ("train", "test")
            )
            origin = f"huggingface:{self.hf_name} (local cache)"
        splits, self._origin = hold_out(train, test, self.val_per_class, self.split_seed, "cifar10", origin)
        return splits


def _hf_split(name, split, image_column, label_column, expected, how_to_obtain, size) -> HFImageDataset:
    dataset = load_hf_cached(name, split, expected, how_to_obtain)
    columns = getattr(dataset, "column_names", None)
    if columns is not None and not {image_column, label_column} <= set(columns):
        raise DataError(
            f"huggingface:{name}",
            f"the cached dataset has columns {columns}, not {image_column!r} and {label_column!r}",
        )
    labels = np.asarray(dataset[label_column], dtype=np.int64)
    return HFImageDataset(dataset, np.arange(len(labels)), image_column, labels, name, size)


TINY_DIR = "tiny-imagenet-200"
TINY_HF_NAME = "zh-plus/tiny-imagenet"
TINY_HOW_TO_OBTAIN = (
    "Expected the official layout: tiny-imagenet-200/wnids.txt (200 class ids), "
    "tiny-imagenet-200/train/<wnid>/images/*.JPEG and tiny-imagenet-200/val/val_annotations.txt "
    "(file, wnid, box) with tiny-imagenet-200/val/images/*.JPEG. Download tiny-imagenet-200.zip from "
    "http://cs231n.stanford.edu/tiny-imagenet-200.zip and unzip it into data_dir, or install `datasets` "
    f"and cache the Hugging Face dataset {TINY_HF_NAME!r} on a machine with network access."
)


class TinyImageNetSource(ImageSource):
    """Tiny ImageNet from ``<data_dir>/tiny-imagenet-200`` (or the cached ``zh-plus/tiny-imagenet``)."""

    name = "tinyimagenet"
    num_classes = 200
    image_size = 64
    mean = (0.485, 0.456, 0.406)  # ImageNet's statistics, as timm uses for Tiny ImageNet
    std = (0.229, 0.224, 0.225)

    def __init__(
        self, data_dir: str | Path, val_per_class: int = 50, split_seed: int = 0, hf_name: str = TINY_HF_NAME
    ):
        super().__init__()
        self.root = Path(data_dir) / TINY_DIR
        self.val_per_class, self.split_seed, self.hf_name = val_per_class, split_seed, hf_name

    def prepare(self) -> None:
        if not self.root.is_dir():
            load_hf_cached(self.hf_name, "valid", self.root, TINY_HOW_TO_OBTAIN)

    def _wnids(self) -> list[str]:
        path = self.root / "wnids.txt"
        if not path.is_file():
            raise DataError(path, f"missing. {TINY_HOW_TO_OBTAIN}")
        wnids = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if len(set(wnids)) != len(wnids) or len(wnids) != self.num_classes:
            raise DataError(
                path,
                f"expected {self.num_classes} distinct class ids, found {len(wnids)} "
                f"({len(set(wnids))} distinct)",
            )
        return wnids

    def _official(self) -> tuple[ImageFileDataset, ImageFileDataset]:
        wnids = self._wnids()
        index = {w: i for i, w in enumerate(wnids)}
        paths, labels = [], []
        for wnid in wnids:
            folder = self.root / "train" / wnid / "images"
            files = sorted(folder.glob("*.JPEG"))
            if not files:
                raise DataError(folder, f"no *.JPEG images for class {wnid} (listed in wnids.txt)")
            paths += files
            labels += [index[wnid]] * len(files)
        train = ImageFileDataset(paths, labels, self.image_size)
        annotations = self.root / "val" / "val_annotations.txt"
        if not annotations.is_file():
            raise DataError(annotations, f"missing. {TINY_HOW_TO_OBTAIN}")
        val_paths, val_labels = [], []
        for number, line in enumerate(annotations.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2:
                raise DataError(annotations, f"expected tab-separated file, wnid, box; got {line!r}", number)
            file, wnid = fields[0], fields[1]
            if wnid not in index:
                raise DataError(annotations, f"class id {wnid!r} is not in wnids.txt", number)
            path = self.root / "val" / "images" / file
            if not path.is_file():
                raise DataError(annotations, f"names {file!r}, but {path} does not exist", number)
            val_paths.append(path)
            val_labels.append(index[wnid])
        if not val_paths:
            raise DataError(annotations, "lists no image")
        return train, ImageFileDataset(val_paths, val_labels, self.image_size)

    def load(self) -> dict[str, ImageDataset]:
        if self.root.is_dir():
            train, test = self._official()
            origin = f"official layout in {self.root} (test = the official val split)"
        else:
            train, test = (
                _hf_split(self.hf_name, split, "image", "label", self.root, TINY_HOW_TO_OBTAIN, 64)
                for split in ("train", "valid")
            )
            origin = f"huggingface:{self.hf_name} (local cache; test = its valid split)"
        splits, self._origin = hold_out(
            train, test, self.val_per_class, self.split_seed, "tinyimagenet", origin
        )
        return splits


class DigitsSource(ImageSource):
    """scikit-learn's bundled 8x8 handwritten digits (1,797 real images, 10 classes, one channel)."""

    name = "digits"
    num_classes = 10
    image_size = 8
    channels = 1
    mean = (0.3,)  # about the mean grey level of the digits scaled to [0, 1]
    std = (0.4,)

    def __init__(self, val_per_class: int = 18, test_per_class: int = 36, split_seed: int = 0):
        super().__init__()
        self.val_per_class, self.test_per_class, self.split_seed = val_per_class, test_per_class, split_seed

    def load(self) -> dict[str, ImageDataset]:
        from sklearn.datasets import load_digits  # bundled with scikit-learn: nothing is downloaded

        digits = load_digits()
        # grey levels 0..16 -> 0..255, one channel
        images = np.rint(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None]
        every = ImageArrayDataset(images, digits.target)
        counts = {"val": self.val_per_class, "test": self.test_per_class}
        splits = split_per_class(every.labels, counts, self.split_seed, "digits")
        self._origin = (
            f"scikit-learn's bundled 8x8 digits ({len(every)} images); val / test = {self.val_per_class} / "
            f"{self.test_per_class} images per class (split_seed {self.split_seed})"
        )
        return {split: every.subset(splits[split]) for split in SPLITS}


# ------------------------------------------------------------------------------------------------
# Transforms and the datamodule


def train_transform(
    size: int,
    mean: Sequence[float],
    std: Sequence[float],
    crop_padding: int = 0,
    hflip: float = 0.0,
    randaugment: str | None = None,
    random_erasing: float = 0.0,
    crop_scale: Sequence[float] | None = None,
) -> v2.Compose:
    """Random crop (``crop_scale``: random-resized, else padded), flip, RandAugment, normalise, erasing."""
    steps: list[Any] = []
    if crop_scale is not None:
        steps.append(v2.RandomResizedCrop(size, scale=tuple(crop_scale), antialias=True))
    elif crop_padding > 0:
        steps.append(v2.RandomCrop(size, padding=crop_padding, padding_mode="reflect"))
    if hflip > 0:
        steps.append(v2.RandomHorizontalFlip(hflip))
    if randaugment:  # timm's own RandAugment (PIL ops), configured by its string, e.g. rand-m9-mstd0.5-inc1
        fill = tuple(round(255 * m) for m in mean)
        hparams = {"translate_const": int(size * 0.45), "img_mean": fill if len(fill) > 1 else fill[0]}
        try:
            sections = str(randaugment).split("-")
            # timm skips sections it cannot parse without a word: a typo would silently mean defaults
            if sections[0] != "rand" or not all(_RANDAUGMENT_SECTION.match(c) for c in sections[1:]):
                raise ValueError("expected rand-<section>-... with sections m, n, mstd, mmax, inc, p, t")
            augment = _posterize_keeps_one_bit(rand_augment_transform(randaugment, hparams))
        except (AssertionError, ValueError, KeyError) as err:
            raise ConfigError(
                f"task.data.randaugment={randaugment!r} is not a timm RandAugment string "
                f"(e.g. rand-m9-mstd0.5-inc1): {err}"
            ) from err
        steps += [v2.ToPILImage(), augment, v2.PILToTensor()]
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    if random_erasing > 0:
        steps.append(v2.RandomErasing(random_erasing))
    return v2.Compose(steps)


def _posterize_keeps_one_bit(augment):
    """timm's increasing posterize keeps 4 - 4·level/10 bits, 0 at the top magnitude (m9 plus mstd noise
    reaches it), and Pillow >= 11 refuses 0 bits (ValueError in a loader worker, mid-run); keep 1 bit,
    the nearest setting Pillow accepts (0 bits would have made the image black)."""
    for op in getattr(augment, "ops", []):
        if op.name == "PosterizeIncreasing":
            fn = op.aug_fn
            op.aug_fn = lambda img, bits, _fn=fn, **kw: _fn(img, max(1, bits), **kw)
    return augment


def eval_transform(mean: Sequence[float], std: Sequence[float]) -> v2.Compose:
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])


def image_collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "images": torch.stack([ex["image"] for ex in batch]),
        "labels": torch.tensor([ex["label"] for ex in batch]),
    }


class ImageDataModule(ShardedDataModule):
    """Augmented image batches ``{"images": (B, C, H, W) float, "labels": (B,)}`` from a source.

    Training batches come from attnlab's resumable, rank-sharded batch sampler (every image has the
    same size, so its length buckets are plain shuffled batches); evaluation runs in order. Each
    training image's augmentation is seeded by (seed, epoch, index) (``seeded_samples``), so a resumed
    run, with any number of loader workers, augments every image as the uninterrupted run did.
    """

    seeded_samples = True

    def __init__(
        self,
        source: ImageSource,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        patch_size: int = 4,
        crop_padding: int = 4,
        hflip: float = 0.5,
        randaugment: str | None = None,
        random_erasing: float = 0.0,
        crop_scale: Sequence[float] | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"task.data.batch_size must be >= 1, got {batch_size}")
        if source.image_size % patch_size:
            raise ConfigError(
                f"task.model.patch_size={patch_size} does not divide the {source.image_size} px images of "
                f"{source.name}"
            )
        for key, value in (("hflip", hflip), ("random_erasing", random_erasing)):
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"task.data.{key}={value!r} must be a probability in [0, 1]")
        self.source, self.seed, self.patch_size = source, seed, patch_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers = num_workers
        self.train_tf = train_transform(
            source.image_size,
            source.mean,
            source.std,
            crop_padding,
            hflip,
            randaugment,
            random_erasing,
            crop_scale,
        )
        self.eval_tf = eval_transform(source.mean, source.std)
        self.datasets: dict[str, ImageDataset] = {}

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        self.datasets = self.source.load()
        for split, dataset in self.datasets.items():
            dataset.transform = self.train_tf if split == "train" else self.eval_tf
        sizes = ", ".join(f"{s} {len(self.datasets[s]):,}" for s in SPLITS)
        log.info("data: %s (%s)", self.source.description, sizes)

    def model_kwargs(self) -> dict[str, int]:
        return {
            "num_classes": self.source.num_classes,
            "img_size": self.source.image_size,
            "in_chans": self.source.channels,
        }

    def max_length(self, split: str = "train") -> int:
        """Patch tokens per image (the class token not counted)."""
        return (self.source.image_size // self.patch_size) ** 2

    def majority_baseline(self, split: str = "test") -> float:
        self.setup()
        labels = self.datasets[split].labels
        return float(np.bincount(labels).max() / len(labels))

    def _collate(self, examples: list) -> dict[str, torch.Tensor]:
        return image_collate(examples)

    def train_lengths(self) -> np.ndarray:
        return np.ones(len(self.datasets["train"]), dtype=np.int64)

    @property
    def train_items(self) -> str:
        return f"{self.source.name} images"
