"""A user's attention backend defined outside attnlab: registered, checked like a built-in, trained.

The files and the command are taken from docs/extending.md, so the page cannot drift from the code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab.attention import (
    AttentionLayer,
    Capabilities,
    UnsupportedAttentionError,
    available_backends,
    backend_options,
    build_attention,
    register_backend,
    registry,
)
from tiny_runs import TINY_LISTOPS

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "extending.md"


def doc_blocks() -> dict[str, str]:
    """The page's code blocks: files by the path in their first comment line, and the shell command."""
    blocks = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), flags=re.S):
        first = body.splitlines()[0]
        if lang in ("python", "yaml") and re.fullmatch(r"# [\w/]+\.(py|yaml)", first):
            blocks[first[2:].strip()] = body
        elif lang == "bash":
            blocks["command"] = body
    return blocks


@pytest.fixture
def clean_registry():
    """Registrations made by a test are undone after it (the registry is process-wide)."""
    saved = dict(registry._BACKENDS)
    yield
    registry._BACKENDS.clear()
    registry._BACKENDS.update(saved)


@pytest.fixture
def user_project(tmp_path, clean_registry, monkeypatch):
    """my_project/ written from the doc, on sys.path as PYTHONPATH would put it."""
    project = tmp_path / "my_project"
    for path, text in doc_blocks().items():
        if path != "command":
            (project / path).parent.mkdir(parents=True, exist_ok=True)
            (project / path).write_text(text)
    monkeypatch.syspath_prepend(str(project))
    yield project
    sys.modules.pop("my_attention", None)


def test_doc_has_the_three_pieces():
    assert set(doc_blocks()) == {"my_attention.py", "my_configs/attn/my_attn.yaml", "command"}


def test_documented_module_registers_and_builds_with_the_same_checks(user_project):
    assert "my_attn" not in available_backends()
    import my_attention  # noqa: F401  (the doc's module registers on import)

    assert available_backends()[-1] == "my_attn"
    assert list(backend_options("my_attn")) == [*backend_options("softmax"), "temperature"]
    layer = build_attention("my_attn", 16, 4, temperature=5.0, rope=True)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    assert layer(torch.randn(2, 7, 16), key_padding_mask=mask).shape == (2, 7, 16)
    with pytest.raises(ValueError, match="unknown option.*temprature.*accepted options: .*temperature"):
        build_attention("my_attn", 16, 4, temprature=5.0)
    with pytest.raises(UnsupportedAttentionError, match="backend 'my_attn'.*causal: not implemented"):
        build_attention("my_attn", 16, 4, causal=True)
    with pytest.raises(ValueError, match="causal must be true or false, got 'yes'"):
        build_attention("my_attn", 16, 4, causal="yes")
    with pytest.raises(ValueError, match=r"dropout must be a finite number in \[0, 1\)"):
        build_attention("my_attn", 16, 4, dropout=1.5)


def test_config_module_option_imports_the_backend(user_project):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(user_project / "my_configs" / "attn" / "my_attn.yaml")
    layer = instantiate(cfg)(dim=16, num_heads=2, rope=False, dropout=0.0)
    assert type(layer).__name__ == "CosineAttention" and layer.name == "my_attn"
    assert layer.temperature == 10.0


def test_module_errors_say_what_to_do(clean_registry):
    with pytest.raises(ModuleNotFoundError, match="module 'no_such_module' not found.*PYTHONPATH"):
        build_attention("my_attn", 16, 4, module="no_such_module")
    with pytest.raises(ValueError, match="'json' was imported but registers no attention backend 'my_attn'"):
        build_attention("my_attn", 16, 4, module="json")


def test_registration_is_checked(clean_registry):
    class Plain(nn.Module):
        pass

    with pytest.raises(TypeError, match="needs a subclass of attnlab.attention.AttentionLayer"):
        register_backend("plain")(Plain)
    with pytest.raises(ValueError, match="must be a Python identifier"):
        register_backend("my-attn")

    class Odd(AttentionLayer):
        def __init__(self, width, heads, **common):
            super().__init__(width, heads, **common)

    with pytest.raises(TypeError, match=r"must start with \(self, dim, num_heads, \.\.\.\)"):
        register_backend("odd")(Odd)

    class Mine(AttentionLayer):
        capabilities = Capabilities(causal=True)

        def attend(self, q, k, v, key_padding_mask):
            return v

    with pytest.raises(
        ValueError, match="'softmax' is already registered by attnlab.attention.softmax.layer"
    ):
        register_backend("softmax")(Mine)
    assert register_backend("mine")(Mine) is Mine
    assert register_backend("mine")(Mine) is Mine  # the same class again (a re-import): fine
    assert Mine.name == "mine" and build_attention("mine", 8, 2, causal=True).causal


@pytest.mark.slow
def test_documented_command_trains_a_tiny_model(tmp_path):
    """The page's command as typed (tiny data and run dirs added), the class in a folder on PYTHONPATH."""
    project = tmp_path / "my_project"
    command = None
    for path, text in doc_blocks().items():
        if path == "command":
            command = text
            continue
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(text)
    lines = command.strip().splitlines()
    assert lines[:2] == ["cd my_project", "export PYTHONPATH=$PWD"]
    argv = shlex.split(lines[2])
    assert argv[:2] == ["python", "/path/to/attnlab/train.py"]
    argv[:2] = [sys.executable, str(REPO_ROOT / "train.py")]
    argv += [
        *TINY_LISTOPS,
        "trainer.max_steps=3",
        "task.val_check_interval=3",
        "logger=csv",
        f"paths.data_dir={tmp_path / 'data'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    # `export PYTHONPATH=$PWD`, keeping what this test process may need to import attnlab itself
    paths = [str(project), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["attn"] == "my_attn" and summary["steps"] == 3
    assert 0.0 <= summary["test_acc"] <= 1.0
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "module: my_attention" in config and "temperature: 10.0" in config


def test_the_flop_counter_counts_a_users_backend_by_its_projections(user_project):
    """attnlab has no FLOP formula for a user's attention: its Linear projections are counted, the
    attention itself is left out, and the run goes on (throughput is logged for every backend)."""
    import my_attention  # noqa: F401

    from attnlab.flops import FlopCounter

    layer = build_attention("my_attn", 16, 4, rope=False)
    counter = FlopCounter().attach(layer)
    layer(torch.randn(2, 7, 16))
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    assert linears and counter.forward_flops == sum(
        2.0 * 2 * 7 * m.in_features * m.out_features for m in linears
    )
