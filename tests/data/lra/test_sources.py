"""Where the LRA sources find the release (both unpacked layouts), and when Pathfinder may generate."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from attnlab.data.errors import MissingDataError
from attnlab.data.lra.sources import ListOpsSource, PathfinderSource, RetrievalSource

NESTED = ("lra_release", "lra_release")  # how the tarball often ends up unpacked in shared setups


def write_official(directory):
    """listops-1000 as in the release: header Source/Target, CRLF rows."""
    directory.mkdir(parents=True)
    for split in ("train", "val", "test"):
        rows = "Source\tTarget\r\n( ( [MAX 2 ) 9 ] )\t9\r\n( ( [MIN 2 ) 9 ] )\t2\r\n[SM 1 2 ]\t3\r\n"
        (directory / f"basic_{split}.tsv").write_bytes(rows.encode())


def write_aan(root):
    """tsv_data as in the release: no header, five tab-separated fields, float labels."""
    (root / "tsv_data").mkdir(parents=True)
    for name in ("train", "eval", "test"):
        rows = "".join(f"{i % 2}.0\ta{i}\tb{i}\t{name} text {i}\tother\n" for i in range(4))
        (root / "tsv_data" / f"new_aan_pairs.{name}.tsv").write_text(rows)


def write_release(root, images=10):
    """pathfinder32/curv_contour_length_14 as in the release: PNGs and 11-column metadata rows."""
    directory = root / "pathfinder32" / "curv_contour_length_14"
    (directory / "metadata").mkdir(parents=True)
    (directory / "imgs" / "0").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(images):
        pixels = ((rng.random((32, 32)) < 0.2) * 255).astype(np.uint8)
        Image.fromarray(pixels, "L").save(directory / "imgs" / "0" / f"sample_{i}.png")
        rows.append(f"imgs/0 sample_{i}.png {i} {i % 2} 1.0 14 4 2 0.5 1 1\n")
    (directory / "metadata" / "0.npy").write_text("".join(rows))
    return directory


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_listops_and_retrieval_read_either_layout_and_say_which(tmp_path, caplog, nested):
    root = tmp_path.joinpath(*NESTED) if nested else tmp_path / "lra_release"
    write_official(root / "listops-1000")
    write_aan(root)
    with caplog.at_level(logging.INFO, logger="attnlab.data"):
        listops = ListOpsSource(tmp_path, subdir="listops-1000", generate=False)
        assert len(listops.load()["train"]) == 3
        retrieval = RetrievalSource(tmp_path)
        retrieval.prepare()
        assert len(retrieval.load()["val"]) == 4
    for source in (listops, retrieval):
        assert str(root) in source.description
        assert ("lra_release/lra_release" in source.description) == nested
    assert str(root / "listops-1000") in caplog.text and str(root / "tsv_data") in caplog.text
    assert not (tmp_path / "lra_release" / "listops-1000" / "GENERATED_BY_ATTNLAB.json").exists()


def test_pathfinder_reads_a_nested_release_and_never_generates_beside_it(tmp_path, caplog):
    release = tmp_path.joinpath(*NESTED)
    write_release(release)
    source = PathfinderSource(tmp_path, generate=False, workers=1)
    with caplog.at_level(logging.INFO, logger="attnlab.data"):
        datasets = source.load()
    assert sum(len(d) for d in datasets.values()) == 10
    assert "LRA release" in source.description and str(release / "pathfinder32") in source.description
    assert str(release / "pathfinder32" / "curv_contour_length_14") in caplog.text
    assert not (tmp_path / "lra_release" / "pathfinder32").exists()


@pytest.mark.parametrize("generate", ["auto", True])
def test_a_damaged_release_is_never_replaced_by_a_generated_set(tmp_path, generate):
    directory = write_release(tmp_path.joinpath(*NESTED))
    (directory / "imgs" / "7").mkdir()  # an image folder without its metadata: a broken extraction
    with pytest.raises(MissingDataError, match="partial") as err:
        PathfinderSource(tmp_path, generate=generate, num_images=10, workers=1).load()
    assert str(directory) in str(err.value)
    assert not (tmp_path / "lra_release" / "pathfinder32").exists()


def test_auto_generates_only_when_no_release_is_present(tmp_path):
    write_aan(tmp_path / "lra_release")  # part of the release, but not Pathfinder
    auto = PathfinderSource(tmp_path, difficulty="easy", num_images=10, seed=3, workers=1)
    with pytest.raises(MissingDataError, match="generate=true") as err:
        auto.load()
    assert "tsv_data" in str(err.value)
    assert not (tmp_path / "lra_release" / "pathfinder32").exists()

    asked = PathfinderSource(tmp_path, difficulty="easy", generate=True, num_images=10, seed=3, workers=1)
    assert sum(len(d) for d in asked.load().values()) == 10
    for words in ("generated", "seed 3", "10 images", "contour_length=6", "asked (generate=true)"):
        assert words in asked.description


def test_auto_generates_when_nothing_is_there_and_says_so(tmp_path):
    source = PathfinderSource(tmp_path, difficulty="easy", num_images=10, workers=1)
    assert sum(len(d) for d in source.load().values()) == 10
    assert "generated" in source.description and "no LRA release under" in source.description


def test_generate_takes_auto_true_or_false(tmp_path):
    with pytest.raises(ValueError, match=r"generate='sometimes'.*auto, True, False"):
        PathfinderSource(tmp_path, generate="sometimes")
