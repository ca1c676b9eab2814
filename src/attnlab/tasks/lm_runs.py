"""A ``task=lm`` run read back for ``attnlab generate``: its model, its tokenizer, its positions.

The model is rebuilt from the run's ``config.yaml`` (beside ``checkpoints/``) and the checkpoint's
weights (a run dir: its best checkpoint, else ``last.ckpt``); the tokenizer comes from the checkpoint
(``attnlab_lm``). The prompt is prefilled with the parallel causal op, then each new token costs one
recurrent step (`attnlab.tasks.sampling`).

A model with a position table (learned, sinusoidal) generates up to its ``max_len`` positions; one
without (RoPE, none) up to 100,000 new tokens, more with ``--allow-long`` (`fit_length`).
"""

from __future__ import annotations

from pathlib import Path

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
    from attnlab.run.resume import checkpoint_weights, read_checkpoint
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


def decoded_text(tokenizer, ids: list[int]) -> str:
    """Decoded text, each ``</s>`` (the document separator) shown as a paragraph break."""
    pieces, run = [], []
    for i in ids:
        if i == tokenizer.eos_id:
            pieces.append(tokenizer.decode(run) + "\n\n")
            run = []
        elif i not in tokenizer.special_ids:
            run.append(i)
    return "".join(pieces) + tokenizer.decode(run)


def fit_length(model, prompt_tokens: int, max_new_tokens: int, allow_long: bool = False) -> None:
    """Refuse a generation longer than the model's positions allow; a model without a position table
    (RoPE, none) gets its ``max_len`` raised to the tokens it will read (nothing in it ends there)."""
    # positions the model reads: the prompt's and every new token's but the last (never fed back)
    total = prompt_tokens + max_new_tokens - 1
    if total <= model.max_len:
        return
    if model.positions in ("learned", "sinusoidal"):  # its position table ends there
        if prompt_tokens >= model.max_len:
            raise UserError(
                f"--prompt: its {prompt_tokens} tokens fill the model's {model.max_len} positions "
                f"({model.positions} positions); give at most {model.max_len - 1}"
            )
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: the prompt's {prompt_tokens} tokens and the new "
            f"ones exceed the model's {model.max_len} positions ({model.positions} positions); "
            f"ask for at most {model.max_len - prompt_tokens + 1}"
        )
    if max_new_tokens > LONG_GENERATION and not allow_long:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: more than {LONG_GENERATION:,} new tokens, "
            f"{total // model.max_len}× the {model.max_len} positions the model was built for "
            f"({model.positions} positions have no end); add --allow-long if you mean it"
        )
    model.max_len = total
