"""Pathfinder generator: a reimplementation of Linsley et al.'s ``snakes2.py`` with LRA's parameters.

Pathfinder (Linsley et al. 2018; Kim et al. 2020) asks whether two marker disks are joined by one
dashed curve ("snake") among distractor curves. LRA used the public generator
(github.com/drewlinsley/pathfinder) at 32, 64, 128 and 256 px; this module follows its algorithm
step by step with numpy and PIL only, so a set written here has the official layout, metadata
format and image statistics, but not the official pixels (their random draws are not public).

One image (`generate_sample`):

1. ``label`` ~ U{0, 1}; a paddle margin is drawn from ``paddle_margins``.
2. Two target snakes are seeded ``seed_distance`` px apart with random orientations: the first
   seed's tail lies at least ``2 * seed_distance`` px from the borders, the second on a circle of
   radius ``seed_distance`` around it.
3. Both snakes grow alternately paddle by paddle: the next pivot lies ``length + 2 * margin`` ahead
   of the last one, and the next paddle's head is drawn among the pixels of a circle of radius
   ``length + margin`` around it with weight
   ``(1 - occupied) * max(cos(min(|dtheta| * continuity, pi/2)), 0) ** 2`` (occupied: the
   occupancy mask dilated by a disk of radius ``margin``); a paddle whose mask overlaps the
   occupancy mask (sum >= 1.8) is redrawn up to ``max_paddle_retrial`` times, and any failure
   regrows both snakes from new seeds.
4. Distractor snakes of ``distractor_length = contour_length // 3`` paddles are added (each tried
   up to ``max_distractor_retrial + 1`` times) until ``num_distractor_snakes`` are placed, or the
   free space falls under 1 %.
5. One marker disk goes on the origin (seed tail) of snake A; the other on the far end of snake A
   (label 1) or of snake B (label 0).
6. Each paddle and disk is drawn at ``aa_scale`` times the resolution and downsampled with Lanczos
   (anti-aliasing); the image is the maximum of snakes (``paddle_contrast * snake_contrast``),
   distractors (``snake_contrast``) and markers (1), rescaled so its maximum is 255 (what the
   original's ``scipy.misc.imsave`` did).

Differences from ``snakes2.py``, all deliberate: the seed footprint is the set of pixels where a
paddle's mask is at least half on, centred on the tail (the original kept pixels at exactly full
value of a Lanczos-resized mask, one pixel off-centre); the last paddles of *both* target snakes
are committed to the occupancy mask (the original forgot the first snake's); marker disks are
centred on their pixel. Each image is drawn from its own random stream, derived from
``(seed, resolution, contour_length, index)``, so parallel workers and resumed runs write
identical files.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

RESOLUTIONS = (32, 64, 128)
# canonical difficulty -> (folder of the official release, contour length in paddles)
DIFFICULTIES = {
    "easy": ("curv_baseline", 6),
    "intermediate": ("curv_contour_length_9", 9),
    "hard": ("curv_contour_length_14", 14),
}
_DIFFICULTY_ALIASES = {
    "easy": "easy",
    "baseline": "easy",
    "curv_baseline": "easy",
    "6": "easy",
    "intermediate": "intermediate",
    "medium": "intermediate",
    "curv_contour_length_9": "intermediate",
    "9": "intermediate",
    "hard": "hard",
    "curv_contour_length_14": "hard",
    "14": "hard",
}
GENERATOR_FILE = "generator.json"  # written by `generate_pathfinder`; absent from the LRA release
_OVERLAP_LIMIT = 1.8  # a paddle is rejected where occupancy + its mask reaches this (snakes.py)
_FREE_THRESHOLD = 0.3  # a pixel is free while its (dilated) occupancy is at most this
_MIN_FREE_FRACTION = 0.01  # distractors stop once less than 1 % of the image is free
_MAX_TARGET_ATTEMPTS = 200_000  # hard 64 px needs ~1,300 on average; this only stops impossible settings


def canonical_difficulty(difficulty: str | int) -> str:
    """``easy`` / ``intermediate`` / ``hard`` from any accepted spelling (folder name, length...)."""
    key = str(difficulty).strip().lower()
    if key not in _DIFFICULTY_ALIASES:
        raise ValueError(
            f"unknown Pathfinder difficulty {difficulty!r}; use one of {sorted(_DIFFICULTY_ALIASES)}"
        )
    return _DIFFICULTY_ALIASES[key]


def difficulty_folder(difficulty: str | int) -> str:
    """The official folder name, e.g. ``curv_contour_length_14`` for ``hard``."""
    return DIFFICULTIES[canonical_difficulty(difficulty)][0]


def dataset_dir(root: str | Path, resolution: int, difficulty: str | int) -> Path:
    """``<root>/pathfinder<resolution>/<difficulty folder>``, the official release layout."""
    _check_resolution(resolution)
    return Path(root) / f"pathfinder{resolution}" / difficulty_folder(difficulty)


def _check_resolution(resolution: int) -> None:
    if resolution not in RESOLUTIONS:
        raise ValueError(f"unsupported Pathfinder resolution {resolution!r}; use one of {list(RESOLUTIONS)}")


@dataclass(frozen=True)
class PathfinderParams:
    """Everything that shapes a Pathfinder image (``snakes2_wrapper.py`` arguments, LRA values)."""

    resolution: int
    contour_length: int
    padding: int
    paddle_length: int
    paddle_thickness: float
    paddle_margins: tuple[int, ...]
    marker_radius: float
    aa_scale: int
    seed_distance: int
    continuity: float
    distractor_length: int
    num_distractor_snakes: int
    snake_contrast: float
    paddle_contrast: float = 1.0
    max_paddle_retrial: int = 2
    max_distractor_retrial: int = 4

    def __post_init__(self):
        blown = self.paddle_thickness * self.aa_scale
        if round(blown) != blown or blown < 1:
            raise ValueError(
                f"paddle_thickness * aa_scale must be a positive integer, got "
                f"{self.paddle_thickness} * {self.aa_scale}"
            )
        if self.contour_length < 1 or self.distractor_length < 1 or not self.paddle_margins:
            raise ValueError(f"contour and distractor lengths must be >= 1 and margins given: {self}")

    def metadata_row(self, batch: int, index: int, label: int, margin: int) -> str:
        """One line of ``metadata/<batch>.npy``, with the 11 columns of the official files:
        folder, file, index in batch, label, continuity, contour length, distractor length,
        paddle length, paddle thickness, paddle margin, number of paddle contrasts."""
        columns = [
            f"imgs/{batch}",
            f"sample_{index}.png",
            index,
            label,
            self.continuity,
            self.contour_length,
            self.distractor_length,
            self.paddle_length,
            self.paddle_thickness,
            margin,
            1,
        ]
        return " ".join(str(c) for c in columns)


def lra_params(resolution: int = 32, difficulty: str | int = "hard") -> PathfinderParams:
    """The parameters LRA used (``lra_benchmarks/data/pathfinder.py`` docstrings), per resolution.

    Distractor length is ``contour_length // 3`` and the distractor count
    ``{20, 22, 35}[resolution] // distractor_length``, as the wrapper's integer division gave.
    """
    _check_resolution(resolution)
    contour_length = DIFFICULTIES[canonical_difficulty(difficulty)][1]
    distractor_length = contour_length // 3
    common = dict(resolution=resolution, contour_length=contour_length, distractor_length=distractor_length)
    if resolution == 32:
        return PathfinderParams(
            **common,
            padding=1,
            paddle_length=2,
            paddle_thickness=0.5,
            paddle_margins=(1,),
            marker_radius=1.5,
            aa_scale=2,
            seed_distance=7,
            continuity=1.0,
            num_distractor_snakes=20 // distractor_length,
            snake_contrast=2.0,
            paddle_contrast=0.75,
        )
    if resolution == 64:
        return PathfinderParams(
            **common,
            padding=1,
            paddle_length=5,
            paddle_thickness=1,
            paddle_margins=(1,),
            marker_radius=2.5,
            aa_scale=2,
            seed_distance=12,
            continuity=1.8,
            num_distractor_snakes=22 // distractor_length,
            snake_contrast=0.8,
        )
    return PathfinderParams(
        **common,
        padding=1,
        paddle_length=5,
        paddle_thickness=1.5,
        paddle_margins=(2, 3),
        marker_radius=3,
        aa_scale=2,
        seed_distance=20,
        continuity=1.8,
        num_distractor_snakes=35 // distractor_length,
        snake_contrast=0.9,
    )


# ---------------------------------------------------------------------------------------------
# geometry and rendering


def _translate(coord: Sequence[int], theta: float, dist: float) -> tuple[int, int]:
    """Move ``dist`` px along ``theta`` (radians, y down) and round up, as ``snakes.translate_coord``."""
    return int(math.ceil(coord[0] + dist * math.sin(theta))), int(
        math.ceil(coord[1] + dist * math.cos(theta))
    )


def _flip(theta: float) -> float:
    return theta + math.pi if theta < 0 else theta - math.pi


def _disk_offsets(radius: float) -> np.ndarray:
    """``(K, 2)`` integer offsets ``(dy, dx)`` with ``dy² + dx² <= radius²``."""
    r = int(math.floor(radius))
    y, x = np.mgrid[-r : r + 1, -r : r + 1]
    inside = y * y + x * x <= radius * radius
    return np.stack([y[inside], x[inside]], axis=1)


def _dilate(image: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Grey dilation: ``out[p] = max_k image[p + offsets[k]]``, ignoring positions off the image."""
    reach = int(np.abs(offsets).max()) if len(offsets) else 0
    h, w = image.shape
    padded = np.zeros((h + 2 * reach, w + 2 * reach), dtype=image.dtype)
    padded[reach : reach + h, reach : reach + w] = image
    out = np.zeros_like(image)
    for dy, dx in offsets:
        np.maximum(out, padded[reach + dy : reach + dy + h, reach + dx : reach + dx + w], out=out)
    return out


def _downsample(blown: np.ndarray, size: int) -> np.ndarray:
    """Lanczos resize of a 0-255 square to ``size`` px, back in [0, 1] (``scipy.misc.imresize``)."""
    image = Image.fromarray(np.clip(blown, 0, 255).astype(np.uint8), "L")
    return np.asarray(image.resize((size, size), Image.Resampling.LANCZOS), dtype=np.float32) / 255.0


class _Renderer:
    """Anti-aliased paddle and disk patches for one parameter set and margin, cached.

    A paddle patch is ``(2R+1)²`` with ``R = length + ceil(thickness) + margin``; its tail sits on
    the centre pixel and it extends ``length`` px along ``theta``. ``line`` is the visible stroke,
    ``mask`` the stroke dilated by ``margin`` (the room it claims), both in [0, 1].
    """

    def __init__(self, params: PathfinderParams, margin: int):
        self.params, self.margin = params, margin
        self.half = params.paddle_length + math.ceil(params.paddle_thickness) + margin
        self.size = 2 * self.half + 1
        self._blown_disk = _disk_offsets(margin * params.aa_scale)
        self.margin_disk = _disk_offsets(margin)
        self._paddles: dict[float, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._marker: np.ndarray | None = None
        step = params.paddle_length + margin
        # candidate heads around a pivot: one sample per pixel of arc, truncated to pixels
        # (for an integer pivot, truncating pivot + f equals pivot + floor(f) on the image)
        angles = np.arange(0, 360, 360.0 / (2 * step * math.pi)) * math.pi / 180
        offsets = np.floor(np.stack([step * np.sin(angles), step * np.cos(angles)], axis=1)).astype(np.int64)
        self.circle = np.unique(offsets, axis=0)
        self.circle_theta = np.arctan2(self.circle[:, 0], self.circle[:, 1])
        self.frame = margin  # zero frame around a canvas's mask, for margin-disk reads
        self._turns: dict[float, np.ndarray] = {}
        self._first_tails: dict[float, np.ndarray] = {}

    def turn_weights(self, theta: float) -> np.ndarray:
        """``max(cos(min(|dtheta| * continuity, pi/2)), 0)²`` for each circle candidate after ``theta``."""
        weights = self._turns.get(theta)
        if weights is None:
            turn = np.abs(self.circle_theta - theta)
            turn = np.minimum(np.minimum(turn, 2 * math.pi - turn) * self.params.continuity, math.pi / 2)
            weights = self._turns[theta] = np.maximum(np.cos(turn), 0.0) ** 2
        return weights

    def first_seed_tails(self, theta: float) -> np.ndarray:
        """Flat indices of the tails allowed for the first target seed at ``theta``: its footprint
        must avoid a frame of ``2 * seed_distance`` px (and the padding). Only the empty image is
        involved, so this is cached."""
        tails = self._first_tails.get(theta)
        if tails is None:
            p, n = self.params, self.params.resolution
            band = max(2 * p.seed_distance, p.padding)
            framed = np.ones((n, n), dtype=np.float32)
            framed[band : n - band, band : n - band] = 0
            tails = self._first_tails[theta] = np.flatnonzero(
                _dilate(framed, self.paddle(theta)[2]) <= _FREE_THRESHOLD
            )
        return tails

    def paddle(self, theta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(line, mask, footprint)``; footprint: offsets from the tail where the mask is >= 0.5."""
        cached = self._paddles.get(theta)
        if cached is None:
            p, s = self.params, self.params.aa_scale
            blown_size, centre = 2 * self.half * s + 1, self.half * s
            head = _translate((centre, centre), theta, p.paddle_length * s)
            canvas = Image.new("L", (blown_size, blown_size), 0)
            ImageDraw.Draw(canvas).line(
                [(centre, centre), (head[1], head[0])], fill=255, width=round(p.paddle_thickness * s)
            )
            blown = np.asarray(canvas)
            line = _downsample(blown, self.size)
            mask = _downsample(_dilate(blown, self._blown_disk), self.size)
            footprint = np.argwhere(mask >= 0.5) - self.half
            if len(footprint) == 0:
                footprint = np.zeros((1, 2), dtype=np.int64)
            cached = self._paddles[theta] = (line, mask, footprint)
        return cached

    def marker(self) -> np.ndarray:
        """Disk of ``marker_radius`` drawn at ``aa_scale`` and downsampled, centred on its patch."""
        if self._marker is None:
            p = self.params
            half = math.ceil(p.marker_radius) + 3  # room for the Lanczos lobes
            s = p.aa_scale
            y, x = np.ogrid[-half * s : half * s + 1, -half * s : half * s + 1]
            blown = np.where(x * x + y * y <= (p.marker_radius * s) ** 2, 255, 0)
            self._marker = _downsample(blown, 2 * half + 1)
        return self._marker


def _region(
    centre: Sequence[int], half: int, shape: tuple[int, int]
) -> tuple[slice, slice, slice, slice] | None:
    """Image and patch slices where a ``(2*half+1)²`` patch centred on ``centre`` meets the image."""
    y0, x0 = centre[0] - half, centre[1] - half
    n = 2 * half + 1
    iy0, ix0 = max(y0, 0), max(x0, 0)
    iy1, ix1 = min(y0 + n, shape[0]), min(x0 + n, shape[1])
    if iy0 >= iy1 or ix0 >= ix1:
        return None
    return slice(iy0, iy1), slice(ix0, ix1), slice(iy0 - y0, iy1 - y0), slice(ix0 - x0, ix1 - x0)


def _stamp(target: np.ndarray, patch: np.ndarray, centre: Sequence[int], scale: float = 1.0) -> None:
    """``target = max(target, scale * patch)`` with the patch centred on ``centre`` (clipped)."""
    region = _region(centre, patch.shape[0] // 2, target.shape)
    if region is not None:
        iy, ix, py, px = region
        np.maximum(target[iy, ix], scale * patch[py, px], out=target[iy, ix])


# ---------------------------------------------------------------------------------------------
# snakes


@dataclass
class Snake:
    """Paddles as ``(start, end)`` pixel pairs along the snake; ``origin`` and ``terminal`` are its
    two ends (the seed paddle's tail and the last paddle's head), where markers may go."""

    paddles: list[tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=list)

    @property
    def origin(self) -> tuple[int, int]:
        return self.paddles[0][0]

    @property
    def terminal(self) -> tuple[int, int]:
        return self.paddles[-1][1]


@dataclass
class _Growth:
    """A snake being grown: its last pivot and orientation, and its last paddle's mask, which is
    committed to the occupancy only when the next paddle is placed (they must be allowed to touch)."""

    snake: Snake
    pivot: tuple[int, int]
    theta: float
    pending: tuple[np.ndarray, tuple[int, int]]


class _Canvas:
    """Image and occupancy mask of one Pathfinder image under construction.

    The mask lives inside a zero frame (``padded``) so neighbourhood reads near the border need
    no bounds checks; zeros never raise a maximum because occupancy is never negative.
    """

    def __init__(self, params: PathfinderParams, renderer: _Renderer, rng: np.random.Generator):
        n, f = params.resolution, renderer.frame
        self.params, self.renderer, self.rng = params, renderer, rng
        self.image = np.zeros((n, n), dtype=np.float32)
        self.padded = np.zeros((n + 2 * f, n + 2 * f), dtype=np.float32)
        self.mask = self.padded[f : f + n, f : f + n]

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.image.copy(), self.padded.copy()

    def restore(self, state: tuple[np.ndarray, np.ndarray]) -> None:
        self.image[...] = state[0]
        self.padded[...] = state[1]

    def _in_image(self, *coords: tuple[int, int]) -> bool:
        n = self.params.resolution
        return all(0 <= y < n and 0 <= x < n for y, x in coords)

    def seed(self, border: int, contrast: float, stop_when_full: bool) -> _Growth | None:
        """Seed paddle at a random free tail (``snakes.seed_snake``); None when no room is left.

        ``border``: width of the frame where tails may not go. The paddle's footprint must stay on
        pixels whose occupancy is at most 0.3, and its head and pivot must lie in the image.
        """
        p, n = self.params, self.params.resolution
        if stop_when_full and np.count_nonzero(self.mask <= _FREE_THRESHOLD) < _MIN_FREE_FRACTION * n * n:
            return None
        framed = self.mask.copy()
        framed[:border], framed[n - border :], framed[:, :border], framed[:, n - border :] = 1, 1, 1, 1
        for _ in range(p.max_paddle_retrial + 1):
            theta = math.radians(int(self.rng.integers(-180, 180)))
            free = np.flatnonzero(_dilate(framed, self.renderer.paddle(theta)[2]) <= _FREE_THRESHOLD)
            if len(free) == 0:
                return None
            growth = self._seed_at(divmod(int(free[self.rng.integers(len(free))]), n), theta, contrast)
            if growth is not None:
                return growth
        return None

    def _seed_at(self, tail: tuple[int, int], theta: float, contrast: float) -> _Growth | None:
        """Draw a seed paddle from ``tail`` along ``theta`` unless its head or pivot leaves the image."""
        p = self.params
        head = _translate(tail, theta, p.paddle_length)
        pivot = _translate(head, _flip(theta), p.paddle_length + self.renderer.margin)
        if not self._in_image(head, pivot):
            return None
        line, mask, _ = self.renderer.paddle(theta)
        _stamp(self.image, line, tail, contrast)
        return _Growth(Snake([(tail, head)]), pivot, theta, (mask, tail))

    def seed_pair(self, contrast: float) -> tuple[_Growth, _Growth] | None:
        """The two target seeds, ``seed_distance`` apart (``snakes2.initialize_two_seeds``).

        The first tail keeps ``2 * seed_distance`` px from the borders; the second lies on a circle
        of radius ``seed_distance`` around it, with no further check (as in the original).
        """
        p, n = self.params, self.params.resolution
        origin = None
        for _ in range(p.max_paddle_retrial + 1):
            theta = math.radians(int(self.rng.integers(-180, 180)))
            free = self.renderer.first_seed_tails(theta)  # the mask is still empty here: cached
            if len(free) == 0:
                return None
            first = self._seed_at(divmod(int(free[self.rng.integers(len(free))]), n), theta, contrast)
            if first is not None:
                origin = first.snake.origin
                break
        if origin is None:
            return None
        for _ in range(p.max_paddle_retrial + 1):
            theta = math.radians(int(self.rng.integers(-180, 180)))
            around = math.radians(int(self.rng.integers(0, 360)))
            tail = (
                int(np.round(origin[0] + p.seed_distance * math.sin(around))),
                int(np.round(origin[1] + p.seed_distance * math.cos(around))),
            )
            second = self._seed_at(tail, theta, contrast)
            if second is not None:
                return first, second
        return None

    def extend(self, growth: _Growth, contrast: float) -> bool:
        """Add one paddle to a snake (``snakes.extend_snake``); False at a dead end."""
        p, r, n = self.params, self.renderer, self.params.resolution
        pivot = _translate(growth.pivot, growth.theta, p.paddle_length + 2 * r.margin)
        heads = r.circle + np.asarray(pivot)
        inside = ((heads >= 0) & (heads < n)).all(axis=1)
        if not inside.any():
            return False
        heads, thetas = heads[inside], r.circle_theta[inside]
        # occupancy dilated by the margin disk, read at the candidate heads only
        ys = heads[:, :1] + (r.frame + r.margin_disk[:, 0])
        xs = heads[:, 1:] + (r.frame + r.margin_disk[:, 1])
        occupied = self.padded[ys, xs].max(axis=1)
        weights = (1.0 - occupied) * r.turn_weights(growth.theta)[inside]
        total = weights.sum()
        if total < 1e-4:
            return False
        cmf = np.cumsum(weights / total)
        for _ in range(p.max_paddle_retrial + 1):
            index = min(int(np.searchsorted(cmf, self.rng.random(), side="right")), len(cmf) - 1)
            head, theta = (int(heads[index, 0]), int(heads[index, 1])), float(thetas[index])
            line, mask, _ = r.paddle(_flip(theta))  # drawn from the head back towards the pivot
            region = _region(head, r.half, self.mask.shape)
            if region is not None:
                iy, ix, py, px = region
                if (self.mask[iy, ix] + mask[py, px]).max() >= _OVERLAP_LIMIT:
                    continue
            _stamp(self.image, line, head, contrast)
            self.commit(growth)
            start = _translate(head, _flip(theta), p.paddle_length)
            growth.snake.paddles.append((start, head))
            growth.pivot, growth.theta, growth.pending = pivot, theta, (mask, head)
            return True
        return False

    def commit(self, growth: _Growth) -> None:
        """Add the snake's pending (last) paddle mask to the occupancy."""
        mask, centre = growth.pending
        _stamp(self.mask, mask, centre)

    def distractor(self) -> Snake | None:
        """One distractor snake (``snakes.make_snake``); on failure the canvas is left unchanged."""
        p = self.params
        state = self.snapshot()
        growth = self.seed(border=1, contrast=p.snake_contrast, stop_when_full=True)
        if growth is not None:
            for _ in range(p.distractor_length - 1):
                if not self.extend(growth, p.snake_contrast):
                    growth = None
                    break
        if growth is None:
            self.restore(state)
            return None
        self.commit(growth)
        return growth.snake


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
    renderer = _renderer(params, margin)
    target_contrast = params.paddle_contrast * params.snake_contrast
    for attempt in range(_MAX_TARGET_ATTEMPTS + 1):  # regrow both target snakes until full length
        if attempt == _MAX_TARGET_ATTEMPTS:
            raise RuntimeError(
                f"no pair of {params.contour_length}-paddle target snakes fits after "
                f"{_MAX_TARGET_ATTEMPTS} attempts with {params}"
            )
        canvas = _Canvas(params, renderer, rng)
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
        _stamp(disks, renderer.marker(), centre)
    image = _to_uint8(np.maximum(canvas.image, disks))
    return PathfinderSample(image, label, margin, targets, distractors, markers, (first, second))


_RENDERERS: dict[tuple[PathfinderParams, int], _Renderer] = {}


def _renderer(params: PathfinderParams, margin: int) -> _Renderer:
    key = (params, margin)
    if key not in _RENDERERS:
        _RENDERERS[key] = _Renderer(params, margin)
    return _RENDERERS[key]


def image_rng(seed: int, params: PathfinderParams, index: int) -> np.random.Generator:
    """The random stream of image ``index`` (global, counted from 0 over all batches)."""
    return np.random.default_rng(
        np.random.SeedSequence([seed, params.resolution, params.contour_length, index])
    )


def sample_at(params: PathfinderParams, seed: int, index: int) -> PathfinderSample:
    """Image ``index`` of the set generated with ``seed``: what `generate_pathfinder` writes."""
    return generate_sample(params, image_rng(seed, params, index))


# ---------------------------------------------------------------------------------------------
# writing the official layout


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
    temporary.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    os.replace(temporary, metadata / f"{batch}.npy")
    return batch, count, positives


def _check_generator_file(directory: Path, record: dict) -> None:
    """Refuse to mix sets: an existing ``generator.json`` must name the same parameters and seed."""
    path = directory / GENERATOR_FILE
    if path.is_file():
        existing = json.loads(path.read_text(encoding="utf-8"))
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
            with multiprocessing.get_context(method).Pool(workers) as pool:
                for _, count, _ in pool.imap_unordered(_write_batch, jobs):
                    if bar is not None:
                        bar.update(count)
    finally:
        if bar is not None:
            bar.close()
    return directory


# ---------------------------------------------------------------------------------------------
# figure


def save_example_grid(
    path: str | Path,
    resolution: int = 32,
    difficulty: str | int = "hard",
    per_label: int = 8,
    seed: int = 0,
) -> Path:
    """Save a PNG with ``per_label`` generated images of each label (top: connected, label 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = lra_params(resolution, difficulty)
    found: dict[int, list[np.ndarray]] = {0: [], 1: []}
    index = 0
    while min(len(v) for v in found.values()) < per_label:
        sample = sample_at(params, seed, index)
        if len(found[sample.label]) < per_label:
            found[sample.label].append(sample.image)
        index += 1
    fig, axes = plt.subplots(2, per_label, figsize=(1.6 * per_label, 3.8))
    for row, label in enumerate((1, 0)):
        for col, image in enumerate(found[label]):
            ax = axes[row, col]
            ax.imshow(image, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        axes[row, 0].set_ylabel("label 1\nconnected" if label == 1 else "label 0\nnot connected")
    fig.suptitle(f"Pathfinder {resolution} px, {difficulty_folder(difficulty)} (generated, seed {seed})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
