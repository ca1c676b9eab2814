"""Which implementation runs (``impl``), and loading the kernels for the mode in force.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *decorated*, not when it is launched:
kernels decorated for the GPU cannot run in the interpreter and vice versa. So the kernel module is
not imported normally: ``kernels()`` executes it once per mode (GPU or interpreter), the mode being
read from the environment at each call. Setting ``TRITON_INTERPRET=1`` at any time before a call
(e.g. with ``monkeypatch.setenv`` in a test) is therefore enough.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

IMPLS = ("auto", "triton", "torch")
_KERNEL_FILE = Path(__file__).with_name("kernels.py")
_LOADED: dict[bool, ModuleType] = {}


class TritonUnavailableError(RuntimeError):
    """``impl="triton"`` was asked for where the kernels cannot run."""


def interpret_mode() -> bool:
    """True when Triton's interpreter is switched on (``TRITON_INTERPRET=1``, read now)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(op: str, impl: str, *tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for a call of ``op`` on ``tensors`` (all on one device).

    ``auto``: Triton for CUDA tensors when triton is installed, torch otherwise (CPU tensors never
    reach Triton). ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``; the error says so.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    on_cuda = all(x.is_cuda for x in tensors)
    if impl == "torch":
        return "torch"
    if impl == "auto":
        return "triton" if on_cuda and _triton_importable() else "torch"
    if not _triton_importable():
        raise TritonUnavailableError(
            f"{op}: impl='triton' needs the triton package (part of torch's CUDA wheels); "
            "it is not installed: use impl='torch' or impl='auto'"
        )
    if not on_cuda and not interpret_mode():
        devices = sorted({str(x.device) for x in tensors})
        raise TritonUnavailableError(
            f"{op}: impl='triton' got tensors on {', '.join(devices)}: the Triton kernels run on CUDA "
            "tensors, or on CPU tensors under Triton's interpreter (set TRITON_INTERPRET=1; slow, "
            "for tests); use impl='auto' or impl='torch' for the CPU path"
        )
    return "triton"


def kernels() -> ModuleType:
    """The kernel module decorated for the current mode (GPU or interpreter), loaded once per mode."""
    mode = interpret_mode()
    module = _LOADED.get(mode)
    if module is None:
        name = f"attnlab.attention.triton._kernels_{'interpreted' if mode else 'compiled'}"
        spec = importlib.util.spec_from_file_location(name, _KERNEL_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # triton looks functions' modules up by name
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if mode else "0"  # one spelling triton reads as we do
        try:
            spec.loader.exec_module(module)
        finally:
            if previous is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = previous
        _LOADED[mode] = module
    return module
