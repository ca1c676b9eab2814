"""The training pipeline end to end on CPU: composition, a short run, summary, resume, bad config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from attnlab.errors import CheckpointError
from attnlab.pipeline import train
from attnlab.run.resume import read_checkpoint
from attnlab.run.summary import SUMMARY_FIELDS
from cross_product import each_value_once
from tiny_runs import REPO_ROOT, run_train_py
from tiny_runs import TINY_LISTOPS as TINY


def _model_target(task: str) -> str:
    """A task file's model ``_target_``, following ``defaults`` to the task it extends (pathx)."""
    conf = OmegaConf.load(REPO_ROOT / "conf" / "task" / f"{task}.yaml")
    target = OmegaConf.select(conf, "model._target_")
    if target is None:
        for parent in conf.get("defaults", []):
            if isinstance(parent, str) and parent != "_self_":
                return _model_target(parent)
    return target or ""


# the token-sequence classifiers (LRA); the other task families build their models in their own tests
# (tests/models/test_vit.py, test_pointcloud.py, test_causal_lm.py; test_mlm_tasks.py, test_glue_tasks.py)
TASKS = sorted(
    p.stem
    for p in (REPO_ROOT / "conf" / "task").glob("*.yaml")
    if _model_target(p.stem) == "attnlab.models.classifier.SequenceClassifier"
)
ATTNS = sorted(p.stem for p in (REPO_ROOT / "conf" / "attn").glob("*.yaml"))
TINY_LISTOPS = [*TINY, "trainer.log_every_n_steps=2", "logger=csv"]


@pytest.mark.parametrize("attn,task", each_value_once(ATTNS, TASKS))
def test_every_task_and_backend_composes_and_builds(train_config, task, attn):
    cfg = train_config(f"task={task}", f"attn={attn}")
    assert cfg.task.name == task and cfg.attn.name == attn
    model = instantiate(cfg.task.model, vocab_size=32, attention=instantiate(cfg.attn))
    dual = cfg.task.model.get("dual", False)
    ids = torch.randint(1, 32, (2, 16))
    out = model(ids, None, ids, None) if dual else model(ids)
    assert out.shape == (2, cfg.task.num_classes)


def test_short_run_writes_summary_checkpoints_and_logs(train_config, tmp_path):
    cfg = train_config(
        *TINY_LISTOPS,
        "trainer.max_steps=12",
        "task.val_check_interval=6",
        "callbacks.periodic_checkpoint.every_n_train_steps=4",
        "callbacks.throughput.warmup_steps=2",
    )
    summary = train(cfg)
    run_dir = tmp_path / "run"
    written = json.loads((run_dir / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    for key in SUMMARY_FIELDS:
        assert key in written, key
    assert written["task"] == "listops" and written["attn"] == "sliced_relu" and written["steps"] == 12
    # the test accuracy is the best checkpoint's, over every test example: recomputed here by hand
    assert written["test_acc"] == pytest.approx(_accuracy_of(cfg, written["best_checkpoint"]), abs=1e-6)
    labels = np.concatenate([b["labels"].numpy() for b in _datamodule(cfg).test_dataloader()])
    assert written["baseline_acc"] == pytest.approx(np.bincount(labels).max() / len(labels))
    assert written["train_samples_per_sec"] > 0 and written["eval_samples_per_sec"] > 0
    assert written["seq_len"] <= 60 and written["world_size"] == 1
    assert "generated" in written["data_source"] and "listops-short" in written["data_source"]
    checkpoints = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert "last.ckpt" in checkpoints and {"step4.ckpt", "step8.ckpt", "step12.ckpt"} <= checkpoints
    assert any(name.startswith("best-") for name in checkpoints)
    metrics = (run_dir / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/loss", "val/acc", "test/acc", "perf/train_samples_per_sec"} <= set(metrics)
    assert (run_dir / "config.yaml").exists()


def test_resume_continues_at_the_saved_step(train_config, tmp_path):
    first = train(train_config(*TINY_LISTOPS, "trainer.max_steps=8", "task.val_check_interval=4"))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == first["steps"] == 8
    assert saved["optimizer_states"] and saved["lr_schedulers"][0]["last_epoch"] == 8

    resumed = train(
        train_config(*TINY_LISTOPS, "trainer.max_steps=12", "task.val_check_interval=4", f"ckpt_path={ckpt}")
    )
    assert resumed["steps"] == 12  # 4 more steps, not 12 from scratch
    final = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["lr_schedulers"][0]["last_epoch"] == 12


def test_missing_checkpoint_is_named(train_config):
    with pytest.raises(CheckpointError, match="/nope.ckpt does not exist"):
        train(train_config(*TINY_LISTOPS, "ckpt_path=/nope.ckpt"))


def test_summary_throughput_is_the_runs_not_the_best_checkpoints(train_config, tmp_path):
    """Testing the best checkpoint must not rewind the throughput counters to its step."""
    # a learning rate too small to change a prediction: val/acc never improves on the first validation,
    # so the best checkpoint is step 4's while the run goes on to step 16
    summary = train(
        train_config(
            *TINY_LISTOPS,
            "trainer.max_steps=16",
            "task.val_check_interval=4",
            "task.module.optimizer.lr=1e-12",
            "callbacks.throughput.warmup_steps=2",
        )
    )
    assert Path(summary["best_checkpoint"]).name.startswith("best-step4-")
    at_end = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]
    at_best = torch.load(summary["best_checkpoint"], weights_only=True)["callbacks"]
    counters_end, counters_best = at_end["ThroughputMonitor"], at_best["ThroughputMonitor"]
    assert counters_end["train_steps"] == 14 and counters_best["train_steps"] == 2
    run_rate = counters_end["train_samples"] / counters_end["train_time"]
    assert summary["train_samples_per_sec"] == pytest.approx(run_rate, rel=1e-12)
    assert summary["eval_samples_per_sec"] == pytest.approx(
        counters_end["eval_samples"] / counters_end["eval_time"], rel=1e-12
    )
    assert summary["steps"] == 16 and summary["attempts"] == 1


def test_unknown_task_and_attention_list_the_available_ones(train_config):
    with pytest.raises(MissingConfigException, match="listops"):
        train_config("task=nope")
    with pytest.raises(MissingConfigException, match="sliced_relu"):
        train_config("attn=nope")


def test_train_py_runs_from_the_command_line(tmp_path):
    """The real entry point, as `make train` calls it (tiny sizes)."""
    overrides = [o for o in TINY_LISTOPS if not o.startswith("logger")] + [
        "trainer.max_steps=3",
        "task.val_check_interval=3",
        "attn=softmax",
        f"paths.data_dir={tmp_path / 'data'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    done = run_train_py(*overrides, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "test accuracy" in done.stdout and "majority baseline" in done.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["attn"] == "softmax"
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def _datamodule(cfg):
    datamodule = instantiate(cfg.task.data)
    datamodule.prepare_data()
    datamodule.setup()
    return datamodule


def _accuracy_of(cfg, checkpoint: str) -> float:
    """Test accuracy of ``checkpoint``'s weights, counted by hand over the test split."""
    datamodule = _datamodule(cfg)
    model = instantiate(cfg.task.model, attention=instantiate(cfg.attn), **datamodule.model_kwargs())
    module = instantiate(cfg.task.module, model=model)
    module.load_state_dict(read_checkpoint(checkpoint)["state_dict"])
    module.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in datamodule.test_dataloader():
            correct += int((module(batch).argmax(-1) == batch["labels"]).sum())
            total += len(batch["labels"])
    return correct / total


@pytest.mark.parametrize("attn", ATTNS)
def test_every_backend_trains_listops_by_name(train_config, attn):
    cfg = train_config(*TINY_LISTOPS, f"attn={attn}", "trainer.max_steps=3", "task.val_check_interval=3")
    summary = train(cfg)
    assert summary["attn"] == attn and summary["steps"] == 3
    assert summary["test_acc"] == pytest.approx(_accuracy_of(cfg, summary["best_checkpoint"]), abs=1e-6)
