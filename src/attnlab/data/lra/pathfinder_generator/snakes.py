"""Snake growth (``snakes.py`` / ``snakes2.py``): seeding, extending paddle by paddle and distractors,
on a canvas that holds the image and its occupancy mask."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from attnlab.data.lra.pathfinder_generator.geometry import dilate, flip, patch_region, stamp, translate
from attnlab.data.lra.pathfinder_generator.params import PathfinderParams
from attnlab.data.lra.pathfinder_generator.rendering import FREE_THRESHOLD, Renderer

_OVERLAP_LIMIT = 1.8  # a paddle is rejected where occupancy + its mask reaches this (snakes.py)
_MIN_FREE_FRACTION = 0.01  # distractors stop once less than 1 % of the image is free


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
class Growth:
    """A snake being grown: its last pivot and orientation, and its last paddle's mask, which is
    committed to the occupancy only when the next paddle is placed (they must be allowed to touch)."""

    snake: Snake
    pivot: tuple[int, int]
    theta: float
    pending: tuple[np.ndarray, tuple[int, int]]


class Canvas:
    """Image and occupancy mask of one Pathfinder image under construction.

    The mask lives inside a zero frame (``padded``) so neighbourhood reads near the border need
    no bounds checks; zeros never raise a maximum because occupancy is never negative.
    """

    def __init__(self, params: PathfinderParams, renderer: Renderer, rng: np.random.Generator):
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

    def seed(self, border: int, contrast: float, stop_when_full: bool) -> Growth | None:
        """Seed paddle at a random free tail (``snakes.seed_snake``); None when no room is left.

        ``border``: width of the frame where tails may not go. The paddle's footprint must stay on
        pixels whose occupancy is at most 0.3, and its head and pivot must lie in the image.
        """
        p, n = self.params, self.params.resolution
        if stop_when_full and np.count_nonzero(self.mask <= FREE_THRESHOLD) < _MIN_FREE_FRACTION * n * n:
            return None
        framed = self.mask.copy()
        framed[:border], framed[n - border :], framed[:, :border], framed[:, n - border :] = 1, 1, 1, 1
        for _ in range(p.max_paddle_retrial + 1):
            theta = math.radians(int(self.rng.integers(-180, 180)))
            free = np.flatnonzero(dilate(framed, self.renderer.paddle(theta)[2]) <= FREE_THRESHOLD)
            if len(free) == 0:
                return None
            growth = self._seed_at(divmod(int(free[self.rng.integers(len(free))]), n), theta, contrast)
            if growth is not None:
                return growth
        return None

    def _seed_at(self, tail: tuple[int, int], theta: float, contrast: float) -> Growth | None:
        """Draw a seed paddle from ``tail`` along ``theta`` unless its head or pivot leaves the image."""
        p = self.params
        head = translate(tail, theta, p.paddle_length)
        pivot = translate(head, flip(theta), p.paddle_length + self.renderer.margin)
        if not self._in_image(head, pivot):
            return None
        line, mask, _ = self.renderer.paddle(theta)
        stamp(self.image, line, tail, contrast)
        return Growth(Snake([(tail, head)]), pivot, theta, (mask, tail))

    def seed_pair(self, contrast: float) -> tuple[Growth, Growth] | None:
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

    def extend(self, growth: Growth, contrast: float) -> bool:
        """Add one paddle to a snake (``snakes.extend_snake``); False at a dead end."""
        p, r, n = self.params, self.renderer, self.params.resolution
        pivot = translate(growth.pivot, growth.theta, p.paddle_length + 2 * r.margin)
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
            line, mask, _ = r.paddle(flip(theta))  # drawn from the head back towards the pivot
            region = patch_region(head, r.half, self.mask.shape)
            if region is not None:
                iy, ix, py, px = region
                if (self.mask[iy, ix] + mask[py, px]).max() >= _OVERLAP_LIMIT:
                    continue
            stamp(self.image, line, head, contrast)
            self.commit(growth)
            start = translate(head, flip(theta), p.paddle_length)
            growth.snake.paddles.append((start, head))
            growth.pivot, growth.theta, growth.pending = pivot, theta, (mask, head)
            return True
        return False

    def commit(self, growth: Growth) -> None:
        """Add the snake's pending (last) paddle mask to the occupancy."""
        mask, centre = growth.pending
        stamp(self.mask, mask, centre)

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
