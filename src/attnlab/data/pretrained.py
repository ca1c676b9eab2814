"""A masked-LM checkpoint as fine-tuning reads it: the model's shape, its encoder weights, its tokenizer.

`attnlab.tasks.mlm.MaskedLMTask` writes ``attnlab_mlm`` (`CHECKPOINT_KEY`) into every checkpoint: the
model's constructor values and the tokenizer's vocabulary and merges, as plain values so that the file
still loads with ``weights_only`` (`attnlab.run.resume.read_checkpoint`). Both the GLUE data module (which
must tokenize exactly as pretraining did) and the GLUE task (which loads the encoder) read it here, so
neither reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from attnlab.data.tokenizer import BPETokenizer, from_strings
from attnlab.errors import CheckpointError, ConfigError
from attnlab.run.resume import read_checkpoint

CHECKPOINT_KEY = "attnlab_mlm"
#: the constructor values a fine-tuned model must share with the pretrained one
SHAPE_KEYS = (
    "vocab_size", "dim", "depth", "num_heads", "mlp_dim", "max_len", "qkv_dim", "pad_id", "short_conv"
)  # fmt: skip
BACKBONE = "model.backbone."


@dataclass
class Pretrained:
    """What fine-tuning takes from a masked-LM checkpoint."""

    path: Path
    shape: dict
    tokenizer: BPETokenizer
    state_dict: dict[str, torch.Tensor]

    def model_shape(self) -> dict:
        return {k: self.shape.get(k) for k in SHAPE_KEYS}

    def backbone(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix(BACKBONE): v for k, v in self.state_dict.items() if k.startswith(BACKBONE)}


def read_pretrained(path: str | Path | None) -> Pretrained:
    """A `task=mlm` checkpoint, loaded safely; `CheckpointError` names the file when it is not one."""
    if path is None:
        raise ConfigError(
            "task.pretrained is not set: give the .ckpt of a task=mlm run "
            "(e.g. task.pretrained=outputs/mlm/<attn>/<date>/checkpoints/best-....ckpt)"
        )
    checkpoint = read_checkpoint(path, "task.pretrained")
    saved = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(saved, dict) or not saved.get("tokenizer") or not saved.get("model"):
        raise CheckpointError(
            f"task.pretrained {path} is not a masked-LM checkpoint: it has no {CHECKPOINT_KEY!r} entry with "
            "the model shape and tokenizer (give a checkpoint written by a task=mlm run)"
        )
    files = saved["tokenizer"]
    tokenizer = from_strings(files["vocab"], files["merges"], f"{path} (the pretrained checkpoint's)")
    state = checkpoint.get("state_dict", {})
    if not any(k.startswith(BACKBONE) for k in state):
        raise CheckpointError(f"task.pretrained {path}: its state_dict has no {BACKBONE}* weights")
    return Pretrained(Path(path), dict(saved["model"]), tokenizer, state)
