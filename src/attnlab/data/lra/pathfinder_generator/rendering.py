"""Drawing: anti-aliased paddle and marker patches for one parameter set and margin, cached per process.

Each patch is drawn at ``aa_scale`` times the resolution with PIL and downsampled with Lanczos, as the
original's ``scipy.misc.imresize`` did.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from attnlab.data.lra.pathfinder_generator.geometry import dilate, disk_offsets, translate
from attnlab.data.lra.pathfinder_generator.params import PathfinderParams

FREE_THRESHOLD = 0.3  # a pixel is free while its (dilated) occupancy is at most this


def _downsample(blown: np.ndarray, size: int) -> np.ndarray:
    """Lanczos resize of a 0-255 square to ``size`` px, back in [0, 1] (``scipy.misc.imresize``)."""
    image = Image.fromarray(np.clip(blown, 0, 255).astype(np.uint8), "L")
    return np.asarray(image.resize((size, size), Image.Resampling.LANCZOS), dtype=np.float32) / 255.0


class Renderer:
    """Anti-aliased paddle and disk patches for one parameter set and margin, cached.

    A paddle patch is ``(2R+1)²`` with ``R = length + ceil(thickness) + margin``; its tail sits on
    the centre pixel and it extends ``length`` px along ``theta``. ``line`` is the visible stroke,
    ``mask`` the stroke dilated by ``margin`` (the room it claims), both in [0, 1].
    """

    def __init__(self, params: PathfinderParams, margin: int):
        self.params, self.margin = params, margin
        self.half = params.paddle_length + math.ceil(params.paddle_thickness) + margin
        self.size = 2 * self.half + 1
        self._blown_disk = disk_offsets(margin * params.aa_scale)
        self.margin_disk = disk_offsets(margin)
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
                dilate(framed, self.paddle(theta)[2]) <= FREE_THRESHOLD
            )
        return tails

    def paddle(self, theta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(line, mask, footprint)``; footprint: offsets from the tail where the mask is >= 0.5."""
        cached = self._paddles.get(theta)
        if cached is None:
            p, s = self.params, self.params.aa_scale
            blown_size, centre = 2 * self.half * s + 1, self.half * s
            head = translate((centre, centre), theta, p.paddle_length * s)
            canvas = Image.new("L", (blown_size, blown_size), 0)
            ImageDraw.Draw(canvas).line(
                [(centre, centre), (head[1], head[0])], fill=255, width=round(p.paddle_thickness * s)
            )
            blown = np.asarray(canvas)
            line = _downsample(blown, self.size)
            mask = _downsample(dilate(blown, self._blown_disk), self.size)
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


_RENDERERS: dict[tuple[PathfinderParams, int], Renderer] = {}


def renderer_for(params: PathfinderParams, margin: int) -> Renderer:
    key = (params, margin)
    if key not in _RENDERERS:
        _RENDERERS[key] = Renderer(params, margin)
    return _RENDERERS[key]
