"""What a user types wrong gets a message naming the key, and Lightning's switches work as typed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from attnlab.config.validation import check_config
from attnlab.errors import ConfigError
from attnlab.pipeline import train
from tiny_runs import REPO_ROOT, TINY_LISTOPS, run_train_py, train_main


def _train_py(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return train_main(*TINY_LISTOPS, "logger=none", *overrides, cwd=tmp_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.max_steps=abc", "task.max_steps='abc': expected an integer >= 1 or -1"),
        ("task.data.batch_size=1.5", "task.data.batch_size=1.5: expected an integer >= 1"),
        ("seed=abc", "seed='abc': expected an integer"),
    ],
)
def test_wrong_typed_override_names_the_key_without_a_traceback(tmp_path, override, message):
    done = _train_py(tmp_path, override)
    assert done.returncode == 1
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists(), "the check must come before any work"
    assert not list((tmp_path / "outputs").rglob("*")), "no run dir left behind by a bad command"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("task.module.optimizer.lr=-1", "task.module.optimizer.lr=-1: expected a number > 0.0"),
        ("task.model.dropout=1.5", "task.model.dropout=1.5: expected a number >= 0.0 and <= 1.0"),
        ("trainer.limit_train_batches=2.5", "trainer.limit_train_batches=2.5"),
        ("trainer.fast_dev_run=-1", "trainer.fast_dev_run=-1"),
        ("test=maybe", "test='maybe': expected true or false"),
    ],
)
def test_check_config_names_each_bad_value(train_config, override, expected):
    with pytest.raises(ConfigError, match="bad config value") as caught:
        check_config(train_config(override))
    assert expected in str(caught.value)


@pytest.mark.slow
def test_every_shipped_config_passes_the_checks(train_config):
    for task in sorted(p.stem for p in (REPO_ROOT / "conf" / "task").glob("*.yaml")):
        check_config(train_config(f"task={task}"))
    for preset in sorted((REPO_ROOT / "conf" / "experiment").glob("*/*.yaml")):
        check_config(train_config(f"experiment={preset.parent.name}/{preset.stem}"))


def test_fast_dev_run_as_lightning_users_type_it(tmp_path):
    done = _train_py(tmp_path, "trainer.fast_dev_run=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Running in `fast_dev_run` mode" in done.stdout + done.stderr
    (summary,) = (tmp_path / "outputs").rglob("summary.json")
    assert json.loads(summary.read_text())["smoke_test"] is True  # `attnlab report` leaves it out


@pytest.mark.parametrize(
    "switches",
    [
        ["trainer.limit_train_batches=0.5", "trainer.limit_val_batches=2", "trainer.limit_test_batches=1"],
        ["trainer.overfit_batches=2"],
        ["trainer.profiler=simple"],
    ],
)
def test_lightning_switches_need_no_plus(train_config, switches):
    summary = train(
        train_config(*TINY_LISTOPS, *switches, "trainer.max_steps=4", "task.val_check_interval=2")
    )
    assert summary["steps"] == 4


def test_train_split_smaller_than_a_batch_is_named(train_config):
    """192 training examples with batch 256 and incomplete batches dropped: no training step at all."""
    with pytest.raises(ConfigError, match=r"train split has 192 listops examples.*batch_size=256"):
        train(train_config(*TINY_LISTOPS, "task.data.batch_size=256", "trainer.max_steps=4"))


def test_a_resolver_refusing_its_inputs_is_named_without_a_traceback(tmp_path):
    """The paper MLM preset derives gradient accumulation from the device count: 3 devices cannot
    share a global batch of 1024 sequences."""
    done = train_main("experiment=mlm/paper", "trainer.devices=3", cwd=tmp_path)
    assert done.returncode == 1
    assert "error: trainer.accumulate_grad_batches:" in done.stderr
    assert "1024 sequences do not split evenly over 3 devices" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("task", "override", "expected"),
    [
        ("digits_vit", "task.model.patch_size=0", "task.model.patch_size=0: expected an integer >= 1"),
        ("shapes", "task.data.num_points=abc", "task.data.num_points='abc': expected an integer >= 1"),
        ("digits_vit", "task.module.ema_decay=abc", "task.module.ema_decay='abc': expected a number > 0.0"),
        (
            "digits_vit",
            "task.module.ema_decay=1.0",
            "task.module.ema_decay=1.0: expected a number > 0.0 and < 1.0",
        ),
        (
            "digits_vit",
            "task.module.mixup=5",
            "task.module.mixup=5: expected null or a mapping of timm Mixup",
        ),
        ("mlm", "task.data.source.tokenizer.vocab_size=3", "vocab_size=3: expected an integer >= 261"),
    ],
)
def test_task_options_are_checked_before_any_work(train_config, task, override, expected):
    """Each of these failed deep in a constructor (ZeroDivisionError, TypeError) without the key."""
    with pytest.raises(ConfigError, match="bad config value") as caught:
        check_config(train_config(f"task={task}", override))
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value), "one problem, one line"


def test_a_missing_logger_package_is_named_with_how_to_install_it(train_config, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real_find_spec(n, *a)
    )
    with pytest.raises(
        ConfigError, match=r"logger=wandb: needs the wandb package.*pip install -e '\.\[wandb\]'"
    ):
        check_config(train_config("logger=wandb"))


def test_an_unreachable_mlflow_server_fails_in_seconds_naming_the_uri():
    import socket
    import time

    from attnlab.run.mlflow_logger import MlflowStoreError, mlflow_logger

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(
        MlflowStoreError, match=rf"tracking_uri=http://127.0.0.1:{port}: no MLflow server answers"
    ):
        mlflow_logger(tracking_uri=f"http://127.0.0.1:{port}", experiment_name="x")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("plus", ["", "+"])
def test_a_misspelt_backend_option_gets_one_line_with_the_accepted_ones(tmp_path, plus):
    done = train_main(f"{plus}attn.projeciton=linear", cwd=tmp_path)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: attn.projeciton: no such option")
    assert "accepted options:" in lines[0] and "projection" in lines[0]


def test_attention_options_are_checked_for_every_backend_of_a_sweep():
    from attnlab.config.overrides import check_attention_options

    conf = REPO_ROOT / "conf"
    assert check_attention_options(["attn=softmax,sliced_relu", "attn.projection=linear"], conf) == (
        check_attention_options(["attn=softmax", "attn.projection=linear"], conf)
    )  # softmax has no slicing projection: refused, naming softmax
    assert "'softmax'" in check_attention_options(["attn=softmax", "attn.projection=linear"], conf)
    assert (
        check_attention_options(["attn=sliced_relu", "attn.projection=linear", "attn.eps=1e-3"], conf) is None
    )
    assert check_attention_options(["experiment=lra/listops", "attn.foo=1"], conf) is None  # a preset decides


def test_a_loader_worker_data_error_reaches_the_user_as_its_own_message(loader_workers):
    """torch re-raises an error it cannot rebuild as RuntimeError("Caught DataError in DataLoader
    worker process 0 ..."): the user must see the file and line, not that."""
    from torch.utils.data import DataLoader

    from attnlab.errors import user_error

    with pytest.raises(RuntimeError) as caught:
        next(iter(DataLoader(_BadRowDataset(), num_workers=1)))
    found = user_error(caught.value)
    assert found is not None and str(found) == "/data/train.tsv:3: a bad row"


class _BadRowDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        from attnlab.data.errors import DataError

        raise DataError("/data/train.tsv", "a bad row", line=3)


def test_a_missing_dataset_is_one_line_and_the_run_dir_keeps_its_config(train_config, tmp_path):
    from attnlab.data.errors import MissingDataError
    from attnlab.errors import UserError

    cfg = train_config("task=text")
    with pytest.raises(MissingDataError) as caught:
        train(cfg)
    assert isinstance(caught.value, UserError)  # train.py prints `error: <message>`, no traceback
    assert "dataset not found" in str(caught.value)
    assert (Path(cfg.paths.run_dir) / "config.yaml").is_file()  # written when the run starts


@pytest.mark.slow
def test_a_default_run_prints_each_line_once_without_adverts(tmp_path):
    done = run_train_py(*TINY_LISTOPS, "task.max_steps=12", cwd=tmp_path, timeout=300, single_thread=True)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    for line in ("GPU available:", "throughput (per device)", "Trainable params", "ListOps: reading"):
        assert output.count(line) <= 1, line
    assert output.count("GPU available:") == 1
    for noise in ("Tip:", "litlogger", "LeafSpec", "srun"):
        assert noise not in output, noise


def test_auto_refuses_a_last_ckpt_that_links_out_of_the_run_dir(tmp_path):
    from attnlab.errors import CheckpointError
    from attnlab.run.resume import resolve_ckpt_path

    elsewhere = tmp_path / "another_run" / "checkpoints" / "last.ckpt"
    elsewhere.parent.mkdir(parents=True)
    torch.save({"global_step": 7}, elsewhere)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"ckpt_path=auto: .*last.ckpt leads to .*another_run.*outside"):
        resolve_ckpt_path("auto", run)


def test_a_checkpoint_of_another_model_is_named_with_both_runs(train_config, tmp_path):
    """Lightning's answer was a state_dict traceback listing every tensor."""
    from attnlab.errors import CheckpointError

    first = train_config(*TINY_LISTOPS, "trainer.max_steps=2", "test=false")
    train(first)
    last = Path(first.paths.run_dir) / "checkpoints" / "last.ckpt"
    wider = train_config(*TINY_LISTOPS, "task.model.dim=32", f"ckpt_path={last}")
    with pytest.raises(CheckpointError) as caught:  # its run's config.yaml says so, before any work
        train(wider)
    message = str(caught.value)
    assert f"ckpt_path {last}: this command changes" in message and "task.model.dim: 16 -> 32" in message
    # a checkpoint copied out of its run has no config.yaml beside it: its weights say it
    copy = tmp_path / "copied.ckpt"
    copy.write_bytes(last.read_bytes())
    with pytest.raises(CheckpointError) as caught:
        train(train_config(*TINY_LISTOPS, "task.model.dim=32", f"ckpt_path={copy}"))
    message = str(caught.value)
    assert f"ckpt_path {copy} holds another model" in message and "of another shape" in message
    assert "saved by a run whose config.yaml is not beside it" in message
    assert "this run is task=listops, attn=sliced_relu, dim=32, depth=2" in message
