"""Whether Triton can run on a device, launching its kernels, and loading them.

The Triton implementations of the ops ask ``triton_problem`` (``attnlab.attention.common.dispatch``):
on CUDA tensors, once per device, whether Triton can build and launch a kernel there
(``device_problem``: a tiny probe kernel, compiled for the device and run). If not, they decline
(``auto`` warns once with the reason and the torch code runs; ``triton`` is refused with it). If a
kernel later fails to build (``launch``), ``auto`` warns once and runs the torch code, ``triton``
raises ``TritonUnavailableError`` with the reason.

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
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import torch

_KERNEL_FILE = Path(__file__).with_name("kernels.py")  # the shared helpers and the device probe
# each family's kernels, executed into the same module after it (they use its helpers)
_FAMILIES = Path(__file__).parents[2]
FAMILY_KERNELS = tuple(
    _FAMILIES / f / "triton_kernels.py"
    for f in ("sliced_common", "sliced_relu", "sliced_relu_bump", "linear")
)
_LOADED: dict[bool, ModuleType] = {}
_PROBED: dict[str, str | None] = {}  # device -> why Triton cannot run there (None: it can)
_WARNED: set[str] = set()
Result = TypeVar("Result")


class TritonUnavailableError(RuntimeError):
    """``impl="triton"`` was asked for where the kernels cannot run; ``problem`` says why."""

    def __init__(self, message: str, problem: str | None = None):
        super().__init__(message)
        self.problem = problem


def interpret_mode() -> bool:
    """True when Triton's interpreter is switched on (``TRITON_INTERPRET=1``, read now)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_problem(op: str, impl: str, device: torch.device, cuda: bool) -> str | None:
    """Why the Triton kernels cannot run ``op`` on ``device`` (None: they can): triton missing, or a
    CUDA device (``cuda``) Triton cannot build and launch a kernel on (``device_problem``, asked
    once). Under ``impl="auto"`` a device problem is also warned about, once: the torch code runs
    instead."""
    if not _triton_importable():
        return "the triton package is not installed (it comes with torch's CUDA wheels)"
    if not cuda:
        return None
    problem = device_problem(device)
    if problem is not None and impl == "auto":
        _warn_fallback(op, problem)
    return problem


_WAY_OUT = "impl='auto' falls back to the torch code, impl='torch' asks for it"


def on_cuda(tensors) -> bool:
    """Whether a call's tensors are CUDA tensors (they share one device)."""
    return all(x.is_cuda for x in tensors)


def _warn_fallback(op: str, problem: str) -> None:
    """One warning per reason and op: a layer calls its op at every step."""
    key = f"{op}: {problem}"
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"{op}: impl='auto' runs the torch code instead of the Triton kernels: {problem}",
            RuntimeWarning,
            stacklevel=4,
        )


def launch(
    op: str,
    impl: str,
    device: torch.device,
    call: Callable[[], Result],
    check: Callable[[], bool] | None = None,
) -> Result | None:
    """Run the Triton path ``call()``. If Triton fails to build or launch a kernel (a
    ``TritonError``: compilation, ptxas, resources), ``impl="triton"`` raises
    ``TritonUnavailableError`` with the reason; ``auto`` warns once, remembers the device as unusable
    (later calls go straight to torch) and returns None: the caller then runs the torch code.
    The forward's call builds its kernels; the backward's are built at the first backward pass,
    after the device probe (``device_problem``) has shown that Triton builds and runs there.
    ``check``: under ``auto``, first the op's first-use check (``selfcheck.trusted``); False: None,
    the torch code (the check has warned). A kernel that fails to build inside the check is a build
    failure as above, not a disagreement."""
    from triton.errors import TritonError

    try:
        if impl == "auto" and check is not None and not check():
            return None
        return call()
    except (TritonError, TritonUnavailableError) as err:
        if isinstance(err, TritonUnavailableError):  # raised inside the check's own impl="triton" call
            if impl != "auto" or err.problem is None:
                raise
            problem = err.problem
        else:
            problem = f"Triton failed to build or launch a kernel on {device}: {_first_line(err)}"
        if impl != "auto":
            message = f"{op}: impl='triton' cannot run: {problem}; {_WAY_OUT}"
            raise TritonUnavailableError(message, problem) from err
        _PROBED[str(device)] = problem
        _warn_fallback(op, problem)
        return None


def _first_line(err: BaseException) -> str:
    """The telling line of a Triton error (ptxas's ``fatal`` line; its messages run to pages of PTX)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    fatal = [line for line in lines if "fatal" in line.lower()]
    return (fatal[0] if fatal else lines[0] if lines else type(err).__name__)[:300]


def device_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on the CUDA ``device`` (None: they can), asked once per
    device: a probe kernel is compiled for it and launched (compiler, ptxas, driver and device)."""
    key = str(device)
    if key not in _PROBED:
        _PROBED[key] = _probe(device)
    return _PROBED[key]


def _probe(device: torch.device) -> str | None:
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    try:
        with torch.cuda.device(device):  # triton launches on the current device
            x = torch.zeros(16, dtype=torch.float32, device=device)
            kernels().probe_kernel[(1,)](x, 16, BLOCK=16)
            ok = bool((x == 1).all())
    except Exception as err:  # noqa: BLE001 - any failure here means "not on this device"
        return f"Triton cannot run on {device} ({name}, sm_{major}{minor}): {_first_line(err)}"
    if not ok:
        return f"Triton's probe kernel gave wrong results on {device} ({name}, sm_{major}{minor})"
    return None


def compile_problem(capability: tuple[int, int]) -> str | None:
    """Why Triton cannot build kernels for a device of ``capability`` (None: it can); compiles the
    probe kernel for that target, no GPU needed (so a start-up check can ask before any work)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    previous = os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernels, whatever the mode
    try:
        probe = kernels().probe_kernel
    finally:
        if previous is not None:
            os.environ["TRITON_INTERPRET"] = previous
    major, minor = capability
    source = ASTSource(
        fn=probe, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 16}
    )
    try:
        triton.compile(source, target=GPUTarget("cuda", 10 * major + minor, 32))
    except Exception as err:  # noqa: BLE001 - any failure to build means "not for this device"
        return f"Triton {triton.__version__} cannot build kernels for sm_{major}{minor}: {_first_line(err)}"
    return None


def kernels() -> ModuleType:
    """The kernel module decorated for the current mode (GPU or interpreter), loaded once per mode:
    ``kernels.py`` with each family's ``triton_kernels.py`` executed into it (``FAMILY_KERNELS``)."""
    mode = interpret_mode()
    module = _LOADED.get(mode)
    if module is None:
        name = f"attnlab.attention.common.triton._kernels_{'interpreted' if mode else 'compiled'}"
        spec = importlib.util.spec_from_file_location(name, _KERNEL_FILE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # triton looks functions' modules up by name
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if mode else "0"  # one spelling triton reads as we do
        try:
            spec.loader.exec_module(module)
            for path in FAMILY_KERNELS:  # one namespace: they use kernels.py's helpers
                exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102
        finally:
            if previous is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = previous
        if mode:
            _round_bf16_as_gpus_do()
        _LOADED[mode] = module
    return module


def _round_bf16_as_gpus_do() -> None:
    """Make the interpreter round float32 -> bf16 to nearest even, as the compiled ``cvt.rn``
    does: Triton 3.6's interpreter truncates (half the bf16 outputs one unit low, measured), so
    bf16 results interpreted would not be a GPU's. Patched once, in the interpreter's builder."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_bf16", False):
        return
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # numpy: no torch op
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # NaN stays NaN
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return truncating(self, src, dst_type)

    cast_impl.rounds_bf16 = True
    builder.cast_impl = cast_impl  # the builder's create_fp_trunc & co. call self.cast_impl
