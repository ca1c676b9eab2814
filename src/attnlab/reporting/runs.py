"""Find, read and check the `summary.json` files a report is built from, and order their names.

The only input of a report is the summary each run writes (fields: `attnlab.run.summary.SUMMARY_FIELDS`),
so a report can be rebuilt at any time from copied run directories, without checkpoints or loggers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.run.summary import SUMMARY_FIELDS

SUMMARY_NAME = "summary.json"

#: Known backends first, in the paper's order; anything else follows alphabetically.
BACKEND_ORDER = ("softmax", "sliced_relu", "sliced_relu_bump", "linear", "performer")
#: LRA tasks in the benchmark's usual order, then the paper's other benchmarks; anything else follows
#: alphabetically.
TASK_ORDER = (
    *("listops", "text", "retrieval", "image", "pathfinder", "pathx"),
    *("cifar10_vit", "tinyimagenet_vit", "digits_vit", "modelnet40", "shapes", "mlm", "mqar"),
)

METRICS = ("test_acc", "val_acc")

_FRACTION_FIELDS = ("val_acc", "test_acc", "baseline_acc")
#: the numbers among the fields every summary has (attnlab.run.summary): checked when a summary is read
_NUMBER_FIELDS = tuple(
    f for f in SUMMARY_FIELDS if f not in ("task", "attn", "seed", "git_commit", "data_source")
)
_INTEGER_FIELDS = ("seed", "params", "attempts", "steps", "seq_len", "world_size")
# measured quantities: a negative value is a broken measurement, not a slow run
_NON_NEGATIVE_FIELDS = tuple(f for f in _NUMBER_FIELDS if f not in _FRACTION_FIELDS)

GLUE_PREFIX = "glue_"  # task=glue runs are named glue_<task>


class ReportError(ValueError):
    """Bad input for a report: the message names the path or value at fault."""


def backend_sort_key(name: str) -> tuple[int, int, str]:
    """Known backends in `BACKEND_ORDER`, then the others alphabetically."""
    return _ordered_key(name, BACKEND_ORDER)


def task_sort_key(name: str) -> tuple[int, int, str]:
    """LRA tasks in `TASK_ORDER`, then the others alphabetically."""
    return _ordered_key(name, TASK_ORDER)


def _ordered_key(name: str, known: Sequence[str]) -> tuple[int, int, str]:
    if name in known:
        return (0, known.index(name), "")
    return (1, 0, name)


@dataclass(frozen=True)
class RunSummary:
    """One run's `summary.json`, validated; `fields` keeps every key the file had."""

    path: Path
    fields: dict[str, Any]

    @property
    def task(self) -> str:
        return self.fields["task"]

    @property
    def attn(self) -> str:
        return self.fields["attn"]

    def get(self, key: str) -> Any:
        return self.fields.get(key)


@dataclass
class LoadResult:
    """The valid runs found, and the files skipped with the reason (for warnings)."""

    runs: list[RunSummary] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def find_summaries(dirs: Iterable[str | Path]) -> list[Path]:
    """All `summary.json` files under the given run or sweep dirs (a summary file itself is accepted).

    Sorted and de-duplicated, so overlapping arguments (a sweep and one of its runs) count each run once.
    """
    found: dict[Path, Path] = {}
    for entry in dirs:
        path = Path(entry)
        if not path.exists():
            raise ReportError(f"run or sweep directory {str(path)!r} does not exist")
        if path.is_file():
            if path.name != SUMMARY_NAME:
                raise ReportError(
                    f"{str(path)!r} is a file but not a {SUMMARY_NAME}; pass a run or sweep dir"
                )
            candidates = [path]
        else:
            candidates = sorted(p for p in path.rglob(SUMMARY_NAME) if p.is_file())
        for candidate in candidates:
            found.setdefault(candidate.resolve(), candidate)
    return [found[key] for key in sorted(found)]


def parse_summary(path: Path) -> RunSummary:
    """Read and check one summary; raise `ReportError` naming the file and the problem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"{path}: cannot read: {err}") from err
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get("interrupted"):
        raise ReportError(
            f"{path}: the run was interrupted ({data.get('signal', 'a signal')} at step "
            f"{data.get('steps')}); resume it with ckpt_path=auto in its run dir to report it"
        )
    if data.get("diverged"):
        raise ReportError(
            f"{path}: the run diverged (a non-finite training loss at step {data.get('diverged_at_step')}); "
            f"not a result"
        )
    if data.get("smoke_test"):
        raise ReportError(f"{path}: a smoke test (trainer.fast_dev_run), not a result")
    for key in ("task", "attn"):
        value = data.get(key)
        if not isinstance(value, str) or not value:
            found = "missing" if key not in data else f"{value!r}"
            raise ReportError(f"{path}: required key {key!r} must be a non-empty string ({found})")
    for key in _NUMBER_FIELDS + ("seed",):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ReportError(f"{path}: {key!r} must be a finite number or null, got {value!r}")
        if key in _INTEGER_FIELDS and value != int(value):
            raise ReportError(f"{path}: {key!r} must be an integer, got {value!r}")
        # GLUE's main metric is a correlation for CoLA (MCC) and STS-B (Spearman): it may be negative
        low = -1.0 if key in ("val_acc", "test_acc") and str(data["task"]).startswith(GLUE_PREFIX) else 0.0
        if key in _FRACTION_FIELDS and not low <= value <= 1.0:
            raise ReportError(f"{path}: {key!r} must be a fraction in [{low:g}, 1], got {value!r}")
        if key in _NON_NEGATIVE_FIELDS and value < 0:
            raise ReportError(f"{path}: {key!r} must be >= 0 (a measured quantity), got {value!r}")
    return RunSummary(path=Path(path), fields=data)


def load_runs(dirs: Iterable[str | Path], on_skip: Callable[[Path, str], None] | None = None) -> LoadResult:
    """Parse every summary under `dirs`; invalid files are listed in `skipped` (and passed to `on_skip`).

    One broken run must not hide a whole sweep, so invalid files are skipped rather than raised.
    Raises `ReportError` when a dir does not exist or when no valid summary remains, naming the dirs.
    """
    dirs = [Path(d) for d in dirs]
    if not dirs:
        raise ReportError("no run or sweep directory given")
    paths = find_summaries(dirs)
    searched = ", ".join(repr(str(d)) for d in dirs)
    if not paths:
        raise ReportError(f"no {SUMMARY_NAME} found under {searched}")
    result = LoadResult()
    for path in paths:
        try:
            result.runs.append(parse_summary(path))
        except ReportError as err:
            result.skipped.append((path, str(err)))
            if on_skip is not None:
                on_skip(path, str(err))
    if not result.runs:
        raise ReportError(f"none of the {len(paths)} {SUMMARY_NAME} file(s) found under {searched} is valid")
    return result


def load_run_config(run: RunSummary) -> Any:
    """The resolved `config.yaml` the pipeline writes beside `summary.json` (None: absent, unreadable)."""
    path = run.path.parent / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(path)
    except Exception:  # a damaged config must not stop the report; the run then lacks what it would give
        return None


def split_by_length(task_runs: Sequence[RunSummary]) -> list[tuple[int | None, list[RunSummary]]]:
    """One task's runs as [(None, all)] when they share one seq_len, else one chunk per seq_len.

    Throughput is only comparable at equal lengths, so a task run at several lengths is split.
    """
    lengths = {r.get("seq_len") for r in task_runs}
    if len(lengths) <= 1:
        return [(None, list(task_runs))]
    ordered = sorted(lengths, key=lambda v: (v is None, v or 0))
    return [(length, [r for r in task_runs if r.get("seq_len") == length]) for length in ordered]
