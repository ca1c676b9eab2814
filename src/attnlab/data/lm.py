"""Causal language-model data: the masked-LM corpus and tokenizer, cut into next-token blocks.

The text, its train/val/test split, the byte-level BPE and the token streams are `TextCorpus`'s, prepared
once under ``<data_dir>/mlm/<corpus>/`` and shared with ``task=mlm`` (same files, same formats; ``attnlab
data prepare mlm`` prepares them for both). A block is ``<s>`` and the next ``seq_len`` tokens of the
stream: the model reads the first ``seq_len`` ids and predicts the last ``seq_len``, so every token of a
split is a target exactly once (the last block padded, its pads unscored).

Per-byte figures: each token id's length in UTF-8 bytes (`token_bytes`), ``</s>`` counting one byte
(it stands for the document break it replaced) and the other specials none, so ``bits_per_byte`` is
comparable across tokenizers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.corpus_blocks import CorpusBlocksDataModule
from attnlab.data.errors import DataError
from attnlab.data.loaders import SPLITS
from attnlab.data.text_corpus import PackedBlocks

IGNORE_INDEX = -100  # targets at padded positions: not scored


class NextTokenBlocks(Dataset):
    """``input_ids`` the block's first ``seq_len`` ids, ``labels`` the next ones (pads: -100)."""

    def __init__(self, stream: np.ndarray, seq_len: int, bos_id: int, pad_id: int):
        self.blocks = PackedBlocks(stream, seq_len + 1, bos_id, pad_id)
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        ids = self.blocks.block(index)
        labels = ids[1:].clone()
        labels[labels == self.pad_id] = IGNORE_INDEX
        return {"input_ids": ids[:-1], "labels": labels}


def token_bytes(tokenizer) -> torch.Tensor:
    """UTF-8 bytes of each id (a byte-level BPE token is one byte per symbol); ``</s>`` 1, specials 0."""
    vocab = tokenizer.tokenizer.get_vocab()
    sizes = torch.zeros(tokenizer.vocab_size, dtype=torch.long)
    special = set(tokenizer.special_ids)
    for symbol, index in vocab.items():
        if index < len(sizes) and index not in special:
            sizes[index] = len(symbol)
    sizes[tokenizer.eos_id] = 1
    return sizes


class LMDataModule(CorpusBlocksDataModule):
    """Next-token blocks of a `TextCorpus` for causal language modelling (``task=lm``)."""

    def _datasets(self) -> dict[str, Dataset]:
        self.token_bytes = token_bytes(self.tokenizer)
        bos_id, pad_id = self.tokenizer.bos_id, self.tokenizer.pad_id
        return {s: NextTokenBlocks(self.streams[s], self.seq_len, bos_id, pad_id) for s in SPLITS}

    # ---- what the pipeline reads ---------------------------------------------------------------------
    def model_kwargs(self) -> dict[str, int]:
        self.setup()
        return {"vocab_size": self.tokenizer.vocab_size}

    def baselines(self, split: str = "test") -> dict[str, float]:
        """A unigram model of the train split (add-one smoothed) scored on ``split``'s targets: its
        cross-entropy ``baseline_loss`` (nats/token), ``baseline_perplexity``, ``baseline_bits_per_byte``
        and the accuracy of always answering the most frequent token (``baseline_acc``)."""
        self.setup()
        counts, log_probs = self._unigram(never=[self.tokenizer.pad_id])  # a pad is never a target
        targets = np.asarray(self.streams[split], dtype=np.int64)  # every token of the split, </s> too
        if len(targets) == 0:
            raise DataError(self.source.short_name, f"the {split} split has no token to score")
        nats = float(-log_probs[targets].sum())
        nbytes = float(self.token_bytes[torch.from_numpy(targets)].sum())
        return {
            "baseline_loss": nats / len(targets),
            "baseline_perplexity": float(np.exp(nats / len(targets))),
            "baseline_bits_per_byte": nats / max(nbytes, 1.0) / np.log(2.0),
            "baseline_acc": float((targets == counts.argmax()).mean()),
        }

    # ---- loaders ---------------------------------------------------------------------------------
    def _collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([ex[key] for ex in examples]) for key in examples[0]}
        batch["mask"] = batch["input_ids"] != self.tokenizer.pad_id
        return self._with_documents(batch, batch["input_ids"])
