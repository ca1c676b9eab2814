"""One Pathfinder image from its own random stream: target snakes, distractors, markers, label
(steps 1-6 of the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnlab.data.lra.pathfinder_generator.geometry import stamp
from attnlab.data.lra.pathfinder_generator.params import PathfinderParams
from attnlab.data.lra.pathfinder_generator.rendering import renderer_for
from attnlab.data.lra.pathfinder_generator.snakes import Canvas, Snake

_MAX_TARGET_ATTEMPTS = 200_000  # hard 64 px needs ~1,300 on average; this only stops impossible settings


@dataclass
class PathfinderSample:
    """One generated image with the structure behind it (for tests and figures).

    ``targets[marked[0]]`` is snake A (the origin marker is on its origin); the second marker is
    on the terminal end of ``targets[marked[1]]``: A again for label 1, B for label 0.
    """

    image: np.ndarray  # (resolution, resolution) uint8
    label: int
    margin: int
    targets: tuple[Snake, Snake]
    distractors: list[Snake]
    markers: tuple[tuple[int, int], tuple[int, int]]
    marked: tuple[int, int]


def _to_uint8(image: np.ndarray) -> np.ndarray:
    """Rescale min..max to 0..255 and round (``scipy.misc.bytescale``, used by ``imsave``)."""
    low, high = float(image.min()), float(image.max())
    scale = 255.0 / (high - low) if high > low else 1.0
    return (np.clip((image - low) * scale, 0, 255) + 0.5).astype(np.uint8)


def generate_sample(params: PathfinderParams, rng: np.random.Generator) -> PathfinderSample:
    """Draw one Pathfinder image (steps 1-6 of the module docstring)."""
    label = int(rng.integers(0, 2))
    margin = params.paddle_margins[int(rng.integers(len(params.paddle_margins)))]
    renderer = renderer_for(params, margin)
    target_contrast = params.paddle_contrast * params.snake_contrast
    for attempt in range(_MAX_TARGET_ATTEMPTS + 1):  # regrow both target snakes until full length
        if attempt == _MAX_TARGET_ATTEMPTS:
            raise RuntimeError(
                f"no pair of {params.contour_length}-paddle target snakes fits after "
                f"{_MAX_TARGET_ATTEMPTS} attempts with {params}"
            )
        canvas = Canvas(params, renderer, rng)
        pad = params.padding
        canvas.mask[:pad], canvas.mask[-pad:], canvas.mask[:, :pad], canvas.mask[:, -pad:] = 1, 1, 1, 1
        seeds = canvas.seed_pair(target_contrast)
        if seeds is None:
            continue
        if all(canvas.extend(g, target_contrast) for _ in range(params.contour_length - 1) for g in seeds):
            break
    for growth in seeds:
        canvas.commit(growth)
    distractors = []
    for _ in range(params.num_distractor_snakes):
        for _ in range(params.max_distractor_retrial + 1):
            snake = canvas.distractor()
            if snake is not None:
                distractors.append(snake)
                break
    first = int(rng.integers(0, 2))
    second = first if label == 1 else 1 - first
    targets = (seeds[0].snake, seeds[1].snake)
    markers = (targets[first].origin, targets[second].terminal)
    disks = np.zeros_like(canvas.image)
    for centre in markers:
        stamp(disks, renderer.marker(), centre)
    image = _to_uint8(np.maximum(canvas.image, disks))
    return PathfinderSample(image, label, margin, targets, distractors, markers, (first, second))


def image_rng(seed: int, params: PathfinderParams, index: int) -> np.random.Generator:
    """The random stream of image ``index`` (global, counted from 0 over all batches)."""
    return np.random.default_rng(
        np.random.SeedSequence([seed, params.resolution, params.contour_length, index])
    )


def sample_at(params: PathfinderParams, seed: int, index: int) -> PathfinderSample:
    """Image ``index`` of the set generated with ``seed``: what `generate_pathfinder` writes."""
    return generate_sample(params, image_rng(seed, params, index))
