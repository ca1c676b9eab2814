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
from attnlab.errors import CheckpointError, UserError

LM_TARGET = "attnlab.models.causal_lm.CausalLM"
#: new tokens a model without a position table (RoPE, none) generates without --allow-long: far past
#: its training context, and hours on a CPU
LONG_GENERATION = 100_000


def find_run(path: Path) -> tuple[Path, Path]:
    """(config.yaml, checkpoint) of a run dir or of a checkpoint inside one."""
    if not path.exists():
        raise UserError(
            f"{path}: no such run dir or checkpoint (give outputs/lm/<attn>/<date> or a .ckpt in it)"
        )
    if path.is_file():
        checkpoint = path
        candidates = [path.parent / "config.yaml", path.parent.parent / "config.yaml"]
        config = next((c for c in candidates if c.is_file()), None)
        if config is None:
            raise UserError(
                f"{path}: no config.yaml beside it or in its run dir; give the run dir it came from"
            )
        return config, checkpoint
    config = path / "config.yaml"
    if not config.is_file():
        raise UserError(
            f"{path} is not a run dir: it has no config.yaml (a `python train.py task=lm` run has one)"
        )
    folder = path / "checkpoints"
    best = sorted(folder.glob("best-*.ckpt"), key=lambda p: p.stat().st_mtime)
    checkpoint = best[-1] if best else folder / "last.ckpt"
    if not checkpoint.is_file():
        raise UserError(f"{path}: no checkpoint in {folder} (the run saved none yet)")
    return config, checkpoint


def load_run(path: Path, device: str = "cpu"):
    """(model in eval mode, tokenizer, config) of a causal LM run."""
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    from attnlab.data.tokenizer import from_strings
    from attnlab.resume import checkpoint_weights, read_checkpoint
    from attnlab.tasks.lm import CHECKPOINT_KEY

    config_path, checkpoint_path = find_run(path)
    try:
        cfg = OmegaConf.load(config_path)
    except Exception as err:  # yaml's and OmegaConf's errors share no base class
        raise UserError(f"{config_path}: not a readable run config ({str(err).splitlines()[0]})") from err
    if not isinstance(cfg, DictConfig):
        raise UserError(f"{config_path}: not a run config (a mapping of keys)")
    task = OmegaConf.select(cfg, "task.name")
    target = OmegaConf.select(cfg, "task.model._target_")
    if target != LM_TARGET:
        raise UserError(
            f"{path} is a task={task} run (model {target}); generate needs a causal language model: "
            "a `python train.py task=lm attn=...` run"
        )
    checkpoint = read_checkpoint(checkpoint_path)
    saved = checkpoint.get(CHECKPOINT_KEY) or {}
    files = saved.get("tokenizer")
    if not files:
        raise CheckpointError(
            f"{checkpoint_path} has no tokenizer ({CHECKPOINT_KEY!r}): a task={task} checkpoint; generate "
            "reads text models trained with task=lm"
        )
    tokenizer = from_strings(files["vocab"], files["merges"], f"{checkpoint_path} (its tokenizer)")
    model = instantiate(cfg.task.model, attention=instantiate(cfg.attn), vocab_size=tokenizer.vocab_size)
    weights = checkpoint_weights(checkpoint_path, "checkpoint")
    state = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    model.load_state_dict(state)
    return model.to(device).eval(), tokenizer, cfg


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """``<s>`` and the prompt's ids, as the model saw text in training; refuses what it cannot encode."""
    ids = tokenizer.encode(prompt)
    if tokenizer.unk_id in ids:
        bad = sorted({ch for ch in prompt if tokenizer.unk_id in tokenizer.encode(ch)})
        raise UserError(f"--prompt holds characters the tokenizer does not know: {''.join(bad)!r}")
    return [tokenizer.bos_id, *ids]


def _text(tokenizer, ids: list[int]) -> str:
    """Decoded text, each ``</s>`` (the document separator) shown as a paragraph break."""
    pieces, run = [], []
    for i in ids:
        if i == tokenizer.eos_id:
            pieces.append(tokenizer.decode(run) + "\n\n")
            run = []
        elif i not in tokenizer.special_ids:
            run.append(i)
    return "".join(pieces) + tokenizer.decode(run)


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
        model, tokenizer, cfg = load_run(args.run, args.device)
        prompt = encode_prompt(tokenizer, args.prompt)
        # positions the model reads: the prompt's and every new token's but the last (never fed back)
        total = len(prompt) + args.max_new_tokens - 1
        if total > model.max_len:
            if model.positions in ("learned", "sinusoidal"):  # its position table ends there
                if len(prompt) >= model.max_len:
                    raise UserError(
                        f"--prompt: its {len(prompt)} tokens fill the model's {model.max_len} positions "
                        f"({model.positions} positions); give at most {model.max_len - 1}"
                    )
                raise UserError(
                    f"--max-new-tokens {args.max_new_tokens}: the prompt's {len(prompt)} tokens and the new "
                    f"ones exceed the model's {model.max_len} positions ({model.positions} positions); "
                    f"ask for at most {model.max_len - len(prompt) + 1}"
                )
            if args.max_new_tokens > LONG_GENERATION and not args.allow_long:
                raise UserError(
                    f"--max-new-tokens {args.max_new_tokens}: more than {LONG_GENERATION:,} new tokens, "
                    f"{total // model.max_len}× the {model.max_len} positions the model was built for "
                    f"({model.positions} positions have no end); add --allow-long if you mean it"
                )
            model.max_len = total  # RoPE / no positions: nothing in the model ends at max_len
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
    print(args.prompt + _text(tokenizer, out.tokens))
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
        help=f"allow more than {LONG_GENERATION:,} new tokens from a model without a position table",
    )  # fmt: skip
    parser.set_defaults(func=main)
