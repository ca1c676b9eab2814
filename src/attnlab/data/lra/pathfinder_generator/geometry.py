"""Pixel geometry shared by drawing and growth: moving along an angle, disks, grey dilation, and
stamping a patch into an image (``max``, clipped at the borders)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def translate(coord: Sequence[int], theta: float, dist: float) -> tuple[int, int]:
    """Move ``dist`` px along ``theta`` (radians, y down) and round up, as ``snakes.translate_coord``."""
    return int(math.ceil(coord[0] + dist * math.sin(theta))), int(
        math.ceil(coord[1] + dist * math.cos(theta))
    )


def flip(theta: float) -> float:
    """The opposite direction, kept in [-pi, pi]."""
    return theta + math.pi if theta < 0 else theta - math.pi


def disk_offsets(radius: float) -> np.ndarray:
    """``(K, 2)`` integer offsets ``(dy, dx)`` with ``dy² + dx² <= radius²``."""
    r = int(math.floor(radius))
    y, x = np.mgrid[-r : r + 1, -r : r + 1]
    inside = y * y + x * x <= radius * radius
    return np.stack([y[inside], x[inside]], axis=1)


def dilate(image: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Grey dilation: ``out[p] = max_k image[p + offsets[k]]``, ignoring positions off the image."""
    reach = int(np.abs(offsets).max()) if len(offsets) else 0
    h, w = image.shape
    padded = np.zeros((h + 2 * reach, w + 2 * reach), dtype=image.dtype)
    padded[reach : reach + h, reach : reach + w] = image
    out = np.zeros_like(image)
    for dy, dx in offsets:
        np.maximum(out, padded[reach + dy : reach + dy + h, reach + dx : reach + dx + w], out=out)
    return out


def patch_region(
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


def stamp(target: np.ndarray, patch: np.ndarray, centre: Sequence[int], scale: float = 1.0) -> None:
    """``target = max(target, scale * patch)`` with the patch centred on ``centre`` (clipped)."""
    region = patch_region(centre, patch.shape[0] // 2, target.shape)
    if region is not None:
        iy, ix, py, px = region
        np.maximum(target[iy, ix], scale * patch[py, px], out=target[iy, ix])
