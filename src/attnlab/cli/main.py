"""The `attnlab` console script: one sub-command per job that is not training.

Each sub-command lives in its own module under `attnlab.cli` and exposes
`register(subparsers)`, which adds its parser and sets `func` (called with the parsed args,
returning an exit code). A module missing from the build simply leaves its sub-command out.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from attnlab import allocator, threads

SUBCOMMANDS = {
    "bench": "attnlab.cli.bench",
    "report": "attnlab.cli.report",
    "data": "attnlab.cli.data",
    "dashboard": "attnlab.cli.dashboard",
    "generate": "attnlab.cli.generate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnlab", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue  # sub-command not shipped in this build
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    threads.configure()  # before the sub-commands load torch (attnlab.threads says why)
    allocator.configure()  # freed buffers kept for reuse: no page faults per call (attnlab.allocator)
    parser = build_parser()
    # `key=value` config overrides may sit anywhere on the line; sub-commands that take them declare
    # an `overrides` argument, and anything else unrecognised is an error as usual
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(not e.count("=") or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as stop:  # one line, not a traceback per process: what is complete is kept
        name = getattr(stop, "signal_name", "Ctrl-C")  # SIGTERM where files were being written
        print(
            f"attnlab {args.command}: interrupted ({name}); what was complete is kept, run the command "
            f"again to continue",
            file=sys.stderr,
        )
        return 143 if name == "SIGTERM" else 130


if __name__ == "__main__":
    sys.exit(main())
