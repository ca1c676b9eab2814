"""glibc keeps freed large buffers when an entry point starts (attnlab.allocator): a loop that
allocates and frees a 64 MiB tensor stops page-faulting it in after the first rounds, unless the
user chose their own allocator settings."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from attnlab import allocator


class Mallopt:
    def __init__(self, answer: int = 1):
        self.calls, self.answer = [], answer

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def test_attnlab_sets_no_mmap_and_a_high_trim_threshold():
    mallopt = Mallopt()
    settings = allocator.configure({}, mallopt)
    assert settings.applied and "M_MMAP_MAX=0" in settings.describe()
    expected = [(allocator.M_MMAP_MAX, 0), (allocator.M_TRIM_THRESHOLD, 2**31 - 1)]
    assert sorted(mallopt.calls) == sorted(expected)


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({"MALLOC_TRIM_THRESHOLD_": "1000"}, "yours: MALLOC_TRIM_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "yours: GLIBC_TUNABLES"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "yours: LD_PRELOAD=/usr/lib/libjemalloc.so.2"),
        ({"ATTNLAB_MALLOC": "off"}, "ATTNLAB_MALLOC=off"),
    ],
)
def test_the_users_choice_wins(environ, reason):
    mallopt = Mallopt()
    settings = allocator.configure(environ, mallopt)
    assert not settings.applied and mallopt.calls == []
    assert settings.describe() == f"memory: malloc as it is ({reason})"


def test_a_refusal_is_said():
    settings = allocator.configure({}, Mallopt(answer=0))
    assert not settings.applied and "refused" in settings.describe()


FAULTS = """
import resource, torch
from attnlab import allocator
settings = allocator.configure()
torch.set_num_threads(1)
counts = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 * 1024 * 1024)
    x.fill_(1.0)
    y = x * 2.0
    del x, y
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(settings.applied, *counts)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.parametrize("switch", ["on", "off"])
def test_freed_buffers_are_reused_instead_of_faulted_in_again(switch):
    env = {"PATH": "/usr/bin:/bin", "ATTNLAB_MALLOC": switch}
    done = subprocess.run(
        [sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    applied, *counts = done.stdout.split()
    pages = 2 * 64 * 1024 * 1024 // 4096  # both tensors, in 4 KiB pages
    if switch == "on":
        assert applied == "True"
        assert max(int(c) for c in counts[-3:]) < pages // 100, counts  # kept: no faults once warm
    else:
        assert applied == "False"
        assert min(int(c) for c in counts[-3:]) >= pages // 2, counts  # glibc's default: faulted each time
