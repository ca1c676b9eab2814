"""Which runs are seeds of one configuration: grouped by their whole resolved config but the seed.

Averaging by (task, backend) alone put a 5-step run beside 1,500-step runs into one "mean ± std",
and eight runs of one seed (a bf16 and a ``ddp_cpu`` one among them) were reported as "8 runs over
seeds". `label_variants` compares the ``config.yaml`` beside each summary: within a task, the keys
whose values differ between runs (apart from the seed and where files go; a backend's options
compared between that backend's runs) name each configuration, and the tables show it as
``<task> [key=value, ...]``. Runs without a readable config.yaml are grouped by task and backend.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from attnlab.reporting.runs import RunSummary, load_run_config

#: keys that do not make another configuration: where files go, logging, how a run is watched
IGNORED_PREFIXES = ("paths.", "logger.", "callbacks.", "hydra.")
IGNORED_KEYS = {
    "seed",
    "ckpt_path",
    "overwrite",
    "test",
    "trainer.default_root_dir",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
    "trainer.profiler",
    "trainer.num_sanity_val_steps",
    "task.data.num_workers",
    "task.data.eval_batch_size",
}


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): node}


def _settings(run: RunSummary) -> dict[str, Any] | None:
    """The run's resolved config as flat keys, less what does not tell configurations apart."""
    from omegaconf import OmegaConf

    cfg = load_run_config(run)
    if cfg is None:
        return None
    try:
        flat = _flatten(OmegaConf.to_container(cfg, resolve=False))
    except Exception:  # a config that is not a mapping: grouped as if it were absent
        return None
    seed = run.get("seed")
    return {
        key: str(value)
        for key, value in flat.items()
        if key not in IGNORED_KEYS
        and not key.startswith(IGNORED_PREFIXES)
        # the run seed copied into a node (task.data.seed: ${seed}) is the seed again
        and not (key.rsplit(".", 1)[-1] == "seed" and value == seed)
    }


def label_variants(runs: Sequence[RunSummary], across_lengths: bool = False) -> list[RunSummary]:
    """``runs`` with each task renamed ``<task> [key=value, ...]`` where the task's runs differ in
    their configs; unchanged where they do not.

    ``across_lengths``: keys whose values go one-to-one with the runs' ``seq_len`` (the length itself,
    a model's ``max_len`` set to it) make no configuration, so a length sweep stays one configuration
    (a plot against length)."""
    settings = {id(r): _settings(r) for r in runs}
    peers: dict[tuple[str, ...], list[tuple[Any, dict[str, Any]]]] = defaultdict(list)
    for run in runs:
        if settings[id(run)] is not None:
            entry = (run.get("seq_len"), settings[id(run)])
            peers[(run.task,)].append(entry)
            peers[(run.task, run.attn)].append(entry)
    labelled = []
    for run in runs:
        mine = settings[id(run)]
        if mine is None:
            labelled.append(run)
            continue
        # the task's runs for the model, data and training keys; the backend's own runs for its options
        task_keys = _differing(peers[(run.task,)], across_lengths)
        attn_keys = _differing(peers[(run.task, run.attn)], across_lengths)
        differing = [k for k in task_keys if not k.startswith("attn.")] + [
            k for k in attn_keys if k.startswith("attn.")
        ]
        if not differing:
            labelled.append(run)
            continue
        label = ", ".join(f"{k}={mine.get(k, '<absent>')}" for k in sorted(differing))
        fields = {**run.fields, "task": f"{run.task} [{label}]"}
        labelled.append(dataclasses.replace(run, fields=fields))
    return labelled


def _differing(entries: list[tuple[Any, dict[str, Any]]], across_lengths: bool = False) -> list[str]:
    if len(entries) < 2:
        return []
    configs = [config for _, config in entries]
    keys = sorted({k for s in configs for k in s})
    differing = [k for k in keys if len({s.get(k) for s in configs}) > 1]
    if across_lengths:
        differing = [k for k in differing if not _follows_length(entries, k)]
    return differing


def _follows_length(entries: list[tuple[Any, dict[str, Any]]], key: str) -> bool:
    """Whether ``key``'s values and the runs' lengths determine each other."""
    pairs = {(length, config.get(key)) for length, config in entries}
    return len(pairs) == len({length for length, _ in pairs}) == len({value for _, value in pairs})


def per_seed(runs: Sequence[RunSummary], metric: str) -> tuple[list[float], dict[Any, int]]:
    """One value per distinct seed (the mean of a seed's repeats) and the seeds run more than once."""
    values: dict[Any, list[float]] = defaultdict(list)
    for run in runs:
        value = run.get(metric)
        if value is not None:
            values[run.get("seed")].append(float(value))
    repeats = {seed: len(v) for seed, v in values.items() if len(v) > 1}
    return [sum(v) / len(v) for v in values.values()], repeats
