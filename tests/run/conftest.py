"""The scheduler tests need a running SLURM cluster (`.ci/slurm/setup.sh` starts one on localhost)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _unavailable(reason: str) -> None:
    """Skip on a developer machine; fail in CI, where setup.sh must have started the cluster."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}; CI must run `bash .ci/slurm/setup.sh` before the tests")
    pytest.skip(f"{reason} (start a local cluster with `bash .ci/slurm/setup.sh`, as root)")


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """Checks once per module that the SLURM client tools exist and the controller answers."""
    if shutil.which("sinfo") is None:
        _unavailable("`sinfo` is not on PATH (SLURM is not installed)")
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        _unavailable(f"`scontrol ping` failed: {err}")
    if ping.returncode != 0 or "UP" not in ping.stdout:
        answer = (ping.stdout + ping.stderr).strip().splitlines()
        _unavailable(
            f"the SLURM controller is not responding (scontrol ping: {answer[0] if answer else ''!r})"
        )
