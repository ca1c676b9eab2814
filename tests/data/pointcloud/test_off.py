"""The OFF reader on files in ModelNet's exact formats, the malformed ones included."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.data.errors import DataError
from attnlab.data.pointcloud.off import parse_off, read_off, write_off

# a unit square as two triangles, then as one quad; ModelNet's files look like this
SQUARE = "OFF\n4 2 0\n0 0 0\n1 0 0\n1 1 0\n0 1 0\n3 0 1 2\n3 0 2 3\n"
VERTICES = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0]], np.float32)


def test_standard_header():
    vertices, faces = parse_off(SQUARE)
    np.testing.assert_array_equal(vertices, VERTICES)
    np.testing.assert_array_equal(faces, [[0, 1, 2], [0, 2, 3]])
    assert vertices.dtype == np.float32 and faces.dtype == np.int64


def test_fused_header_as_in_a_fifth_of_modelnet40():
    """ModelNet40's bathtub_0001.off and many others start with 'OFF490 518 0' on one line."""
    vertices, faces = parse_off(SQUARE.replace("OFF\n4 2 0", "OFF4 2 0"))
    np.testing.assert_array_equal(vertices, VERTICES)
    assert faces.tolist() == [[0, 1, 2], [0, 2, 3]]


@pytest.mark.parametrize(
    "text",
    [
        SQUARE.replace("\n", "\r\n"),  # CRLF
        SQUARE.replace("OFF\n", "OFF  \n"),  # trailing spaces after OFF (PyG's reader fails here)
        SQUARE.rstrip("\n"),  # no final newline (PyG's reader drops the last face)
        "# made by hand\n"
        + SQUARE.replace("0 0 0\n1 0 0", "0 0 0 # origin\n\n1 0 0"),  # comments, blank line
        SQUARE.replace("3 0 1 2\n3 0 2 3", "3 0 1 2 255 0 0\n3 0 2 3 255 0 0"),  # face colours
        "OFF\n4 1 0\n0 0 0\n1 0 0\n1 1 0\n0 1 0\n4 0 1 2 3\n",  # a quad, fan-triangulated
    ],
    ids=["crlf", "trailing-space", "no-final-newline", "comments", "face-colours", "quad"],
)
def test_variants_read_to_the_same_mesh(text):
    vertices, faces = parse_off(text)
    np.testing.assert_array_equal(vertices, VERTICES)
    assert faces.tolist() == [[0, 1, 2], [0, 2, 3]]


def test_polygon_is_fan_triangulated():
    text = "OFF\n5 1 0\n0 0 0\n1 0 0\n2 1 0\n1 2 0\n0 1 0\n5 0 1 2 3 4\n"
    assert parse_off(text)[1].tolist() == [[0, 1, 2], [0, 2, 3], [0, 3, 4]]


def test_truncated_file_names_the_file_and_what_is_missing(tmp_path):
    path = tmp_path / "chair_0007.off"
    path.write_text(SQUARE[: SQUARE.index("1 1 0")])  # cut inside the vertex block
    expected = (
        r"chair_0007\.off:\d+: truncated: the header announces 4 vertices and 2 faces, the file ends after 2"
    )
    with pytest.raises(DataError, match=expected + " vertices and 0 faces"):
        read_off(path)
    path.write_text(SQUARE[: SQUARE.index("3 0 2 3")])  # cut after the first face
    with pytest.raises(DataError, match=r"chair_0007\.off.*ends after 4 vertices and 1 faces"):
        read_off(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("PLY\n4 2 0\n", "not an OFF file"),
        ("OFF\nfour two zero\n", "bad counts line"),
        (SQUARE.replace("1 1 0", "1 one 0"), r":5: bad vertex '1 one 0'"),
        (SQUARE.replace("3 0 2 3", "3 0 2 9"), r":8: face '3 0 2 9' refers to a vertex outside 0..3"),
        (SQUARE.replace("3 0 2 3", "2 0 2"), r":8: bad face '2 0 2'"),
        (SQUARE.replace("1 1 0", "1 nan 0"), r":5: vertex coordinate is not a finite number"),
        (
            SQUARE.replace("4 2 0", "4 1 0"),
            r":8: the header announces 4 vertices and 1 faces, but the file holds 1 more",
        ),
    ],
    ids=["empty", "not-off", "counts", "vertex", "face-index", "face-size", "nan", "fewer-faces-declared"],
)
def test_broken_files_stop_with_file_and_line(tmp_path, text, message):
    path = tmp_path / "lamp_0001.off"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"lamp_0001\.off.*{message}"):
        read_off(path)


def test_binary_file_is_named(tmp_path):
    path = tmp_path / "x_0001.off"
    path.write_bytes(b"OFF\n\xff\xfe")
    with pytest.raises(DataError, match=r"x_0001\.off: not an ASCII OFF file"):
        read_off(path)


@pytest.mark.parametrize("fused", [False, True])
def test_write_then_read_round_trips(tmp_path, fused):
    rng = np.random.default_rng(0)
    vertices = rng.normal(size=(30, 3)).astype(np.float32)
    faces = rng.integers(0, 30, size=(50, 3))
    path = tmp_path / "m.off"
    write_off(path, vertices, faces, fused_header=fused)
    assert path.read_text().startswith("OFF30 50 0\n" if fused else "OFF\n30 50 0\n")
    got_v, got_f = read_off(path)
    np.testing.assert_allclose(got_v, vertices, atol=1e-6)
    np.testing.assert_array_equal(got_f, faces)


def test_fast_and_careful_paths_agree():
    """The vectorised path (plain triangle files) and the line-by-line one give the same mesh."""
    rng = np.random.default_rng(1)
    lines = ["OFF", "20 30 0"] + [" ".join(f"{x:.5f}" for x in rng.normal(size=3)) for _ in range(20)]
    lines += ["3 " + " ".join(map(str, rng.integers(0, 20, 3))) for _ in range(30)]
    plain = "\n".join(lines) + "\n"
    with_comment = "# forces the careful path\n" + plain
    for a, b in zip(parse_off(plain), parse_off(with_comment), strict=True):
        np.testing.assert_array_equal(a, b)
