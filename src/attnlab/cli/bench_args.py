"""What the ``attnlab bench`` sub-commands (and ``attnlab generate``) share: argument types and options."""

from __future__ import annotations

import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def out_dir(text: str) -> Path:
    """An output folder: refused when a file of that name is in the way (mkdir's traceback otherwise)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder; give a folder for the results")
    return path


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_names_argument(parser, flag: str, names, what: str, default=None) -> None:
    """``flag NAME [NAME ...]`` choosing among ``names`` (``default``, or all); the help lists them."""
    chosen = "all" if default is None else ", ".join(default)
    parser.add_argument(
        flag, nargs="+", default=list(names if default is None else default), choices=list(names),
        metavar="NAME", help=f"{what} (known: {', '.join(names)}; default: {chosen})",
    )  # fmt: skip


def add_op_shape_arguments(parser, seq_lens: list[int], heads: int, dtypes, dtype: str) -> None:
    """The shape of the random op inputs (B, H, T, D) and their dtype: what `bench attention` and
    `bench bytes` both take, each with its own defaults."""
    parser.add_argument("--seq-lens", nargs="+", type=positive_int, default=seq_lens, metavar="T")
    parser.add_argument("-B", "--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=heads)
    parser.add_argument("--dim", type=positive_int, default=64, help="head dimension D")
    parser.add_argument("--dtype", choices=sorted(dtypes), default=dtype)
