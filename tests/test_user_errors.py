"""What a user types wrong gets a message naming the key, and Lightning's switches work as typed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from attnlab.errors import ConfigError
from attnlab.pipeline import train
from attnlab.validation import check_config
from tiny_runs import REPO_ROOT, TINY_LISTOPS, run_train_py


def _train_py(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_train_py(*TINY_LISTOPS, "logger=none", *overrides, cwd=tmp_path, timeout=300)


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


def test_every_shipped_config_passes_the_checks(train_config):
    for task in sorted(p.stem for p in (REPO_ROOT / "conf" / "task").glob("*.yaml")):
        check_config(train_config(f"task={task}"))
    for preset in sorted((REPO_ROOT / "conf" / "experiment").glob("*/*.yaml")):
        check_config(train_config(f"experiment={preset.parent.name}/{preset.stem}"))


def test_fast_dev_run_as_lightning_users_type_it(tmp_path):
    done = _train_py(tmp_path, "trainer.fast_dev_run=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Running in `fast_dev_run` mode" in done.stdout + done.stderr


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
    done = run_train_py("experiment=mlm/paper", "trainer.devices=3", cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    assert "error: trainer.accumulate_grad_batches:" in done.stderr
    assert "1024 sequences do not split evenly over 3 devices" in done.stderr
    assert "Traceback" not in done.stderr
