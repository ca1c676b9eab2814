"""The README's commands work in a new shell that did only what the README says: `make` built `.venv`,
`source .venv/bin/activate` put it on the PATH. Nothing else: no PYTHONPATH, no venv already active."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ACTIVATE = REPO_ROOT / ".venv" / "bin" / "activate"


@pytest.mark.skipif(not ACTIVATE.exists(), reason="needs the .venv that make builds")
def test_python_and_attnlab_after_activating_the_venv():
    assert "source .venv/bin/activate" in (REPO_ROOT / "README.md").read_text()
    venv_bin = str(ACTIVATE.parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    script = "source .venv/bin/activate && attnlab --help && python train.py --help && attnlab report --help"
    done = subprocess.run(
        ["bash", "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: attnlab" in done.stdout and "Powered by Hydra" in done.stdout
