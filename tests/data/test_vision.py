"""Vision loaders on fixtures written in the official formats: labels, splits, shapes, clear errors."""

from __future__ import annotations

import pickle
import shutil
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from attnlab.data.errors import DataError, MissingDataError
from attnlab.data.lra.sources import ImageSource
from attnlab.data.vision import (
    Cifar10Source,
    DigitsSource,
    ImageDataModule,
    TinyImageNetSource,
    split_per_class,
)
from attnlab.errors import ConfigError

CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def write_cifar(root, per_batch=20):
    """The python version's pickles: b"data" (N, 3072) uint8 planes R, G, B; b"labels" a list.

    Image n of a file has red = n, green = 100 + label, blue = 200 everywhere, and label n % 10.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in CIFAR_FILES:
        labels = [n % 10 for n in range(per_batch)]
        data = np.zeros((per_batch, 3, 1024), dtype=np.uint8)
        data[:, 0] = np.arange(per_batch)[:, None]
        data[:, 1] = 100 + np.array(labels)[:, None]
        data[:, 2] = 200
        batch = {b"data": data.reshape(per_batch, 3072), b"labels": labels, b"batch_label": name.encode()}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    return folder


def wnid(c: int) -> str:
    return f"n{c:08d}"


def write_tiny_imagenet(root, classes=200, per_class=3):
    """The official tree: wnids.txt, train/<wnid>/images/*.JPEG, val/val_annotations.txt + val/images/.

    Each image is a flat colour whose red channel encodes its class (c % 256), so labels can be read back.
    """
    base = root / "tiny-imagenet-200"
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnid(c) for c in range(classes)) + "\n")
    annotations = []
    for c in range(classes):
        folder = base / "train" / wnid(c) / "images"
        folder.mkdir(parents=True)
        colour = (c % 256, 60, 120)
        for i in range(per_class):
            Image.new("RGB", (64, 64), colour).save(folder / f"{wnid(c)}_{i}.JPEG", quality=95)
        (base / "train" / wnid(c) / f"{wnid(c)}_boxes.txt").write_text("")
        Image.new("RGB", (64, 64), colour).save(base / "val" / "images" / f"val_{c}.JPEG", quality=95)
        annotations.append(f"val_{c}.JPEG\t{wnid(c)}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(annotations) + "\n")
    return base


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_imagenet(root)
    return root


def test_cifar10_reads_the_official_pickles(tmp_path):
    folder = write_cifar(tmp_path)
    source = Cifar10Source(tmp_path, val_per_class=2)
    source.prepare()
    data = source.load()
    assert {k: len(v) for k, v in data.items()} == {"train": 80, "val": 20, "test": 20}
    assert np.bincount(data["val"].labels).tolist() == [2] * 10  # class-stratified hold-out
    image = data["test"].image(7)
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    # the planes are R, G, B: red = index in file, green = 100 + label, blue = 200
    assert (image[0] == 7).all() and (image[1] == 107).all() and (image[2] == 200).all()
    assert data["test"].labels[7] == 7
    for split in ("train", "val"):
        ds = data[split]
        greens = np.array([int(ds.image(i)[1, 0, 0]) for i in range(len(ds))])
        assert (greens - 100 == ds.labels).all()  # every image keeps its own label through the split
    assert str(folder) in source.description and "val = 2 training images per class" in source.description


def test_val_hold_out_is_seeded_and_disjoint(tmp_path):
    write_cifar(tmp_path)
    first = Cifar10Source(tmp_path, val_per_class=2, split_seed=0).load()
    again = Cifar10Source(tmp_path, val_per_class=2, split_seed=0).load()
    other = Cifar10Source(tmp_path, val_per_class=2, split_seed=1).load()
    reds = lambda ds: sorted(  # noqa: E731 (identifies an image: file index and label)
        (int(ds.image(i)[0, 0, 0]), int(ds.labels[i])) for i in range(len(ds))
    )
    assert reds(first["val"]) == reds(again["val"]) and reds(first["val"]) != reds(other["val"])
    labels = np.repeat(np.arange(3), 5)
    parts = split_per_class(labels, {"val": 1, "test": 2}, seed=0, what="x")
    together = np.concatenate(list(parts.values()))
    assert sorted(together.tolist()) == list(range(15))  # a partition: disjoint, nothing lost
    assert np.bincount(labels[parts["test"]]).tolist() == [2, 2, 2]
    with pytest.raises(ConfigError, match="class 0 has 5 training images, too few to hold out 5 for val"):
        split_per_class(labels, {"val": 5}, seed=0, what="x")


def test_missing_cifar_names_the_path_and_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: only the folder could serve
    with pytest.raises(MissingDataError) as err:
        Cifar10Source(tmp_path).prepare()
    message = str(err.value)
    assert str(tmp_path / "cifar-10-batches-py") in message and "cifar-10-python.tar.gz" in message


def test_an_incomplete_cifar_folder_names_the_missing_file(tmp_path):
    """It used to fall through to the Hugging Face cache and never say that data_batch_5 is gone."""
    folder = write_cifar(tmp_path)
    (folder / "data_batch_5").unlink()
    for source in (Cifar10Source(tmp_path), ImageSource(tmp_path)):
        with pytest.raises(
            MissingDataError, match=r"cifar-10-batches-py is incomplete: data_batch_5 missing"
        ):
            source.prepare()


def test_cifar_from_a_cached_hugging_face_copy(tmp_path, monkeypatch):
    """No folder, `datasets` present with the dataset cached: the same images through the HF rows."""
    rng = np.random.default_rng(0)
    rows = {
        split: [
            {"img": Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)), "label": i % 10}
            for i in range(n)
        ]
        for split, n in (("train", 30), ("test", 10))
    }

    class Cached(list):
        column_names = ["img", "label"]

        def __getitem__(self, key):
            return [r[key] for r in self] if isinstance(key, str) else list.__getitem__(self, key)

    module = types.ModuleType("datasets")
    module.config = types.SimpleNamespace(HF_DATASETS_OFFLINE=False)
    seen = []

    def load_dataset(name, split):
        seen.append((name, split, module.config.HF_DATASETS_OFFLINE))
        return Cached(rows[split])

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
    source = Cifar10Source(tmp_path, val_per_class=1)
    source.prepare()
    data = source.load()
    assert {k: len(v) for k, v in data.items()} == {"train": 20, "val": 10, "test": 10}
    expected = np.asarray(rows["test"][3]["img"]).transpose(2, 0, 1)
    assert (data["test"].image(3).numpy() == expected).all()
    assert "huggingface:uoft-cs/cifar10" in source.description
    assert ("uoft-cs/cifar10", "train", True) in seen  # read offline: nothing is downloaded


def test_tiny_imagenet_reads_the_official_tree(tiny_root):
    source = TinyImageNetSource(tiny_root, val_per_class=1)
    source.prepare()
    data = source.load()
    assert {k: len(v) for k, v in data.items()} == {"train": 400, "val": 200, "test": 200}
    for split in ("train", "val", "test"):
        ds = data[split]
        for i in range(0, len(ds), 37):
            image = ds.image(i)
            assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
            assert abs(int(image[0].float().mean().round()) - ds.labels[i] % 256) <= 2  # label matches pixels
    assert sorted(data["test"].labels.tolist()) == list(range(200))  # official val, labelled by annotation
    assert "test = the official val split" in source.description and str(tiny_root) in source.description


def test_tiny_imagenet_malformed_inputs_name_the_file(tiny_root, tmp_path):
    broken = tmp_path / "tiny-imagenet-200"
    shutil.copytree(tiny_root / "tiny-imagenet-200", broken)
    (broken / "wnids.txt").rename(broken / "wnids.bak")
    with pytest.raises(DataError, match=r"tiny-imagenet-200/wnids.txt: missing"):
        TinyImageNetSource(tmp_path).load()
    (broken / "wnids.bak").rename(broken / "wnids.txt")

    annotations = broken / "val" / "val_annotations.txt"
    lines = annotations.read_text().splitlines()
    lines[4] = "val_4.JPEG\tn99999999\t0\t0\t63\t63"
    annotations.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"val_annotations.txt:5: class id 'n99999999' is not in wnids.txt"):
        TinyImageNetSource(tmp_path).load()
    shutil.copy(tiny_root / "tiny-imagenet-200" / "val" / "val_annotations.txt", annotations)

    bad = broken / "train" / wnid(3) / "images" / f"{wnid(3)}_1.JPEG"
    bad.write_bytes(b"not a jpeg at all")
    data = TinyImageNetSource(tmp_path, val_per_class=1).load()
    where = next(s for s in ("train", "val") if bad in data[s].paths)
    with pytest.raises(DataError, match=rf"{bad}: cannot decode the image"):
        data[where].image(data[where].paths.index(bad))


def test_missing_tiny_imagenet_names_the_layout(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingDataError) as err:
        TinyImageNetSource(tmp_path).prepare()
    message = str(err.value)
    assert str(tmp_path / "tiny-imagenet-200") in message
    assert "wnids.txt" in message and "val_annotations.txt" in message and "tiny-imagenet-200.zip" in message


def test_digits_are_the_bundled_real_images():
    source = DigitsSource()
    data = source.load()
    assert {k: len(v) for k, v in data.items()} == {"train": 1257, "val": 180, "test": 360}
    assert np.bincount(data["test"].labels).tolist() == [36] * 10
    image = data["train"].image(0)
    assert image.shape == (1, 8, 8) and image.dtype == torch.uint8 and image.max() > 200
    assert "scikit-learn's bundled 8x8 digits (1797 images)" in source.description


def test_datamodule_batches_and_answers_the_pipeline(tmp_path):
    write_cifar(tmp_path)
    dm = ImageDataModule(Cifar10Source(tmp_path, val_per_class=2), batch_size=16, eval_batch_size=32)
    dm.prepare_data()
    dm.setup()
    assert dm.model_kwargs() == {"num_classes": 10, "img_size": 32, "in_chans": 3}
    assert dm.max_length("train") == 64  # 32 px, patch 4
    assert dm.majority_baseline("test") == pytest.approx(0.1)
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape == (16, 3, 32, 32) and batch["images"].dtype == torch.float32
    assert batch["labels"].shape == (16,)
    assert len(dm.train_dataloader()) == 5  # 80 images, incomplete batches dropped
    test = list(dm.test_dataloader())
    assert [len(b["labels"]) for b in test] == [20]
    # evaluation images are normalised, not augmented: the same every time
    assert torch.equal(test[0]["images"], next(iter(dm.test_dataloader()))["images"])
    with pytest.raises(ConfigError, match="task.model.patch_size=5 does not divide the 32 px images"):
        ImageDataModule(Cifar10Source(tmp_path), patch_size=5)
    with pytest.raises(ConfigError, match="task.data.randaugment='rand-zz' is not a timm RandAugment"):
        ImageDataModule(Cifar10Source(tmp_path), randaugment="rand-zz")


def test_randaugment_survives_its_strongest_posterize():
    """timm's posterize at magnitude 10 asks Pillow for 0 bits, which Pillow refuses: a run must go on."""
    from attnlab.data.vision import train_transform

    augment = train_transform(32, (0.5,) * 3, (0.25,) * 3, randaugment="rand-m10-n3-inc1")
    torch.manual_seed(0)
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    for _ in range(300):  # each op is drawn with probability 3/15 per image, and applied half the time
        assert augment(image).shape == (3, 32, 32)
