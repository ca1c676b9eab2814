"""What shapes a Pathfinder set: the parameters LRA used per resolution, the difficulties and the
official folder names (``<root>/pathfinder<res>/<curv_...>``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    check_resolution(resolution)
    return Path(root) / f"pathfinder{resolution}" / difficulty_folder(difficulty)


def check_resolution(resolution: int) -> None:
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
    check_resolution(resolution)
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
