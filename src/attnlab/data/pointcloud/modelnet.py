"""ModelNet40 point clouds from the official OFF meshes (through torch-geometric) or the HDF5 copy.

Sources give the datamodule `PointClouds` per split (``train``, ``test``): every cloud with the same
number of points, ``(M, S, C)`` float32 (C = 3, or 6 with normals), labels and class names.

`ModelNetSource` reads the Princeton layout as the user unzips it::

    <data_dir>/ModelNet40/<class>/{train,test}/<class>_NNNN.off      (9,843 / 2,468 meshes)

with attnlab's strict OFF reader (ModelNet's fused ``OFF<counts>`` headers, and an error naming any
broken file; a missing folder is an error saying where to put what, nothing is ever downloaded), then
torch-geometric's transforms on each mesh: ``SamplePoints`` (``sample_points`` points on the surface,
area-weighted, with normals on request) under a seed fixed per file, and ``NormalizeScale`` (centred,
into the unit ball). That happens once: the clouds are cached under ``<data_dir>/ModelNet40_pyg/``
(or ``cache_dir``) in a folder named by the sampling settings, one ``.npz`` per split, with a manifest
written last, so an interrupted or outdated cache is rebuilt rather than read. Every split is then
deterministic, the test set included.

Why not ``torch_geometric.datasets.ModelNet`` and its processed cache: PyG pickles
``pre_transform.pt``/``pre_filter.pt`` and loads them, and retries its data files, with
``weights_only=False``, so a file planted in the cache folder runs code. The cache here is plain
arrays read with ``np.load(allow_pickle=False)``: a file that is not one is refused and rebuilt.

`ModelNetH5Source` reads PointNet's pre-sampled ``modelnet40_ply_hdf5_2048/`` (see `h5`).
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnlab.data.errors import DataError, MissingDataError, check_choice
from attnlab.data.pointcloud import h5
from attnlab.data.pointcloud.off import read_off
from attnlab.files import removed_on_failure

log = logging.getLogger(__name__)

SPLITS = ("train", "test")
CACHE_VERSION = 2  # bump when the processing changes: older caches are then rebuilt (2: npz)
MANIFEST = "manifest.json"
HOW_TO_OBTAIN_OFF = (
    "Download ModelNet40.zip from the Princeton ModelNet page (https://modelnet.cs.princeton.edu/) and "
    "unzip it into the data dir (paths.data_dir), so that <data_dir>/ModelNet40/<class>/train/*.off and "
    "<data_dir>/ModelNet40/<class>/test/*.off exist; or use PointNet's pre-sampled HDF5 copy "
    "(<data_dir>/modelnet40_ply_hdf5_2048/, task.data.source.format=hdf5; docs/pointcloud.md)."
)
HOW_TO_OBTAIN_H5 = (
    "Get modelnet40_ply_hdf5_2048.zip (PointNet's pre-sampled ModelNet40, 2,048 points per shape) and "
    "unzip it into the data dir, so that <data_dir>/modelnet40_ply_hdf5_2048/ply_data_train0.h5 and "
    "shape_names.txt exist (docs/pointcloud.md)."
)


@dataclass
class PointClouds:
    """One split: ``points`` (M, S, C) float32, ``labels`` (M,) int64, ``classes`` in label order."""

    points: torch.Tensor
    labels: torch.Tensor
    classes: list[str]

    def __post_init__(self):
        if self.points.ndim != 3 or len(self.points) != len(self.labels):
            raise ValueError(
                f"points must be (M, S, C) with one label per cloud, got {tuple(self.points.shape)} "
                f"and {len(self.labels)} labels"
            )

    def __len__(self) -> int:
        return len(self.labels)


def scan_off_layout(folder: str | Path, how_to_obtain: str = HOW_TO_OBTAIN_OFF) -> dict[str, dict[str, int]]:
    """Class → {split: number of ``<class>_*.off`` files}; stops on a missing or incomplete layout."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MissingDataError(folder, how_to_obtain)
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    if not classes:
        raise MissingDataError(folder / "<class>" / "train", how_to_obtain)
    counts: dict[str, dict[str, int]] = {}
    for name in classes:
        counts[name] = {}
        for split in SPLITS:
            files = list((folder / name / split).glob(f"{name}_*.off"))
            if not files:
                raise DataError(
                    folder / name / split,
                    f"no {name}_*.off files: ModelNet's layout is <class>/{{train,test}}/<class>_NNNN.off "
                    f"for every class folder ({how_to_obtain})",
                )
            counts[name][split] = len(files)
    return counts


def _file_seed(seed: int, relative: str) -> int:
    """A seed per mesh, from the run seed and the file's path: independent of file order and count."""
    return (zlib.crc32(relative.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF


def _check_surface(path: Path, vertices: np.ndarray, faces: np.ndarray) -> None:
    if len(faces):
        a, b, c = (vertices[faces[:, k]].astype(np.float64) for k in range(3))
        if np.linalg.norm(np.cross(b - a, c - a), axis=1).sum() > 0:
            return
    raise DataError(
        path, "the mesh has no surface (no face of non-zero area): no points can be sampled on it"
    )


def _sample_meshes(root: Path, classes: list[str], split: str, transform, seed: int, normals: bool):
    """Every mesh of ``split`` read, checked and sampled: ``(M, S, C)`` float32 points, ``(M,)`` labels."""
    from torch_geometric.data import Data

    clouds, labels = [], []
    for target, category in enumerate(classes):
        paths = sorted((root / category / split).glob(f"{category}_*.off"))
        for path in paths:
            vertices, faces = read_off(path)
            _check_surface(path, vertices, faces)
            data = Data(pos=torch.from_numpy(vertices), face=torch.from_numpy(faces).T.contiguous())
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_file_seed(seed, f"{category}/{split}/{path.name}"))
                data = transform(data)
            cloud = [data.pos, data.normal] if normals else [data.pos]
            clouds.append(torch.cat(cloud, dim=1).to(torch.float32).numpy())
            labels.append(target)
        log.info("ModelNet %s: %s sampled (%d meshes so far)", split, category, len(clouds))
    return np.stack(clouds), np.asarray(labels, dtype=np.int64)


def _read_cached_split(path: Path, sample_points: int, channels: int, classes: int) -> tuple:
    """A split's ``.npz`` as written by `ModelNetSource.prepare`, read without pickles and checked."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            points, labels = arrays["points"], arrays["labels"]
    except (OSError, ValueError, KeyError, EOFError) as err:
        raise DataError(path, f"not a point-cloud cache written by attnlab ({err}); it is rebuilt") from err
    if (
        points.dtype != np.float32 or points.ndim != 3 or points.shape[1:] != (sample_points, channels)
        or labels.dtype != np.int64 or labels.shape != points.shape[:1]
        or (labels.size and not 0 <= labels.min() <= labels.max() < classes)
    ):  # fmt: skip
        raise DataError(path, "the cached arrays have the wrong shape, type or labels; it is rebuilt")
    finite = np.isfinite(points).all(axis=(1, 2))
    if not finite.all():  # checked as the source files are: NaN would train on without a word
        raise DataError(
            path,
            f"cloud {int(np.argmin(finite))} holds NaN or inf coordinates; it is rebuilt",
        )
    return points, labels


class ModelNetSource:
    """ModelNet (40, or any folder in its layout) from OFF meshes, sampled with PyG's transforms, cached."""

    name = "modelnet40"
    up_axis = 2  # ModelNet's meshes stand on the xy plane: z is up

    def __init__(
        self,
        data_dir: str | Path,
        folder: str = "ModelNet40",
        sample_points: int = 1024,
        normals: bool = False,
        seed: int = 0,
        cache_dir: str | Path | None = None,
    ):
        if sample_points < 1:
            raise ValueError(f"task.data.source.sample_points must be >= 1, got {sample_points}")
        self.root = Path(data_dir) / folder
        self.sample_points, self.normals, self.seed = sample_points, normals, seed
        self.cache_root = Path(cache_dir) if cache_dir else self.root.parent / f"{self.root.name}_pyg"
        self._counts: dict[str, dict[str, int]] | None = None

    @property
    def channels(self) -> int:
        return 6 if self.normals else 3

    @property
    def processed_name(self) -> str:
        normals = "_normals" if self.normals else ""
        return f"processed_v{CACHE_VERSION}_{self.sample_points}pts{normals}_seed{self.seed}"

    @property
    def cache_dir(self) -> Path:
        return self.cache_root / self.processed_name

    def _manifest(self) -> dict:
        return {
            "version": CACHE_VERSION,
            "raw_folder": str(self.root.resolve()),
            "files": self._counts,
            "sample_points": self.sample_points,
            "normals": self.normals,
            "seed": self.seed,
        }

    def _cache_is_current(self) -> bool:
        path = self.cache_dir / MANIFEST
        try:
            return json.loads(path.read_text()) == json.loads(json.dumps(self._manifest()))
        except (OSError, ValueError):
            return False

    def prepare(self) -> None:
        """Check the layout; sample and cache the meshes unless a current cache is there."""
        from torch_geometric.transforms import Compose, NormalizeScale, SamplePoints

        self._counts = scan_off_layout(self.root)
        if self._cache_is_current():
            return
        total = {s: sum(c[s] for c in self._counts.values()) for s in SPLITS}
        log.info(
            "processing %s (%d classes, %d train / %d test meshes): %d points per mesh -> %s",
            self.root,
            len(self._counts),
            total["train"],
            total["test"],
            self.sample_points,
            self.cache_dir,
        )
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        (self.cache_dir / MANIFEST).unlink(missing_ok=True)
        sample = SamplePoints(self.sample_points, remove_faces=True, include_normals=self.normals)
        transform = Compose([sample, NormalizeScale()])
        for split in SPLITS:
            points, labels = _sample_meshes(
                self.root, list(self._counts), split, transform, self.seed, self.normals
            )
            partial = self.cache_dir / f"{split}.tmp.npz"
            with removed_on_failure(partial):
                np.savez(partial, points=points, labels=labels)  # plain arrays: nothing to unpickle
                partial.replace(self.cache_dir / f"{split}.npz")
        (self.cache_dir / MANIFEST).write_text(json.dumps(self._manifest(), indent=2) + "\n")

    def load(self) -> dict[str, PointClouds]:
        if self._counts is None or not self._cache_is_current():
            self.prepare()
        classes = list(self._counts)
        try:
            return {split: self._split(split, classes) for split in SPLITS}
        except DataError as err:  # a damaged or planted cache file: say so, then sample again
            log.warning("%s", err)
            (self.cache_dir / MANIFEST).unlink(missing_ok=True)
            self.prepare()
            return {split: self._split(split, classes) for split in SPLITS}

    def _split(self, split: str, classes: list[str]) -> PointClouds:
        points, labels = _read_cached_split(
            self.cache_dir / f"{split}.npz", self.sample_points, self.channels, len(classes)
        )
        return PointClouds(torch.from_numpy(points), torch.from_numpy(labels), classes)

    @property
    def description(self) -> str:
        counts = self._counts or {}
        sizes = "/".join(f"{sum(c[s] for c in counts.values()):,}" for s in SPLITS) if counts else "?"
        return (
            f"ModelNet OFF meshes at {self.root} (<class>/{{train,test}}/*.off; {len(counts)} classes, "
            f"{sizes} train/test meshes), read by attnlab's OFF reader: "
            f"{self.sample_points} points per mesh by SamplePoints (seed {self.seed} per file"
            f"{', with normals' if self.normals else ''}) + NormalizeScale, cached at {self.cache_dir}"
        )


class ModelNetH5Source:
    """PointNet's pre-sampled ModelNet40: 2,048 points per shape, y up, unit sphere (h5py)."""

    name = "modelnet40_h5"
    up_axis = 1

    def __init__(self, data_dir: str | Path, folder: str = h5.FOLDER, normals: bool = False):
        self.root = Path(data_dir) / folder
        self.normals = normals
        self._sizes: dict[str, int] = {}

    @property
    def channels(self) -> int:
        return 6 if self.normals else 3

    def prepare(self) -> None:
        if not (self.root / "shape_names.txt").is_file():
            raise MissingDataError(self.root / "shape_names.txt", HOW_TO_OBTAIN_H5)
        for split in SPLITS:
            if not h5.split_files(self.root, split):
                raise MissingDataError(self.root / f"ply_data_{split}0.h5", HOW_TO_OBTAIN_H5)

    def load(self) -> dict[str, PointClouds]:
        self.prepare()
        out = {}
        for split in SPLITS:
            points, labels, names = h5.read_h5_split(self.root, split, normals=self.normals)
            out[split] = PointClouds(torch.from_numpy(points), torch.from_numpy(labels), names)
            self._sizes[split] = len(labels)
        return out

    @property
    def description(self) -> str:
        sizes = "/".join(f"{self._sizes[s]:,}" for s in SPLITS) if self._sizes else "?"
        return (
            f"ModelNet40 pre-sampled HDF5 at {self.root} (ply_data_{{train,test}}<k>.h5, shape_names.txt; "
            f"{sizes} train/test clouds{', with normals' if self.normals else ''})"
        )


FORMATS = ("auto", "off", "hdf5")


class ModelNet40Source:
    """ModelNet40 in either format: ``off`` (the official meshes, through PyG), ``hdf5`` (PointNet's
    pre-sampled copy) or ``auto`` (the HDF5 copy when it is there, as PointNet, DGCNN and PCT read
    it, else the meshes). The choice is made when the data is first needed, and said in the log and
    ``data_source``."""

    def __init__(
        self,
        data_dir: str | Path,
        format: str = "auto",
        folder: str = "ModelNet40",
        hdf5_folder: str = h5.FOLDER,
        sample_points: int = 1024,
        normals: bool = False,
        seed: int = 0,
        cache_dir: str | Path | None = None,
    ):
        check_choice("task.data.source.format", format, FORMATS)
        self.format = format
        self.off = ModelNetSource(data_dir, folder, sample_points, normals, seed, cache_dir)
        self.hdf5 = ModelNetH5Source(data_dir, hdf5_folder, normals)
        self.name = "modelnet40"

    @property
    def chosen(self) -> ModelNetSource | ModelNetH5Source:
        if self.format == "off":
            return self.off
        if self.format == "hdf5":
            return self.hdf5
        if self.hdf5.root.is_dir():  # the common input of the published ModelNet40 tables
            return self.hdf5
        if self.off.root.is_dir():
            return self.off
        raise MissingDataError(
            self.off.root,
            f"Neither the meshes nor the HDF5 copy ({self.hdf5.root}) is there. {HOW_TO_OBTAIN_OFF} "
            f"Or: {HOW_TO_OBTAIN_H5}",
        )

    @property
    def channels(self) -> int:
        return self.off.channels

    @property
    def up_axis(self) -> int:
        return self.chosen.up_axis

    def prepare(self) -> None:
        self.chosen.prepare()

    def load(self) -> dict[str, PointClouds]:
        return self.chosen.load()

    @property
    def description(self) -> str:
        return self.chosen.description
