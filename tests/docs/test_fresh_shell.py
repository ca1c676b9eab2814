"""The docs' commands work in a new shell that did only what the README says: `make` built `.venv`,
`source .venv/bin/activate` put it on the PATH. Nothing else: no PYTHONPATH, no venv already active.

Each command runs as typed with a flag that stops it before any work: ``python train.py ...`` with
Hydra's ``--cfg job`` (attnlab's own checks of the command line, then the composed config printed;
a sweep's first point),
``attnlab ...`` with ``--help`` (the sub-command exists; its arguments are parsed in-process by
``test_docs_commands``). Both run in ``make test-all``; ``make test`` keeps the activated venv's check.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from docs.test_docs_commands import COMMANDS, PLACEHOLDER, first_point

REPO_ROOT = Path(__file__).resolve().parents[2]
ACTIVATE = REPO_ROOT / ".venv" / "bin" / "activate"
needs_venv = pytest.mark.skipif(not ACTIVATE.exists(), reason="needs the .venv that make builds")


def _fresh_shell(script: str, timeout: float) -> subprocess.CompletedProcess:
    venv_bin = str(ACTIVATE.parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    return subprocess.run(
        ["bash", "-c", f"source .venv/bin/activate && {script}"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _stopped_before_work(command: str) -> str:
    words = shlex.split(command)
    if "python" in words and "train.py" in words:
        if "--cfg" in words or "--help" in words:
            return command
        if "-m" in words or "--multirun" in words:  # Hydra takes one mode: the sweep's first point
            words = first_point(words)
        return shlex.join([*words, "--cfg", "job"])
    return command if "--help" in words else f"{command} --help"


def _run_all(commands: list[str], timeout: float) -> None:
    """One fresh shell runs every command; the failures are named with what they printed."""
    lines = [
        f'( {_stopped_before_work(c)} ) > /dev/null 2> "$ERR" || '
        f'{{ echo {shlex.quote("FAILED: " + c)}; tail -3 "$ERR"; }}'
        for c in commands
    ]
    done = _fresh_shell("\n".join(["ERR=$(mktemp)", *lines, 'rm -f "$ERR"']), timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FAILED" not in done.stdout, done.stdout[-4000:]


def _concrete(doc: str | None = None) -> list[str]:
    return sorted({c for d, c in COMMANDS if (doc is None or d == doc) and not PLACEHOLDER.search(c)})


@needs_venv
def test_python_and_attnlab_after_activating_the_venv():
    assert "source .venv/bin/activate" in (REPO_ROOT / "README.md").read_text()
    done = _fresh_shell("attnlab --help && python train.py --help", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: attnlab" in done.stdout and "Powered by Hydra" in done.stdout


@pytest.mark.slow
@needs_venv
def test_the_readmes_commands_in_a_fresh_shell():
    commands = _concrete("README.md")
    assert len(commands) >= 8
    _run_all(commands, timeout=600)


@pytest.mark.slow
@needs_venv
def test_every_documented_command_in_a_fresh_shell():
    _run_all(_concrete(), timeout=1800)
