"""`logger=mlflow` when several jobs start at once on a fresh project store.

Each worker is a separate Python process, like the jobs of a SLURM array. All import what they need,
wait until every one is ready, then open the store at the same moment and log. The fast test's workers
go through `prepare_mlflow_store` and MLflow's client; the slow one's build the logger from the composed
`conf/logger/mlflow.yaml` as training does (importing Lightning in 4 processes takes a while).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from attnlab.run.mlflow_logger import MlflowStoreError, mlflow_logger, sqlite_store_path

WORKERS = 4
STEPS = 5
START = """
import json, os, sys, time
node, go, index, steps = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
"""
# what MLFlowLogger does (get or create the experiment, create a run, log), after attnlab's preparation
CLIENT_WORKER = (
    """
from attnlab.run.mlflow_logger import prepare_mlflow_store
from mlflow.tracking import MlflowClient
from mlflow.entities import Metric, Param
"""
    + START
    + """
prepare_mlflow_store(node["tracking_uri"], node["experiment_name"], node["artifact_location"])
client = MlflowClient(node["tracking_uri"])
experiment = client.get_experiment_by_name(node["experiment_name"])
run = client.create_run(experiment.experiment_id, run_name=f"worker{index}")
client.log_batch(run.info.run_id, params=[Param("worker", str(index))])
for step in range(steps):
    client.log_batch(run.info.run_id, metrics=[Metric("val/acc", index + step / 10, 0, step)])
client.set_terminated(run.info.run_id)
"""
)
LOGGER_WORKER = (
    """
from hydra.utils import instantiate
import lightning.pytorch.loggers, mlflow.tracking
"""
    + START
    + """
logger = instantiate({**node, "run_name": f"worker{index}"})
logger.log_hyperparams({"worker": index})
for step in range(steps):
    logger.log_metrics({"val/acc": index + step / 10}, step=step)
logger.finalize("success")
"""
)


def _mlflow_node(train_config) -> dict:
    cfg = train_config("logger=mlflow", "attn=linear", "seed=1")
    return OmegaConf.to_container(cfg.logger.mlflow, resolve=True)


def _start_together(script: str, node: dict, tmp_path: Path) -> None:
    """Run ``script`` in WORKERS processes that open the store at the same moment; all must succeed."""
    assert not sqlite_store_path(node["tracking_uri"]).exists(), "the store must be fresh"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(node), str(go), str(i), str(STEPS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(WORKERS)
    ]
    try:
        for worker in workers:  # every worker has its imports done: the race is on opening the store
            line = _readline(worker, timeout_s=300)  # a hung worker fails the test, not the suite
            assert line.strip() == "ready", (
                f"worker said {line!r}: " + worker.communicate(timeout=60)[1][-3000:]
            )
        go.touch()
        errors = [w.communicate(timeout=300)[1] for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    failed = {i: err[-2000:] for i, (w, err) in enumerate(zip(workers, errors, strict=True)) if w.returncode}
    assert not failed, f"{len(failed)} of {WORKERS} workers failed: {failed}"


def _assert_store_healthy(node: dict) -> None:
    """Every worker's run and metrics are in the store, and it still serves a later run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(node["tracking_uri"])  # raises if the schema is not at MLflow's head revision
    experiment = client.get_experiment_by_name(node["experiment_name"])
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"worker{i}" for i in range(WORKERS)]
    for run in runs:
        assert run.info.status == "FINISHED"
        index = int(run.data.params["worker"])
        history = [m.value for m in client.get_metric_history(run.info.run_id, "val/acc")]
        assert history == pytest.approx([index + step / 10 for step in range(STEPS)])

    later_args = {k: v for k, v in node.items() if not k.startswith("_")} | {"run_name": "later"}
    later = mlflow_logger(**later_args)
    later.log_metrics({"val/acc": 0.5}, step=0)
    later.finalize("success")
    assert client.get_run(later.run_id).data.metrics["val/acc"] == 0.5


@pytest.mark.slow
@pytest.mark.xdist_group("processes")  # several processes at once: never two such tests together
def test_processes_starting_together_on_a_fresh_store_all_log(train_config, tmp_path):
    node = _mlflow_node(train_config)
    _start_together(CLIENT_WORKER, node, tmp_path)
    _assert_store_healthy(node)


@pytest.mark.slow
def test_training_loggers_starting_together_on_a_fresh_store_all_log(train_config, tmp_path):
    node = _mlflow_node(train_config)
    _start_together(LOGGER_WORKER, node, tmp_path)
    _assert_store_healthy(node)


def test_logger_config_builds_the_store_and_experiment_before_logging(train_config):
    node = _mlflow_node(train_config)
    assert node["_target_"] == "attnlab.run.mlflow_logger.mlflow_logger"
    from hydra.utils import instantiate
    from mlflow.tracking import MlflowClient

    logger = instantiate(node)
    db = sqlite_store_path(node["tracking_uri"])
    assert db.is_file() and db.with_name("mlflow.db.lock").is_file()
    experiment = MlflowClient(node["tracking_uri"]).get_experiment_by_name("listops")
    assert experiment is not None and experiment.artifact_location.endswith("mlruns/artifacts/listops")
    assert logger.experiment_id == experiment.experiment_id


def test_a_damaged_store_is_named_in_the_error(tmp_path):
    db = tmp_path / "mlruns" / "mlflow.db"
    db.parent.mkdir()
    db.write_bytes(b"not a database " * 100)
    with pytest.raises(MlflowStoreError, match=rf"MLflow store {db}.*mlflow db upgrade sqlite:///{db}"):
        mlflow_logger(tracking_uri=f"sqlite:///{db}", experiment_name="listops")


@pytest.mark.parametrize(
    ("uri", "path"),
    [
        ("sqlite:////abs/mlruns/mlflow.db", "/abs/mlruns/mlflow.db"),
        ("sqlite:///rel/mlflow.db?timeout=30", "rel/mlflow.db"),
        ("sqlite:///:memory:", None),
        ("http://host:5000", None),
        ("file:./mlruns", None),
        (None, None),
    ],
)
def test_sqlite_store_path(uri, path):
    assert sqlite_store_path(uri) == (Path(path) if path else None)


def _readline(process: subprocess.Popen, timeout_s: float) -> str:
    """The process's next stdout line, or "" once ``timeout_s`` has passed without one."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=timeout_s):
            process.kill()
            return ""
    return process.stdout.readline()


def test_creating_the_store_says_nothing_at_info_level(tmp_path):
    """alembic logs a line per migration plugin and MLflow one per table step: not for the user's log."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
        "from attnlab.run.mlflow_logger import prepare_mlflow_store; "
        f"prepare_mlflow_store('sqlite:///{tmp_path}/mlruns/mlflow.db', 'listops')"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "alembic" not in said and "Creating initial MLflow database tables" not in said, said
