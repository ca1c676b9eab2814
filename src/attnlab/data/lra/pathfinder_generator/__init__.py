"""Pathfinder generator: a reimplementation of Linsley et al.'s ``snakes2.py`` with LRA's parameters.

Pathfinder (Linsley et al. 2018; Kim et al. 2020) asks whether two marker disks are joined by one
dashed curve ("snake") among distractor curves. LRA used the public generator
(github.com/drewlinsley/pathfinder) at 32, 64, 128 and 256 px; this package follows its algorithm
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

One module per idea: `params` (LRA's parameters, difficulties, folder names), `geometry` (pixel
moves, disks, dilation, stamping), `rendering` (anti-aliased paddle and marker patches), `snakes`
(seeding and growing snakes on a canvas), `sample` (one image, steps 1-6), `writer` (the official
layout on disk, parallel and resumable) and `figure` (a grid of examples).
"""

from attnlab.data.lra.pathfinder_generator.figure import save_example_grid
from attnlab.data.lra.pathfinder_generator.params import (
    DIFFICULTIES,
    RESOLUTIONS,
    PathfinderParams,
    canonical_difficulty,
    dataset_dir,
    difficulty_folder,
    lra_params,
)
from attnlab.data.lra.pathfinder_generator.sample import (
    PathfinderSample,
    generate_sample,
    image_rng,
    sample_at,
)
from attnlab.data.lra.pathfinder_generator.snakes import Snake
from attnlab.data.lra.pathfinder_generator.writer import (
    GENERATOR_FILE,
    batch_is_complete,
    generate_pathfinder,
)

__all__ = [
    "DIFFICULTIES",
    "GENERATOR_FILE",
    "RESOLUTIONS",
    "PathfinderParams",
    "PathfinderSample",
    "Snake",
    "batch_is_complete",
    "canonical_difficulty",
    "dataset_dir",
    "difficulty_folder",
    "generate_pathfinder",
    "generate_sample",
    "image_rng",
    "lra_params",
    "sample_at",
    "save_example_grid",
]
