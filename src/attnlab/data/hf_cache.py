"""Reading Hugging Face datasets from the local cache only: nothing is ever downloaded.

Every dataset attnlab can take from the Hub (IMDB, CIFAR-10, Tiny ImageNet, GLUE) and the MLM corpus
reader go through here, so that offline mode, the Hub's renamed ids and the error that says how to get
the data are handled once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from attnlab.data.errors import MissingDataError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def hf_offline(datasets_module) -> Iterator[None]:
    """Tell `datasets` and `huggingface_hub` to use the local cache only, for this call alone.

    The flags are module attributes read at call time; their names moved between releases, so each
    is set only where it exists and restored afterwards.
    """
    targets = [(datasets_module.config, name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")]
    with contextlib.suppress(ImportError):
        import huggingface_hub.constants as hub_constants

        targets.append((hub_constants, "HF_HUB_OFFLINE"))
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets if hasattr(obj, name)]
    try:
        for obj, name, _ in saved:
            setattr(obj, name, True)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


# Canonical datasets moved under organisations on the Hub; a cache made under the older short name sits
# in `<cache>/<old>/` rather than `<cache>/<org>___<name>/`, so each id is looked up under both.
HUB_OLDER_NAMES = {"stanfordnlp/imdb": "imdb", "uoft-cs/cifar10": "cifar10", "nyu-mll/glue": "glue"}


def load_hf_cached(
    name: str, split: str, expected: str | Path, how_to_obtain: str, config: str | None = None
):
    """``datasets.load_dataset(name[, config], split=split)`` from the local cache (under ``name``, then
    its older short name), or MissingDataError.

    ``expected`` and ``how_to_obtain`` describe the folder layout that would have been read instead,
    so the error tells the user both ways to get the data.
    """
    try:
        import datasets  # lazy: an optional dependency
    except ImportError as err:
        raise MissingDataError(
            expected, f"The Hugging Face `datasets` library is not installed either. {how_to_obtain}"
        ) from err
    names = [name] + ([HUB_OLDER_NAMES[name]] if name in HUB_OLDER_NAMES else [])
    failures = []
    for candidate in names:
        try:
            with hf_offline(datasets):
                args = (candidate,) if config is None else (candidate, config)
                dataset = datasets.load_dataset(*args, split=split)
        # offline and uncached, `datasets` raises one of several types depending on its version
        except Exception as err:
            failures.append(f"{candidate}: {type(err).__name__}: {err}")
            continue
        if candidate != name:
            log.info("%s: read from the local cache of its older name %r", name, candidate)
        return dataset
    what = " or ".join(repr(n) for n in names) + (f" ({config})" if config else "")
    raise MissingDataError(
        expected,
        f"The Hugging Face dataset {what} (split {split!r}) is not in the local cache "
        f"({'; '.join(failures)}). {how_to_obtain}",
    )
