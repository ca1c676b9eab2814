"""``attnlab generate <run dir or .ckpt> --prompt TEXT --max-new-tokens N``: text from a ``task=lm`` run.

The model is rebuilt from the run's ``config.yaml`` (beside ``checkpoints/``) and the checkpoint's
weights (a run dir: its best checkpoint, else ``last.ckpt``); the tokenizer comes from the checkpoint
(``attnlab_lm``). The prompt is prefilled with the parallel causal op, then each new token costs one
recurrent step (`attnlab.tasks.sampling`). The text goes to stdout, the progress bar and the speed
(tokens/s) to stderr.

A model with a position table (learned, sinusoidal) generates up to its ``max_len`` positions; one
without (RoPE, none) up to 100,000 new tokens, more with ``--allow-long``. The progress bar shows the
tokens done, the rate and the time left.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab.cli.bench_args import positive_int
from attnlab.errors import UserError
from attnlab.tasks import lm_runs


def main(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from attnlab.tasks.sampling import check_sampling, generate

    try:
        check_sampling(args.temperature, args.top_k, args.max_new_tokens)
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {args.device}: CUDA is not available here (use --device cpu)")
        model, tokenizer, cfg = lm_runs.load_run(args.run, args.device)
        prompt = lm_runs.encode_prompt(tokenizer, args.prompt)
        lm_runs.fit_length(model, len(prompt), args.max_new_tokens, args.allow_long)
    except UserError as err:
        print(f"attnlab generate: error: {err}", file=sys.stderr)
        return 2
    bar = tqdm(
        total=args.max_new_tokens, unit="tok", file=sys.stderr, disable=args.quiet, leave=False,
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} tokens [{elapsed}, ETA {remaining}, {rate_fmt}]",
    )  # fmt: skip
    out = generate(
        model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
        on_token=lambda _: bar.update(1),
    )  # fmt: skip
    bar.close()
    print(args.prompt + lm_runs.decoded_text(tokenizer, out.tokens))
    print(
        f"{cfg.attn.name}: {len(out.tokens)} tokens in {out.decode_s:.2f} s "
        f"({out.tokens_per_s:,.1f} tokens/s), "
        f"prompt of {len(prompt)} tokens prefilled in {1000 * out.prefill_s:.1f} ms",
        file=sys.stderr,
    )
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="sample text from a task=lm run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "run", type=Path, help="a task=lm run dir (outputs/lm/<attn>/<date>) or a .ckpt in one"
    )
    parser.add_argument(
        "--prompt", default="", help="text to continue (default: from the start of a document)"
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: always the likeliest token")
    parser.add_argument("--top-k", type=positive_int, default=None, help="sample among the k likeliest only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--allow-long", action="store_true",
        help=f"allow more than {lm_runs.LONG_GENERATION:,} new tokens from a model without a position table",
    )  # fmt: skip
    parser.set_defaults(func=main)
