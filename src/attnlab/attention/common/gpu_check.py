"""Can this machine's GPUs run the installed torch build and the Triton kernels? Asked at start.

A torch wheel carries GPU kernels for a fixed list of compute capabilities (``sm_70`` … ``sm_120``
for the pinned torch 2.10 CUDA 12.8 build; 2.11+ dropped Volta). On a device outside that list
torch only warns, then the first kernel fails deep inside the fit ("no kernel image is available"),
on every DDP rank, after the data was prepared. ``check_gpus`` runs before any work when the trainer
asks for GPUs (``trainer=gpu|ddp|ddp_slurm``) and stops with one line naming the device, the build
and the fix. It also asks Triton to build a probe kernel for each device's capability (no launch,
no CUDA context: ``attnlab.attention.common.triton.runtime.compile_problem``).

Compatibility rule (CUDA's): a cubin ``sm_XY`` runs on devices of the same major version and minor
>= Y (``sm_90a``-style arch-specific cubins on exactly X.Y), a PTX ``compute_XY`` on any device of
capability >= X.Y (JIT-compiled by the driver).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from attnlab.errors import UserError

GPU_ACCELERATORS = ("gpu", "cuda")
_ARCH = re.compile(r"(sm|compute)_(\d+)([a-z]?)\Z")


class GPUUnsupportedError(UserError):
    """The trainer asks for GPUs this torch build (or Triton) cannot run on."""


def build_archs() -> list[str]:
    """The compute capabilities the installed torch build has kernels for (``sm_70``, ``compute_90``…).

    ``torch.cuda.get_arch_list()`` is empty without a driver; ``_cuda_getArchFlags`` reads the build.
    """
    archs = list(torch.cuda.get_arch_list())
    if not archs:
        flags = getattr(torch._C, "_cuda_getArchFlags", lambda: "")()
        archs = (flags or "").split()
    return archs


def runs_on(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether kernels built for ``archs`` run on a device of ``capability`` (the module's rule)."""
    major, minor = capability
    for arch in archs:
        match = _ARCH.match(arch)
        if match is None:
            continue
        kind, digits, suffix = match.groups()
        arch_major, arch_minor = divmod(int(digits), 10)
        if kind == "sm" and arch_major == major and (arch_minor == minor if suffix else arch_minor <= minor):
            return True
        if kind == "compute" and not suffix and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


def _uses_gpus(trainer: Mapping[str, Any]) -> bool:
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    return accelerator in GPU_ACCELERATORS or (accelerator == "auto" and torch.cuda.is_available())


def _build() -> str:
    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU-only'})"


def check_gpus(trainer: Mapping[str, Any]) -> None:
    """Stop (``GPUUnsupportedError``, one line) if ``trainer`` (the ``trainer`` config) asks for GPUs
    that torch or Triton cannot run on; do nothing for CPU trainers."""
    if not _uses_gpus(trainer):
        return
    fix_cpu = "or run on CPU with trainer=cpu"
    if not torch.cuda.is_available():
        raise GPUUnsupportedError(
            f"trainer.accelerator={trainer.get('accelerator')!r} asks for a GPU but {_build()} sees no CUDA "
            f"device (driver missing, CUDA_VISIBLE_DEVICES empty, or a CPU-only build): run on a GPU node "
            f"with the CUDA build of torch (pyproject.toml pins it), {fix_cpu}"
        )
    archs = build_archs()
    for index in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        device = f"cuda:{index} {name} (compute capability {major}.{minor}, sm_{major}{minor})"
        if archs and not runs_on(archs, (major, minor)):
            raise GPUUnsupportedError(
                f"{device} has no kernels in {_build()}, built for {' '.join(archs)}: install a torch "
                f"build whose torch.cuda.get_arch_list() covers sm_{major}{minor} (the pinned torch 2.10 "
                f"CUDA 12.8 build covers sm_70 to sm_120; torch 2.11+ dropped sm_70), {fix_cpu}"
            )
        problem = _triton_problem((major, minor))
        if problem is not None:
            raise GPUUnsupportedError(
                f"{device}: {problem}: install the triton version that comes with {_build()} "
                f"(pip install torch reinstalls it), {fix_cpu}"
            )


def _triton_problem(capability: tuple[int, int]) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return None  # no triton: the ops run their torch code (impl="auto")
    from attnlab.attention.common.triton.runtime import compile_problem

    return compile_problem(capability)


__all__ = ["GPUUnsupportedError", "build_archs", "check_gpus", "runs_on"]
