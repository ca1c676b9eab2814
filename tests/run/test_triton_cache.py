"""Inside a SLURM job the Triton kernel cache is the job's own folder on local disk
(attnlab.run.slurm_layout). No cluster is needed."""

from __future__ import annotations

import pytest

from attnlab.run.slurm_layout import job_local_triton_cache


def test_a_job_gets_its_own_cache_on_local_disk():
    env = {"SLURM_JOB_ID": "4242", "TMPDIR": "/scratch/local"}
    assert job_local_triton_cache(env) == "/scratch/local/attnlab-triton-4242"
    assert env["TRITON_CACHE_DIR"] == "/scratch/local/attnlab-triton-4242"
    array = {"SLURM_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    assert job_local_triton_cache(array) == "/tmp/attnlab-triton-77_3"


def test_outside_a_job_and_under_the_users_choice_nothing_changes():
    assert job_local_triton_cache({}) is None
    mine = {"SLURM_JOB_ID": "1", "TRITON_CACHE_DIR": "/home/me/cache"}
    assert job_local_triton_cache(mine) is None and mine["TRITON_CACHE_DIR"] == "/home/me/cache"


def test_triton_reads_the_folder_set_at_start(monkeypatch, tmp_path):
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    job_local_triton_cache()
    assert triton.knobs.cache.dir == str(tmp_path / "attnlab-triton-9")
