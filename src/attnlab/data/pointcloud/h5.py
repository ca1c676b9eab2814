"""The pre-sampled ModelNet40 of PointNet (``modelnet40_ply_hdf5_2048/``), read with h5py.

Layout::

    modelnet40_ply_hdf5_2048/
        shape_names.txt              40 class names, one a line, in label order
        ply_data_train0.h5 ... 4     data (N, 2048, 3) float32, label (N, 1) integer, normal (N, 2048, 3)
        ply_data_test0.h5, 1         (normal is absent from some copies)
        train_files.txt, test_files.txt

Points are already centred and scaled into the unit sphere; the up axis is y (PointNet's rotation
augmentation turns about y). The ``*_files.txt`` lists name paths of the authors' machine, so the
files are found by name here (``ply_data_<split><k>.h5``, in the order of k).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from attnlab.data.errors import DataError

FOLDER = "modelnet40_ply_hdf5_2048"
SPLITS = ("train", "test")
_FILE = re.compile(r"^ply_data_(train|test)(\d+)\.h5$")


def split_files(folder: str | Path, split: str) -> list[Path]:
    """``ply_data_<split><k>.h5`` in ``folder``, in the order of k (numeric: 10 after 9)."""
    found = []
    for path in Path(folder).glob(f"ply_data_{split}*.h5"):
        match = _FILE.match(path.name)
        if match and match.group(1) == split:
            found.append((int(match.group(2)), path))
    return [path for _, path in sorted(found)]


def read_shape_names(folder: str | Path) -> list[str]:
    path = Path(folder) / "shape_names.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            path, f"not UTF-8 text ({err.reason} at byte {err.start}): expected one name per line"
        ) from err
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise DataError(path, "no class names: expected one name per line")
    if len(set(names)) != len(names):
        raise DataError(path, "a class name appears twice")
    return names


def _dataset(handle, path: Path, key: str, shape_hint: str):
    if key not in handle:
        raise DataError(
            path,
            f"no dataset {key!r} (has {', '.join(sorted(handle.keys())) or 'none'}): "
            f"expected {key} {shape_hint}",
        )
    return handle[key]


def read_h5_split(
    folder: str | Path, split: str, normals: bool = False
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Points ``(N, P, 3)`` (``(N, P, 6)`` with normals) float32, labels ``(N,)`` int64, class names."""
    import h5py

    folder = Path(folder)
    names = read_shape_names(folder)
    files = split_files(folder, split)
    if not files:
        raise DataError(folder, f"no ply_data_{split}<k>.h5 files")
    clouds, labels = [], []
    for path in files:
        try:
            handle = h5py.File(path, "r")
        except OSError as err:
            raise DataError(path, f"not a readable HDF5 file ({err})") from None
        with handle:
            data = _dataset(handle, path, "data", "(N, points, 3) float")
            label = _dataset(handle, path, "label", "(N, 1) integer")
            if data.ndim != 3 or data.shape[2] != 3:
                raise DataError(path, f"data has shape {data.shape}, expected (N, points, 3)")
            points = np.asarray(data, dtype=np.float32)
            if normals:
                normal = _dataset(handle, path, "normal", "(N, points, 3) float (task.data.normals=true)")
                if normal.shape != data.shape:
                    raise DataError(path, f"normal has shape {normal.shape}, data {data.shape}")
                points = np.concatenate([points, np.asarray(normal, dtype=np.float32)], axis=2)
            label = np.asarray(label)
        if label.ndim == 2 and label.shape[1] == 1:
            label = label[:, 0]
        if label.shape != (len(points),) or not np.issubdtype(label.dtype, np.integer):
            raise DataError(
                path, f"label has shape {label.shape} ({label.dtype}), expected ({len(points)}, 1) integers"
            )
        if len(label) and (label.min() < 0 or label.max() >= len(names)):
            raise DataError(
                path,
                f"label {int(label.max() if label.max() >= len(names) else label.min())} outside "
                f"0..{len(names) - 1} (the classes of shape_names.txt)",
            )
        if not np.isfinite(points).all():
            raise DataError(path, "data holds non-finite values")
        if clouds and points.shape[1:] != clouds[0].shape[1:]:
            raise DataError(
                path, f"{points.shape[1]} points per cloud; {files[0].name} has {clouds[0].shape[1]}"
            )
        clouds.append(points)
        labels.append(label.astype(np.int64))
    return np.concatenate(clouds), np.concatenate(labels), names
