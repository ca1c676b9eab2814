"""``python -m attnlab.cli.gpu_results {probe,collect} OUT``: ``make bench-gpu``'s first and last steps.

The arguments of `attnlab.bench.gpu_results` (what is probed and collected: its docstring).
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnlab.bench import gpu_results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("probe", "collect"):
        print("usage: python -m attnlab.cli.gpu_results {probe,collect} OUT", file=sys.stderr)
        return 2
    out = Path(argv[1])
    if argv[0] == "collect" and not out.is_dir():
        print(f"error: {out} is not a folder of bench-gpu results", file=sys.stderr)
        return 2
    if argv[0] == "probe":
        print(gpu_results.probe_line(gpu_results.probe(out)))
    else:
        gpu_results.print_summary(gpu_results.collect(out), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
