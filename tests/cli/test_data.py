import pytest

from attnlab.cli.main import main

TINY = [
    "task.data.source.sizes.train=30",
    "task.data.source.sizes.val=5",
    "task.data.source.sizes.test=5",
    "task.data.source.min_length=5",
    "task.data.source.max_length=40",
]


def test_check_only_names_every_missing_path_and_fails(tmp_path, capsys, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))  # where a per-call dir would be left
    code = main(["data", "prepare", "lra", "--task", "all", "--check-only", "--data-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"{tmp_path}/lra_release/tsv_data/new_aan_pairs.eval.tsv" in out
    assert f"{tmp_path}/aclImdb/train" in out and "aclImdb_v1.tar.gz" in out
    assert f"{tmp_path}/lra_release/pathfinder128/curv_contour_length_14" in out
    assert not (tmp_path / "lra_release" / "listops-short").exists()  # --check-only generates nothing
    assert not any(scratch.iterdir())  # nor leaves a temporary dir per task


def test_prepare_generates_listops_then_reports_it_complete(tmp_path, capsys):
    args = ["data", "prepare", "lra", "--task", "listops", "--data-dir", str(tmp_path), *TINY]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train  ok      30 of 30 expected" in out
    assert (tmp_path / "lra_release" / "listops-short" / "basic_test.tsv").is_file()
    assert main([*args[:5], "--check-only", *args[5:]]) == 0


def test_prepare_follows_experiment_overrides(tmp_path, capsys):
    main(
        [
            "data",
            "prepare",
            "lra",
            "--task",
            "listops",
            "--check-only",
            "--data-dir",
            str(tmp_path),
            "experiment=lra/listops",
        ]
    )
    out = capsys.readouterr().out
    assert "listops-1000/basic_train.tsv" in out and "of 96,000 expected" in out


def test_retrieval_missing_is_reported_not_raised(tmp_path, capsys):
    assert main(["data", "prepare", "lra", "--task", "retrieval", "--data-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "dataset not found" in out and "lra_release.gz" in out


def test_the_how_to_is_said_once(tmp_path, hf_cache, capsys):
    """Preparing Text with no data: the error names the how-to, and the status table does not repeat it."""
    assert main(["data", "prepare", "lra", "--task", "text", "--data-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.count("Download aclImdb_v1.tar.gz") == 1, out
    assert f"{tmp_path}/aclImdb/train" in out  # the table is still there
    assert (
        main(["data", "prepare", "lra", "--task", "text", "--check-only", "--data-dir", str(tmp_path)]) == 1
    )
    assert "how to obtain: Download aclImdb_v1.tar.gz" in capsys.readouterr().out  # the only place it is said


@pytest.mark.parametrize(
    ("signum", "name", "status"), [("SIGINT", "Ctrl-C", 130), ("SIGTERM", "SIGTERM", 143)]
)
def test_a_signal_while_pathfinder_generates_is_one_line_and_leaves_nothing_half_written(
    tmp_path, signum, name, status, terminal_signals
):
    """Ctrl-C reaches the whole process group: the pool's workers each printed a traceback (58 lines);
    a SIGTERM (``kill <pid>``) left temporary files in the data dir."""
    import os
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "attnlab.cli.main", "data", "prepare", "lra", "--task", "pathfinder"]
    process = subprocess.Popen(
        [*command, "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(tmp_path.rglob("sample_*.png")):
            assert process.poll() is None, process.communicate()
            time.sleep(0.2)
        assert any(tmp_path.rglob("sample_*.png")), "generation never started"
        if signum == "SIGINT":
            os.killpg(process.pid, signal.SIGINT)  # as the terminal sends it
        else:
            process.send_signal(signal.SIGTERM)  # `kill <pid>`
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == status
    assert "Traceback" not in err
    lines = [line for line in err.replace("\r", "\n").splitlines() if "interrupted" in line]
    assert lines == [
        f"attnlab data: interrupted ({name}); what was complete is kept, run the command again to continue"
    ]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")], "half-written files left"
