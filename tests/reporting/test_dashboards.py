"""Dashboards: a tiny real run per logger, then the run is read back the way each dashboard reads it.

TensorBoard event files, the MLflow store and the W&B offline run file must each hold the accuracy and
throughput series, and the hyperparameters that set runs side by side (task, attention, seed).
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import pytest
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

from attnlab.pipeline import hyperparameters, train
from tiny_runs import TINY_LISTOPS as TINY

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_LISTOPS = [
    *TINY,
    "trainer.log_every_n_steps=2",
    "callbacks.throughput.warmup_steps=1",
    "trainer.max_steps=6",
    "task.val_check_interval=3",
]
CONFIGS = [[f"task={p.stem}"] for p in sorted((REPO_ROOT / "conf" / "task").glob("*.yaml"))] + [
    [f"experiment={p.parent.name}/{p.stem}"]
    for p in sorted((REPO_ROOT / "conf" / "experiment").glob("*/*.yaml"))
]
SERIES = ("val/acc", "perf/train_samples_per_sec")
MLFLOW_MAX_PARAM_VALUE = 250  # Lightning's MLFlowLogger cuts longer values to this many characters
MLFLOW_PARAM_KEY = re.compile(r"^[\w\-. :/]{1,250}$")  # MLflow's allowed key characters and length


def _mlflow_run(cfg, run_name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.logger.mlflow.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.task.name)
    assert experiment is not None, f"no MLflow experiment named {cfg.task.name!r}"
    by_name = f"tags.`mlflow.runName` = '{run_name}'"
    runs = client.search_runs([experiment.experiment_id], filter_string=by_name)
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def test_many_writes_series_and_hyperparameters_to_tensorboard_and_mlflow(train_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = train_config(*TINY_LISTOPS, "logger=many", "attn=softmax", "seed=3")
    assert set(cfg.logger) == {"csv", "tensorboard", "mlflow"}
    train(cfg)

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in SERIES:
        assert tag in events.Tags()["scalars"], (tag, events.Tags()["scalars"])
        values = [e.value for e in events.Scalars(tag)]
        assert values and all(v >= 0 for v in values), (tag, values)

    store = tmp_path / "outputs" / "mlruns"
    assert cfg.logger.mlflow.tracking_uri == f"sqlite:///{store}/mlflow.db"
    assert (store / "mlflow.db").is_file()
    client, run = _mlflow_run(cfg, "softmax-seed3")
    for key in SERIES:
        history = client.get_metric_history(run.info.run_id, key)
        assert history and all(m.value >= 0 for m in history), key
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/acc")]
    assert steps == sorted(steps) and len(steps) == 2  # validation at steps 3 and 6
    assert client.get_metric_history(run.info.run_id, "test/acc"), "test accuracy missing from MLflow"
    params = run.data.params
    assert (params["task"], params["attn"], params["seed"]) == ("listops", "softmax", "3")
    assert 0 < int(params["seq_len"]) <= 60 and int(params["params"]) > 0  # max_length=60 in tiny_runs
    assert params["config/task/model/dim"] == "16"  # the nested config arrives flattened, not as one string
    tags = run.data.tags
    assert (tags["task"], tags["attn"], tags["seed"]) == ("listops", "softmax", "3")
    assert tags["run_dir"] == str(tmp_path / "run")


def test_tensorboard_event_files_carry_the_hyperparameters(train_config, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    quick = [*TINY_LISTOPS, "trainer.max_steps=2", "task.val_check_interval=2", "test=false"]
    train(train_config(*quick, "logger=tensorboard", "attn=linear", "seed=6"))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    start = HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert (hparams["task"].string_value, hparams["attn"].string_value) == ("listops", "linear")
    assert hparams["seed"].number_value == 6


@pytest.mark.slow
def test_runs_of_a_project_share_one_mlflow_store(train_config, tmp_path):
    quick = [*TINY_LISTOPS, "trainer.max_steps=2", "task.val_check_interval=2", "test=false", "logger=mlflow"]
    first = train_config(*quick, "attn=linear", "seed=1")
    train(first)
    second = train_config(*quick, "attn=softmax", "seed=2", f"paths.run_dir={tmp_path / 'second'}")
    train(second)  # a run dir of its own: the first run's holds a finished run

    assert first.logger.mlflow.tracking_uri == second.logger.mlflow.tracking_uri
    for cfg, name in ((first, "linear-seed1"), (second, "softmax-seed2")):
        _, run = _mlflow_run(cfg, name)
        assert run.data.params["attn"] == cfg.attn.name and run.data.params["seed"] == str(cfg.seed)
        assert run.info.status == "FINISHED"


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: o[0])
def test_full_config_fits_mlflow_param_limits(train_config, overrides):
    """Lightning flattens the config MLflow gets and silently cuts values; nothing may be cut or rejected."""
    cfg = train_config(*overrides, "attn=performer")  # the attention with the most settings
    flat = _flatten_dict(_convert_params(hyperparameters(cfg, params=10**6, seq_len=4096)))
    too_long = {k: len(str(v)) for k, v in flat.items() if len(str(v)) > MLFLOW_MAX_PARAM_VALUE}
    assert not too_long, f"MLflow param values over {MLFLOW_MAX_PARAM_VALUE} characters: {too_long}"
    bad_keys = [k for k in flat if not MLFLOW_PARAM_KEY.match(k)]
    assert not bad_keys, f"keys MLflow rejects: {bad_keys}"
    assert {"task", "attn", "seed", "params", "seq_len", "config/seed"} <= set(flat)


def test_wandb_mode_is_offline_unless_asked(train_config, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = train_config("logger=wandb", "attn=linear", "seed=4")
    wandb_cfg = cfg.logger.wandb
    assert wandb_cfg.mode == "offline"
    assert (wandb_cfg.project, wandb_cfg.group, wandb_cfg.name) == ("attnlab", "listops", "linear-seed4")
    assert wandb_cfg.save_dir == cfg.paths.run_dir
    monkeypatch.setenv("WANDB_MODE", "online")
    assert train_config("logger=wandb").logger.wandb.mode == "online"


def _wandb_records(path: Path):
    """The records of a ``.wandb`` file (a LevelDB-style log of protobuf ``Record`` messages)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, header, pos, parts = 32768, 7, 7, []
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        payload = data[pos + header : pos + header + length]
        assert zlib.crc32(bytes([kind]) + payload) == checksum, f"corrupt record at byte {pos} of {path}"
        pos += header + length
        parts.append(payload)
        if kind in (1, 4):  # a full record, or the last part of a split one
            yield Record.FromString(b"".join(parts))
            parts = []


def test_wandb_offline_run_gets_history_and_config(train_config, tmp_path, monkeypatch, capfd):
    import wandb  # in the dev extras: logger=wandb is offered by the README, so CI runs it

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)  # the logger's config must silence wandb itself
    for name, value in {"WANDB_MODE": "offline", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # keep wandb out of ~/
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    cfg = train_config(*TINY_LISTOPS, "logger=wandb", "attn=sliced_relu", "seed=5", "test=false")
    try:
        train(cfg)
    finally:
        wandb.finish()  # Lightning leaves the run open; finishing flushes it to disk
        wandb.teardown()  # and stops wandb's background service
    said = capfd.readouterr()
    for line in ("Run summary", "Tracking run with wandb", "You can sync this run", "anonymous setting"):
        assert line not in said.out + said.err  # wandb's own banner and summary: silent

    run_files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, run_files
    records = list(_wandb_records(run_files[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.run_group, run.display_name) == ("attnlab", "listops", "sliced_relu-seed5")
    config = {
        u.key: json.loads(u.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for u in r.config.update
    }
    assert (config["task"], config["attn"], config["seed"]) == ("listops", "sliced_relu", 5)
    assert config["config"]["task"]["model"]["dim"] == 16  # the nested config, kept nested
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    for key in SERIES:
        values = [row[key] for row in history if key in row]
        assert values and all(v >= 0 for v in values), (key, history)


def test_attnlab_dashboard_reads_what_a_real_run_writes(train_config, tmp_path):
    """`attnlab dashboard`'s log dir from a trained run: the summary's values in the HParams session and the
    run's own curves beside them (tests/cli/test_dashboard.py serves and renders it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    from attnlab.reporting.dashboard import METRIC_PREFIX, load_runs, write_logdir

    quick = [*TINY_LISTOPS, "trainer.max_steps=4", "task.val_check_interval=2", "logger=tensorboard"]
    train(train_config(*quick, "attn=linear", "seed=7"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    write_logdir(load_runs([tmp_path]), tmp_path / "dashboard")

    events = EventAccumulator(str(tmp_path / "dashboard" / "run"), size_guidance={"scalars": 0})
    events.Reload()
    start_info = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(start_info).session_start_info.hparams
    assert (hparams["task"].string_value, hparams["attn"].string_value) == ("listops", "linear")
    assert hparams["seed"].string_value == "7" and hparams["seq_len"].number_value == summary["seq_len"]
    for key in ("test_acc", "val_acc", "train_samples_per_sec", "peak_mem_mb"):
        (point,) = events.Scalars(METRIC_PREFIX + key)
        assert point.value == pytest.approx(summary[key], rel=1e-6), key  # stored as float32
    own = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    own.Reload()
    for tag in ("val/acc", "train/loss"):  # the run's own curves came along, point for point
        copied = [(e.step, e.value) for e in events.Scalars(tag)]
        assert copied == [(e.step, e.value) for e in own.Scalars(tag)] and len(copied) >= 2, tag
    assert "hp_metric" not in events.Tags()["scalars"]
