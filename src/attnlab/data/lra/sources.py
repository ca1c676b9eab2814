"""Data sources of the Long Range Arena tasks, as the datamodule consumes them.

Each source binds one task's loader to a place under ``data_dir`` (the official ``lra_release``
layout), says what it read in ``description``, and in ``prepare()`` generates what is generated
by nature (ListOps, Pathfinder) or fails with the expected path and how to obtain the files.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.data.common import TokenSequenceDataset
from attnlab.data.lra import listops

LRA_DIR = "lra_release"


class ListOpsSource:
    """ListOps from ``<data_dir>/lra_release/<subdir>/basic_{train,val,test}.tsv``.

    ``subdir`` is ``listops-1000`` for the official release (and the full-size generator
    defaults); smaller presets generate into their own folder so they never pass for the
    official files. ``max_tokens`` truncates longer token sequences (first tokens kept).
    """

    name = "listops"
    vocab_size = listops.VOCAB_SIZE

    def __init__(
        self,
        data_dir: str | Path,
        subdir: str = "listops-1000",
        generate: bool = True,
        sizes: dict[str, int] | None = None,
        seed: int = 0,
        min_length: int = 500,
        max_length: int = 2000,
        max_depth: int = 10,
        max_tokens: int | None = None,
    ):
        self.root = Path(data_dir) / LRA_DIR / subdir
        self.generate = generate
        self.generator_args = dict(
            sizes=dict(sizes or {"train": 96_000, "val": 2_000, "test": 2_000}),
            seed=seed, min_length=min_length, max_length=max_length, max_depth=max_depth,
        )
        self.max_tokens = max_tokens
        self._generated = False
        self.num_truncated = 0

    def prepare(self) -> None:
        existed = all((self.root / f"basic_{s}.tsv").exists() for s in ("train", "val", "test"))
        listops.ensure_listops(self.root, generate=self.generate, **self.generator_args)
        self._generated = not existed

    def load(self) -> dict[str, TokenSequenceDataset]:
        self.prepare()
        datasets = {}
        for split in ("train", "val", "test"):
            datasets[split] = listops.load_split(self.root / f"basic_{split}.tsv", max_length=self.max_tokens)
            self.num_truncated += getattr(datasets[split], "num_truncated", 0)
        return datasets

    @property
    def description(self) -> str:
        args = self.generator_args
        origin = (
            f"generated now by the LRA-faithful generator (seed {args['seed']}, "
            f"{args['min_length']} < length < {args['max_length']})"
            if self._generated
            else "read as found (official release or an earlier generation)"
        )
        truncated = f"; {self.num_truncated} sequences truncated to {self.max_tokens} tokens" if self.num_truncated else ""
        return f"ListOps TSV files in {self.root}, {origin}{truncated}"
