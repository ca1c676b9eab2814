"""LRA Image (CIFAR-10 grey): the python-version pickles, TF's grey levels, the 90/10 split, errors."""

from __future__ import annotations

import pickle
import sys
import types

import numpy as np
import pytest
from PIL import Image

from attnlab.data.errors import DataError, MissingDataError
from attnlab.data.lra import image

PER_BATCH = 4  # images per fixture batch file (10,000 in the real ones)


def make_images(first_id: int, n: int) -> np.ndarray:
    """Images whose every pixel is (k, k, k) for image id k, so grey level = k identifies the image."""
    ids = np.arange(first_id, first_id + n, dtype=np.uint8)
    return np.repeat(ids[:, None], 3 * 1024, axis=1)


def write_batch(path, data: np.ndarray, labels: list[int], key_type=bytes) -> None:
    """A batch file like the originals: a dict with b"batch_label", b"labels", b"data", b"filenames"."""
    k = (lambda s: s.encode()) if key_type is bytes else str
    batch = {
        k("batch_label"): b"training batch",
        k("labels"): labels,
        k("data"): data,
        k("filenames"): [f"img_{i}.png".encode() for i in range(len(data))],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


@pytest.fixture
def data_dir(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    for b in range(5):
        write_batch(folder / f"data_batch_{b + 1}", make_images(b * PER_BATCH, PER_BATCH), [b] * PER_BATCH)
    write_batch(folder / "test_batch", make_images(100, 3), [7, 8, 9])
    return tmp_path


def grey_of_pixel(r: int, g: int, b: int) -> int:
    data = np.zeros((1, 3072), dtype=np.uint8)
    data[0, 0], data[0, 1024], data[0, 2048] = r, g, b
    return int(image.rgb_to_grey(data)[0, 0])


@pytest.mark.parametrize(
    ("rgb", "grey"),
    [
        # by hand: (100/255*0.2989 + 150/255*0.5870 + 200/255*0.1140) * 255.5 = 141.016 -> 141
        ((100, 150, 200), 141),
        # luma 0.9999, scaled by 255.5/255 to 1.0019 -> 1 (floor of the luma would give 0)
        ((1, 1, 1), 1),
        # luma 0.5978 -> 0.599 -> 0 (rounding the luma would give 1)
        ((2, 0, 0), 0),
        # luma 254.97 -> 255.47 -> 255, no overflow
        ((255, 255, 255), 255),
        ((0, 0, 0), 0),
        # 0.5870 * 255/255 * 255.5 = 149.98 -> 149 (truncation, not rounding)
        ((0, 255, 0), 149),
    ],
)
def test_grey_level_matches_tensorflow_by_hand(rgb, grey):
    assert grey_of_pixel(*rgb) == grey


def test_rgb_to_grey_rejects_other_layouts():
    with pytest.raises(ValueError, match=r"\(N, 3072\)"):
        image.rgb_to_grey(np.zeros((2, 32, 32, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        image.rgb_to_grey(np.zeros((2, 3072), dtype=np.float32))


def test_sequences_are_row_major_channel_planes_combined(tmp_path):
    data = np.zeros((2, 3072), dtype=np.uint8)
    row, col = 1, 2
    data[0, row * 32 + col] = 255  # red plane
    data[1, 2048 + 31 * 32 + 31] = 255  # blue plane, last pixel
    folder = tmp_path / "cifar-10-batches-py"
    write_batch(folder / "test_batch", data, [3, 4])
    ds = image.load_cifar10_grey(tmp_path, "test")
    first, second = ds[0]["input_ids"], ds[1]["input_ids"]
    assert first.shape == (1024,) and ds.labels.tolist() == [3, 4]
    red_grey = grey_of_pixel(255, 0, 0)  # 0.2989 * 255.5 = 76.37 -> 76
    assert red_grey == 76 and first[34].item() == red_grey + 1
    assert (first.count_nonzero() == 1024) and int((first != 1).sum()) == 1  # token = grey + 1, 0 unused
    assert second[1023].item() == grey_of_pixel(0, 0, 255) + 1 and int((second != 1).sum()) == 1


def test_split_90_10_in_file_order(data_dir):
    train = image.load_cifar10_grey(data_dir, "train")
    val = image.load_cifar10_grey(data_dir, "val")
    test = image.load_cifar10_grey(data_dir, "test")
    assert (len(train), len(val), len(test)) == (18, 2, 3)
    # every pixel of image k has grey level k (k, k, k -> k), so token k + 1 names the image
    assert [int(train[i]["input_ids"][0]) - 1 for i in range(18)] == list(range(18))
    assert [int(val[i]["input_ids"][0]) - 1 for i in range(2)] == [18, 19]  # last of data_batch_5
    assert train.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 2
    assert val.labels.tolist() == [4, 4] and test.labels.tolist() == [7, 8, 9]
    assert all(int(test[i]["input_ids"].max()) == 101 + i for i in range(3))
    assert image.VOCAB_SIZE == 257 and image.SEQ_LEN == 1024


def test_real_cut_is_45000_5000():
    assert image._train_slice("train", 50_000) == slice(0, 45_000)
    assert image._train_slice("val", 50_000) == slice(45_000, 50_000)


def test_reads_python2_style_globals_and_str_keys(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_batch(folder / "test_batch", make_images(5, 2), [1, 2], key_type=str)
    # the original files were written by Python 2 with numpy 1: numpy.core.multiarray._reconstruct
    raw = (folder / "test_batch").read_bytes()
    (folder / "test_batch").write_bytes(raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    ds = image.load_cifar10_grey(tmp_path, "test")
    assert ds.labels.tolist() == [1, 2] and int(ds[1]["input_ids"][0]) == 7


class _Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickle_with_foreign_globals_is_refused(tmp_path, capsys):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": _Exploit(), b"labels": []}, protocol=2))
    with pytest.raises(DataError, match=r"test_batch: not a CIFAR-10 python batch .*print is not allowed"):
        image.load_cifar10_grey(tmp_path, "test")
    assert "must never run" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("data", "labels", "message"),
    [
        (np.zeros((2, 3000), dtype=np.uint8), [0, 1], r"shape \(N, 3072\)"),
        (np.zeros((2, 3072), dtype=np.float64), [0, 1], "must be uint8"),
        (np.zeros((2, 3072), dtype=np.uint8), [0], "must be 2 integers"),
        (np.zeros((2, 3072), dtype=np.uint8), [0, 10], r"labels must lie in 0..9"),
    ],
)
def test_malformed_batch_names_the_file(tmp_path, data, labels, message):
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    write_batch(path, data, labels)
    with pytest.raises(DataError, match=message) as info:
        image.load_cifar10_grey(tmp_path, "test")
    assert str(info.value).startswith(str(path))


def test_missing_batch_names_the_path(data_dir):
    (data_dir / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(MissingDataError) as info:
        image.load_cifar10_grey(data_dir, "val")
    assert str(data_dir / "cifar-10-batches-py" / "data_batch_3") in str(info.value)
    assert "cifar-10-python.tar.gz" in str(info.value)
    with pytest.raises(MissingDataError, match="incomplete: data_batch_3 missing"):
        image.find_cifar10(data_dir)  # not None: the Hugging Face cache must not stand in for it
    assert len(image.load_cifar10_grey(data_dir, "test")) == 3  # the test split does not need it


def test_unknown_split(data_dir):
    with pytest.raises(ValueError, match="train, val, test"):
        image.load_cifar10_grey(data_dir, "validation")


class FakeHFDataset(list):
    column_names = ["img", "label"]


def test_hf_path_gives_the_same_tokens(data_dir, tmp_path_factory, monkeypatch):
    rng = np.random.default_rng(0)
    pictures = rng.integers(0, 256, size=(10, 32, 32, 3), dtype=np.uint8)
    rows = [{"img": Image.fromarray(p), "label": i % 10} for i, p in enumerate(pictures)]
    seen = []
    module = types.ModuleType("datasets")
    module.config = types.SimpleNamespace(HF_DATASETS_OFFLINE=False)

    def load_dataset(name, split):
        seen.append((name, split, module.config.HF_DATASETS_OFFLINE))
        return FakeHFDataset(rows if split == "train" else rows[:3])

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)

    train, val = image.load_cifar10_hf("train"), image.load_cifar10_hf("val")
    assert (len(train), len(val)) == (9, 1) and val.labels.tolist() == [9]
    assert seen[0] == ("uoft-cs/cifar10", "train", True) and module.config.HF_DATASETS_OFFLINE is False
    # the same pictures written as a batch file give the same tokens
    planes = pictures.transpose(0, 3, 1, 2).reshape(10, 3072)
    empty = tmp_path_factory.mktemp("pickled")
    write_batch(empty / "cifar-10-batches-py" / "test_batch", planes, list(range(10)))
    from_pickle = image.load_cifar10_grey(empty, "test")
    for i in range(9):
        assert train[i]["input_ids"].tolist() == from_pickle[i]["input_ids"].tolist()

    # no folder: load_image falls back to the cache and says so
    ds, source = image.load_image(tmp_path_factory.mktemp("nothing"), "test")
    assert source == "huggingface:uoft-cs/cifar10" and len(ds) == 3
    # the folder wins when present
    _, source = image.load_image(data_dir, "test")
    assert source == str(data_dir / "cifar-10-batches-py")


def test_hf_not_installed_is_clear(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingDataError) as info:
        image.load_image(tmp_path, "train")
    message = str(info.value)
    assert (
        str(tmp_path / "cifar-10-batches-py") in message and "`datasets` library is not installed" in message
    )
    assert "cifar-10-python.tar.gz" in message


def test_real_hf_cifar10_when_installed_and_cached(tmp_path):
    pytest.importorskip("datasets")
    try:
        ds = image.load_cifar10_hf("test", data_dir=tmp_path)
    except MissingDataError as err:
        pytest.skip(f"CIFAR-10 is not in the local Hugging Face cache: {err}")
    assert len(ds) == 10_000 and ds[0]["input_ids"].shape == (1024,)


def test_describe(data_dir, tmp_path_factory):
    info = image.describe(data_dir)
    assert info["task"] == "image"
    assert {s: v["num_examples"] for s, v in info["splits"].items()} == {"train": 18, "val": 2, "test": 3}
    assert info["splits"]["test"]["path"] == str(data_dir / "cifar-10-batches-py" / "test_batch")
    empty = image.describe(tmp_path_factory.mktemp("empty"))
    assert not any(v["present"] for v in empty["splits"].values())
    assert empty["splits"]["val"]["expected_examples"] == 5_000


def test_an_empty_split_is_an_error_naming_the_files(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    for b in range(5):
        write_batch(folder / f"data_batch_{b + 1}", make_images(0, PER_BATCH), [0] * PER_BATCH)
    write_batch(folder / "test_batch", np.zeros((0, 3072), np.uint8), [])
    with pytest.raises(DataError, match="no image") as info:
        image.load_cifar10_grey(tmp_path, "test")
    assert str(folder / "test_batch") in str(info.value)


def test_zero_pixels_padding_keeps_grey_levels_so_black_is_padding(data_dir):
    token = image.load_cifar10_grey(data_dir, "train")  # image 0 is all black: grey level 0
    padding = image.load_cifar10_grey(data_dir, "train", zero_pixels="padding")
    assert token[0]["input_ids"].unique().tolist() == [1] and padding[0]["input_ids"].unique().tolist() == [0]
    assert (padding[5]["input_ids"] + 1).tolist() == token[5]["input_ids"].tolist()
    with pytest.raises(ValueError, match=r"zero_pixels='black'.*padding, token"):
        image.load_cifar10_grey(data_dir, "train", zero_pixels="black")
