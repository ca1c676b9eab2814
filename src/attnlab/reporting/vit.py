"""The tiny-ViT protocol of the sliced ReLU paper: per-backend selection on a hold-out, then the median
curve of the chosen configuration over seeds (its Fig. 2 plots a median "validation accuracy" and names
no split; attnlab's presets validate on the test split, so theirs is a test curve).

Two kinds of ViT runs (tasks `VIT_TASKS`) go in, told apart by ``data_source`` in their summary:

- *selection* runs (``experiment=vit/grid``) validate on training images held out. Per task and
  backend, the configuration (`GRID_KEYS`) whose final weights score best on that hold-out is chosen
  (the last ``val/acc`` of the run's ``csv/metrics.csv``; ties: the first run dir). The report gives
  the command that trains it with 4 seeds on the whole training set.
- *test-curve* runs (``experiment=vit/cifar10`` / ``vit/tinyimagenet``) train on every training image
  and validate on the test split, so their ``val/acc`` rows are a test curve. Per task, backend and
  configuration: the median over seeds at each step that every seed logged.

A run's configuration is read from the ``config.yaml`` the pipeline writes beside its summary.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from attnlab.reporting.formats import MISSING, markdown_table, write_csv
from attnlab.reporting.runs import RunSummary, backend_sort_key, load_run_config, task_sort_key

VIT_TASKS = ("cifar10_vit", "tinyimagenet_vit")
#: the paper preset of each task: the one the chosen configuration is trained with
PAPER_PRESETS = {"cifar10_vit": "vit/cifar10", "tinyimagenet_vit": "vit/tinyimagenet"}
#: what experiment=vit/grid sweeps: (column, config key)
GRID_KEYS = (
    ("lr", "task.module.optimizer.lr"),
    ("weight decay", "task.module.optimizer.weight_decay"),
    ("drop-path", "task.model.drop_path"),
)
FINAL_SEEDS = "0,1,2,3"  # the paper's median of 4 runs

Config = tuple  # the values of GRID_KEYS, in order


@dataclass(frozen=True)
class VitRun:
    """A ViT run with what the protocol needs: its grid values and its validation curve."""

    run: RunSummary
    config: Config
    curve: tuple[tuple[int, float], ...]  # (step, val/acc), one point per step
    test_curve: bool  # val is the test split


@dataclass(frozen=True)
class Choice:
    """The selected configuration of one task and backend, with its held-out score."""

    task: str
    attn: str
    config: Config
    score: float
    tried: int


def run_config(run: RunSummary) -> Config | None:
    """The `GRID_KEYS` values of a run (None without the ``config.yaml`` the pipeline writes)."""
    from omegaconf import OmegaConf

    cfg = load_run_config(run)
    return None if cfg is None else tuple(OmegaConf.select(cfg, key) for _, key in GRID_KEYS)


def val_curve(run_dir: Path) -> tuple[tuple[int, float], ...]:
    """``val/acc`` by step from the run's ``csv/metrics.csv`` (the last row of a step wins)."""
    path = run_dir / "csv" / "metrics.csv"
    if not path.is_file():
        return ()
    points: dict[int, float] = {}
    with path.open(newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if row.get("val/acc") and row.get("step"):
                points[int(float(row["step"]))] = float(row["val/acc"])
    return tuple(sorted(points.items()))


def vit_runs(runs: Sequence[RunSummary]) -> list[VitRun]:
    """The ViT runs that have a configuration and a validation curve on disk."""
    vit = [run for run in runs if run.task in VIT_TASKS]
    if not vit:
        return []  # no need for the data module's imports (torchvision) in a report without ViT runs
    from attnlab.data.vision import VAL_IS_TEST  # the marker the sources write into data_source

    found = []
    for run in vit:
        config, curve = run_config(run), val_curve(run.path.parent)
        if config is not None and curve:
            test_curve = VAL_IS_TEST in str(run.get("data_source") or "")
            found.append(VitRun(run, config, curve, test_curve))
    return found


def select(runs: Sequence[VitRun]) -> dict[tuple[str, str], Choice]:
    """Per (task, backend): the held-out run whose final weights score best."""
    groups: dict[tuple[str, str], list[VitRun]] = {}
    for r in runs:
        if not r.test_curve:
            groups.setdefault((r.run.task, r.run.attn), []).append(r)
    choices = {}
    for (task, attn), group in groups.items():
        ordered = sorted(group, key=lambda r: str(r.run.path))
        best = max(ordered, key=lambda r: r.curve[-1][1])
        configs = {r.config for r in group}
        choices[task, attn] = Choice(task, attn, best.config, best.curve[-1][1], len(configs))
    return choices


def median_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The median over runs at each step that every run logged."""
    steps = set.intersection(*(set(dict(c)) for c in curves)) if curves else set()
    return [(step, statistics.median(dict(c)[step] for c in curves)) for step in sorted(steps)]


def final_curves(runs: Sequence[VitRun]) -> dict[tuple[str, str, Config], tuple[int, list]]:
    """Per (task, backend, configuration) of the test-curve runs: (seeds, median test curve)."""
    groups: dict[tuple[str, str, Config], list[VitRun]] = {}
    for r in runs:
        if r.test_curve:
            groups.setdefault((r.run.task, r.run.attn, r.config), []).append(r)
    return {key: (len(group), median_curve([r.curve for r in group])) for key, group in groups.items()}


def _value(value: object) -> str:
    return MISSING if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def final_command(choice: Choice) -> str:
    """The multirun that trains the chosen configuration with 4 seeds on the whole training set."""
    values = " ".join(f"{key}={_value(v)}" for (_, key), v in zip(GRID_KEYS, choice.config, strict=True))
    return (
        f"python train.py -m experiment={PAPER_PRESETS[choice.task]} attn={choice.attn} "
        f"seed={FINAL_SEEDS} {values}"
    )


def _order(keys):
    return sorted(keys, key=lambda k: (task_sort_key(k[0]), backend_sort_key(k[1]), str(k[2:])))


def vit_markdown(runs: Sequence[VitRun]) -> str:
    """The selection and the median test curves, per task (empty without ViT runs)."""
    choices, finals = select(runs), final_curves(runs)
    if not choices and not finals:
        return ""
    names = [name for name, _ in GRID_KEYS]
    parts = ["## Tiny ViT: per-backend selection and median test curves\n"]
    if choices:
        rows = [
            [c.task, c.attn, *map(_value, c.config), f"{100 * c.score:.2f}", str(c.tried)]
            for c in (choices[k] for k in _order(choices))
        ]
        header = ["task", "backend", *names, "held-out acc %", "configurations"]
        commands = "\n".join(final_command(choices[k]) for k in _order(choices))
        parts += [
            "Chosen per task and backend: the configuration whose final weights score best on the "
            "held-out training images.\n",
            markdown_table(header, rows),
            f"Train each with 4 seeds on the whole training set:\n\n```bash\n{commands}\n```\n",
        ]
    if finals:
        rows = []
        for key in _order(finals):
            task, attn, config = key
            seeds, curve = finals[key]
            chosen = choices.get((task, attn))
            mark = MISSING if chosen is None else "yes" if chosen.config == config else "no"
            last = f"{100 * curve[-1][1]:.2f} (step {curve[-1][0]})" if curve else MISSING
            rows.append([task, attn, *map(_value, config), mark, str(seeds), last])
        header = ["task", "backend", *names, "chosen", "seeds", "median test acc % at the end"]
        parts += [
            "Test curves (runs on the whole training set, val = the test split): the median over "
            "seeds at each step, in vit_curves.csv and vit_curves.png.\n",
            markdown_table(header, rows),
        ]
    return "\n".join(parts)


def write_vit_curves(runs: Sequence[VitRun], out: Path) -> dict[str, Path]:
    """vit_curves.csv (every median point) and vit_curves.png (one panel per task); {} without any."""
    finals = final_curves(runs)
    if not finals:
        return {}
    names = [name.replace(" ", "_").replace("-", "_") for name, _ in GRID_KEYS]
    rows = [
        [task, attn, *config, seeds, step, f"{acc:.6f}"]
        for task, attn, config in _order(finals)
        for seeds in [finals[task, attn, config][0]]
        for step, acc in finals[task, attn, config][1]
    ]
    files = {"vit_curves.csv": out / "vit_curves.csv", "vit_curves.png": out / "vit_curves.png"}
    write_csv(files["vit_curves.csv"], ["task", "backend", *names, "seeds", "step", "median_test_acc"], rows)
    _plot(finals, files["vit_curves.png"])
    return files


def _plot(finals, path: Path) -> None:
    from attnlab.reporting.plots import panel_grid, style_by_backend

    tasks = sorted({task for task, _, _ in finals}, key=task_sort_key)
    style = style_by_backend(sorted({attn for _, attn, _ in finals}, key=backend_sort_key))
    fig, axes = panel_grid(len(tasks), "median test accuracy over seeds")
    for ax, task in zip(axes, tasks, strict=False):
        for _, attn, config in _order(k for k in finals if k[0] == task):
            seeds, curve = finals[task, attn, config]
            if curve:
                steps, accs = zip(*curve, strict=True)
                colour, marker = style[attn]
                label = f"{attn} ({seeds} seeds)"
                ax.plot(
                    steps, [100 * a for a in accs], color=colour, marker=marker, markersize=3, label=label
                )
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("test accuracy (%)")
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
