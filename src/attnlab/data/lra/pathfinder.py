"""Pathfinder and Path-X (Long Range Arena): reading the official layout, or generating it.

Files (the ``lra_release`` tarball, or `generate_pathfinder`)::

    <root>/pathfinder<res>/<curv_baseline | curv_contour_length_9 | curv_contour_length_14>/
        imgs/<k>/sample_<i>.png      greyscale, res x res
        metadata/<k>.npy             plain text despite the extension; one row per image:
                                     "imgs/<k> sample_<i>.png <i> <label> <7 generator settings>"

Only columns 0 (folder), 1 (file) and 3 (label) are used. LRA's Pathfinder is 32 px ``hard``
(``curv_contour_length_14``) and Path-X is 128 px ``hard``.

Tokens, by the ``zero_pixels`` rule. LRA feeds the pixel values 0-255 as tokens and its encoder
masks ``inputs > 0``, so black pixels (most of a Pathfinder image) never take part in attention:
that is ``zero_pixels="padding"`` (token = pixel, id 0 masked by the batches). ``"token"``
(attnlab's default) makes every pixel a real token, ``p + 1``, attended like any other. The
vocabulary has 257 ids either way; every sequence has ``res²`` positions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from attnlab.data.errors import BadRows, DataError, MissingDataError, read_json, require_examples
from attnlab.data.examples import TokenSequenceDataset, pixel_offset
from attnlab.data.lra.pathfinder_generator import (
    GENERATOR_FILE,
    batch_is_complete,
    dataset_dir,
    difficulty_folder,
    generate_pathfinder,
)

log = logging.getLogger(__name__)

VOCAB_SIZE = 257  # 0 is padding; pixel + 1 (zero_pixels=token) or the pixel (padding, 256 unused)
TOKEN_OFFSET = 1  # under zero_pixels=token
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
HOW_TO_OBTAIN = (
    "Get it from the LRA release (lra_release.gz, linked from the google-research/long-range-arena "
    "README; extract it so that this folder exists), or generate it with "
    "`attnlab data prepare lra --task pathfinder` (attnlab.data.lra.pathfinder.ensure_pathfinder)."
)


class _TokenRows(Sequence):
    """Read-only view of a uint8 pixel matrix as token-id rows (pixel + offset), built per access."""

    def __init__(self, pixels: np.ndarray, offset: int):
        self._pixels, self._offset = pixels, offset

    def __len__(self) -> int:
        return len(self._pixels)

    def __getitem__(self, index):
        return self._pixels[index].astype(np.int64) + self._offset


class PathfinderDataset(TokenSequenceDataset):
    """Flattened images in one ``(N, res²)`` uint8 array; example ``i`` has ``input_ids =
    pixels[i] + offset`` (int64; offset 1 under zero_pixels=token, 0 under padding) and its label.
    ``pixels`` keeps the raw 0-255 values."""

    def __init__(
        self, pixels: np.ndarray, labels: Sequence[int], resolution: int, offset: int = TOKEN_OFFSET
    ):
        # no super().__init__: it would copy the rows into a list; the base class only needs these
        pixels = np.asarray(pixels, dtype=np.uint8)
        if pixels.ndim != 2 or pixels.shape[1] != resolution * resolution:
            raise ValueError(f"pixels must be (N, {resolution * resolution}), got {pixels.shape}")
        if len(labels) != len(pixels):
            raise ValueError(f"{len(pixels)} images but {len(labels)} labels")
        self.pixels, self.resolution, self.offset = pixels, resolution, offset
        self.labels = np.asarray(labels, dtype=np.int64)
        self.sequences, self.sequences2 = _TokenRows(pixels, offset), None

    def __len__(self) -> int:
        return len(self.pixels)

    def lengths(self) -> np.ndarray:
        return np.full(len(self), self.pixels.shape[1], dtype=np.int64)

    def __getitem__(self, index: int) -> dict:
        ids = torch.from_numpy(self.pixels[index].astype(np.int64)) + self.offset
        return {"input_ids": ids, "label": int(self.labels[index])}


# ---------------------------------------------------------------------------------------------
# metadata and layout


@dataclass
class _Row:
    folder: str
    file: str
    label: int
    meta: Path | None = None  # the metadata file and line that list this image, for error messages
    line: int = 0


def read_metadata(path: str | Path, bad_rows: BadRows | None = None) -> list[_Row]:
    """Rows of one ``metadata/<k>.npy`` text file; a malformed row (not UTF-8, too few columns, a
    label other than 0/1) goes to ``bad_rows`` (default: raise DataError naming file:line)."""
    path, bad_rows = Path(path), bad_rows or BadRows()
    rows = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            bad_rows.add(DataError(path, f"not valid UTF-8 (byte {err.start} of the line)", number))
            continue
        if not line.strip():
            continue
        columns = line.split()
        if len(columns) < 4:
            bad_rows.add(
                DataError(
                    path,
                    f"expected at least 4 space-separated columns (folder, file, index, label), "
                    f"got {len(columns)}: {line.strip()!r}",
                    number,
                )
            )
            continue
        if columns[3] not in ("0", "1"):
            bad_rows.add(DataError(path, f"label (column 4) must be 0 or 1, got {columns[3]!r}", number))
            continue
        rows.append(_Row(columns[0], columns[1], int(columns[3]), path, number))
    return rows


def _metadata_files(directory: Path) -> list[Path]:
    """``metadata/*.npy`` in batch order (numeric names first, as in the release)."""
    meta = directory / "metadata"
    if not meta.is_dir():
        return []
    files = [p for p in meta.glob("*.npy") if not p.name.startswith(".")]
    return sorted(files, key=lambda p: (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem))


@dataclass
class Layout:
    """What is on disk for one resolution and difficulty."""

    directory: Path
    metadata: list[Path] = field(default_factory=list)
    generator: dict | None = None
    problems: list[str] = field(default_factory=list)  # why the set is partial

    @property
    def status(self) -> str:
        if not self.metadata and not self.problems:
            return "missing"
        return "partial" if self.problems else "complete"


def inspect_layout(directory: Path) -> Layout:
    """What one Pathfinder folder holds: its metadata files, and what an unfinished generation or an
    interrupted extraction left incomplete (the loader and ``attnlab data prepare`` read the same)."""
    layout = Layout(directory, _metadata_files(directory))
    generator_file = directory / GENERATOR_FILE
    if generator_file.is_file():
        layout.generator = read_json(
            generator_file, ("num_images", "images_per_batch"), "a Pathfinder generator record"
        )
        total, per_batch = int(layout.generator["num_images"]), int(layout.generator["images_per_batch"])
        expected = [min(per_batch, total - start) for start in range(0, total, per_batch)]
        incomplete = [k for k, count in enumerate(expected) if not batch_is_complete(directory, k, count)]
        if incomplete:
            shown = ", ".join(map(str, incomplete[:10])) + (" ..." if len(incomplete) > 10 else "")
            layout.problems.append(
                f"generation unfinished: {len(incomplete)} of {len(expected)} batches incomplete ({shown}); "
                "run the generator again to resume"
            )
    else:
        with_metadata = {p.stem for p in layout.metadata}
        imgs = directory / "imgs"
        folders = sorted(p.name for p in imgs.iterdir() if p.is_dir()) if imgs.is_dir() else []
        orphans = [f"imgs/{name}" for name in folders if name not in with_metadata]
        if orphans:
            more = " ..." if len(orphans) > 5 else ""
            layout.problems.append(
                f"image folders without a metadata file: {', '.join(orphans[:5])}{more} "
                "(an interrupted extraction or generation)"
            )
    return layout


def require_complete(layout: Layout) -> None:
    """A missing or partial set raises `MissingDataError` saying what is wrong and how to obtain it."""
    if layout.status == "missing":
        raise MissingDataError(layout.directory, HOW_TO_OBTAIN)
    if layout.status == "partial":
        raise MissingDataError(
            layout.directory, f"The set there is partial: {'; '.join(layout.problems)}. {HOW_TO_OBTAIN}"
        )


def _split_of_rows(count: int, split_seed: int) -> np.ndarray:
    """0/1/2 (train/val/test) per row: a permutation seeded by ``split_seed``, cut 80/10/10."""
    order = np.random.default_rng(split_seed).permutation(count)
    n_train = int(round(SPLIT_FRACTIONS[0] * count))
    n_val = int(round(SPLIT_FRACTIONS[1] * count))
    split = np.empty(count, dtype=np.int8)
    split[order[:n_train]] = 0
    split[order[n_train : n_train + n_val]] = 1
    split[order[n_train + n_val :]] = 2
    return split


def _collect_rows(
    layout: Layout, max_images: int | None, bad_rows: BadRows | None = None
) -> list[tuple[Path, _Row]]:
    rows = []
    for meta in layout.metadata:
        for row in read_metadata(meta, bad_rows):
            rows.append((layout.directory / row.folder / row.file, row))
            if max_images is not None and len(rows) >= max_images:
                return rows
    return rows


# ---------------------------------------------------------------------------------------------
# images


EMPTY_FILE = "empty file"


def read_image(path: Path, resolution: int) -> np.ndarray | str:
    """Flattened uint8 pixels, or why the image is unusable (missing, empty, corrupt, wrong size,
    blank: a constant image cannot be a Pathfinder sample, which always shows its markers)."""
    try:
        if path.stat().st_size == 0:
            return EMPTY_FILE
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"), dtype=np.uint8)
    except FileNotFoundError:
        return "missing"
    except Exception as err:  # PIL raises many kinds for damaged files
        return f"unreadable ({type(err).__name__})"
    if pixels.shape != (resolution, resolution):
        return f"size {pixels.shape[1]}x{pixels.shape[0]}, expected {resolution}x{resolution}"
    if pixels.min() == pixels.max():
        return "blank"
    return pixels.reshape(-1)


def _compact(pixels: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Drop the rows where ``keep`` is False, in place (no second copy of a multi-GB array)."""
    if keep.all():
        return pixels
    write = 0
    for index in np.flatnonzero(keep):
        if index != write:
            pixels[write] = pixels[index]
        write += 1
    return pixels[:write]


def load_pathfinder(
    root: str | Path,
    resolution: int = 32,
    difficulty: str | int = "hard",
    max_images: int | None = None,
    split_seed: int = 0,
    workers: int | None = None,
    on_bad_rows: str = "error",
    zero_pixels: str = "token",
) -> dict[str, PathfinderDataset]:
    """``train`` / ``val`` / ``test`` datasets from ``<root>/pathfinder<res>/<difficulty folder>``.

    Split: the metadata rows, in batch order (``max_images`` keeps the first ones), are permuted
    with ``numpy.random.default_rng(split_seed)`` and cut 80 / 10 / 10 %, as LRA cut its TFDS
    set; the assignment depends only on the row count, so it is the same on every machine.

    Empty (0-byte) image files are dropped, as LRA's pipeline drops them (``tf.strings.length > 0``;
    the release has one, ``pathfinder32/curv_baseline/imgs/0/sample_172.png``), and counted in the
    log. Any other unusable image (missing, corrupt, wrong size, blank) or malformed metadata row is
    a bad row: DataError naming the metadata file:line and the image, or, with
    ``on_bad_rows="skip"``, skipped and counted in one warning. A split left empty is a DataError;
    a missing or partial set raises MissingDataError. ``zero_pixels`` sets the tokens (module docstring).
    """
    bad_rows, offset = BadRows(on_bad_rows), pixel_offset(zero_pixels)
    directory = dataset_dir(root, resolution, difficulty)
    layout = inspect_layout(directory)
    require_complete(layout)
    rows = _collect_rows(layout, max_images, bad_rows)
    split = _split_of_rows(len(rows), split_seed)
    # rows are stored grouped by split, so each split is a contiguous block of one array
    order = np.argsort(split, kind="stable")
    slot = np.empty(len(rows), dtype=np.int64)
    slot[order] = np.arange(len(rows))
    pixels = np.empty((len(rows), resolution * resolution), dtype=np.uint8)
    ok = np.zeros(len(rows), dtype=bool)
    problems: list[tuple[int, str]] = []  # (row index, why the image is unusable)

    def read_chunk(start: int) -> None:
        for i in range(start, min(start + 512, len(rows))):
            result = read_image(rows[i][0], resolution)
            if isinstance(result, str):
                problems.append((i, result))
            else:
                pixels[slot[i]] = result
                ok[slot[i]] = True

    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(read_chunk, range(0, len(rows), 512)))
    empty = [rows[i][0] for i, reason in sorted(problems) if reason == EMPTY_FILE]
    for i, reason in sorted(problems):  # in row order, so the error names the first bad image
        if reason != EMPTY_FILE:
            path, row = rows[i]
            bad_rows.add(DataError(row.meta or directory, f"image {path}: {reason}", row.line or None))
    if empty:
        log.info(
            "Pathfinder: dropped %d empty image files, as LRA's pipeline drops them, e.g. %s",
            len(empty),
            empty[0],
        )
    bad_rows.report(f"Pathfinder {directory}", len(rows))
    labels = np.array([row.label for _, row in rows], dtype=np.int64)[order]
    datasets, start = {}, 0
    for index, name in enumerate(SPLITS):
        stop = start + int(np.count_nonzero(split == index))
        keep = ok[start:stop]
        block = _compact(pixels[start:stop], keep)
        datasets[name] = PathfinderDataset(block, labels[start:stop][keep], resolution, offset)
        require_examples(datasets[name], f"{directory} ({name} split)", "usable image")
        datasets[name].num_skipped = int(np.count_nonzero(~keep))
        start = stop
    return datasets


# ---------------------------------------------------------------------------------------------
# preparing and describing


def ensure_pathfinder(
    root: str | Path,
    resolution: int = 32,
    difficulty: str | int = "hard",
    num_images: int = 20_000,
    seed: int = 0,
    generate: bool = True,
    images_per_batch: int = 1000,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Make sure a usable set exists; returns its folder.

    A complete release-style set (no ``generator.json``) is used as found, whatever its size. A
    generated set is reused when it holds ``num_images`` images made with the same settings;
    otherwise the generator resumes or extends it (and refuses other settings). With
    ``generate=False`` a missing or partial set raises MissingDataError.
    """
    directory = dataset_dir(root, resolution, difficulty)
    layout = inspect_layout(directory)
    if layout.status == "complete" and layout.generator is None:
        return directory
    if layout.status == "partial" and layout.generator is None:
        require_complete(layout)  # a damaged release: never write generated files into it
    if (
        layout.status == "complete"
        and layout.generator is not None
        and int(layout.generator["num_images"]) >= num_images
        and layout.generator.get("seed") == seed
        and int(layout.generator["images_per_batch"]) == images_per_batch
    ):
        return directory
    if not generate:
        require_complete(layout)
        raise MissingDataError(
            directory,
            f"It holds {layout.generator['num_images']} generated images "
            f"(seed {layout.generator.get('seed')}), not the {num_images} (seed {seed}) requested, "
            f"and generate=False. {HOW_TO_OBTAIN}",
        )
    log.info("generating %d Pathfinder images into %s", num_images, directory)
    return generate_pathfinder(
        root,
        resolution,
        difficulty,
        num_images=num_images,
        images_per_batch=images_per_batch,
        seed=seed,
        workers=workers,
        progress=progress,
    )


def describe(root: str | Path, resolution: int = 32, difficulty: str | int = "hard") -> dict:
    """What is on disk, for ``attnlab data prepare``: status (``missing`` / ``partial`` /
    ``complete``), source (``release`` or ``generated``), metadata rows, usable files per split
    (listed and present with a non-zero size; images are not decoded), and what is missing."""
    directory = dataset_dir(root, resolution, difficulty)
    layout = inspect_layout(directory)
    info = {
        "path": str(directory),
        "resolution": resolution,
        "difficulty": difficulty_folder(difficulty),
        "status": layout.status,
        "source": None if layout.status == "missing" else ("generated" if layout.generator else "release"),
        "generator": layout.generator,
        "metadata_files": len(layout.metadata),
        "rows": 0,
        "splits": dict.fromkeys(SPLITS, 0),
        "missing": list(layout.problems),
        "how_to_obtain": HOW_TO_OBTAIN,
    }
    if layout.status == "missing":
        info["missing"].append(f"{directory} (no metadata/*.npy)")
        return info
    try:
        rows = _collect_rows(layout, None)
    except DataError as err:
        info["missing"].append(str(err))
        return info
    split = _split_of_rows(len(rows), 0)
    present = np.array([path.is_file() and path.stat().st_size > 0 for path, _ in rows], dtype=bool)
    info["rows"] = len(rows)
    info["splits"] = {name: int(np.count_nonzero(present & (split == i))) for i, name in enumerate(SPLITS)}
    absent = [path for (path, _), here in zip(rows, present, strict=True) if not here]
    if absent:
        info["missing"].append(f"{len(absent)} listed images absent or empty, e.g. {absent[0]}")
    return info
