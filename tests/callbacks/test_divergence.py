"""A run whose loss stops being finite says so, in one line, and is no result; its weights never resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from attnlab.callbacks.divergence import TrainingDiverged
from attnlab.errors import CheckpointError, user_error
from attnlab.pipeline import train
from attnlab.reporting.runs import ReportError, parse_summary
from attnlab.run.resume import resolve_ckpt_path
from tiny_runs import TINY_LISTOPS

DIVERGING = [*TINY_LISTOPS, "trainer.max_steps=30", "task.module.optimizer.lr=1e10", "logger=csv"]


def test_a_nan_loss_stops_the_run_names_the_step_and_marks_the_summary(train_config):
    cfg = train_config(*DIVERGING)
    with pytest.raises(TrainingDiverged) as caught:
        train(cfg)
    err = caught.value
    assert user_error(err) is err  # train.py prints it as one `error:` line
    assert 1 <= err.step < 30 and not math.isfinite(err.loss)
    message = str(err)
    assert "\n" not in message and f"at training step {err.step}" in message
    run_dir = Path(cfg.paths.run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["diverged"] is True and summary["diverged_at_step"] == err.step
    assert summary["test_acc"] is None and summary["steps"] == err.step
    with pytest.raises(ReportError, match="diverged"):
        parse_summary(run_dir / "summary.json")
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.exists():  # saved before the step that diverged: finite, and resumable
        held = torch.load(last, weights_only=True)
        assert held["global_step"] < err.step
        assert all(torch.isfinite(v).all() for v in held["state_dict"].values() if v.is_floating_point())


def test_checkpoint_with_non_finite_weights_is_refused_on_resume(train_config, tmp_path):
    cfg = train_config(*TINY_LISTOPS, "trainer.max_steps=2", "test=false", "logger=none")
    train(cfg)
    last = Path(cfg.paths.run_dir) / "checkpoints" / "last.ckpt"
    held = torch.load(last, weights_only=True)
    name = next(k for k, v in held["state_dict"].items() if v.is_floating_point())
    held["state_dict"][name][..., 0] = float("nan")
    torch.save(held, last)
    with pytest.raises(CheckpointError, match=rf"non-finite weights \(NaN or inf, first in {name}\)"):
        train(
            train_config(*TINY_LISTOPS, "trainer.max_steps=4", "test=false", "logger=none", "ckpt_path=auto")
        )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"global_step": 3}, "holds no state_dict"),
        ({"global_step": "three", "state_dict": {}}, "its global_step is 'three', not an integer"),
    ],
)
def test_damaged_checkpoints_are_named_before_any_work(tmp_path, content, message):
    path = tmp_path / "odd.ckpt"
    torch.save(content, path)
    with pytest.raises(CheckpointError, match=message):
        resolve_ckpt_path(str(path), tmp_path)
