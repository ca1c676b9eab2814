"""Which implementation of an op runs: each declares what it accepts, the first that accepts runs.

An op lists its implementations in the order it prefers them (the cheapest that can run first:
sliced ReLU takes its dense O(T²) evaluation at short T, then the Triton kernels, then the sorted
torch op). Each is an `Implementation`: the devices, accumulation dtypes, causal forms, head dims,
sequence lengths and padded-query modes it runs, whether it is deterministic, what it costs, and
the ``impl=`` / ``path=`` values that name it. A call is a `Request`; `run_first` asks every
implementation in turn (`Implementation.not_supported_reasons`), runs the first with no reason to
decline and, when none accepts, raises one `NoImplementationError` whose single line names the op
and each implementation tried with why it declined. ``impl=`` and ``path=`` only narrow the list:
an implementation they do not name declines with that reason like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnlab.attention.common import compiler
from attnlab.attention.common.padding import COMMON_PADDED_QUERIES
from attnlab.attention.common.triton import runtime

IMPLS = ("auto", "triton", "torch")
PATHS = ("auto", "dense", "sorted")
ACCUMULATION_DTYPES = (torch.float32, torch.float64)


class NoImplementationError(ValueError):
    """No implementation of an op accepts a call; the message lists each one and why it declined."""


def check_choice(op: str, impl: str, path: str | None = None) -> None:
    """``impl`` (and ``path``, for the ops that have one) among the known values: one line each."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if path is not None and path not in PATHS:
        raise ValueError(f"{op}: path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")


def device_type(*tensors: torch.Tensor) -> str:
    """The kind of device a call's tensors sit on (they share one): ``"cuda"`` when
    ``runtime.on_cuda`` says so, their own device type otherwise."""
    return "cuda" if runtime.on_cuda(tensors) else tensors[0].device.type


@dataclass(frozen=True)
class Request:
    """One call of an op, as the implementations see it: ``device`` its tensors' device and
    ``device_type`` its kind (`device_type`), ``dtype`` the accumulation dtype (float32 for half and
    float32 inputs, float64 for float64), ``head_dim`` the widest of q, k, v."""

    op: str
    device: torch.device
    device_type: str
    dtype: torch.dtype
    impl: str = "auto"
    path: str = "auto"
    causal: bool = False
    head_dim: int = 0
    length: int = 0
    padded_queries: str = "zero"
    deterministic: bool = field(default_factory=torch.are_deterministic_algorithms_enabled)

    def describe(self) -> str:
        path = "" if self.path == "auto" else f", path={self.path!r}"
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"impl={self.impl!r}{path}, causal={self.causal}, {self.device_type} {dtype}, "
            f"T={self.length}, head dim {self.head_dim}"
        )


@dataclass(frozen=True)
class Implementation:
    """What one implementation of an op accepts and costs, and how it runs.

    ``impl`` is the ``impl=`` value that names it ("torch" or "triton"), ``path`` the ``path=`` value
    ("dense", "sorted"; None for ops without one). ``devices`` are device types (None: any device
    torch runs on). ``dtypes`` are accumulation dtypes, narrowed per
    device type by ``dtypes_on``. ``max_length`` bounds T whatever ``path`` says; ``auto_length`` is
    the longest T at which ``path="auto"`` takes it (a measured crossover; None: no bound).
    ``interpreted``: CPU tensors also run under Triton's interpreter (``TRITON_INTERPRET=1``) when
    the call names it. ``available`` says why it cannot run here (a missing package, a device it
    cannot build for); it is asked last. ``notes`` add the reason behind a declared limit to the
    line that reports it (keys: "device", "dtype", "causal", "head_dim", "length"). ``traceable``:
    ``torch.compile`` can trace ``run`` (plain torch code); the others run there as the op's
    custom op (``attnlab.attention.common.compiler``). ``run(args)``
    returns the output, or None when it found at run time that it cannot run (and warned): the next
    implementation that accepts then runs.
    """

    name: str
    cost: str
    run: Callable[[Any], torch.Tensor | None]
    impl: str = "torch"
    path: str | None = None
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] = ACCUMULATION_DTYPES
    dtypes_on: dict[str, tuple[torch.dtype, ...]] = field(default_factory=dict)
    causal: tuple[bool, ...] = (False, True)
    max_head_dim: int | None = None
    max_length: int | None = None
    auto_length: Callable[[Request], int] | None = None
    padded_queries: tuple[str, ...] = COMMON_PADDED_QUERIES
    deterministic: bool = True
    interpreted: bool = False
    available: Callable[[Request], str | None] | None = None
    notes: dict[str, str] = field(default_factory=dict)
    traceable: bool = False

    def not_supported_reasons(self, request: Request) -> list[str]:
        """Why this implementation declines ``request`` (empty: it accepts)."""
        if request.impl not in ("auto", self.impl):
            return [f"is impl={self.impl!r}"]
        if self.path is not None and request.path not in ("auto", self.path):
            return [f"is path={self.path!r}"]
        reasons = []
        device = request.device_type
        if self.devices is not None and device not in self.devices and not self._interpreted(request):
            runs = " or ".join(f"{d.upper()} tensors" for d in self.devices)
            if self.interpreted:
                runs += (
                    f" (CPU tensors under Triton's interpreter: TRITON_INTERPRET=1 and impl={self.impl!r})"
                )
            reasons.append(self._noted("device", f"runs {runs}, got {device.upper()} tensors"))
        dtypes = self.dtypes_on.get(device, self.dtypes)
        if request.dtype not in dtypes:
            name = str(request.dtype).removeprefix("torch.")
            reasons.append(self._noted("dtype", f"no {name} kernel on {device.upper()}"))
        if request.causal not in self.causal:
            form = "causal=True" if request.causal else "causal=False"
            reasons.append(self._noted("causal", f"no {form} form"))
        if self.max_head_dim is not None and request.head_dim > self.max_head_dim:
            reasons.append(
                self._noted(
                    "head_dim", f"runs head dims up to {self.max_head_dim}, got {_shown(request.head_dim)}"
                )
            )
        if (problem := self._length_problem(request)) is not None:
            reasons.append(problem)
        if request.padded_queries not in self.padded_queries:
            reasons.append(f"no padded_queries={request.padded_queries!r}")
        if request.deterministic and not self.deterministic:
            reasons.append("not deterministic (torch.use_deterministic_algorithms is on)")
        if not reasons and self.available is not None and (problem := self.available(request)):
            reasons.append(problem)
        return reasons

    def _interpreted(self, request: Request) -> bool:
        return (
            self.interpreted
            and request.device_type == "cpu"
            and request.impl == self.impl
            and runtime.interpret_mode()
        )

    def _length_problem(self, request: Request) -> str | None:
        limit = math.inf if self.max_length is None else self.max_length
        if request.length > limit:
            return self._noted("length", f"runs T up to {limit}, got T={_shown(request.length)}")
        if request.path == "auto" and self.auto_length is not None:
            crossover = self.auto_length(request)
            if request.length > crossover:
                dtype = str(request.dtype).removeprefix("torch.")
                where = f"{request.device_type} {dtype}"
                if crossover == 0:
                    return f"path='auto' never takes it on {where} (no crossover measured)"
                return f"path='auto' takes it up to T={crossover} on {where}, got T={_shown(request.length)}"
        return None

    def _noted(self, key: str, reason: str) -> str:
        note = self.notes.get(key)
        return f"{reason} ({note})" if note else reason

    def __str__(self) -> str:
        return f"{self.name} [{self.impl}, {self.cost}]"


def _shown(size: int) -> str:
    """A size as a reason states it. Under ``torch.compile`` a size is a symbol, and formatting it
    would fix the graph to that one value (a recompile at every new length), so the reason says so
    instead: a reason is read only when no implementation accepts, which fails the call anyway."""
    return "a traced size" if compiler.compiling() else str(size)


def accepting(implementations: Sequence[Implementation], request: Request) -> list[Implementation]:
    """The implementations that accept ``request``, in their order (what ``run_first`` tries)."""
    return [i for i in implementations if not i.not_supported_reasons(request)]


def run_first(
    implementations: Sequence[Implementation],
    request: Request,
    args: Any,
    opaque: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the first implementation that accepts ``request`` on ``args``; when one returns None (it
    could not run after all, and warned), the next that accepts. None left: `NoImplementationError`.

    Under ``torch.compile``, an implementation that is not ``traceable`` is not traced: ``opaque()``
    (the whole op as one custom op, which dispatches again when it runs) takes its place."""
    tried = []
    for implementation in implementations:
        reasons = implementation.not_supported_reasons(request)
        if not reasons:
            if opaque is not None and not implementation.traceable and compiler.compiling():
                return opaque()
            out = implementation.run(args)
            if out is not None:
                return out
            reasons = ["could not run here (warned above)"]
        tried.append(f"{implementation}: {'; '.join(reasons)}")
    raise NoImplementationError(
        f"{request.op}: no implementation accepts this call ({request.describe()}); tried {' | '.join(tried)}"
    )
