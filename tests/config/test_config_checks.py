"""Every value a constructor would refuse is named in one line before any work, and a ``+key`` that
nothing reads is refused with the closest key."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.config.validation import check_config
from attnlab.errors import ConfigError, user_error
from tiny_runs import TINY_LISTOPS, train_main


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["task.model.dim=30", "task.model.num_heads=4"], "dim=30 is not divisible by num_heads=4"),
        (["+task.model.dimm=64"], "+task.model.dimm: nothing reads this key; did you mean task.model.dim?"),
        (["+task.modle.dim=32"], "+task.modle.dim: nothing reads this key; did you mean task.model.dim?"),
        (["+trainer.max_stepz=5"], "did you mean trainer.max_steps?"),
        (["+seeed=3"], "+seeed: nothing reads this key; did you mean seed?"),
        (["trainer.precision=bogus"], "trainer.precision='bogus': expected one of 64-true, 32-true"),
        (["attn.eps=0"], "eps must be a finite number in (0, inf), got 0"),
        (["attn.eps=zero"], "eps must be a finite number in (0, inf), got 'zero'"),
        (["attn.projection=cubic"], "projection must be 'mlp' or 'linear', got 'cubic'"),
        (["attn=softmax", "attn.causal=maybe"], "causal must be true or false, got 'maybe'"),
        (["attn=performer", "attn.num_features=0"], "num_features must be an integer >= 1, got 0"),
        (
            ["+attn.dropout=1.5"],
            "attn.dropout: set by the model, not by the attention config; use task.model",
        ),
        (["task.model.positions=bogus"], "task.model.positions='bogus': expected one of learned, sinusoidal"),
        (["trainer.max_epochs=abc"], "trainer.max_epochs='abc': expected null or an integer >= -1"),
        (["task.data.source.sizes.train=-5"], "task.data.source.sizes.train=-5: expected an integer >= 1"),
        (
            ["callbacks.last_checkpoint.every_n_train_steps=-5"],
            "every_n_train_steps=-5: expected an integer >= 0",
        ),
        # the attention layer refuses a dropout of 1.0: the check said <= 1.0
        (["task.model.attn_dropout=1.0"], "task.model.attn_dropout=1.0: expected a number >= 0.0 and < 1.0"),
        (
            ["task.model.positions=learned", "task.model.max_len=1000000000"],
            "task.model.max_len=1000000000: its learned position table (1,000,000,000 × 64 floats)",
        ),
    ],
)
def test_bad_values_are_named_before_any_work(train_config, overrides, expected):
    with pytest.raises(ConfigError) as caught:
        check_config(train_config(*overrides))
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["+task.max_epochs=2"],  # read by trainer.max_epochs's ${oc.select:...}
        ["+task.model.backend_options.sliced_relu.projection=linear"],
        [
            "+callbacks.extra._target_=lightning.pytorch.callbacks.Timer",
            "+callbacks.extra.duration=00:00:01:00",
        ],
        ["task=lm", "attn=softmax"],  # a causal model: its layers are checked causal
        ["task=digits_vit"],
    ],
)
def test_keys_that_are_read_pass(train_config, overrides):
    check_config(train_config(*overrides))


def test_a_value_a_constructor_refuses_is_one_line_naming_the_node():
    """The class behind the cases no pre-check names: Hydra's 'Error in call to target' report."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {"task": {"data": {"_target_": "attnlab.config.validation.integer", "minimum": "x", "y": 1}}}
    )
    with pytest.raises(Exception) as caught:
        instantiate(cfg.task.data)
    found = user_error(caught.value)
    assert found is not None and str(found).startswith("task.data: ")
    assert "unexpected keyword argument 'y'" in str(found) and "\n" not in str(found)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("+task.modle.dim=32", "did you mean task.model.dim?"),
        ("attn.eps=0", "eps must be a finite number in (0, inf)"),
        ("trainer.precision=bogus", "trainer.precision='bogus'"),
        ("+attn.dropout=1.5", "attn.dropout: set by the model"),
    ],
)
def test_the_command_line_says_it_in_one_line_and_leaves_nothing(tmp_path, override, expected):
    done = train_main(*TINY_LISTOPS, "logger=none", override, cwd=tmp_path)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr[-2000:]
    assert not (tmp_path / "data").exists(), "the check must come before any work"
    assert not list((tmp_path / "outputs").rglob("*")), "no run dir left behind"


def test_a_run_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "taken").write_text("a file")
    done = train_main(*TINY_LISTOPS, f"hydra.run.dir={tmp_path / 'taken'}", cwd=tmp_path)
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        == f"error: hydra.run.dir={tmp_path / 'taken'}: a file, not a directory; give a run directory"
    )


def test_a_data_file_that_is_a_folder_is_one_line(tmp_path):
    """Reading a folder where a file belongs (or a file the user may not read) is the user's to fix."""
    folder = tmp_path / "basic_train.tsv"
    folder.mkdir()
    with pytest.raises(OSError) as caught:
        folder.read_text()
    assert str(user_error(caught.value)) == f"{folder}: Is a directory"
    assert user_error(OSError("no file name, no errno")) is None


def test_a_max_len_shorter_than_the_data_is_named_before_training(train_config):
    """The classifier refused the first batch that was too long, mid-epoch, in a traceback."""
    from attnlab.pipeline import train

    cfg = train_config(*TINY_LISTOPS, "task.model.max_len=20", "logger=none")
    with pytest.raises(
        ConfigError, match=r"task\.model\.max_len=20: the train split holds sequences of up to \d+"
    ):
        train(cfg)
    assert not (Path(cfg.paths.run_dir) / "checkpoints").exists()


def test_wandb_online_without_login_is_one_line_before_any_work(train_config, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ConfigError) as caught:
        check_config(train_config("logger=wandb"))
    message = str(caught.value)
    assert "logger=wandb: wandb runs online (WANDB_MODE=online) but is not logged in here" in message
    assert "`wandb login`" in message and "WANDB_MODE=offline" in message and "\n" not in message
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # logged in: no complaint
    check_config(train_config("logger=wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY")
    check_config(train_config("logger=wandb"))
