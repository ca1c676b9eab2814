"""``attnlab dashboard [DIR ...] [--host H] [--port P]``: the arguments, and serving until Ctrl-C.

What is served, and why from a fresh log dir, is in `attnlab.reporting.dashboard`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from attnlab.reporting.dashboard import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DashboardError,
    load_runs,
    start_tensorboard,
    write_logdir,
)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `dashboard` sub-command to the `attnlab` parser."""
    parser = subparsers.add_parser(
        "dashboard",
        help="browse runs in TensorBoard: an HParams table of every run + their curves",
        description=(
            "Collect every summary.json under the given run or sweep directories and serve a TensorBoard "
            "whose HPARAMS tab lists each run (task, backend, seed, sequence length, ...) with its test and "
            "val accuracy, throughput and peak memory, and whose SCALARS tab has the runs' curves. Prints "
            "the URL on a line of its own, then serves until Ctrl-C."
        ),
    )
    parser.add_argument(
        "dirs", nargs="*", type=Path, default=[Path("outputs")], metavar="DIR",
        help="run or sweep directories (default: outputs/, as attnlab report)",
    )  # fmt: skip
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0 for all)",
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=None,
        help=f"port to serve on; 0 = any free port (default: {DEFAULT_PORT}, or the next free one)",
    )
    parser.set_defaults(func=run)
    return parser


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0 = any free port)")
    return port


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: its addresses may be anyone's


def run(args: argparse.Namespace) -> int:
    """Build the log dir, serve it, block until Ctrl-C or SIGTERM; 2 on bad input (message on stderr)."""
    if not is_loopback(args.host):
        print(
            f"attnlab dashboard: warning: --host {args.host} serves the runs (configs, metrics, paths) to "
            "every machine that can reach this one on the network, without a password; the default "
            f"{DEFAULT_HOST} keeps them on this machine (reach it from elsewhere with `ssh -L`)",
            file=sys.stderr,
            flush=True,
        )
    with tempfile.TemporaryDirectory(prefix="attnlab-dashboard-") as logdir:
        try:
            runs = load_runs(args.dirs)
            write_logdir(runs, Path(logdir))
            url = start_tensorboard(logdir, host=args.host, port=args.port)
        except DashboardError as err:
            print(f"attnlab dashboard: error: {err}", file=sys.stderr)
            return 2
        print(url, flush=True)
        print(
            f"attnlab dashboard: {len(runs)} run(s); runs table: {url}#hparams (Ctrl-C to stop)",
            file=sys.stderr,
            flush=True,
        )
        _wait_until_stopped()
    return 0


def _wait_until_stopped() -> None:
    """Block the main thread (the server runs in a daemon thread) until Ctrl-C or SIGTERM."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
