"""Small C++ kernels for the CPU, built on first use and called through ``ctypes``.

Two kinds of CPU work lose most of their time to torch's op-by-op execution: a chain of many tiny ops,
whose cost is the dispatch of each (a decoding step searches a few sorted runs in about thirty ops), and
a chain of full passes over (T, D) memory that one walk could do (the sorted sliced ReLU op builds and
gathers prefix tables). Such work is written once in plain C++ (``extern "C"`` functions on raw arrays,
no torch headers) and built by torch's own ``cpp_extension.load``, which finds the compiler, caches the
library under ``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions`` by default), rebuilds it when the
source changes and locks the build against concurrent processes. Without torch's headers a build takes
about a second instead of the 40 s a ``torch/extension.h`` source takes. Each library is built for the
CPU it runs on (``-march=native``: the sums vectorise to the widest registers there) under a name
holding a hash of that CPU. The callers own the autograd (their hand-written backward passes call
the kernels too) and run large calls on torch's threads (``threads_for``).

Where no compiler (or no ``ninja``) is found, or ``ATTNLAB_NATIVE=off`` is set, ``library`` returns
None and the callers keep their torch code: the results are the same up to rounding, only slower.
The reason is logged once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from attnlab.errors import first_line

log = logging.getLogger(__name__)

#: set to "off" to use the torch code instead of the C++ kernels
SWITCH = "ATTNLAB_NATIVE"


def enabled() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


@contextlib.contextmanager
def torch_code() -> Iterator[None]:
    """The torch code instead of the kernels while inside (``ATTNLAB_NATIVE=off``), then the switch as
    it was: for a caller that measures or checks what other devices run."""
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "off"
    try:
        yield
    finally:
        if before is None:
            del os.environ[SWITCH]
        else:
            os.environ[SWITCH] = before


@functools.cache
def _cpu_tag() -> str:
    """A short hash of this CPU's model and instruction sets: the libraries are built for the CPU they
    run on (``-march=native``), and a cache shared by different machines (an NFS home on a cluster)
    keeps one build per kind of CPU instead of loading another CPU's instructions."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        described = [line for line in lines if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        described = []
    text = "\n".join(described) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def library_name(source: Path) -> str:
    """The built library's name: its folder and file (two ops have a ``cpu_kernels.cpp``) and the CPU."""
    return f"attnlab_{source.parent.name}_{source.stem}_{_cpu_tag()}"


@functools.cache
def _build(source: str) -> ctypes.CDLL | None:
    path = Path(source)
    name = library_name(path)
    started = time.perf_counter()
    try:
        cpp_extension = _cpp_extension()
        _clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
        library = _load(cpp_extension, name, path)
    except Exception as error:  # no compiler, no ninja, a read-only cache: the torch code runs instead
        log.warning(
            "C++ CPU kernels %s not built (%s): using the torch code, which is slower",
            name,
            first_line(error),
        )
        return None
    log.info("C++ CPU kernels %s ready in %.1f s (%s)", name, time.perf_counter() - started, library)
    return ctypes.CDLL(library)


def _load(cpp_extension, name: str, path: Path) -> str:
    """The built library's path: with OpenMP (libgomp.so.1, the runtime torch loaded: the kernels
    split their rows over torch's threads, ``parallel_rows.h``), or where the compiler has no
    OpenMP (Apple's clang), without it, each call then on one thread (one warning)."""

    def load(openmp: bool) -> str:
        return cpp_extension.load(
            name,
            [str(path)],
            extra_cflags=["-O3", "-march=native", "-fopenmp" if openmp else "-fopenmp-simd"],
            extra_ldflags=["-fopenmp"] if openmp else [],
            is_python_module=False,
            verbose=False,
        )

    try:
        return load(openmp=True)
    except Exception as error:  # noqa: BLE001 - one more try, without OpenMP; its failure is the caller's
        without = load(openmp=False)
        log.warning(
            "C++ CPU kernels %s built without OpenMP (%s): each call on one thread", name, first_line(error)
        )
        return without


#: a build takes about a second: a build lock older than this was left by a process that was killed
STALE_LOCK_S = 120


def _clear_stale_lock(build_dir: Path) -> None:
    """``cpp_extension`` waits, without end, while its build lock exists; a process killed during its
    build (Ctrl-C in the first second of a run) leaves one behind, which would hang every later run."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing the build lock %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported without its warning that no CUDA runtime is found
    (these kernels are CPU code)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def library(source: Path) -> ctypes.CDLL | None:
    """The built library of the C++ file ``source`` (once per process), or None: switched off
    (``ATTNLAB_NATIVE=off``) or not buildable here (logged once)."""
    if not enabled():
        return None
    return _build(str(source))


@torch.compiler.assume_constant_result
def built(source: str) -> bool:
    """Whether ``library(source)`` is there: a decision such as a crossover can read it while
    ``torch.compile`` traces (a constant there, not a graph break)."""
    return library(Path(source)) is not None


#: the kernels' name suffix for each dtype they take
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def kernels(source: Path, dtype: torch.dtype, argtypes: dict[str, list]) -> dict | None:
    """The functions ``{name}_f32`` or ``{name}_f64`` (by ``dtype``) of the library of ``source``,
    for each ``name`` of ``argtypes``, with their argument types set; None where the library is not
    there (``library``) or the dtype has no kernels."""
    found = library(source) if dtype in SUFFIX else None
    if found is None:
        return None
    functions = {}
    for name, types in argtypes.items():
        function = getattr(found, f"{name}_{SUFFIX[dtype]}")
        if function.argtypes is None:
            function.argtypes, function.restype = types, None
        functions[name] = function
    return functions


def cpu_kernels(x: torch.Tensor, source: Path, argtypes: dict[str, list]) -> dict | None:
    """``kernels`` for a CPU tensor ``x`` (by its dtype), None on any other device: the sorted ops'
    C++ kernels serve CPU inputs only."""
    return kernels(source, x.dtype, argtypes) if x.device.type == "cpu" else None


def pointer(x) -> ctypes.c_void_p:
    """A tensor's data as a C pointer (the caller keeps the tensor alive and contiguous)."""
    return ctypes.c_void_p(x.data_ptr())


#: numbers of work below which a call stays on one thread (waking a thread costs microseconds)
PARALLEL_FROM = 1 << 16


def threads_for(rows: int, work: int) -> int:
    """The threads a kernel call over ``rows`` rows runs on: torch's (``torch.get_num_threads()``, so
    the thread settings and governor apply), at most one per row; one for a call touching fewer than
    ``PARALLEL_FROM`` numbers (``work``), and in a forked child. The kernel splits its rows into one
    block per thread on the OpenMP team torch's CPU ops run on (``parallel_rows.h``); a ctypes call
    releases the GIL."""
    if work < PARALLEL_FROM or _forked:
        return 1
    return max(1, min(torch.get_num_threads(), rows))


_forked = False


def _after_fork_in_child() -> None:
    """libgomp's team does not survive a fork: a parallel region in the child waits on the parent's
    threads for ever (torch's own parallel ops as well), so a forked child runs the kernels on its
    one thread."""
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def call_rows(kernel, arrays, shape) -> None:
    """``kernel(*arrays, length, dim, 0, rows, threads)`` over the rows of ``shape = (rows, length,
    dim)`` on ``threads_for`` threads: the calling convention of the sorted ops' kernels. Tensors
    pass as pointers (None as a null one), numbers as they are."""
    rows, length, dim = shape
    tensors = [x for x in arrays if isinstance(x, torch.Tensor)]
    assert all(x.is_contiguous() for x in tensors), "the kernels read every array as contiguous"
    passed = [pointer(x) if isinstance(x, torch.Tensor) else x for x in arrays]
    kernel(*passed, length, dim, 0, rows, threads_for(rows, rows * length * dim))
