"""A figure of generated examples of both labels (``docs/pathfinder_examples.png``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attnlab.data.lra.pathfinder_generator.params import difficulty_folder, lra_params
from attnlab.data.lra.pathfinder_generator.sample import sample_at


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
