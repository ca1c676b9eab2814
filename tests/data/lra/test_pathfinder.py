from __future__ import annotations

import hashlib
import logging
import math

import numpy as np
import pytest
from PIL import Image

from attnlab.data.errors import DataError, MissingDataError
from attnlab.data.examples import PAD_ID
from attnlab.data.lra import pathfinder_generator as gen
from attnlab.data.lra.pathfinder import (
    VOCAB_SIZE,
    PathfinderDataset,
    describe,
    ensure_pathfinder,
    load_pathfinder,
    read_metadata,
)

EASY = gen.lra_params(32, "easy")
HARD = gen.lra_params(32, "hard")


def png_bytes(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*.png"))}


# --- generator -----------------------------------------------------------------------------------


def test_lra_parameters_match_the_release():
    assert (HARD.contour_length, HARD.distractor_length, HARD.num_distractor_snakes) == (14, 4, 5)
    assert (EASY.contour_length, EASY.distractor_length, EASY.num_distractor_snakes) == (6, 2, 10)
    assert (HARD.paddle_length, HARD.paddle_thickness, HARD.paddle_margins, HARD.marker_radius) == (
        2,
        0.5,
        (1,),
        1.5,
    )
    assert (HARD.seed_distance, HARD.continuity, HARD.aa_scale, HARD.paddle_contrast) == (7, 1.0, 2, 0.75)
    pathx = gen.lra_params(128, "hard")
    assert (pathx.seed_distance, pathx.marker_radius, pathx.paddle_thickness, pathx.paddle_margins) == (
        20,
        3,
        1.5,
        (2, 3),
    )
    assert pathx.num_distractor_snakes == 35 // 4
    assert gen.difficulty_folder("hard") == "curv_contour_length_14" == gen.difficulty_folder(14)
    with pytest.raises(ValueError, match="unknown Pathfinder difficulty 'extreme'"):
        gen.lra_params(32, "extreme")
    with pytest.raises(ValueError, match="resolution 48"):
        gen.lra_params(48, "hard")


def test_labels_are_balanced():
    labels = [gen.sample_at(EASY, 3, i).label for i in range(300)]
    assert abs(sum(labels) - 150) < 45  # 5 standard deviations of Binomial(300, 1/2)


@pytest.mark.parametrize("params", [EASY, HARD], ids=["easy", "hard"])
def test_markers_lie_on_the_ends_of_the_target_snakes(params):
    step = params.paddle_length + 2 * params.paddle_margins[0]
    for index in range(25):
        sample = gen.sample_at(params, 1, index)
        a, b = sample.targets[sample.marked[0]], sample.targets[1 - sample.marked[0]]
        assert all(len(snake.paddles) == params.contour_length for snake in sample.targets)
        if sample.label == 1:
            assert sample.markers == (a.origin, a.terminal)
        else:
            assert sample.markers == (a.origin, b.terminal)
        # the two snakes start seed_distance apart, and each is a chain of nearby paddles
        assert math.dist(a.origin, b.origin) == pytest.approx(params.seed_distance, abs=1.5)
        for snake in sample.targets:
            for (_, end), (start, _) in zip(snake.paddles, snake.paddles[1:], strict=False):
                assert math.dist(end, start) <= step + 1.5
        # both markers are drawn: bright pixels at their centres
        for y, x in sample.markers:
            assert sample.image[y, x] >= 100
        assert all(len(d.paddles) == params.distractor_length for d in sample.distractors)


def test_image_statistics():
    images = np.stack([gen.sample_at(HARD, 0, i).image for i in range(20)])
    assert images.dtype == np.uint8 and images.shape == (20, 32, 32)
    assert images.max() == 255  # rescaled to the full range, like the original's imsave
    lit = (images > 0).mean()
    assert 0.05 < lit < 0.6, lit
    assert np.median(images) < 20  # dark background
    assert (images > 128).mean() < 0.2


def test_same_seed_same_image_and_other_seeds_differ():
    first = gen.sample_at(HARD, 5, 11).image
    assert gen.sample_at(HARD, 5, 11).image.tobytes() == first.tobytes()
    assert gen.sample_at(HARD, 6, 11).image.tobytes() != first.tobytes()
    assert gen.sample_at(HARD, 5, 12).image.tobytes() != first.tobytes()


@pytest.mark.parametrize(("resolution", "difficulty"), [(64, "easy"), (128, "hard")])
def test_larger_resolutions_and_path_x(resolution, difficulty):
    params = gen.lra_params(resolution, difficulty)
    sample = gen.sample_at(params, 0, 0)
    assert sample.image.shape == (resolution, resolution)
    assert sample.margin in params.paddle_margins
    assert all(len(snake.paddles) == params.contour_length for snake in sample.targets)
    assert 0.01 < (sample.image > 0).mean() < 0.5


def test_generated_layout_and_metadata_rows(tmp_path):
    directory = gen.generate_pathfinder(
        tmp_path, 32, "easy", num_images=7, images_per_batch=4, seed=2, workers=1, progress=False
    )
    assert directory == tmp_path / "pathfinder32" / "curv_baseline"
    assert sorted(p.name for p in (directory / "metadata").iterdir()) == ["0.npy", "1.npy"]
    lines = (directory / "metadata" / "1.npy").read_text().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        columns = line.split(" ")
        # the official rows look like 'imgs/0 sample_0.png 0 0 1.0 6 2 2 0.5 1 1'
        assert columns[:3] == ["imgs/1", f"sample_{i}.png", str(i)]
        assert columns[3] in ("0", "1")
        assert columns[4:] == ["1.0", "6", "2", "2", "0.5", "1", "1"]
        image = np.asarray(Image.open(directory / "imgs" / "1" / f"sample_{i}.png"))
        expected = gen.sample_at(EASY, 2, 4 + i)
        assert np.array_equal(image, expected.image) and int(columns[3]) == expected.label


def test_parallel_generation_and_resume_give_identical_files(tmp_path):
    args = dict(resolution=32, difficulty="easy", num_images=12, images_per_batch=4, seed=9, progress=False)
    reference = gen.generate_pathfinder(tmp_path / "a", workers=1, **args)
    resumed = gen.generate_pathfinder(tmp_path / "b", workers=2, **args)
    assert png_bytes(resumed) == png_bytes(reference)
    # interrupt batch 1: its metadata never written, one image damaged, one missing
    (resumed / "metadata" / "1.npy").unlink()
    (resumed / "imgs" / "1" / "sample_0.png").write_bytes(b"half a png")
    (resumed / "imgs" / "1" / "sample_3.png").unlink()
    (resumed / "metadata" / ".1.npy.123.tmp").write_text("imgs/1 sample_0.png 0 1\n")
    untouched = (resumed / "imgs" / "0" / "sample_0.png").stat().st_mtime_ns
    with pytest.raises(MissingDataError, match="1 of 3 batches incomplete"):
        load_pathfinder(tmp_path / "b", 32, "easy")
    gen.generate_pathfinder(tmp_path / "b", workers=1, **args)
    assert (resumed / "imgs" / "0" / "sample_0.png").stat().st_mtime_ns == untouched  # complete: skipped
    assert png_bytes(resumed) == png_bytes(reference)
    assert (resumed / "metadata" / "1.npy").read_text() == (reference / "metadata" / "1.npy").read_text()


def test_generator_refuses_to_mix_settings(tmp_path):
    gen.generate_pathfinder(
        tmp_path, 32, "easy", num_images=2, images_per_batch=2, seed=0, workers=1, progress=False
    )
    with pytest.raises(ValueError, match="seed: existing 0, requested 1"):
        gen.generate_pathfinder(
            tmp_path, 32, "easy", num_images=2, images_per_batch=2, seed=1, workers=1, progress=False
        )


def _pixels_digest(directory) -> str:
    """Every file of a generated set: PNGs by their pixels (not their zlib bytes), others byte for byte."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(np.asarray(Image.open(path)).tobytes() if path.suffix == ".png" else path.read_bytes())
    return digest.hexdigest()


def test_generated_sets_are_pinned(tmp_path):
    """The generator's output for fixed seeds, pinned: a refactoring must leave every pixel, label,
    snake and metadata row as it was (covers both margins of 128 px and every difficulty)."""
    directory = gen.generate_pathfinder(
        tmp_path, 32, "hard", num_images=5, images_per_batch=3, seed=3, workers=1, progress=False
    )
    assert _pixels_digest(directory) == "1788118a9fd59d4744621a6812077dadc899199d944288df6b1657a16edb047d"
    digest = hashlib.sha256()
    for resolution, difficulty, seed, index in [
        (32, "easy", 1, 0),
        (32, "intermediate", 1, 1),
        (64, "easy", 2, 0),
        (128, "hard", 4, 0),  # margin 2
        (128, "hard", 4, 3),  # margin 3
    ]:
        s = gen.sample_at(gen.lra_params(resolution, difficulty), seed, index)
        digest.update(s.image.tobytes())
        digest.update(repr((s.label, s.margin, s.targets, s.distractors, s.markers, s.marked)).encode())
    assert digest.hexdigest() == "d5500f65a95356ab5f109ba93a50db038836438c41b5b26b93a2061727b314fd"


def test_example_grid(tmp_path):
    path = gen.save_example_grid(tmp_path / "grid.png", resolution=32, difficulty="easy", per_label=2)
    assert Image.open(path).size[0] > 100


# --- official layout -----------------------------------------------------------------------------


def write_release(root, labels_per_batch, resolution=32, folder="curv_contour_length_14"):
    """Files as in lra_release: PNGs and text metadata rows of 11 columns; returns {pixels: label}."""
    directory = root / f"pathfinder{resolution}" / folder
    (directory / "metadata").mkdir(parents=True)
    rng = np.random.default_rng(0)
    truth = {}
    for k, labels in enumerate(labels_per_batch):
        (directory / "imgs" / str(k)).mkdir(parents=True)
        rows = []
        for i, label in enumerate(labels):
            image = ((rng.random((resolution, resolution)) < 0.2) * rng.integers(1, 256)).astype(np.uint8)
            image[0, 0] = 255
            Image.fromarray(image, "L").save(directory / "imgs" / str(k) / f"sample_{i}.png")
            truth[image.tobytes()] = label
            rows.append(f"imgs/{k} sample_{i}.png {i} {label} 1.0 14 4 2 0.5 1 1\n")
        (directory / "metadata" / f"{k}.npy").write_text("".join(rows))
    return directory, truth


def test_release_layout_is_read_and_split(tmp_path):
    labels = [[i % 2 for i in range(10)], [1, 1, 0, 0, 1, 0, 1, 0, 0, 1]]
    _, truth = write_release(tmp_path, labels)
    splits = load_pathfinder(tmp_path, 32, "hard")
    assert [len(splits[s]) for s in ("train", "val", "test")] == [16, 2, 2]
    seen = []
    for dataset in splits.values():
        assert isinstance(dataset, PathfinderDataset) and dataset.pixels.dtype == np.uint8
        assert (dataset.lengths() == 1024).all()
        for i in range(len(dataset)):
            example = dataset[i]
            ids = example["input_ids"].numpy()
            assert ids.shape == (1024,) and ids.min() >= 1 and ids.max() <= VOCAB_SIZE - 1
            pixels = (ids - 1).astype(np.uint8)
            assert truth[pixels.tobytes()] == example["label"] == dataset.labels[i]
            assert np.array_equal(dataset.sequences[i], ids)
            seen.append(pixels.tobytes())
    assert sorted(seen) == sorted(truth) and PAD_ID == 0
    again = load_pathfinder(tmp_path, 32, "hard", workers=1)
    assert np.array_equal(again["val"].pixels, splits["val"].pixels)  # deterministic split
    assert len(load_pathfinder(tmp_path, 32, "hard", max_images=10)["train"]) == 8


def test_an_unreadable_image_stops_with_its_file_and_metadata_line(tmp_path):
    directory, _ = write_release(tmp_path, [[0, 1] * 5], folder="curv_baseline")
    (directory / "imgs" / "0" / "sample_5.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(DataError, match="unreadable") as err:
        load_pathfinder(tmp_path, 32, "easy")
    message = str(err.value)
    assert f"{directory / 'metadata' / '0.npy'}:6" in message and "sample_5.png" in message
    assert "on_bad_rows=skip" in message


def test_on_bad_rows_skip_counts_unusable_images_and_empty_files_are_dropped(tmp_path, caplog):
    directory, _ = write_release(tmp_path, [[0, 1] * 5], folder="curv_baseline")
    (directory / "imgs" / "0" / "sample_2.png").write_bytes(b"")  # like the release's sample_172.png
    (directory / "imgs" / "0" / "sample_5.png").write_bytes(b"\x89PNG garbage")
    (directory / "imgs" / "0" / "sample_6.png").unlink()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(directory / "imgs" / "0" / "sample_7.png")
    with caplog.at_level(logging.INFO, logger="attnlab.data"):
        splits = load_pathfinder(tmp_path, 32, "easy", on_bad_rows="skip")
    assert sum(len(d) for d in splits.values()) == 6
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "skipped 3 bad rows" in messages and "sample_5.png" in messages
    assert "1 empty image file" in messages and "sample_2.png" in messages
    # an empty file alone is dropped as LRA's pipeline drops it, even when bad rows are errors
    (directory / "imgs" / "0" / "sample_5.png").unlink()
    write_release(tmp_path / "again", [[0, 1] * 5], folder="curv_baseline")
    (tmp_path / "again" / "pathfinder32" / "curv_baseline" / "imgs" / "0" / "sample_2.png").write_bytes(b"")
    assert sum(len(d) for d in load_pathfinder(tmp_path / "again", 32, "easy").values()) == 9
    info = describe(tmp_path, 32, "easy")
    assert info["status"] == "complete" and info["source"] == "release" and info["rows"] == 10


def test_a_split_whose_every_image_is_missing_is_an_error(tmp_path):
    directory, _ = write_release(tmp_path, [[0, 1] * 5])
    for png in (directory / "imgs" / "0").glob("*.png"):
        png.unlink()
    with pytest.raises(DataError, match="no usable image") as err:
        load_pathfinder(tmp_path, 32, "hard", on_bad_rows="skip")
    assert str(directory) in str(err.value)


def test_non_utf8_metadata_names_file_and_line(tmp_path):
    directory, _ = write_release(tmp_path, [[0, 1, 0]])
    meta = directory / "metadata" / "0.npy"
    meta.write_bytes(meta.read_bytes().replace(b"imgs/0 sample_1.png", b"imgs/0 sample_\xff.png"))
    with pytest.raises(DataError, match="not valid UTF-8") as err:
        load_pathfinder(tmp_path, 32, "hard")
    assert f"{meta}:2" in str(err.value)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("imgs/0 sample_1.png 1", "expected at least 4"),
        ("imgs/0 sample_1.png 1 2 1.0", "must be 0 or 1, got '2'"),
    ],
)
def test_malformed_metadata_row_names_file_and_line(tmp_path, row, message):
    directory, _ = write_release(tmp_path, [[0, 1, 0]])
    meta = directory / "metadata" / "0.npy"
    lines = meta.read_text().splitlines()
    lines[1] = row
    meta.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message) as err:
        load_pathfinder(tmp_path, 32, "hard")
    assert f"{meta}:2" in str(err.value)
    with pytest.raises(DataError):
        read_metadata(meta)


def test_missing_or_partial_set_raises_with_path_and_remedy(tmp_path):
    with pytest.raises(MissingDataError, match="attnlab data prepare lra --task pathfinder") as err:
        load_pathfinder(tmp_path, 128, "hard")
    assert str(tmp_path / "pathfinder128" / "curv_contour_length_14") in str(err.value)
    assert describe(tmp_path, 128, "hard")["status"] == "missing"
    directory, _ = write_release(tmp_path, [[0, 1]])
    (directory / "imgs" / "5").mkdir()
    with pytest.raises(MissingDataError, match="imgs/5"):
        load_pathfinder(tmp_path, 32, "hard")
    with pytest.raises(MissingDataError, match="partial"):
        ensure_pathfinder(tmp_path, 32, "hard", num_images=4)  # never generates into a release
    assert describe(tmp_path, 32, "hard")["status"] == "partial"


def test_ensure_generates_once_then_reuses(tmp_path):
    with pytest.raises(MissingDataError):
        ensure_pathfinder(tmp_path, 32, "easy", num_images=6, generate=False)
    args = dict(num_images=10, images_per_batch=5, seed=4, workers=1, progress=False)
    directory = ensure_pathfinder(tmp_path, 32, "easy", **args)
    stamp = (directory / "metadata" / "0.npy").stat().st_mtime_ns
    assert ensure_pathfinder(tmp_path, 32, "easy", **args) == directory
    assert (directory / "metadata" / "0.npy").stat().st_mtime_ns == stamp
    splits = load_pathfinder(tmp_path, 32, "easy")
    assert [len(splits[s]) for s in ("train", "val", "test")] == [8, 1, 1]
    info = describe(tmp_path, 32, "easy")
    assert info["source"] == "generated" and info["generator"]["seed"] == 4 and info["rows"] == 10


def test_zero_pixels_padding_feeds_raw_pixels_and_masks_black_ones(tmp_path):
    from attnlab.data.examples import pad_collate

    write_release(tmp_path, [[0, 1] * 5])
    token = load_pathfinder(tmp_path, 32, "hard")["train"]
    padding = load_pathfinder(tmp_path, 32, "hard", zero_pixels="padding")["train"]
    pixels = padding.pixels[:2].astype(np.int64)
    batch = pad_collate([padding[0], padding[1]])
    assert batch["input_ids"].tolist() == pixels.tolist()  # LRA's tokens: the pixel values
    assert batch["mask"].tolist() == (pixels > 0).tolist()  # LRA's mask: inputs > 0
    assert (pixels == 0).mean() > 0.5  # most of a Pathfinder image is black
    assert (
        pad_collate([token[0]])["mask"].all() and (token[0]["input_ids"] == padding[0]["input_ids"] + 1).all()
    )
