"""LRA Image: CIFAR-10 in grey levels, one pixel per token (``lra_benchmarks/image``).

Official source. LRA loads TFDS ``cifar10`` with splits ``train[:90%]`` / ``train[90%:]`` / ``test``
(45,000 / 5,000 / 10,000 images) and converts each image with ``tf.image.rgb_to_grayscale``, then
flattens the 32 x 32 grey image row by row into 1,024 tokens; 10 classes.

What we read, in this order of preference:

1. The "CIFAR-10 python version" (``cifar-10-python.tar.gz`` extracted into data_dir):
   ``<data_dir>/cifar-10-batches-py/{data_batch_1..data_batch_5,test_batch}``, each a pickled dict
   with ``b"data"``, a uint8 array (10000, 3072) whose row holds the 1,024 red values, then the 1,024
   green, then the 1,024 blue, each plane row-major, and ``b"labels"``, 10,000 ints in 0..9.
2. The Hugging Face dataset ``uoft-cs/cifar10`` (``img``, ``label``), only when ``datasets`` is
   installed and the dataset is already cached; the same 90/10 cut is applied to its train split in
   its stored order.

Splits: ``train`` is the first 90 % of the 50,000 training images in file order (data_batch_1 to 4
and the first 5,000 images of data_batch_5), ``val`` the last 10 % (the last 5,000 of data_batch_5),
``test`` is test_batch. The sizes are LRA's; the membership is not exactly LRA's, because TFDS
shuffled the training records when it prepared the dataset, so its ``train[:90%]`` is a different
(equally random) 45,000.

Grey levels, exactly as TensorFlow computes them: the uint8 channels are scaled to float32 by
``x * float32(1/255)``, combined as ``0.2989 R + 0.5870 G + 0.1140 B`` in float32, scaled back by
``255.5`` and cast to uint8, which truncates. This is neither ``round`` nor ``floor`` of the
0-255 luma: (1, 1, 1) gives 1 where ``floor`` gives 0, and (2, 0, 0) gives 0 where ``round`` gives 1.
About a quarter of all colours get a level different from ``round`` (and from ``floor``). TF sums the
three products inside its tensordot kernel; we sum R, G, B in that order in float32. The order only
matters for values within an ulp of an integer: over all 2^24 colours, summing B, G, R instead changes
47 of them by one level, and float64 arithmetic 237 (measured with this module's ``rgb_to_grey``).

Tokens, by the ``zero_pixels`` rule: ``token`` (attnlab's default) gives ``token = grey + 1`` (ids
1..256; every pixel is attended); ``padding`` (LRA's rule) gives ``token = grey``, so black pixels are
id 0, which the batches mask out of attention as LRA's encoder does with ``inputs > 0``. Vocabulary
257 either way (0 = padding); 1,024 tokens per image. An all-black image under ``padding`` is fully
masked: the models give it a fixed, input-independent output (LRA's gave it one too).

The pickles are read with an unpickler that only admits what these files contain (numpy arrays,
Python lists, bytes), so a tampered file cannot run code.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from attnlab.data.errors import DataError, MissingDataError, require_examples
from attnlab.data.examples import TokenSequenceDataset, pixel_offset
from attnlab.data.hf_cache import load_hf_cached

VOCAB_SIZE = 257  # 0 = padding; grey level + 1 (zero_pixels=token) or grey level (padding, 256 unused)
NUM_CLASSES = 10
IMAGE_SIZE = 32
SEQ_LEN = IMAGE_SIZE * IMAGE_SIZE  # 1024
SPLITS = ("train", "val", "test")
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
TRAIN_FRACTION = 0.9  # LRA: train[:90%] / train[90%:]
EXPECTED_EXAMPLES = {"train": 45_000, "val": 5_000, "test": 10_000}
HF_NAME = "uoft-cs/cifar10"
HOW_TO_OBTAIN = (
    "Download the CIFAR-10 python version cifar-10-python.tar.gz from "
    "https://www.cs.toronto.edu/~kriz/cifar.html and extract it into data_dir (it creates "
    "cifar-10-batches-py/), or cache the Hugging Face dataset "
    f"{HF_NAME!r} with `datasets` (installed with attnlab) on a machine with network access."
)

# TensorFlow's constants (tf.image.rgb_to_grayscale and convert_image_dtype), in float32 as TF uses them
_TF_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
_TF_TO_FLOAT = np.float32(1.0 / 255.0)
_TF_TO_UINT8 = np.float32(255.5)


def rgb_to_grey(planes: np.ndarray) -> np.ndarray:
    """Grey levels of uint8 images given as channel-major rows ``(N, 3072)``, as ``(N, 1024)`` uint8.

    Reproduces ``tf.image.rgb_to_grayscale`` on uint8 input bit for bit up to summation order
    (see the module docstring).
    """
    planes = np.asarray(planes)
    if planes.dtype != np.uint8 or planes.ndim != 2 or planes.shape[1] != 3 * SEQ_LEN:
        raise ValueError(
            f"expected uint8 images of shape (N, {3 * SEQ_LEN}), got {planes.dtype} {planes.shape}"
        )
    rgb = planes.reshape(len(planes), 3, SEQ_LEN).astype(np.float32) * _TF_TO_FLOAT
    grey = rgb[:, 0] * _TF_WEIGHTS[0] + rgb[:, 1] * _TF_WEIGHTS[1] + rgb[:, 2] * _TF_WEIGHTS[2]
    return (grey * _TF_TO_UINT8).astype(np.uint8)


def cifar_dir(data_dir: str | Path) -> Path:
    return Path(data_dir) / "cifar-10-batches-py"


class _BatchUnpickler(pickle.Unpickler):
    """Admits only the globals a CIFAR batch pickle needs (Python 2 or 3, numpy 1 or 2)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how Python 3 writes bytes with protocol 2
        ("__builtin__", "bytes"),  # ... and empty bytes (an empty array's buffer)
        ("builtins", "bytes"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return super().find_class(module, name)


def _field(batch: dict, key: str):
    """``batch[b"key"]`` as the original Python 2 pickles have it, or ``batch["key"]`` if re-pickled."""
    if key.encode() in batch:
        return batch[key.encode()]
    return batch.get(key)


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(data (N, 3072) uint8, labels (N,) int64)`` of one batch file, checked."""
    if not path.is_file():
        raise MissingDataError(path, HOW_TO_OBTAIN)
    try:
        # encoding="bytes": the originals are Python 2 pickles whose str keys become b"data", b"labels"
        batch = _BatchUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except Exception as err:  # any failure to unpickle means the file is not a CIFAR batch
        raise DataError(path, f"not a CIFAR-10 python batch ({type(err).__name__}: {err})") from err
    if not isinstance(batch, dict):
        raise DataError(path, f"expected a pickled dict, found {type(batch).__name__}")
    data, labels = _field(batch, "data"), _field(batch, "labels")
    if data is None or labels is None:
        raise DataError(path, f"expected keys b'data' and b'labels', found {sorted(map(repr, batch))}")
    data, labels = np.asarray(data), np.asarray(labels)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * SEQ_LEN:
        raise DataError(
            path, f"b'data' must be uint8 of shape (N, {3 * SEQ_LEN}), got {data.dtype} {data.shape}"
        )
    # an empty list of labels reads as float64: only a non-empty one must be integers
    if labels.shape != (len(data),) or (len(labels) and not np.issubdtype(labels.dtype, np.integer)):
        raise DataError(path, f"b'labels' must be {len(data)} integers, got {labels.dtype} {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise DataError(
            path, f"labels must lie in 0..{NUM_CLASSES - 1}, found {labels.min()}..{labels.max()}"
        )
    return data, labels.astype(np.int64)


def _train_slice(split: str, total: int) -> slice:
    """``train`` = first 90 %, ``val`` = last 10 % of the training images in file order."""
    cut = int(total * TRAIN_FRACTION)
    return slice(0, cut) if split == "train" else slice(cut, total)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def _build(grey_blocks: Iterable[np.ndarray], labels: np.ndarray, offset: int = 1) -> TokenSequenceDataset:
    blocks = [g.astype(np.int16) + offset for g in grey_blocks]
    tokens = np.concatenate(blocks) if blocks else np.zeros((0, SEQ_LEN), dtype=np.int16)
    return TokenSequenceDataset(list(tokens), labels)  # rows are views of one compact (N, 1024) array


def load_cifar10_grey(root: str | Path, split: str, zero_pixels: str = "token") -> TokenSequenceDataset:
    """Grey CIFAR-10 of ``split`` from ``<root>/cifar-10-batches-py`` (sequences of 1,024 tokens)."""
    _check_split(split)
    offset = pixel_offset(zero_pixels)
    files = TEST_FILES if split == "test" else TRAIN_FILES
    batches = [read_batch(cifar_dir(root) / name) for name in files]
    data = np.concatenate([d for d, _ in batches])
    labels = np.concatenate([lab for _, lab in batches])
    if split != "test":
        keep = _train_slice(split, len(data))
        data, labels = data[keep], labels[keep]
    # convert in blocks of one batch file's size to bound the float32 temporary
    dataset = _build((rgb_to_grey(data[i : i + 10_000]) for i in range(0, len(data), 10_000)), labels, offset)
    require_examples(dataset, ", ".join(str(cifar_dir(root) / name) for name in files), "image")
    return dataset


def load_cifar10_hf(
    split: str, name: str = HF_NAME, data_dir: str | Path = "data", zero_pixels: str = "token"
) -> TokenSequenceDataset:
    """The same images from the Hugging Face cache; nothing is downloaded.

    ``data_dir`` only serves the error message (where cifar-10-batches-py was expected).
    """
    _check_split(split)
    offset = pixel_offset(zero_pixels)
    dataset = load_hf_cached(name, "test" if split == "test" else "train", cifar_dir(data_dir), HOW_TO_OBTAIN)
    columns = getattr(dataset, "column_names", None)
    if columns is not None and not {"img", "label"} <= set(columns):
        raise DataError(
            f"huggingface:{name}", f"the cached dataset has columns {columns}, not 'img' and 'label'"
        )
    rows = range(len(dataset))
    if split != "test":
        keep = _train_slice(split, len(dataset))
        rows = rows[keep]
    planes = np.empty((len(rows), 3 * SEQ_LEN), dtype=np.uint8)
    labels = np.empty(len(rows), dtype=np.int64)
    for out, index in enumerate(rows):
        row = dataset[index]
        pixels = np.asarray(row["img"].convert("RGB"), dtype=np.uint8)  # (32, 32, 3), channels last
        if pixels.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
            raise DataError(
                f"huggingface:{name}", f"image {index} has shape {pixels.shape}, expected (32, 32, 3)"
            )
        planes[out] = pixels.reshape(SEQ_LEN, 3).T.reshape(-1)  # to the batch files' channel-major layout
        labels[out] = int(row["label"])
    blocks = (rgb_to_grey(planes[i : i + 10_000]) for i in range(0, len(planes), 10_000))
    dataset = _build(blocks, labels, offset)
    require_examples(dataset, f"huggingface:{name}", "image")
    return dataset


def find_cifar10(data_dir: str | Path) -> Path | None:
    """The cifar-10-batches-py folder when all six batch files are there; None when there is no folder
    (the Hugging Face cache is tried next). A folder that lacks some files is an error naming them:
    falling through to another source would hide a broken extraction."""
    folder = cifar_dir(data_dir)
    if not folder.is_dir():
        return None
    missing = [f for f in TRAIN_FILES + TEST_FILES if not (folder / f).is_file()]
    if missing:
        raise MissingDataError(
            folder / missing[0],
            f"{folder} is incomplete: {', '.join(missing)} missing. Extract cifar-10-python.tar.gz "
            "into data_dir again (it holds data_batch_1..5 and test_batch).",
        )
    return folder


def ensure_image(data_dir: str | Path, name: str = HF_NAME) -> str:
    """Where CIFAR-10 will be read from (the ``data_source``): the folder or ``huggingface:<name>``."""
    folder = find_cifar10(data_dir)
    if folder is not None:
        return str(folder)
    load_hf_cached(name, "test", cifar_dir(data_dir), HOW_TO_OBTAIN)
    return f"huggingface:{name}"


def load_image(
    data_dir: str | Path, split: str, name: str = HF_NAME, zero_pixels: str = "token"
) -> tuple[TokenSequenceDataset, str]:
    """One split from the preferred source, and the ``data_source`` string saying which was read."""
    source = ensure_image(data_dir, name)
    if source.startswith("huggingface:"):
        return load_cifar10_hf(split, name=name, data_dir=data_dir, zero_pixels=zero_pixels), source
    return load_cifar10_grey(data_dir, split, zero_pixels), source


def describe(data_dir: str | Path, count: bool = True) -> dict:
    """Per split: the batch files it reads, whether they are all there, and (``count``) its size.

    Counting reads the labels of the six pickles (about 180 MB, well under a second).
    """
    folder = cifar_dir(data_dir)
    sizes = {}
    for name in TRAIN_FILES + TEST_FILES:
        if (folder / name).is_file() and count:
            sizes[name] = len(read_batch(folder / name)[1])
    splits = {}
    for split in SPLITS:
        files = TEST_FILES if split == "test" else TRAIN_FILES
        present = all((folder / f).is_file() for f in files)
        num = None
        if present and count:
            total = sum(sizes[f] for f in files)
            num = total if split == "test" else len(range(total)[_train_slice(split, total)])
        splits[split] = {
            "path": ", ".join(str(folder / f) for f in files),
            "present": present,
            "num_examples": num,
            "expected_examples": EXPECTED_EXAMPLES[split],
        }
    return {
        "task": "image",
        "format": "cifar-10-batches-py pickles; train/val = first 90 % / last 10 % of data_batch_1..5",
        "fallback": f"huggingface:{HF_NAME} (local cache only)",
        "how_to_obtain": HOW_TO_OBTAIN,
        "splits": splits,
    }
