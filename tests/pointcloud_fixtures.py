"""Point-cloud data in the official formats, written small: ModelNet40's OFF tree and PointNet's HDF5."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnlab.data.pointcloud.off import write_off
from attnlab.data.pointcloud.shapes import CLASSES, random_solid

# shape_names.txt of modelnet40_ply_hdf5_2048, the folder names of ModelNet40.zip
MODELNET40_CLASSES = [
    "airplane",
    "bathtub",
    "bed",
    "bench",
    "bookshelf",
    "bottle",
    "bowl",
    "car",
    "chair",
    "cone",
    "cup",
    "curtain",
    "desk",
    "door",
    "dresser",
    "flower_pot",
    "glass_box",
    "guitar",
    "keyboard",
    "lamp",
    "laptop",
    "mantel",
    "monitor",
    "night_stand",
    "person",
    "piano",
    "plant",
    "radio",
    "range_hood",
    "sink",
    "sofa",
    "stairs",
    "stool",
    "table",
    "tent",
    "toilet",
    "tv_stand",
    "vase",
    "wardrobe",
    "xbox",
]


def write_modelnet_off(root: Path, classes=MODELNET40_CLASSES, train: int = 2, test: int = 1) -> Path:
    """``root/<class>/{train,test}/<class>_NNNN.off``; every other file with the fused ``OFF<counts>``
    header; class c holds solids of one kind (so the labels can be learnt)."""
    for c, name in enumerate(classes):
        for split, count in (("train", train), ("test", test)):
            folder = root / name / split
            folder.mkdir(parents=True)
            for i in range(count):
                rng = np.random.default_rng([c, i, split == "test"])
                vertices, faces = random_solid(CLASSES[c % len(CLASSES)], rng, noise=0.0, tilt_degrees=0)
                write_off(folder / f"{name}_{i + 1:04d}.off", vertices, faces, fused_header=i % 2 == 1)
    return root


def write_modelnet_h5(
    folder: Path, sizes=(("train", 0, 6), ("train", 1, 5), ("test", 0, 4)), points: int = 2048, normals=True
) -> Path:
    """PointNet's ``modelnet40_ply_hdf5_2048`` layout: data (N, P, 3) float32, label (N, 1) uint8,
    normal (N, P, 3), shape_names.txt, {train,test}_files.txt naming the authors' paths."""
    import h5py

    folder.mkdir(parents=True)
    (folder / "shape_names.txt").write_text("\n".join(MODELNET40_CLASSES) + "\n")
    names = {"train": [], "test": []}
    rng = np.random.default_rng(0)
    for split, k, n in sizes:
        name = f"ply_data_{split}{k}.h5"
        names[split].append(f"data/modelnet40_ply_hdf5_2048/{name}")
        with h5py.File(folder / name, "w") as f:
            xyz = rng.normal(size=(n, points, 3)).astype(np.float32)
            f.create_dataset("data", data=xyz)
            f.create_dataset("label", data=rng.integers(0, 40, size=(n, 1)).astype(np.uint8))
            if normals:
                unit = xyz / np.linalg.norm(xyz, axis=2, keepdims=True)
                f.create_dataset("normal", data=unit)
            f.create_dataset("faceId", data=np.zeros((n, points), np.int32))
    for split in ("train", "test"):
        (folder / f"{split}_files.txt").write_text("\n".join(names[split]) + "\n")
    return folder
