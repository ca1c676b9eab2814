"""Count the bytes an attention op reads and writes: every torch op and every Triton launch.

Why by hand: profilers count time, and on a CPU there is no DRAM counter to read for a GPU kernel.
What a GPU will move can still be *measured* on a CPU, one access at a time:

- **torch ops** go through the dispatcher, where a ``TorchDispatchMode`` sees each op with its
  tensors (forward and the autograd backward alike). An op is charged the bytes of its tensor
  inputs (read) and outputs (written): views and ``empty`` cost nothing, an expanded input only its
  distinct elements, a gather only the rows it picks, an in-place scatter only the slots it touches
  (read-modify-write). This is what the op must move at least once; a sort's extra passes are not
  seen (a lower bound for sorts, exact for elementwise ops and reductions).
- **Triton kernels** run under the interpreter (``TRITON_INTERPRET=1``), which performs every
  ``tl.load``/``tl.store`` with numpy: each is charged its unmasked lanes × the element size. This
  counts re-reads of the same address separately (a GPU's caches may serve them), so it is what the
  kernel asks of memory, not necessarily what reaches DRAM.
- **Sectors**: a GPU moves memory in 32-byte sectors, so a load that gathers 4-byte numbers from
  scattered addresses moves 32 bytes for each. Each row also counts ``sectors``: for a kernel, the
  distinct 32-byte sectors each ``tl.load``/``tl.store`` touches (over the whole program's block,
  as if perfectly coalesced), times 32; for a torch op, its bytes (whole passes over memory).

``count_bytes(fn)`` runs ``fn`` under both and returns one :class:`Traffic` row per op or kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnlab.attention.common import compiler, native

aten = torch.ops.aten
SECTOR = 32  # bytes: the least a GPU's memory system moves for an access

# ops that allocate without writing, or only change metadata: no bytes move
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_FREE |= {"detach", "alias", "lift_fresh"}
# new tensors filled with a constant: written, their tensor argument only gives the shape
_FILLS = {"ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full"}
# out = source[index] along some dimension: the source is read only where the index points
_GATHERS = {"gather", "index_select", "index", "take_along_dim", "embedding", "take"}
_GATHERS |= {"_embedding_bag", "_embedding_bag_forward_only"}  # rows summed per bag: read where picked
# self[index] (op)= src, in place: self is read and written only at the indexed slots
_SCATTERS_INPLACE = {"scatter_", "scatter_add_", "scatter_reduce_", "index_add_", "index_put_", "index_copy_"}
# writes self without reading it
_WRITE_ONLY_INPLACE = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_"}


@dataclass
class Traffic:
    """Bytes one op or kernel read and wrote, summed over its ``calls``."""

    kind: str  # "torch" | "triton"
    name: str
    read: int = 0
    written: int = 0
    calls: int = 0
    sectors: int = 0  # bytes in whole 32-byte sectors, read and written (module docstring)

    @property
    def total(self) -> int:
        return self.read + self.written


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements ``t`` addresses (an expanded view counts its storage once)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
    return min(t.numel(), span) * t.element_size()


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [x for item in obj for x in _tensors(item)]
    return []


def _op_traffic(func, args, kwargs, out) -> tuple[int, int]:
    """(read, written) bytes of one aten op, by the rules in the module docstring."""
    name = func._schema.name.split("::")[-1]
    if func.is_view or name in _FREE:
        return 0, 0
    inputs = _tensors(list(args) + list(kwargs.values()))
    outputs = _tensors(out)
    inplace = name.endswith("_")
    if name in _FILLS:
        return 0, sum(map(tensor_bytes, outputs))
    if name in _GATHERS:
        source, rest = inputs[0], inputs[1:]
        picked = min(tensor_bytes(source), sum(o.numel() for o in outputs) * source.element_size())
        return picked + sum(map(tensor_bytes, rest)), sum(map(tensor_bytes, outputs))
    if name in _SCATTERS_INPLACE:
        target, rest = inputs[0], inputs[1:]
        values = [x for x in rest if x.dtype == target.dtype] or rest
        touched = min(tensor_bytes(target), sum(x.numel() for x in values[-1:]) * target.element_size())
        return touched + sum(map(tensor_bytes, rest)), touched
    if inplace and name in _WRITE_ONLY_INPLACE:
        return sum(map(tensor_bytes, inputs[1:])), tensor_bytes(inputs[0])
    if inplace:  # self is read and written, the rest read
        return sum(map(tensor_bytes, inputs)), tensor_bytes(inputs[0])
    out_ids = {id(o) for o in outputs}
    reads = [x for x in inputs if id(x) not in out_ids]  # out= arguments are written, not read
    return sum(map(tensor_bytes, reads)), sum(map(tensor_bytes, outputs))


class _Counter(TorchDispatchMode):
    """Charges every dispatched op to a :class:`Traffic` row, except inside a Triton launch (the
    interpreter's own copies to and from the host are not the kernel's traffic)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, str], Traffic] = {}
        self.launch: Traffic | None = None

    def row(self, kind: str, name: str) -> Traffic:
        return self.rows.setdefault((kind, name), Traffic(kind, name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.launch is None:
            read, written = _op_traffic(func, args, kwargs, out)
            if read or written:
                row = self.row("torch", func._schema.name.split("::")[-1])
                row.read, row.written, row.calls = row.read + read, row.written + written, row.calls + 1
                row.sectors += read + written
        return out


@contextlib.contextmanager
def _interpreter_hooks(counter: _Counter):
    """Charge the interpreter's loads and stores to the running launch (TRITON_INTERPRET=1 only)."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: torch ops only
        yield
        return
    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__

    def _lanes(ptrs, mask) -> int:
        size = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
        return int(mask.data.sum()) * size

    def _sectors(ptrs, mask) -> int:
        addresses = np.broadcast_to(ptrs.data, np.broadcast(ptrs.data, mask.data).shape)
        return np.unique(addresses[np.broadcast_to(mask.data, addresses.shape)] // SECTOR).size * SECTOR

    def counted_load(self, ptrs, mask, *rest):
        if counter.launch is not None:
            counter.launch.read += _lanes(ptrs, mask)
            counter.launch.sectors += _sectors(ptrs, mask)
        return load(self, ptrs, mask, *rest)

    def counted_store(self, ptrs, value, mask, *rest):
        if counter.launch is not None:
            counter.launch.written += _lanes(ptrs, mask)
            counter.launch.sectors += _sectors(ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    def counted_call(self, *args, **kwargs):
        outer, counter.launch = counter.launch, counter.row("triton", self.fn.__name__)
        counter.launch.calls += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            counter.launch = outer

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    executor.__call__ = counted_call
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store, executor.__call__ = load, store, call


@contextlib.contextmanager
def _no_host_reads():
    """The ops' code for CUDA tensors, which reads no value back to the host: on the CPU an op may
    look first and skip work (softmax's finiteness check; the sliced ops' NaN rows), a GPU runs
    the branch-free code (``compiler.host_reads_allowed``)."""
    allowed = compiler.host_reads_allowed
    compiler.host_reads_allowed = lambda x: False
    try:
        yield
    finally:
        compiler.host_reads_allowed = allowed


def count_bytes(fn: Callable[[], object]) -> list[Traffic]:
    """Run ``fn`` once and return the bytes each torch op and Triton kernel moved, largest first."""
    counter = _Counter()
    # the torch code a GPU runs beside its Triton kernels, not the CPU's C++ kernels
    with native.torch_code(), _no_host_reads(), _interpreter_hooks(counter), counter:
        fn()
    return sorted(counter.rows.values(), key=lambda r: -r.total)
