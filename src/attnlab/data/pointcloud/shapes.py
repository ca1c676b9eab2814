"""``task=shapes``: a generated ModelNet-style set of parametric solids, so a CPU run learns out of the box.

No point-cloud dataset ships with our dependencies, so this one is generated, and says so (log and
``summary.json`` ``data_source``). `generate_shapes` writes OFF meshes in ModelNet's exact layout,
``<root>/<class>/{train,test}/<class>_NNNN.off``, and the run then reads them through the very same
path as ModelNet40 (`ModelNetSource`: attnlab's OFF reader, PyG's ``SamplePoints`` and
``NormalizeScale``, the cache). One file in five is written with ModelNet's fused ``OFF<counts>``
header, as about a fifth of ModelNet40's are, so that path is exercised too.

Classes (8): box, capsule, cone, cylinder, octahedron, pyramid, sphere, torus. Each mesh draws its
proportions (per class, ranges in `PROPORTIONS`), an overall size U(0.5, 2), a turn about the up axis
(z) U(0, 360°), a tilt about x U(-tilt, tilt) and Gaussian noise on the vertices (``noise`` × size).
Every file has its own seed, from (seed, class, split, index): the set depends on nothing else.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np

from attnlab.data.errors import read_json
from attnlab.data.pointcloud.modelnet import ModelNetSource, PointClouds
from attnlab.data.pointcloud.off import write_off
from attnlab.files import remove_orphans, removed_on_failure

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1
GENERATOR_FILE = "generator.json"  # written last: a folder without it is incomplete
CLASSES = ("box", "capsule", "cone", "cylinder", "octahedron", "pyramid", "sphere", "torus")
SEGMENTS = 24  # around the up axis, for surfaces of revolution
#: proportion ranges per class (uniform); widths are x/y half-sizes or radii, heights along z
PROPORTIONS = {
    "box": {"x": (0.3, 1.0), "y": (0.3, 1.0), "z": (0.3, 1.0)},
    "capsule": {"radius": (0.25, 0.5), "length": (0.5, 1.5)},
    "cone": {"radius": (0.3, 0.8), "height": (0.6, 1.6)},
    "cylinder": {"radius": (0.3, 0.8), "height": (0.4, 1.6)},
    "octahedron": {"x": (0.4, 1.0), "y": (0.4, 1.0), "z": (0.4, 1.0)},
    "pyramid": {"x": (0.4, 1.0), "y": (0.4, 1.0), "height": (0.5, 1.5)},
    "sphere": {"y": (0.85, 1.0), "z": (0.85, 1.0)},
    "torus": {"minor": (0.15, 0.45)},
}


def _revolve(profile: list[tuple[float, float]], closed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Surface of revolution about z of a (radius, z) polyline; radius 0 makes a pole (one vertex)."""
    angles = np.linspace(0.0, 2 * math.pi, SEGMENTS, endpoint=False)
    vertices, rings = [], []
    for radius, z in profile:
        start = len(vertices)
        if radius == 0:
            vertices.append((0.0, 0.0, z))
            rings.append([start])
        else:
            vertices += [(radius * math.cos(a), radius * math.sin(a), z) for a in angles]
            rings.append(list(range(start, start + SEGMENTS)))
    pairs = list(zip(rings[:-1], rings[1:], strict=True))
    if closed:
        pairs.append((rings[-1], rings[0]))
    faces = []
    for lower, upper in pairs:
        for k in range(SEGMENTS):
            nxt = (k + 1) % SEGMENTS
            if len(lower) == 1:
                faces.append((lower[0], upper[k], upper[nxt]))
            elif len(upper) == 1:
                faces.append((lower[k], upper[0], lower[nxt]))
            else:
                faces += [(lower[k], upper[k], upper[nxt]), (lower[k], upper[nxt], lower[nxt])]
    return np.array(vertices, dtype=np.float64), np.array(faces, dtype=np.int64)


def _arc(radius: float, centre_z: float, start: float, stop: float, steps: int) -> list[tuple[float, float]]:
    return [
        (max(0.0, radius * math.cos(t)) if abs(math.cos(t)) > 1e-9 else 0.0, centre_z + radius * math.sin(t))
        for t in np.linspace(start, stop, steps)
    ]


def solid(name: str, p: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """Vertices and triangles of one solid of class ``name`` with proportions ``p``."""
    if name in ("box", "octahedron"):
        x, y, z = p["x"], p["y"], p["z"]
        if name == "box":
            corners = np.array([(i, j, k) for i in (-1, 1) for j in (-1, 1) for k in (-1, 1)], float)
            quads = [(0, 1, 3, 2), (4, 6, 7, 5), (0, 4, 5, 1), (2, 3, 7, 6), (0, 2, 6, 4), (1, 5, 7, 3)]
            faces = [t for a, b, c, d in quads for t in ((a, b, c), (a, c, d))]
            return corners * (x, y, z), np.array(faces)
        vertices = np.array([(x, 0, 0), (-x, 0, 0), (0, y, 0), (0, -y, 0), (0, 0, z), (0, 0, -z)], float)
        faces = [(a, b, c) for a in (0, 1) for b in (2, 3) for c in (4, 5)]
        return vertices, np.array(faces)
    if name == "pyramid":
        x, y, h = p["x"], p["y"], p["height"]
        vertices = np.array([(-x, -y, 0), (x, -y, 0), (x, y, 0), (-x, y, 0), (0, 0, h)], float)
        faces = [(0, 2, 1), (0, 3, 2), (0, 1, 4), (1, 2, 4), (2, 3, 4), (3, 0, 4)]
        return vertices, np.array(faces)
    if name == "sphere":
        vertices, faces = _revolve(_arc(1.0, 0.0, -math.pi / 2, math.pi / 2, 13))
        return vertices * (1.0, p["y"], p["z"]), faces
    if name == "capsule":
        r, half = p["radius"], p["length"] / 2
        lower = _arc(r, -half, -math.pi / 2, 0.0, 7)
        upper = _arc(r, half, 0.0, math.pi / 2, 7)
        return _revolve(lower + upper)
    if name == "cylinder":
        r, h = p["radius"], p["height"]
        return _revolve([(0.0, 0.0), (r, 0.0), (r, h), (0.0, h)])
    if name == "cone":
        return _revolve([(0.0, 0.0), (p["radius"], 0.0), (0.0, p["height"])])
    if name == "torus":
        minor = p["minor"]
        circle = [
            (1.0 + minor * math.cos(t), minor * math.sin(t)) for t in np.linspace(0, 2 * math.pi, 12, False)
        ]
        return _revolve(circle, closed=True)
    raise ValueError(f"unknown solid {name!r}; choose one of {', '.join(CLASSES)}")


def _rotation(turn: float, tilt: float) -> np.ndarray:
    c, s = math.cos(turn), math.sin(turn)
    about_z = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])
    c, s = math.cos(tilt), math.sin(tilt)
    about_x = np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
    return about_x @ about_z


def random_solid(name: str, rng: np.random.Generator, noise: float, tilt_degrees: float):
    """One mesh of class ``name``: drawn proportions, size, orientation and vertex noise."""
    proportions = {key: float(rng.uniform(*bounds)) for key, bounds in PROPORTIONS[name].items()}
    vertices, faces = solid(name, proportions)
    size = float(rng.uniform(0.5, 2.0))
    turn = float(rng.uniform(0, 2 * math.pi))
    tilt = math.radians(float(rng.uniform(-tilt_degrees, tilt_degrees)))
    vertices = vertices @ _rotation(turn, tilt).T * size
    vertices = vertices + rng.normal(0.0, noise * size, vertices.shape)
    return vertices, faces


def generator_params(train_per_class: int, test_per_class: int, seed: int, noise: float, tilt_degrees: float):
    return {
        "generator": "attnlab.data.pointcloud.shapes",
        "version": GENERATOR_VERSION,
        "classes": list(CLASSES),
        "proportions": PROPORTIONS,
        "size": [0.5, 2.0],
        "turn_degrees": [0, 360],
        "tilt_degrees": tilt_degrees,
        "noise": noise,
        "per_class": {"train": train_per_class, "test": test_per_class},
        "seed": seed,
        "fused_off_header": "every 5th file",
    }


def generate_shapes(
    root: str | Path,
    train_per_class: int = 64,
    test_per_class: int = 16,
    seed: int = 0,
    noise: float = 0.01,
    tilt_degrees: float = 10.0,
) -> Path:
    """Write the set to ``root`` (ModelNet's layout) unless it is there, complete; return ``root``.

    Written to a temporary sibling folder and renamed, with ``generator.json`` last, so an interrupted
    generation is never mistaken for a set.
    """
    root = Path(root)
    params = generator_params(train_per_class, test_per_class, seed, noise, tilt_degrees)
    marker = root / GENERATOR_FILE
    if marker.is_file():
        if read_json(marker, (), "a shapes generator record") == json.loads(json.dumps(params)):
            return root
        raise ValueError(f"{root} holds a set generated with other parameters ({marker}); remove it")
    root.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(root.parent, rf"{re.escape(root.name)}\.tmp-(?P<pid>\d+)")  # left by a kill -9
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with removed_on_failure(tmp):
        for label, name in enumerate(CLASSES):
            for split_index, (split, count) in enumerate(
                (("train", train_per_class), ("test", test_per_class))
            ):
                folder = tmp / name / split
                folder.mkdir(parents=True)
                for index in range(count):
                    rng = np.random.default_rng([seed, label, split_index, index])
                    vertices, faces = random_solid(name, rng, noise, tilt_degrees)
                    path = folder / f"{name}_{index + 1:04d}.off"
                    write_off(path, vertices, faces, fused_header=index % 5 == 4)
        (tmp / GENERATOR_FILE).write_text(json.dumps(params, indent=2) + "\n")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root


class ShapesSource:
    """The generated solids, written once under ``<data_dir>/shapes/`` and read as ModelNet is."""

    name = "shapes"
    up_axis = 2

    def __init__(
        self,
        data_dir: str | Path,
        train_per_class: int = 64,
        test_per_class: int = 16,
        seed: int = 0,
        noise: float = 0.01,
        tilt_degrees: float = 10.0,
        sample_points: int = 1024,
        normals: bool = False,
        sample_seed: int = 0,
    ):
        for key, value in (("train_per_class", train_per_class), ("test_per_class", test_per_class)):
            if value < 1:
                raise ValueError(f"task.data.source.{key} must be >= 1, got {value}")
        if noise < 0 or tilt_degrees < 0:
            raise ValueError(
                f"task.data.source.noise and tilt_degrees must be >= 0, got {noise}, {tilt_degrees}"
            )
        self.params = dict(
            train_per_class=train_per_class,
            test_per_class=test_per_class,
            seed=seed,
            noise=noise,
            tilt_degrees=tilt_degrees,
        )
        tag = f"train{train_per_class}_test{test_per_class}_seed{seed}_noise{noise:g}_tilt{tilt_degrees:g}"
        self.root = Path(data_dir) / "shapes" / f"v{GENERATOR_VERSION}_{tag}"
        self.meshes = ModelNetSource(
            self.root.parent,
            folder=self.root.name,
            sample_points=sample_points,
            normals=normals,
            seed=sample_seed,
        )

    @property
    def channels(self) -> int:
        return self.meshes.channels

    def prepare(self) -> None:
        if not (self.root / GENERATOR_FILE).is_file():
            log.info("generating the shapes set in %s", self.root)
        generate_shapes(self.root, **self.params)
        self.meshes.prepare()

    def load(self) -> dict[str, PointClouds]:
        self.prepare()
        return self.meshes.load()

    @property
    def description(self) -> str:
        p = self.params
        return (
            f"GENERATED by attnlab (not a benchmark): parametric solids {', '.join(CLASSES)}, "
            f"{p['train_per_class']} train / {p['test_per_class']} test meshes per class, seed {p['seed']}, "
            f"random proportions, size U(0.5, 2), turn about z U(0, 360), tilt U(-{p['tilt_degrees']:g}, "
            f"{p['tilt_degrees']:g}) degrees, vertex noise {p['noise']:g} x size; written as "
            + self.meshes.description
        )
