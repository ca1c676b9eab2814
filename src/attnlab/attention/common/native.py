"""Small C++ kernels for the CPU, built on first use and called through ``ctypes``.

Some CPU work is a chain of many tiny tensor ops whose cost is the dispatch of each, not the arithmetic
(a decoding step searches a few sorted runs in about thirty ops). Such a chain is written once in plain
C++ (``extern "C"`` functions on raw arrays, no torch headers) and built by torch's own
``cpp_extension.load``, which finds the compiler, caches the library under ``TORCH_EXTENSIONS_DIR``
(``~/.cache/torch_extensions`` by default), rebuilds it when the source changes and locks the build
against concurrent processes. Without torch's headers a build takes about a second instead of the 40 s
a ``torch/extension.h`` source takes, and the call is a ``ctypes`` call: no op registration is needed
for code that runs under ``torch.inference_mode`` on contiguous CPU tensors.

Where no compiler (or no ``ninja``) is found, or ``ATTNLAB_NATIVE=off`` is set, ``library`` returns
None and the callers keep their torch code: the results are the same, only slower. The reason is
logged once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: set to "off" to use the torch code instead of the C++ kernels
SWITCH = "ATTNLAB_NATIVE"


def enabled() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


@functools.cache
def _build(source: str) -> ctypes.CDLL | None:
    path = Path(source)
    name = f"attnlab_{path.stem}"
    started = time.perf_counter()
    try:
        cpp_extension = _cpp_extension()
        library = cpp_extension.load(
            name, [str(path)], extra_cflags=["-O3"], is_python_module=False, verbose=False
        )
    except Exception as error:  # no compiler, no ninja, a read-only cache: the torch code runs instead
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log.warning("C++ CPU kernels %s not built (%s): using the torch code, which is slower", name, reason)
        return None
    log.info("C++ CPU kernels %s ready in %.1f s (%s)", name, time.perf_counter() - started, library)
    return ctypes.CDLL(library)


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


def pointer(x) -> ctypes.c_void_p:
    """A tensor's data as a C pointer (the caller keeps the tensor alive and contiguous)."""
    return ctypes.c_void_p(x.data_ptr())
