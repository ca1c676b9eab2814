"""A misspelt config-group choice stops `python train.py` with one line: the choice, the closest name
and what the group offers, instead of Hydra's twenty-line report."""

from __future__ import annotations

from attnlab.config.group_choices import check_group_choices
from tiny_runs import REPO_ROOT, train_main

CONF = REPO_ROOT / "conf"


def test_a_misspelt_task_is_one_line_with_the_choices(tmp_path):
    done = train_main("task=lisops", cwd=tmp_path)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: task=lisops: no such task (did you mean listops?); task is one of: ")
    assert "digits_vit" in lines[0] and "Config search path" not in done.stdout + done.stderr
    assert not any(tmp_path.iterdir()), "a refused command leaves nothing behind"


def test_backends_presets_and_sweeps_are_checked_and_good_ones_pass(tmp_path):
    assert "attn=sofmax: no such attn (did you mean softmax?)" in check_group_choices(["attn=sofmax"], CONF)
    problem = check_group_choices(["attn=softmax,linaer"], CONF)  # every value of a sweep
    assert problem.startswith("attn=linaer: no such attn (did you mean linear?)")
    assert "experiment=lra/listop: no such experiment" in check_group_choices(["experiment=lra/listop"], CONF)
    good = ["task=listops", "attn=softmax,sliced_relu", "experiment=lra/listops", "logger=none", "seed=3",
            "task.model.dim=32", "hydra/launcher=slurm", "+trainer.profiler=simple"]  # fmt: skip
    assert check_group_choices(good, CONF) is None
    hydra_syntax = ["logger=[csv,tensorboard]", "attn=glob(*)", "attn=choice(softmax,linear)"]
    hydra_syntax.append("attn='softmax'")
    assert [check_group_choices([arg], CONF) for arg in hydra_syntax] == [None] * 4
    assert "logger=tensorbord: no such logger" in check_group_choices(["logger=[csv,tensorbord]"], CONF)


def test_a_search_path_adds_its_choices(tmp_path):
    (tmp_path / "attn").mkdir()
    (tmp_path / "attn" / "my_attn.yaml").write_text("name: my_attn\n")
    assert check_group_choices(["attn=my_attn"], CONF) is not None
    assert check_group_choices([f"hydra.searchpath=[file://{tmp_path}]", "attn=my_attn"], CONF) is None
    assert check_group_choices(["hydra.searchpath=[pkg://somewhere]", "attn=my_attn"], CONF) is None
