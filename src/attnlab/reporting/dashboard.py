"""What `attnlab dashboard` serves: a TensorBoard over finished runs, with one HParams table row per run.

The runs' own TensorBoard logs are not enough for a side-by-side table: the final test accuracy,
throughput and peak memory are only in each run's `summary.json`, and every run's event file carries
its own HParams experiment (the whole flattened config), so TensorBoard would pick one run's columns
at random. So the dashboard reads the summaries (found as `attnlab report` finds them), writes a fresh
log dir holding one HParams experiment (fixed columns) and, per run, a session with its summary
values and a copy of the scalar curves of ``<run_dir>/tensorboard``, and serves that dir. It is a
snapshot: start the command again to see newer runs.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnlab.reporting.runs import (
    ReportError,
    RunSummary,
    backend_sort_key,
    find_summaries,
    parse_summary,
    task_sort_key,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 6006

#: HParams table columns taken from summary.json (name, display name); `task` and `attn` also filter.
HPARAMS = (
    ("task", "task"),
    ("attn", "backend"),
    ("seed", "seed"),
    ("seq_len", "seq len"),
    ("params", "params"),
    ("steps", "steps"),
    ("world_size", "devices"),
    ("data_source", "data"),
)
#: The columns shown first (by name: backend, seed, seq len, task); the others can be ticked on.
FIRST_COLUMNS = ("task", "attn", "seed", "seq_len")
#: Columns whose values get one checkbox each in the HPARAMS sidebar (to filter rows).
DISCRETE = ("task", "attn", "seed", "seq_len", "world_size", "data_source")
#: Identifiers rather than quantities: shown as text.
LABELS = ("seed", "world_size")
#: Metric columns, logged as the scalar `summary/<field>` of each run (name, display name).
METRICS = (
    ("test_acc", "test acc"),
    ("val_acc", "val acc"),
    ("train_samples_per_sec", "train samples/s"),
    ("eval_samples_per_sec", "eval samples/s"),
    ("peak_mem_mb", "peak mem MB"),
    ("wall_time_s", "wall time s"),
    ("baseline_acc", "majority acc"),
)
METRIC_PREFIX = "summary/"
SKIPPED_CURVES = ("hp_metric",)  # Lightning's placeholder for the HParams tab, always -1


class DashboardError(ValueError):
    """Bad input for the dashboard; the message names the path, value or port at fault."""


# --------------------------------------------------------------------------------------------------
# Runs


def _warn(message: str) -> None:
    print(f"attnlab dashboard: warning: {message}", file=sys.stderr)


def load_runs(dirs: Sequence[str | Path], warn=_warn) -> list[RunSummary]:
    """Every valid summary under ``dirs``, sorted by task, backend, seed; invalid ones are warned about."""
    try:
        paths = find_summaries(dirs)
    except ReportError as err:
        raise DashboardError(str(err)) from err
    if not paths:
        searched = ", ".join(str(d) for d in dirs)
        raise DashboardError(f"no summary.json under {searched} (runs write one when they finish)")
    runs = []
    for path in paths:
        try:
            runs.append(parse_summary(path))
        except ReportError as err:
            warn(f"skipped {err}")
    if not runs:
        raise DashboardError(f"none of the {len(paths)} summary.json files found is valid (see warnings)")
    return sorted(
        runs,
        key=lambda r: (task_sort_key(r.task), backend_sort_key(r.attn), r.get("seed") or 0, str(r.path)),
    )


def session_names(runs: Sequence[RunSummary]) -> list[str]:
    """One TensorBoard run name per run: its dir relative to the dirs' common parent (unique, readable)."""
    dirs = [r.path.parent.resolve() for r in runs]
    common = Path(os.path.commonpath(dirs)) if dirs else Path()
    if len(set(dirs)) == 1:
        common = common.parent
    return [d.relative_to(common).as_posix() for d in dirs]


# --------------------------------------------------------------------------------------------------
# Log dir


def write_logdir(runs: Sequence[RunSummary], logdir: Path) -> None:
    """The HParams experiment at the root of ``logdir``; one session dir per run (see module doc)."""
    from tensorboard.plugins.hparams import summary_v2 as hp

    experiment = hp.hparams_config_pb(
        hparams=[hp.HParam(name, _domain(name, runs), display_name=shown) for name, shown in HPARAMS],
        metrics=[hp.Metric(METRIC_PREFIX + name, display_name=shown) for name, shown in METRICS],
        time_created_secs=time.time(),
    )
    _put_first(experiment, FIRST_COLUMNS)
    with _EventWriter(logdir) as root:
        root.write(experiment)

    for summary, name in zip(runs, session_names(runs), strict=True):
        wall_time = summary.path.stat().st_mtime
        hparams = {key: _hparam_value(key, summary.get(key)) for key, _ in HPARAMS}
        hparams = {key: value for key, value in hparams.items() if value is not None}
        start = wall_time - float(summary.get("wall_time_s") or 0)
        with _EventWriter(logdir / name) as session:
            session.write(hp.hparams_pb(hparams, trial_id=name, start_time_secs=start), wall_time=start)
            _copy_curves(summary.path.parent / "tensorboard", session)
            step = int(summary.get("steps") or 0)
            values = {METRIC_PREFIX + key: summary.get(key) for key, _ in METRICS}
            for tag, value in values.items():
                if value is not None:
                    session.scalar(tag, float(value), step=step, wall_time=wall_time)


def _domain(name: str, runs: Sequence[RunSummary]):
    """The values the runs have, so the HPARAMS sidebar offers one checkbox per task, backend, seed..."""
    from tensorboard.plugins.hparams import summary_v2 as hp

    if name not in DISCRETE:
        return None
    values = {_hparam_value(name, r.get(name)) for r in runs} - {None}
    key = {"task": task_sort_key, "attn": backend_sort_key, **dict.fromkeys(LABELS, _number_first)}.get(name)
    if not values or len({type(v) for v in values}) > 1:
        return None  # missing everywhere, or of mixed types: no domain to declare
    return hp.Discrete(sorted(values, key=key))


def _number_first(label: str) -> tuple[int, float | str]:
    try:
        return (0, float(label))
    except ValueError:
        return (1, label)


def _put_first(config_summary, names: Sequence[str]) -> None:
    """Flag ``names`` as "differing" in an HParams config summary (edited in place).

    TensorBoard lists differing hparams first, by name, and shows the first five columns: the flag puts
    the columns a comparison needs on screen.
    """
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    (value,) = config_summary.value
    experiment = metadata.parse_experiment_plugin_data(value.metadata.plugin_data.content)
    for info in experiment.hparam_infos:
        info.differs = info.name in names
    data = plugin_data_pb2.HParamsPluginData(experiment=experiment)
    value.metadata.CopyFrom(metadata.create_summary_metadata(data))


def _hparam_value(name: str, value: Any) -> str | float | bool | None:
    """Labels (seed, device count) as text, so the table shows ``3``, not ``3.0000``; sizes as numbers."""
    if value is None or isinstance(value, str | bool):
        return value
    if name in LABELS:
        return str(value)
    if isinstance(value, int | float):
        return float(value)
    return str(value)


def _copy_curves(tb_dir: Path, session: _EventWriter) -> None:
    """Every scalar series of the run's own event files, so a run's row and its curves live together."""
    if not any(tb_dir.glob("events.out.tfevents.*")):  # no TensorBoard log (e.g. `logger=csv`)
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    for tag in events.Tags()["scalars"]:
        if tag in SKIPPED_CURVES:
            continue
        for point in events.Scalars(tag):
            session.scalar(tag, point.value, step=point.step, wall_time=point.wall_time)


class _EventWriter:
    """A TensorBoard event file writer that needs neither TensorFlow nor torch."""

    def __init__(self, directory: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(directory))

    def write(self, summary, step: int = 0, wall_time: float | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        wall_time = time.time() if wall_time is None else wall_time
        self._writer.add_event(Event(wall_time=wall_time, step=step, summary=summary))

    def scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.write(Summary(value=[Summary.Value(tag=tag, simple_value=value)]), step, wall_time)

    def __enter__(self) -> _EventWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._writer.close()


# --------------------------------------------------------------------------------------------------
# Server


def start_tensorboard(logdir: str | Path, host: str = DEFAULT_HOST, port: int | None = None) -> str:
    """Serve ``logdir`` from a background thread, its data loaded before this returns; the URL."""
    from tensorboard import program

    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        raise DashboardError(f"cannot serve on --host {host!r}: {err.strerror or err}") from err
    tensorboard = program.TensorBoard()
    tensorboard.configure(
        argv=[
            "tensorboard",
            f"--logdir={logdir}",
            f"--host={host}",
            f"--port={'default' if port is None else port}",
            "--load_fast=false",  # in-process loading: no data-server child process to clean up
            "--reload_interval=0",  # the log dir is a snapshot: load it once...
            "--reload_task=blocking",  # ...before the server answers
            "--window_title=attnlab dashboard",
        ]
    )
    try:
        return tensorboard.launch()
    except program.TensorBoardPortInUseError as err:
        raise DashboardError(
            f"port {port} is in use on {host}: pick another (--port N) or any free one (--port 0)"
        ) from err
    except program.TensorBoardServerException as err:
        where = f"{host}:{port}" if port is not None else f"{host}, ports {DEFAULT_PORT} and up"
        raise DashboardError(f"cannot serve on {where}: {err.msg}") from err
    except SystemExit as err:  # Werkzeug exits on bind errors, after printing the reason
        raise DashboardError(f"cannot listen on {host}:{port} (reason above)") from err
