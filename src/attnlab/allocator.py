"""glibc's malloc told to keep freed large buffers, so that a step reuses its memory instead of
page-faulting it in afresh.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
returns it with ``munmap`` when freed, and it trims the top of its heap whenever more than the trim
threshold is free. An attention op at long sequences allocates and frees buffers of tens of MiB on
every call, so each call faulted all their pages in again: the sliced ReLU op ran 1.26-1.28 times
slower than with the same buffers kept (docs/benchmarks.md, "CPU: the allocator"). ``configure()``
sets, through ``mallopt``, what ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` would: no mmap'd
chunks, and a trim threshold of 2 GiB (``mallopt`` takes an ``int``), so freed buffers stay in the
heap for the next step. A run's resident memory then stays at its peak instead of falling between
steps; it does not grow beyond it.

The user's choice wins: any ``MALLOC_*_`` variable, a ``glibc.malloc`` tunable in ``GLIBC_TUNABLES``,
or another allocator preloaded (``LD_PRELOAD`` naming jemalloc or tcmalloc) leaves malloc as it is,
and ``ATTNLAB_MALLOC=off`` keeps glibc's defaults. Not glibc (macOS, musl): nothing to set.
Entry points only (``train.py``, the ``attnlab`` command): a library must not change its host's
allocator. Stdlib only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

#: set to "off" to keep glibc's malloc defaults
SWITCH = "ATTNLAB_MALLOC"
# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: the largest trim threshold mallopt accepts (an int); the heap keeps up to this much freed memory
TRIM_THRESHOLD = 2**31 - 1
SETTINGS = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD}


@dataclass(frozen=True)
class AllocatorSettings:
    """What ``configure`` decided, for the run's log."""

    applied: bool
    reason: str

    @property
    def summary(self) -> str:
        """What applies, in a few words (a benchmark's title line)."""
        return "memory: glibc keeps freed buffers for reuse" if self.applied else "memory: malloc as it is"

    def describe(self) -> str:
        if self.applied:
            return (
                f"{self.summary} (M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB; attnlab); set MALLOC_MMAP_MAX_ / "
                f"MALLOC_TRIM_THRESHOLD_ to choose, {SWITCH}=off for glibc's defaults"
            )
        return f"{self.summary} ({self.reason})"


_applied: AllocatorSettings | None = None


def _user_choice(env: dict) -> str | None:
    """The user's own allocator settings, named, or None."""
    if env.get(SWITCH, "").strip().lower() in {"off", "0", "false", "no"}:
        return f"{SWITCH}={env[SWITCH]}"
    mine = sorted(key for key in env if key.startswith("MALLOC_") and key.endswith("_"))
    if mine:
        return f"yours: {', '.join(mine)}"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "yours: GLIBC_TUNABLES"
    preload = env.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"yours: LD_PRELOAD={preload}"
    return None


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def configure(
    environ: dict | None = None, mallopt: Callable[[int, int], int] | None = None
) -> AllocatorSettings:
    """Keep freed large buffers in glibc's heap, unless the user chose (see the module's docstring).

    The first call in a process decides; ``environ`` and ``mallopt`` replace the process's own for
    tests (then nothing is remembered).
    """
    global _applied
    if _applied is not None and environ is None:
        return _applied
    env = os.environ if environ is None else environ
    reason = _user_choice(env)
    if reason is None:
        mallopt = mallopt or _glibc_mallopt()
        if mallopt is None:
            reason = "not glibc"
        elif not all(mallopt(param, value) == 1 for param, value in SETTINGS.items()):
            reason = "glibc refused mallopt"
    settings = AllocatorSettings(applied=reason is None, reason=reason or "attnlab")
    if environ is None:
        _applied = settings
    return settings


def applied() -> AllocatorSettings | None:
    """What ``configure`` decided in this process, or None when no entry point called it."""
    return _applied
