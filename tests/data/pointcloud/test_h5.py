"""The HDF5 reader on files in the exact layout of PointNet's modelnet40_ply_hdf5_2048."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from attnlab.data.errors import DataError
from attnlab.data.pointcloud import h5
from pointcloud_fixtures import MODELNET40_CLASSES, write_modelnet_h5


@pytest.fixture
def folder(tmp_path):
    return write_modelnet_h5(tmp_path / h5.FOLDER, points=64)


def test_reads_every_file_of_a_split_in_order(folder):
    points, labels, names = h5.read_h5_split(folder, "train")
    assert points.shape == (11, 64, 3) and points.dtype == np.float32
    assert labels.shape == (11,) and labels.dtype == np.int64
    assert names == MODELNET40_CLASSES
    with h5py.File(folder / "ply_data_train1.h5") as f:  # file 1 follows file 0
        np.testing.assert_array_equal(points[6:], f["data"][:])
        np.testing.assert_array_equal(labels[6:], f["label"][:, 0])


def test_normals_join_the_coordinates(folder):
    points, _, _ = h5.read_h5_split(folder, "test", normals=True)
    assert points.shape == (4, 64, 6)
    np.testing.assert_allclose(np.linalg.norm(points[..., 3:], axis=2), 1.0, rtol=1e-5)


def test_files_are_ordered_by_number_not_by_name(tmp_path):
    for k in (10, 2, 0):
        (tmp_path / f"ply_data_train{k}.h5").touch()
    (tmp_path / "ply_data_trainval0.h5").touch()
    assert [p.name for p in h5.split_files(tmp_path, "train")] == [
        "ply_data_train0.h5",
        "ply_data_train2.h5",
        "ply_data_train10.h5",
    ]


def test_missing_normals_name_the_file_and_the_option(folder):
    with h5py.File(folder / "ply_data_test0.h5", "a") as f:
        del f["normal"]
    with pytest.raises(DataError, match=r"ply_data_test0\.h5: no dataset 'normal'.*task\.data\.normals=true"):
        h5.read_h5_split(folder, "test", normals=True)
    assert h5.read_h5_split(folder, "test")[0].shape == (4, 64, 3)  # not needed without normals


def _replace(name, data):
    def edit(f):
        del f[name]
        f.create_dataset(name, data=data)

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f.__delitem__("label"), r"no dataset 'label'"),
        (_replace("label", np.full((4, 1), 40)), r"label 40 outside 0\.\.39"),
        (_replace("data", np.zeros((4, 64))), r"data has shape \(4, 64\)"),
        (_replace("label", np.zeros((3, 1), int)), r"label has shape \(3,\)"),
    ],
    ids=["no-label", "label-range", "data-shape", "label-count"],
)
def test_bad_files_are_named(folder, edit, message):
    with h5py.File(folder / "ply_data_test0.h5", "a") as f:
        edit(f)
    with pytest.raises(DataError, match=rf"ply_data_test0\.h5: {message}"):
        h5.read_h5_split(folder, "test")


def test_a_file_that_is_not_hdf5_is_named(folder):
    (folder / "ply_data_test0.h5").write_bytes(b"not hdf5")
    with pytest.raises(DataError, match=r"ply_data_test0\.h5: not a readable HDF5 file"):
        h5.read_h5_split(folder, "test")


def test_shape_names_that_are_not_utf8_are_named(tmp_path):
    from attnlab.data.errors import DataError
    from attnlab.data.pointcloud.h5 import read_shape_names

    (tmp_path / "shape_names.txt").write_bytes(b"airplane\nbath\xfftub\n")
    with pytest.raises(
        DataError, match=r"shape_names\.txt: not UTF-8 text \(invalid start byte at byte 13\)"
    ):
        read_shape_names(tmp_path)
