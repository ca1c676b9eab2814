"""`attnlab dashboard`: started as a user starts it, then read through TensorBoard's HTTP API and a browser.

The runs are written as training writes them: a `summary.json` and a Lightning TensorBoard log (with
Lightning's own HParams record of the whole config, which must not leak into the dashboard's table).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from attnlab.reporting import parse_summary
from attnlab.reporting.dashboard import METRIC_PREFIX, session_names

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "dashboards.md"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# (task, attn, seed, seq_len, test_acc, val_acc, train samples/s, peak MB); one run did not test
RUNS = [
    ("listops", "softmax", 0, 2000, 0.3712, 0.3805, 101.5, 1234.5),
    ("listops", "sliced_relu", 0, 2000, 0.4031, 0.4102, 212.25, 567.0),
    ("image", "linear", 1, 1024, None, 0.4219, 333.0, 89.5),
]
STAMP = "2026-01-0{}_10-00-00"
RUN_NAMES = [f"{task}/{attn}/{STAMP.format(i + 1)}" for i, (task, attn, *_) in enumerate(RUNS)]
# the servers are stopped with Ctrl-C, and never two at once (ports, timing)
pytestmark = pytest.mark.usefixtures("terminal_signals")


def _write_run(root: Path, index: int, task, attn, seed, seq_len, test_acc, val_acc, sps, mem) -> Path:
    from lightning.pytorch.loggers import TensorBoardLogger

    run_dir = root / task / attn / STAMP.format(index + 1)
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="")
    logger.log_hyperparams({"task": task, "attn": attn, "seed": seed, "config/lr": 1e-3, "config/dim": 64})
    for step in (10, 20, 30):
        logger.log_metrics({"val/acc": val_acc * step / 30, "train/loss": 3.0 - step / 30}, step=step)
    logger.finalize("success")
    summary = {
        "task": task,
        "attn": attn,
        "seed": seed,
        "val_acc": val_acc,
        "test_acc": test_acc,
        "baseline_acc": 0.1,
        "train_samples_per_sec": sps,
        "eval_samples_per_sec": 3 * sps,
        "peak_mem_mb": mem,
        "params": 12345,
        "wall_time_s": 60.0,
        "steps": 30,
        "seq_len": seq_len,
        "world_size": 1,
        "git_commit": "abc123",
        "data_source": "generated",
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    """A project dir with `outputs/` holding the RUNS (module scope: Lightning's logger is slow to import)."""
    project = tmp_path_factory.mktemp("project")
    for index, run in enumerate(RUNS):
        _write_run(project / "outputs", index, *run)
    return project / "outputs"


def _doc_command(prefix: str) -> list[str]:
    """The one command of docs/dashboards.md that starts with ``prefix`` (so the doc and test agree)."""
    lines = [line.split("#")[0].strip() for line in DOC.read_text().splitlines()]
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, f"expected one `{prefix}...` line in {DOC}, found {found}"
    return shlex.split(found[0])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _dashboard(argv: list[str], cwd: Path, tmpdir: Path | None = None):
    """Start `attnlab ...` as a user would; yield (process, URL) once it has printed its URL line."""
    attnlab = Path(sys.executable).with_name("attnlab")
    command = [str(attnlab), *argv] if attnlab.exists() else [sys.executable, "-m", "attnlab.cli.main", *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), *sys.path])}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline().strip()  # blocks until the URL or the end of output
        if not re.fullmatch(r"http://[^\s/]+:\d+/", line):
            process.kill()
            _, err = process.communicate(timeout=30)
            pytest.fail(f"no URL line from {argv}, got {line!r}; stderr: {err[-3000:]}")
        yield process, line
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # Ctrl-C
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        process.stdout.close()
        process.stderr.close()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def _hparams_table(url: str) -> tuple[dict, list[dict]]:
    """The HParams experiment and its session groups, as the HPARAMS tab requests them."""
    experiment = _post(url + "data/plugin/hparams/experiment", {"experimentName": ""})
    columns = [{"hparam": h["name"]} for h in experiment["hparamInfos"]]
    columns += [{"metric": m["name"]} for m in experiment["metricInfos"]]
    request = {
        "experimentName": "",
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
        "colParams": [{**c, "order": "ORDER_UNSPECIFIED", "missingValuesFirst": False} for c in columns],
        "startIndex": 0,
        "sliceSize": 100,
    }
    return experiment, _post(url + "data/plugin/hparams/session_groups", request)["sessionGroups"]


def test_documented_command_serves_every_run_with_its_summary_and_curves(outputs, tmp_path):
    argv = _doc_command("attnlab dashboard ")
    assert argv[:3] == ["attnlab", "dashboard", "outputs"], argv
    with _dashboard(argv[1:], cwd=outputs.parent, tmpdir=tmp_path) as (process, url):
        assert process.poll() is None, "the dashboard must keep serving after printing its URL"
        assert [p.name.startswith("attnlab-dashboard-") for p in tmp_path.iterdir()] == [True]
        experiment, groups = _hparams_table(url)

        hparams = [h["name"] for h in experiment["hparamInfos"]]
        assert sorted(hparams[:4]) == ["attn", "seed", "seq_len", "task"], "not the columns on screen"
        assert not any(name.startswith("config/") for name in hparams), "a run's own HParams leaked in"
        metric_tags = [m["name"]["tag"] for m in experiment["metricInfos"]]
        shown = ["test_acc", "val_acc", "train_samples_per_sec", "eval_samples_per_sec", "peak_mem_mb"]
        assert metric_tags[:5] == [METRIC_PREFIX + name for name in shown], "not the metrics on screen"

        by_name = {group["name"]: group for group in groups}
        assert sorted(by_name) == sorted(
            f"{t}/{a}/{STAMP.format(i + 1)}" for i, (t, a, *_) in enumerate(RUNS)
        )
        for index, (task, attn, seed, seq_len, test_acc, val_acc, sps, mem) in enumerate(RUNS):
            group = by_name[f"{task}/{attn}/{STAMP.format(index + 1)}"]
            assert group["hparams"]["task"] == task and group["hparams"]["attn"] == attn
            assert group["hparams"]["seed"] == str(seed) and group["hparams"]["seq_len"] == seq_len
            metrics = {
                m["name"]["tag"].removeprefix(METRIC_PREFIX): m["value"] for m in group["metricValues"]
            }
            expected = {
                "test_acc": test_acc,
                "val_acc": val_acc,
                "train_samples_per_sec": sps,
                "peak_mem_mb": mem,
            }
            for key, value in expected.items():
                if value is None:
                    assert key not in metrics, (key, metrics)  # not run: an empty cell, not a made-up 0
                else:
                    assert metrics[key] == pytest.approx(value, rel=1e-6), key

        # the curves came along, under the same run names; Lightning's hp_metric placeholder did not
        run = f"listops/softmax/{STAMP.format(1)}"
        tags = _get(url + "data/plugin/scalars/tags")[run]
        assert {"val/acc", "train/loss", METRIC_PREFIX + "test_acc"} <= set(tags) and "hp_metric" not in tags
        points = _get(url + f"data/plugin/scalars/scalars?run={run}&tag=val/acc")
        assert [p[1] for p in points] == [10, 20, 30]
        assert points[-1][2] == pytest.approx(RUNS[0][5])

        process.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop that removes its log dir
        assert process.wait(timeout=30) == 0, process.stderr.read()[-2000:]
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


class _Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4; no extra package).

    Unlike ``--dump-dom``, page text is read through the shadow roots TensorBoard's components render
    into, and the page is polled until the table is there instead of guessing a time budget.
    """

    def __init__(self, profile: Path, width: int, height: int):
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()

        def at_fds_3_and_4():  # in the child, before exec: the two pipe ends Chromium expects
            ends = os.dup(to_browser), os.dup(from_browser)
            os.dup2(ends[0], 3)
            os.dup2(ends[1], 4)
            for fd in {*ends, to_browser, from_browser, self._to_browser, self._from_browser} - {3, 4}:
                os.close(fd)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic"]
        flags += ["--no-first-run", "--disable-background-networking", "--disable-component-update"]
        flags += ["--disable-sync", f"--user-data-dir={profile}", f"--window-size={width},{height}"]
        self._process = subprocess.Popen(
            [CHROMIUM, *flags, "--remote-debugging-pipe", "about:blank"],
            preexec_fn=at_fds_3_and_4,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._last_id, self._session = b"", 0, None
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        except BaseException:
            self.close()
            raise
        # the page itself at width x height (--window-size counts the window's frame too)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, **params) -> dict:
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params}
        if self._session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:  # replies and events, each JSON text ended by a NUL byte
            while b"\0" not in self._buffer:
                ready, _, _ = select.select([self._from_browser], [], [], 60)
                assert ready, f"chromium did not answer {method} within 60 s"
                chunk = os.read(self._from_browser, 1 << 16)
                assert chunk, f"chromium closed the DevTools pipe during {method}"
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._last_id:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def text(self) -> str:
        """The page's visible text, shadow DOM included."""
        script = """(() => { const parts = [];
            const walk = (node) => {
              if (node.nodeName === 'STYLE' || node.nodeName === 'SCRIPT') return;
              if (node.nodeType === Node.TEXT_NODE) parts.push(node.data);
              if (node.shadowRoot) walk(node.shadowRoot);
              for (const child of node.childNodes) walk(child);
            };
            walk(document); return parts.join(' ').replace(/\\s+/g, ' '); })()"""
        return self.call("Runtime.evaluate", expression=script, returnByValue=True)["result"]["value"]

    def close(self) -> None:
        with contextlib.suppress(AssertionError, OSError):
            self.call("Browser.close")
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (.ci/run installs it from Debian)")
def test_runs_table_renders_in_headless_chromium(outputs, tmp_path):
    """The HPARAMS table as a browser draws it: every run's row with its numbers, and a non-blank image.

    ``ATTNLAB_SCREENSHOT=docs/dashboard_hparams.png`` also saves the screenshot there (the docs' image).
    """
    from PIL import Image

    with _dashboard(["dashboard", "outputs", "--port", str(_free_port())], cwd=outputs.parent) as (_, url):
        browser = _Browser(tmp_path / "profile", width=2300, height=560)
        try:
            browser.call("Page.navigate", url=url + "#hparams")
            deadline = time.monotonic() + 60
            loaded = ("TABLE VIEW", "Color by", *RUN_NAMES)  # the table's rows come after its header
            while not all(part in (text := browser.text()) for part in loaded):
                assert time.monotonic() < deadline, f"no HParams table after 60 s; page text: {text[-2000:]}"
                time.sleep(0.25)
            png = tmp_path / "hparams.png"
            png.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
        finally:
            browser.close()

    table = text[text.index("TABLE VIEW") : text.index("Color by")]  # the table view's own text
    for column in (
        "backend",
        "seed",
        "seq len",
        "task",
        "test acc",
        "val acc",
        "train samples/s",
        "peak mem MB",
    ):
        assert column in table, f"column {column!r} is not in the rendered table: {table}"
    rows = {  # name, backend, seed, seq len, task, data, then the metrics, as TensorBoard formats them
        RUN_NAMES[0]: "softmax 0 2000.0 listops generated 0.37120 0.38050 101.50 304.50 1234.5",
        RUN_NAMES[1]: "sliced_relu 0 2000.0 listops generated 0.40310 0.41020 212.25 636.75 567.00",
        RUN_NAMES[2]: "linear 1 1024.0 image generated 0.42190 333.00 999.00 89.500",  # no test acc
    }
    for name, cells in rows.items():
        assert f"{name} {cells}" in table, f"row {name} should read {cells!r}: {table}"

    image = Image.open(png).convert("RGB")
    assert image.size == (2300, 560)
    pixels = list(image.getdata())
    colours = len(set(pixels))
    non_white = sum(1 for p in pixels if min(p) < 230) / len(pixels)
    blank = f"blank screenshot: {colours} colours, {non_white:.1%} non-white"
    assert colours > 50 and non_white > 0.02, blank
    if os.environ.get("ATTNLAB_SCREENSHOT"):
        image.save(os.environ["ATTNLAB_SCREENSHOT"], optimize=True)


def test_port_in_use_is_an_error_naming_it(outputs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "attnlab.cli.main", "dashboard", str(outputs), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2 and result.stdout == ""
    assert f"port {port} is in use on 127.0.0.1" in result.stderr and "--port 0" in result.stderr


def test_dirs_without_summaries_are_named(tmp_path, capsys):
    from attnlab.cli.main import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "also_empty").mkdir()
    assert main(["dashboard", str(tmp_path / "empty"), str(tmp_path / "also_empty")]) == 2
    err = capsys.readouterr().err
    assert f"no summary.json under {tmp_path / 'empty'}, {tmp_path / 'also_empty'}" in err
    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    assert f"{str(tmp_path / 'missing')!r} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_bad_port_is_refused(port, capsys):
    from attnlab.cli.main import main

    with pytest.raises(SystemExit):
        main(["dashboard", "outputs", "--port", port])
    assert f"{port!r} is not a port number" in capsys.readouterr().err


def test_session_names_are_the_run_dirs_below_their_common_parent(outputs):
    runs = [parse_summary(p) for p in sorted(outputs.rglob("summary.json"))]
    assert (
        session_names(runs) == [f"{t}/{a}/{STAMP.format(i + 1)}" for i, (t, a, *_) in enumerate(RUNS)][::-1]
    )
    assert session_names(runs[:1]) == [runs[0].path.parent.name]  # one run: its own dir name


def test_documented_tensorboard_command_shows_the_runs_own_logs_and_hparams(outputs):
    """`tensorboard --logdir outputs` (the TensorBoard section of the doc) on the runs' own event files."""
    argv = _doc_command("tensorboard ")
    assert argv == ["tensorboard", "--logdir", "outputs"], argv
    executable = Path(sys.executable).with_name("tensorboard")
    process = subprocess.Popen(
        [str(executable), *argv[1:]],
        cwd=outputs.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for (
            line
        ) in process.stderr:  # TensorBoard announces "TensorBoard <version> at <URL> (Press CTRL+C...)"
            if match := re.search(r" at (http://\S+/) ", line):
                break
        else:
            pytest.fail(f"tensorboard exited with {process.wait()} before printing its URL")
        url = match.group(1)
        runs = _get(url + "data/runs")
        for _ in range(60):  # the first load runs in the background
            if len(runs) == len(RUN_NAMES):
                break
            time.sleep(0.5)
            runs = _get(url + "data/runs")
        assert sorted(runs) == sorted(f"{name}/tensorboard" for name in RUN_NAMES)  # as the doc says
        experiment = _post(url + "data/plugin/hparams/experiment", {"experimentName": ""})
        assert {"task", "attn", "seed"} <= {h["name"] for h in experiment["hparamInfos"]}  # HPARAMS tab
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stderr.close()


def test_unknown_host_is_an_error_naming_it(outputs, capsys):
    from attnlab.cli.main import main

    assert main(["dashboard", str(outputs), "--host", "no-such-host.invalid", "--port", "0"]) == 2
    assert "cannot serve on --host 'no-such-host.invalid'" in capsys.readouterr().err


def test_address_of_another_machine_is_an_error_naming_it(outputs, capsys):
    from attnlab.cli.main import main

    # 192.0.2.1 (TEST-NET-1, RFC 5737) resolves but is no address of this machine: the bind fails
    assert main(["dashboard", str(outputs), "--host", "192.0.2.1", "--port", "0"]) == 2
    assert "cannot listen on 192.0.2.1:0" in capsys.readouterr().err


def test_a_host_beyond_this_machine_is_warned_about(outputs, capsys):
    """The runs (configs, metrics, paths) go to whoever can reach the address: say so before serving.
    (192.0.2.1 is no address of this machine, so nothing is served here; see the test above.)"""
    from attnlab.cli.dashboard import is_loopback
    from attnlab.cli.main import main

    assert main(["dashboard", str(outputs), "--host", "192.0.2.1", "--port", "0"]) == 2
    assert "warning: --host 192.0.2.1 serves the runs" in capsys.readouterr().err
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.org"))


def test_the_server_waits_until_sigterm_and_gives_the_handler_back():
    """The main thread's wait (the server is a daemon thread) outlasts its poll interval and ends on
    SIGTERM, with the caller's SIGTERM handler restored."""
    from attnlab.cli.dashboard import _wait_until_stopped

    previous = signal.getsignal(signal.SIGTERM)

    def terminate_once_waiting():
        while signal.getsignal(signal.SIGTERM) is previous:  # until the wait's handler is in
            time.sleep(0.01)
        time.sleep(0.8)  # past one 0.5 s poll
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=terminate_once_waiting)
    started = time.monotonic()
    sender.start()
    _wait_until_stopped()
    sender.join()
    assert time.monotonic() - started >= 0.8
    assert signal.getsignal(signal.SIGTERM) is previous
