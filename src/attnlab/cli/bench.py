"""``attnlab bench {attention,bytes,threads,training,generate,authors}``: the arguments of each benchmark.

What each one measures, and how, is in its module of `attnlab.bench` (shown by ``--help``); this
module only builds the parsers and hands the parsed arguments to it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.bench import attention, authors, bytes_moved, generate, training
from attnlab.bench import threads as thread_bench
from attnlab.bench.backends import BACKENDS
from attnlab.cli.bench_args import (
    add_names_argument,
    add_op_shape_arguments,
    out_dir,
    positive_float,
    positive_int,
)
from attnlab.run.compile_modes import COMPILE_CHOICES


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (attention ops)", description="Benchmarks.")
    kinds = bench.add_subparsers(
        dest="bench_kind", metavar="{attention,bytes,threads,training,generate,authors}"
    )
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    for add in (_attention, _bytes, _threads, _training, _generate, _authors):
        add(kinds)


def _kind(kinds, name: str, module, help: str) -> argparse.ArgumentParser:
    """A benchmark's parser, its module's docstring as the description."""
    return kinds.add_parser(
        name, help=help, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def _threads_option(parser, default: str) -> None:
    parser.add_argument(
        "--threads", type=positive_int, default=None,
        help=f"CPU threads for torch (default: {default}); 1 gives steadier figures on a busy machine",
    )  # fmt: skip


def _attention(kinds) -> None:
    parser = _kind(
        kinds, "attention", attention, "time and peak memory of the attention ops against sequence length"
    )
    parser.add_argument(
        "--backends", nargs="+", default=attention.DEFAULT_BACKENDS, choices=sorted(BACKENDS), metavar="NAME",
        help=f"backends to run (known: {', '.join(sorted(BACKENDS))}; default: %(default)s)",
    )  # fmt: skip
    add_op_shape_arguments(
        parser, attention.DEFAULT_SEQ_LENS, heads=8, dtypes=attention.DTYPES, dtype="float32"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--mode", nargs="+", choices=attention.MODES, default=list(attention.MODES))
    parser.add_argument(
        "--compile", choices=tuple(COMPILE_CHOICES), default="off",
        help="each op eager (off), under torch.compile as compile=true compiles it (on), or both",
    )  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed calls per cell (median)")
    parser.add_argument(
        "--timeout-s", type=positive_float, default=120.0,
        help="per-cell time limit in seconds, checked between calls (default: %(default)s)",
    )  # fmt: skip
    _threads_option(parser, "torch's choice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=out_dir, default=Path("bench_results"))
    parser.set_defaults(func=attention.main)


def _bytes(kinds) -> None:
    parser = _kind(
        kinds, "bytes", bytes_moved,
        "bytes each attention op reads and writes (torch ops and Triton kernels) against the floor",
    )  # fmt: skip
    known = bytes_moved.BYTE_BACKENDS
    parser.add_argument(
        "--backends", nargs="+", default=bytes_moved.DEFAULT_BACKENDS, choices=list(known), metavar="NAME",
        help=f"backends to count (known: {', '.join(known)}; default: %(default)s)",
    )  # fmt: skip
    add_op_shape_arguments(parser, [1024], heads=2, dtypes=bytes_moved.DTYPES, dtype="bfloat16")
    parser.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    parser.add_argument("--detail", action="store_true", help="every op and kernel, not the largest three")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=out_dir, default=Path("bench_results"))
    parser.set_defaults(func=lambda args: (bytes_moved.run(args), 0)[1])


def _threads(kinds) -> None:
    parser = _kind(
        kinds, "threads", thread_bench,
        "training steps quiet and beside busy processes, per CPU thread setting",
    )  # fmt: skip
    add_names_argument(parser, "--settings", thread_bench.SETTINGS, "thread settings to compare")
    parser.add_argument(
        "--busy", type=int, default=2, help="busy processes for the loaded runs (0: quiet only)"
    )
    parser.add_argument("--steps", type=positive_int, default=15, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs per setting")
    parser.add_argument(
        "--max-seconds", type=float, default=40.0, help="a run stops timing after this long (slow settings)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/threads.json"))
    parser.set_defaults(func=lambda args: (thread_bench.run(args), 0)[1])


def _training(kinds) -> None:
    parser = _kind(
        kinds, "training", training,
        "training samples/s per attention backend at each task's real sequence length",
    )  # fmt: skip
    add_names_argument(
        parser, "--tasks", training.TASKS, "tasks (lengths) to run", default=training.FIXED_TASKS
    )
    parser.set_defaults(tasks=None)  # not given: the fixed tasks, or the mixed ones under --packing
    add_names_argument(
        parser, "--backends", training.KNOWN_BACKENDS, "attention backends", default=training.BACKENDS
    )
    parser.add_argument(
        "--path", choices=("auto", "dense", "sorted"), default="auto", help="sliced backends' path"
    )
    parser.add_argument(
        "--positions", choices=("task", *training.POSITIONS), default="task",
        help="positions of every row (default: each task's own, as in TASKS)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", choices=tuple(COMPILE_CHOICES), default="off",
        help="eager models (off), under torch.compile as compile=true trains them (on), or both interleaved",
    )  # fmt: skip
    parser.add_argument(
        "--packing", choices=tuple(training.PACKING_CHOICES), default="off",
        help=f"the mixed-length tasks ({', '.join(training.MIXED)}; the default tasks when on or both) "
        "padded (off), packed (on), or both",
    )  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs per backend")
    parser.add_argument(
        "--stat", choices=("best", "median"), default="best", help="which run of each backend"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=20.0, help="a run stops timing after this long (slow backends)"
    )
    _threads_option(parser, "attnlab's cap")
    parser.add_argument("--out", type=Path, default=Path("bench_results/training.json"))
    parser.set_defaults(func=lambda args: (training.run(args), 0)[1])


def _generate(kinds) -> None:
    from attnlab.models.causal_lm import causal_backends

    parser = _kind(
        kinds, "generate", generate, "time per new token and decoding-state memory against context length"
    )
    parser.add_argument("--backends", nargs="+", default=causal_backends(), metavar="NAME")
    parser.add_argument(
        "--contexts", nargs="+", type=positive_int, default=generate.DEFAULT_CONTEXTS, metavar="N"
    )
    parser.add_argument("--dim", type=positive_int, default=512, help="model width (default: %(default)s)")
    parser.add_argument("--depth", type=positive_int, default=2, help="layers (default: %(default)s)")
    parser.add_argument("--heads", type=positive_int, default=8, help="heads (default: %(default)s)")
    parser.add_argument("--mlp-ratio", type=float, default=4.0, help="MLP width / dim (default: %(default)s)")
    parser.add_argument("--vocab", type=positive_int, default=2048, help="vocabulary (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed steps per cell (median)")
    parser.add_argument(
        "--timeout-s", type=float, default=120.0, help="skip larger contexts after a slower cell"
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=out_dir, default=Path("bench_results"))
    parser.set_defaults(func=generate.main)


def _authors(kinds) -> None:
    parser = _kind(
        kinds, "authors", authors,
        "attnlab's sliced layers against a transcription of the authors' published layers",
    )  # fmt: skip
    parser.add_argument("--dim", type=positive_int, default=1024)
    parser.add_argument("--heads", type=positive_int, default=64)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    parser.add_argument(
        "--real-tokens", type=positive_int, default=16, help="real tokens of the padded sequence"
    )
    parser.add_argument("--padding", type=positive_int, default=8, help="padded tokens, then 4 more")
    parser.add_argument("--dropout", type=positive_float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=lambda args: (authors.run(args), 0)[1])
