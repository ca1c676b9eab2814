"""Augmentation properties: rotation keeps norms and the up coordinate, dropout keeps the shape,
translation and scaling stay in their bounds; normals move with the points."""

from __future__ import annotations

import math

import pytest
import torch
from torch_geometric.data import Data

from attnlab.data.pointcloud.transforms import (
    AnisotropicScale,
    PointDropout,
    RandomTranslate,
    RotateUp,
    augmentation,
    rotation_about,
)


def cloud(n: int = 500, normals: bool = True, seed: int = 0) -> Data:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randn(n, 3, generator=g)
    data = Data(pos=pos)
    if normals:
        data.normal = torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=1)
    return data


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_rotation_keeps_norms_and_the_up_coordinate(axis):
    torch.manual_seed(0)
    before = cloud()
    for _ in range(20):
        after = RotateUp(180, axis)(before)
        torch.testing.assert_close(after.pos.norm(dim=1), before.pos.norm(dim=1))
        torch.testing.assert_close(after.pos[:, axis], before.pos[:, axis])
        torch.testing.assert_close(after.normal.norm(dim=1), torch.ones(len(before.pos)))
        # normals turn with the points: every normal keeps its angle to its point
        torch.testing.assert_close((after.pos * after.normal).sum(1), (before.pos * before.normal).sum(1))
    assert not torch.equal(after.pos, before.pos)


def test_rotation_stays_within_its_range():
    torch.manual_seed(1)
    before = Data(pos=torch.tensor([[1.0, 0.0, 0.0]]))
    angles = []
    for _ in range(200):
        x, y, _ = RotateUp(30, axis=2)(before).pos[0].tolist()
        angles.append(math.degrees(math.atan2(y, x)))
    assert max(map(abs, angles)) <= 30 + 1e-4 and max(angles) > 20 and min(angles) < -20


def test_rotation_matrix_is_proper():
    for axis in range(3):
        m = rotation_about(axis, 0.7)
        torch.testing.assert_close(m @ m.T, torch.eye(3))
        assert torch.linalg.det(m) == pytest.approx(1.0)


def test_scaling_per_axis_within_bounds_and_normals_stay_unit():
    torch.manual_seed(2)
    before = cloud()
    ratios = []
    for _ in range(100):
        after = AnisotropicScale(2 / 3, 3 / 2)(before)
        ratio = after.pos / before.pos
        assert torch.allclose(ratio, ratio[0].expand_as(ratio), atol=1e-4)  # one factor per axis
        ratios.append(ratio[0])
        torch.testing.assert_close(after.normal.norm(dim=1), torch.ones(len(before.pos)))
    ratios = torch.stack(ratios)
    assert ratios.min() >= 2 / 3 - 1e-5 and ratios.max() <= 3 / 2 + 1e-5
    assert (ratios.std(0) > 0.1).all()  # the axes vary independently
    assert not torch.allclose(ratios[:, 0], ratios[:, 1])


def test_scaling_keeps_the_surface_normal_perpendicular_to_the_surface():
    """A plane x + y + z = 1 stays a plane; its normal must follow the inverse transpose."""
    torch.manual_seed(3)
    g = torch.rand(200, 2)
    pos = torch.stack([g[:, 0], g[:, 1], 1 - g[:, 0] - g[:, 1]], dim=1)
    data = Data(pos=pos, normal=torch.full((200, 3), 1 / math.sqrt(3)))
    after = AnisotropicScale(0.5, 2.0)(data)
    tangent = after.pos[1:] - after.pos[:1]
    assert (tangent @ after.normal[0]).abs().max() < 1e-5


def test_translation_moves_the_whole_cloud_within_bounds():
    torch.manual_seed(4)
    before = cloud()
    shifts = []
    for _ in range(100):
        after = RandomTranslate(0.2)(before)
        shift = after.pos - before.pos
        torch.testing.assert_close(shift, shift[0].expand_as(shift))
        shifts.append(shift[0])
        torch.testing.assert_close(after.normal, before.normal)
    shifts = torch.stack(shifts)
    assert shifts.abs().max() <= 0.2 + 1e-6 and shifts.abs().max() > 0.15


def test_point_dropout_keeps_the_shape_and_puts_the_first_point_in_place():
    torch.manual_seed(5)
    before = cloud()
    original = before.pos.clone()
    counts = []
    for _ in range(50):
        after = PointDropout(0.875)(before)
        assert after.pos.shape == before.pos.shape and after.normal.shape == before.normal.shape
        kept = (after.pos == before.pos).all(1)
        dropped = ~kept
        assert (after.pos[dropped] == before.pos[0]).all() and (
            after.normal[dropped] == before.normal[0]
        ).all()
        counts.append(int(dropped.sum()))
    torch.testing.assert_close(before.pos, original)  # the input cloud is left alone
    assert max(counts) <= 0.875 * 500 * 1.2 and max(counts) > 100 and min(counts) < 100


def test_augmentation_order_and_switches():
    assert augmentation(scale=None, translate=0, rotate_degrees=0, point_dropout=0) is None
    steps = augmentation(rotate_degrees=180, up_axis=1).transforms
    assert [type(t).__name__ for t in steps] == [
        "RotateUp",
        "AnisotropicScale",
        "RandomTranslate",
        "PointDropout",
    ]
    assert steps[0].axis == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: AnisotropicScale(0, 1),
        lambda: AnisotropicScale(2, 1),
        lambda: RandomTranslate(-1),
        lambda: RotateUp(10, axis=3),
        lambda: PointDropout(1.0),
    ],
)
def test_bad_ranges_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_transforms_are_reproducible_under_a_forked_seed():
    """Test-time voting relies on it: the same seed gives the same augmented cloud."""
    pipeline = augmentation(rotate_degrees=180)
    outs = []
    for _ in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            outs.append(pipeline(cloud()).pos)
    torch.testing.assert_close(outs[0], outs[1])
