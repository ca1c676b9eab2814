"""Shared fixtures: compose the real Hydra configs the way `python train.py` does."""

from __future__ import annotations

import os
import signal
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"

# compiled Triton kernels kept in the checkout (git-ignored), for this process and those it starts: the
# next run of the suite loads them instead of compiling again (a user's own TRITON_CACHE_DIR wins)
os.environ.setdefault("TRITON_CACHE_DIR", str(REPO_ROOT / ".cache" / "triton"))

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import open_dict  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` (``make test``): the grouped tests first (``slurm``: jobs on the one
    test cluster; ``processes``: tests that start several processes at once; a module's name: tests that
    share an expensive module fixture, built once on one worker), so that each group's
    worker starts its serial chain while the others take the rest; and a loud stop where pytest-xdist
    did not mark the groups (its node-id suffix), which would run them side by side without a word."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
        return
    grouped = [item for item in items if item.get_closest_marker("xdist_group")]
    unmarked = [item.nodeid for item in grouped if "@" not in item.nodeid]
    if unmarked:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(unmarked)} xdist_group tests (e.g. {unmarked[0]}): this "
            f"pytest ({pytest.__version__}) and pytest-xdist do not work together; use the pins in "
            "pyproject.toml"
        )
    # a stable sort: the order within the grouped tests and within the rest is kept
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


@pytest.fixture(autouse=True)
def _small_torch_threads():
    """Tests are many small ops; one thread avoids oversubscribing the 2-core CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGTERM as a terminal leaves them, for this test and the processes it starts.

    A shell that starts the suite in the background (`nohup make test &`, a CI runner, a batch job)
    sets SIGINT to ignored, and every process inherits that: Ctrl-C would then reach nothing. A caught
    signal is reset to its default by exec, so a child of this test gets SIG_DFL for both.
    """
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def compose_train_config(overrides: list[str], tmp_path: Path):
    """The composed `conf/train.yaml` with run and data dirs under ``tmp_path``, as Hydra's app sets it."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[f"hydra.run.dir={tmp_path / 'run'}", *overrides],
            return_hydra_config=True,
        )
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
        cfg.hydra.runtime.cwd = str(REPO_ROOT)
        if not any(o.startswith("paths.data_dir=") for o in overrides):
            cfg.paths.data_dir = str(tmp_path / "data")
        cfg.paths.output_dir = str(tmp_path / "outputs")
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # as in a real run: the app's config has no hydra node, the resolver reads it
    return cfg


@pytest.fixture
def train_config(tmp_path):
    return lambda *overrides: compose_train_config(list(overrides), tmp_path)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """``tiny_runs.TINY_RESUMABLE`` trained once, start to end: (summary, run dir), the run that every
    killed, signalled or requeued run of that config must end as. Trained on one thread, as each test
    runs (the float sums must match); tests read its run dir and never write there."""
    from attnlab.pipeline import train
    from tiny_runs import TINY_RESUMABLE

    root = tmp_path_factory.mktemp("uninterrupted")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = train(compose_train_config([*TINY_RESUMABLE, f"paths.run_dir={root / 'run'}"], root))
    finally:
        torch.set_num_threads(threads)
    return summary, root / "run"


@pytest.fixture(scope="session")
def corpus_data_dir(tmp_path_factory):
    """One ``paths.data_dir`` for the runs on the embedded text corpus: each tokenizer (one per
    vocabulary size) is trained, and its token streams written, once a session, not once a module."""
    return tmp_path_factory.mktemp("corpus-data")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty `datasets` cache for this test alone (the env var for subprocesses, the config here)."""
    import datasets

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.fixture
def loader_workers():
    """For a test that starts DataLoader workers in this process: after it, pass or fail, their
    iterators are shut down (`shut_down_loader_workers`)."""
    yield
    shut_down_loader_workers()


def shut_down_loader_workers() -> None:
    """Shut down every live multi-process DataLoader iterator: a failing test's traceback holds its
    iterator, whose workers ignore SIGTERM and would otherwise live until the session ends."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    # ``type``, not ``isinstance``: a dead weak proxy among the objects (torch.compile leaves some)
    # raises ReferenceError on any attribute lookup, and isinstance looks up ``__class__``
    for iterator in [o for o in gc.get_objects() if issubclass(type(o), _MultiProcessingDataLoaderIter)]:
        iterator._shutdown_workers()
