"""Training augmentation of point clouds, as PyG transforms on ``Data(pos, normal)``.

The sliced ReLU paper lists anisotropic scaling, random translation, in-plane rotation and random point
dropout for ModelNet40; the ranges below are PCT's (Guo et al. 2021, PCT_Pytorch ``data.py``:
scale U(2/3, 3/2) per axis, translation U(-0.2, 0.2) per axis, dropout ratio U(0, 0.875)).

These are our own transforms rather than PyG's because PyG's do not fit: ``RandomScale`` scales all
axes by one factor, ``RandomJitter`` moves each point independently (noise, not a translation), and
``RandomRotate``/``LinearTransformation`` leave ``data.normal`` unrotated and draw from Python's
``random`` module. Ours move normals with the points (rotation as is; scaling by the inverse
transpose, renormalised) and draw only from torch's generator, so ``torch.random.fork_rng`` plus a
seed makes them reproducible (test-time voting relies on that). They subclass PyG's
``BaseTransform`` and compose with PyG's own transforms.
"""

from __future__ import annotations

import math

import torch
from torch_geometric.data import Data
from torch_geometric.transforms import BaseTransform, Compose


def _uniform(low: float, high: float, *shape: int) -> torch.Tensor:
    return torch.empty(shape).uniform_(low, high) if high > low else torch.full(shape, float(low))


class AnisotropicScale(BaseTransform):
    """Scale each axis by its own factor drawn from U(low, high)."""

    def __init__(self, low: float = 2.0 / 3.0, high: float = 1.5):
        if not 0 < low <= high:
            raise ValueError(f"scale range needs 0 < low <= high, got ({low}, {high})")
        self.low, self.high = low, high

    def forward(self, data: Data) -> Data:
        factors = _uniform(self.low, self.high, 3).to(data.pos.dtype)
        data.pos = data.pos * factors
        if getattr(data, "normal", None) is not None:  # normals transform by the inverse transpose
            data.normal = torch.nn.functional.normalize(data.normal / factors, dim=-1)
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.low:.4g}, {self.high:.4g})"


class RandomTranslate(BaseTransform):
    """Move the whole cloud by one offset drawn from U(-max_offset, max_offset) per axis."""

    def __init__(self, max_offset: float = 0.2):
        if max_offset < 0:
            raise ValueError(f"max_offset must be >= 0, got {max_offset}")
        self.max_offset = max_offset

    def forward(self, data: Data) -> Data:
        data.pos = data.pos + _uniform(-self.max_offset, self.max_offset, 3).to(data.pos.dtype)
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.max_offset})"


def rotation_about(axis: int, angle: float) -> torch.Tensor:
    """Rotation matrix (3, 3) by ``angle`` radians about coordinate ``axis`` (right-handed)."""
    c, s = math.cos(angle), math.sin(angle)
    i, j = [a for a in range(3) if a != axis]
    matrix = torch.eye(3)
    matrix[i, i], matrix[i, j], matrix[j, i], matrix[j, j] = c, -s, s, c
    return matrix


class RotateUp(BaseTransform):
    """In-plane rotation: turn the cloud (and its normals) about the up axis by U(-degrees, degrees)."""

    def __init__(self, degrees: float = 180.0, axis: int = 2):
        if axis not in (0, 1, 2):
            raise ValueError(f"up axis must be 0 (x), 1 (y) or 2 (z), got {axis}")
        if degrees < 0:
            raise ValueError(f"rotation degrees must be >= 0, got {degrees}")
        self.degrees, self.axis = degrees, axis

    def forward(self, data: Data) -> Data:
        angle = math.radians(float(_uniform(-self.degrees, self.degrees, 1)))
        matrix = rotation_about(self.axis, angle).to(data.pos.dtype)
        data.pos = data.pos @ matrix.T
        if getattr(data, "normal", None) is not None:
            data.normal = data.normal @ matrix.T
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.degrees}, axis={'xyz'[self.axis]})"


class PointDropout(BaseTransform):
    """PointNet++'s random input dropout: draw a ratio r ~ U(0, max_ratio), drop each point with
    probability r and put the first point in its place, so every cloud keeps its size."""

    def __init__(self, max_ratio: float = 0.875):
        if not 0 <= max_ratio < 1:
            raise ValueError(f"max dropout ratio must be in [0, 1), got {max_ratio}")
        self.max_ratio = max_ratio

    def forward(self, data: Data) -> Data:
        ratio = float(_uniform(0.0, self.max_ratio, 1))
        dropped = torch.rand(data.pos.shape[0]) <= ratio
        if dropped.any():
            data.pos = data.pos.clone()
            data.pos[dropped] = data.pos[0].clone()
            if getattr(data, "normal", None) is not None:
                data.normal = data.normal.clone()
                data.normal[dropped] = data.normal[0].clone()
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.max_ratio})"


def augmentation(
    scale: tuple[float, float] | None = (2.0 / 3.0, 1.5),
    translate: float = 0.2,
    rotate_degrees: float = 0.0,
    up_axis: int = 2,
    point_dropout: float = 0.875,
) -> Compose | None:
    """The training transforms in order (rotate, scale, translate, drop), leaving out disabled ones."""
    steps: list[BaseTransform] = []
    if rotate_degrees > 0:
        steps.append(RotateUp(rotate_degrees, up_axis))
    if scale is not None:
        low, high = scale
        if (low, high) != (1.0, 1.0):
            steps.append(AnisotropicScale(low, high))
    if translate > 0:
        steps.append(RandomTranslate(translate))
    if point_dropout > 0:
        steps.append(PointDropout(point_dropout))
    return Compose(steps) if steps else None
