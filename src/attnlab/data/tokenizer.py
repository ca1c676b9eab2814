"""Byte-level BPE (RoBERTa's tokenizer) on the `tokenizers` library: trained here or loaded from files.

Either form ends as the same two files, RoBERTa's ``vocab.json`` + ``merges.txt``: attnlab trains one on
a corpus and saves it beside the data (`train_bpe`), or reads the pair a user provides (`load_bpe`).
Byte-level means no unknown characters: any UTF-8 text encodes, and decoding gives it back.

The special tokens are RoBERTa's names. A tokenizer trained here puts ``<pad>`` at id 0 (attnlab's
padding id elsewhere) and the other specials right after it; a RoBERTa vocabulary keeps its own ids
(``<s>`` 0, ``<pad>`` 1, ...): batches read `BPETokenizer.pad_id`, never assume 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from attnlab.data.errors import DataError, MissingDataError
from attnlab.errors import ConfigError

PAD, BOS, EOS, UNK, MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, MASK)  # the trained tokenizer's ids 0..4, in this order
VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"


class BPETokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` with the special ids that MLM and GLUE need.

    ``encode`` gives the ids of plain text, no specials added (documents and sentence pairs are framed
    by their callers). Picklable, so ``datasets.map(num_proc=N)`` can ship it to worker processes.
    """

    def __init__(self, tokenizer, where: str):
        self.tokenizer, self.where = tokenizer, where
        vocab = tokenizer.get_vocab()
        self.pad_id, self.bos_id, self.eos_id = vocab[PAD], vocab[BOS], vocab[EOS]
        self.unk_id, self.mask_id = vocab[UNK], vocab[MASK]
        self.special_ids = tuple(sorted({vocab[t] for t in SPECIAL_TOKENS}))
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def __getstate__(self):
        return {"json": self.tokenizer.to_str(), "where": self.where}

    def __setstate__(self, state):
        from tokenizers import Tokenizer

        self.__init__(Tokenizer.from_str(state["json"]), state["where"])

    def files(self) -> dict[str, str]:
        """The vocabulary and merges as text (what a checkpoint carries so fine-tuning reuses them)."""
        model = json.loads(self.tokenizer.to_str())["model"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        return {"vocab": json.dumps(model["vocab"], ensure_ascii=False), "merges": "\n".join(merges)}


def _assemble(model, where: str | None = None) -> object:
    """The BPE model as a byte-level tokenizer; ``where`` (a given vocabulary) must hold every special."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tokenizer = Tokenizer(model)
    missing = [t for t in SPECIAL_TOKENS if t not in tokenizer.get_vocab()]
    if where is not None and missing:  # checked before they are added below, which would hide it
        raise DataError(
            where,
            f"the vocabulary has no {', '.join(missing)}: a RoBERTa-style vocab.json holds the special "
            f"tokens {', '.join(SPECIAL_TOKENS)}",
        )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # never split; specials already in the vocab keep ids
    return tokenizer


def load_bpe(vocab: str | Path, merges: str | Path) -> BPETokenizer:
    """A RoBERTa-style pair of files: ``vocab.json`` (token → id) and ``merges.txt`` (one merge a line)."""
    from tokenizers.models import BPE

    vocab, merges = Path(vocab), Path(merges)
    for path, what in ((vocab, "vocab.json"), (merges, "merges.txt")):
        if not path.is_file():
            raise MissingDataError(
                path,
                f"Give the {what} of a byte-level BPE tokenizer (RoBERTa's format), or leave "
                f"task.data.source.tokenizer.vocab/merges null to train one on the corpus.",
            )
    try:
        model = BPE.from_file(str(vocab), str(merges), unk_token=UNK)
    except Exception as err:  # the Rust side raises plain Exceptions with its parser's message
        raise DataError(vocab, f"not a byte-level BPE vocab.json + merges.txt pair ({err})") from err
    return BPETokenizer(_assemble(model, str(vocab)), f"{vocab} + {merges.name}")


def from_strings(vocab_json: str, merges: str, where: str) -> BPETokenizer:
    """The tokenizer of `BPETokenizer.files` (e.g. read back from a checkpoint)."""
    from tokenizers.models import BPE

    pairs = [tuple(line.split(" ")) for line in merges.splitlines() if line and not line.startswith("#")]
    model = BPE(vocab=json.loads(vocab_json), merges=pairs, unk_token=UNK)
    return BPETokenizer(_assemble(model, where), where)


def train_bpe(
    texts: Iterator[list[str]], vocab_size: int, folder: str | Path, min_frequency: int = 2
) -> BPETokenizer:
    """Train on batches of texts and save ``vocab.json`` + ``merges.txt`` into ``folder``.

    The files are written to a temporary name and renamed, so a killed run never leaves half a tokenizer.
    """
    from tokenizers import pre_tokenizers, trainers
    from tokenizers.models import BPE

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ConfigError(
            f"task.data.source.tokenizer.vocab_size={vocab_size} is too small: byte-level BPE needs the "
            f"256 bytes and {len(SPECIAL_TOKENS)} special tokens, so at least {minimum}"
        )
    tokenizer = _assemble(BPE(unk_token=UNK))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".partial"
    tmp.mkdir(exist_ok=True)
    tokenizer.model.save(str(tmp))
    for name in (MERGES_FILE, VOCAB_FILE):  # vocab.json last: its presence means the pair is complete
        (tmp / name).replace(folder / name)
    tmp.rmdir()
    return load_bpe(folder / VOCAB_FILE, folder / MERGES_FILE)
