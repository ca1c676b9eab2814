"""``python -m attnlab.cli.gpu_check OUT --backend NAME``: one Triton op checked on the device.

The arguments of `attnlab.bench.gpu_check` (what is checked and how: its docstring); ``make bench-gpu``
runs it once per op, each in its own process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab.bench import gpu_check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnlab.cli.gpu_check", description=gpu_check.__doc__.split("\n")[0]
    )
    parser.add_argument("out", type=Path, help="results folder; writes <out>/check/<backend>.json")
    parser.add_argument("--backend", required=True, choices=gpu_check.BACKENDS)
    parser.add_argument("--dtypes", nargs="+", default=list(gpu_check.DTYPES), choices=list(gpu_check.DTYPES))
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu with TRITON_INTERPRET=1 (the tests)"
    )
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    return gpu_check.run(args.out, args.backend, args.dtypes, device=args.device)


if __name__ == "__main__":
    sys.exit(main())
