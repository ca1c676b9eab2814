"""Writing a generated set in the official layout: PNG batches, metadata rows and ``generator.json``,
in parallel and resumable."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from dataclasses import asdict
from pathlib import Path

from PIL import Image

from attnlab.data.errors import read_json
from attnlab.data.lra.pathfinder_generator.params import (
    PathfinderParams,
    dataset_dir,
    difficulty_folder,
    lra_params,
)
from attnlab.data.lra.pathfinder_generator.sample import sample_at
from attnlab.files import remove_orphans, removed_on_failure

GENERATOR_FILE = "generator.json"  # written by `generate_pathfinder`; absent from the LRA release


def _batch_sizes(num_images: int, images_per_batch: int) -> list[int]:
    full, rest = divmod(num_images, images_per_batch)
    return [images_per_batch] * full + ([rest] if rest else [])


def batch_is_complete(directory: Path, batch: int, expected_rows: int) -> bool:
    """A batch is complete when its metadata file exists (it is written last, atomically) with
    ``expected_rows`` lines."""
    path = directory / "metadata" / f"{batch}.npy"
    if not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip()) == expected_rows


def _write_batch(job: tuple[str, PathfinderParams, int, int, int, int]) -> tuple[int, int, int]:
    """Generate batch ``k`` (images, then its metadata file, atomically); returns (k, count, positives)."""
    directory, params, seed, batch, start, count = job
    directory = Path(directory)
    folder = directory / "imgs" / str(batch)
    folder.mkdir(parents=True, exist_ok=True)
    rows, positives = [], 0
    for i in range(count):
        sample = sample_at(params, seed, start + i)
        Image.fromarray(sample.image, "L").save(folder / f"sample_{i}.png")
        rows.append(params.metadata_row(batch, i, sample.label, sample.margin))
        positives += sample.label
    metadata = directory / "metadata"
    metadata.mkdir(exist_ok=True)
    temporary = metadata / f".{batch}.npy.{os.getpid()}.tmp"
    with removed_on_failure(temporary):
        temporary.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
        os.replace(temporary, metadata / f"{batch}.npy")
    return batch, count, positives


def _leave_ctrl_c_to_parent() -> None:
    """Pool workers ignore SIGINT: a Ctrl-C reaches the whole process group, and each worker printed
    its own traceback; the parent stops the pool and says so in one line (`attnlab.cli.main`). The
    SIGTERM that stops the pool raises, so a batch being written removes its temporary file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_quietly)


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _check_generator_file(directory: Path, record: dict) -> None:
    """Refuse to mix sets: an existing ``generator.json`` must name the same parameters and seed."""
    path = directory / GENERATOR_FILE
    if path.is_file():
        existing = read_json(path, (), "a Pathfinder generator record")
        keys = ("params", "seed", "images_per_batch")
        differ = [k for k in keys if existing.get(k) != record[k]]
        if differ:
            details = "; ".join(f"{k}: existing {existing.get(k)!r}, requested {record[k]!r}" for k in differ)
            raise ValueError(
                f"{directory} holds a Pathfinder set generated with other settings ({details}); "
                "use another root or delete that folder"
            )
        record["num_images"] = max(record["num_images"], int(existing.get("num_images", 0)))
    elif (directory / "metadata").is_dir() and any((directory / "metadata").glob("*.npy")):
        raise ValueError(
            f"{directory} already holds a Pathfinder set that this generator did not write (the LRA "
            "release?); generate into another root"
        )
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{GENERATOR_FILE}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def generate_pathfinder(
    root: str | Path,
    resolution: int = 32,
    difficulty: str | int = "hard",
    num_images: int = 20_000,
    images_per_batch: int = 1000,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
    params: PathfinderParams | None = None,
) -> Path:
    """Write ``num_images`` images in the LRA layout under ``root``; returns the dataset folder.

    Layout: ``<root>/pathfinder<res>/<curv_...>/imgs/<k>/sample_<i>.png`` and
    ``metadata/<k>.npy`` (plain text despite the extension, one official 11-column row per image),
    with ``images_per_batch`` images per batch ``k`` (the release has 1000), plus
    ``generator.json`` recording the settings. Batches run in parallel on ``workers`` processes
    (default: all cores). Resumable: a batch whose metadata file exists with the right number of
    rows is skipped, any other is regenerated, and every image comes from its own seeded stream,
    so the result does not depend on interruptions or on ``workers``.
    """
    if num_images < 1 or images_per_batch < 1:
        raise ValueError(
            f"num_images and images_per_batch must be >= 1, got {num_images}, {images_per_batch}"
        )
    params = params or lra_params(resolution, difficulty)
    if params.resolution != resolution:
        raise ValueError(f"params are for {params.resolution} px but resolution={resolution}")
    directory = dataset_dir(root, resolution, difficulty)
    record = {
        "generator": "attnlab.data.lra.pathfinder_generator",
        "params": json.loads(json.dumps(asdict(params))),
        "seed": seed,
        "images_per_batch": images_per_batch,
        "num_images": num_images,
    }
    _check_generator_file(directory, record)
    for folder in (directory, directory / "metadata"):  # what killed writers left: .<name>.<pid>.tmp
        remove_orphans(folder, r"\..+\.(?P<pid>\d+)\.tmp")
    jobs, start = [], 0
    for batch, count in enumerate(_batch_sizes(num_images, images_per_batch)):
        if not batch_is_complete(directory, batch, count):
            jobs.append((str(directory), params, seed, batch, start, count))
        start += count
    todo = sum(job[-1] for job in jobs)
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=todo, unit="img", desc=f"pathfinder{resolution} {difficulty_folder(difficulty)}")
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    try:
        if workers == 1:
            for job in jobs:
                _, count, _ = _write_batch(job)
                if bar is not None:
                    bar.update(count)
        elif jobs:
            # fork where the platform has it: workers need only numpy and PIL, and unlike spawn it
            # works from scripts without an `if __name__ == "__main__"` guard; chunks of one batch
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            with multiprocessing.get_context(method).Pool(
                workers, initializer=_leave_ctrl_c_to_parent
            ) as pool:
                for _, count, _ in pool.imap_unordered(_write_batch, jobs):
                    if bar is not None:
                        bar.update(count)
    finally:
        if bar is not None:
            bar.close()
    return directory
