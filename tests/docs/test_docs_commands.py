"""Every command the README and docs show is one a user can type: it parses and its config composes.

Running each to the end needs datasets that tests cannot download, and the runs that can
(make train, the MLM, MQAR, shapes, digits, resume, dashboard and report commands) have their own
tests. This one catches what those miss: a documented option that no longer exists, a config key
renamed in the code but not in the docs, a backend option misspelt in an example. Lines with
placeholders (``<task>``, ``...``, ``HOST``) are templates, not commands, and are skipped.
"""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from attnlab.cli.main import build_parser
from attnlab.config.overrides import check_attention_options
from attnlab.config.validation import check_config
from attnlab.errors import ConfigError
from conftest import compose_train_config
from tiny_runs import REPO_ROOT

DOCS = [
    REPO_ROOT / "README.md",
    REPO_ROOT / "slurm" / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
]
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\bHOST\b|\[|\|")


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every ``python train.py`` / ``attnlab`` line in a code block or inline."""
    found = []
    for path in DOCS:
        text = path.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        lines = [
            re.sub(r"\s+#.*$", "", line).strip()
            for block in blocks
            for line in block.replace("\\\n", " ").splitlines()
        ]
        lines += re.findall(r"`([^`\n]+)`", text)
        for line in lines:
            if re.match(r"^(\w+=\S+\s+|time\s+)*(python train\.py|attnlab \w)", line):
                found.append((path.relative_to(REPO_ROOT).as_posix(), line))
    return sorted(set(found))


COMMANDS = documented_commands()


def first_point(words: list[str]) -> list[str]:
    """A sweep's words as its first run: ``-m`` dropped, ``key=a,b,c`` as ``key=a``."""
    return [re.sub(r"=([^,=]+),\S+$", r"=\1", w) for w in words if w not in ("-m", "--multirun")]


def test_the_docs_show_commands():
    assert len(COMMANDS) > 40  # the extraction still finds the docs' commands


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_parses_and_composes(doc, command, tmp_path):
    if PLACEHOLDER.search(command):
        pytest.skip("a template with placeholders")
    words = shlex.split(command)
    while words and (re.fullmatch(r"\w+=\S*", words[0]) or words[0] == "time"):
        words.pop(0)  # environment settings (WANDB_MODE=online) and `time`
    if words[:2] == ["python", "train.py"]:
        if "--cfg" in words or "--help" in words:
            return
        first = first_point(words[2:])
        assert check_attention_options(first, REPO_ROOT / "conf") is None
        cfg = compose_train_config([a for a in first if not a.startswith("hydra/")], tmp_path)
        if "logger=wandb" in first and importlib.util.find_spec("wandb") is None:
            with pytest.raises(ConfigError, match=r"-e '\.\[wandb\]'"):  # the optional extra, named
                check_config(cfg)
            assert "pip install -e '.[wandb]'" in (REPO_ROOT / doc).read_text()  # and the docs say so
            return
        check_config(cfg)
    else:
        assert words[0] == "attnlab"
        if "--help" in words:
            return
        args = build_parser().parse_args(words[1:])
        assert getattr(args, "func", None) is not None, f"{command}: no sub-command runs"
