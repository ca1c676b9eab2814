"""How the attention ops meet ``torch.compile``: what the compiler traces, and what it calls as one op.

Plain torch code (softmax, linear and Performer on the CPU, the dense sliced evaluation) is traced,
so inductor fuses it with the layer around it. It only must not read a tensor's value on the host:
the CPU fast paths that skip work when, say, no score is NaN ask `host_reads_allowed` first.

The sorted and causal sliced ops and the Triton launches cannot be traced: their work and their
saved state depend on the data (sort orders, lists of tied pairs sized by the data, a first-use
check against the torch code). Under compile they run as ``torch.library`` custom ops
(`opaque_op`): a fake implementation gives the output's shape, and the registered backward is a
second custom op. A custom op's schema has no place for such state, so on the CPU the forward runs
the eager op with autograd on and keeps its graph in `_RECORDED` under a key it returns as a small
tensor (the handle); the backward looks the graph up and differentiates it, as the eager op's own
backward would. The entry lives as long as the handle: the compiled graph saves the handle for its
backward, and an inference call drops it at once. On CUDA, where a host read of the key would stall
the stream, and wherever the graph is gone, the backward recomputes the op's forward with
autograd on (one extra forward of the op).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

NAMESPACE = "attnlab"


def compiling() -> bool:
    """True while dynamo traces the calling code (``torch.compile``)."""
    return torch.compiler.is_compiling()


def host_reads_allowed(x: torch.Tensor) -> bool:
    """True where an op may read ``x``'s values on the host to skip work: eager CPU tensors. Not on
    CUDA (the read would stall the stream) and not under ``torch.compile`` (a graph break): there
    the op takes the branch-free path, which gives the same values."""
    return not x.is_cuda and not compiling()


#: the dispatch keys of autograd, which a custom op's kernel runs with excluded
_AUTOGRAD_KEYS = (
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
)


def _autograd_back_on():
    """A context in which autograd records again inside a custom op's kernel.

    The dispatcher runs a kernel below autograd (its keys excluded from the thread's dispatch
    state), so ``enable_grad`` alone records nothing there; the recorded graph needs them.
    torch has no public guard for this; ``_ForceDispatchKeyGuard`` is what its own higher-order ops
    use to the same end."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    included = torch._C._dispatch_tls_local_include_set()
    return torch._C._ForceDispatchKeyGuard(included, excluded - _AUTOGRAD_KEYS)


def registered_op(name: str):
    """The op ``attnlab::<name>`` if a module registered it already (imported a second time), else None."""
    namespace = getattr(torch.ops, NAMESPACE)
    return getattr(namespace, name).default if hasattr(namespace, name) else None


def library_op(name: str, fn: Callable, fake: Callable, mutates_args: tuple[str, ...] = ()):
    """``fn`` (annotated: its schema is inferred) as the custom op ``attnlab::<name>`` with ``fake``
    as its fake implementation, or the op a module imported a second time registered before."""
    if (registered := registered_op(name)) is not None:
        return registered
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)(fn)
    op.register_fake(fake)
    return op


#: the graphs that opaque ops' forwards recorded for their backwards: key -> (output, leaves)
_RECORDED: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
_KEYS = itertools.count()
NOT_RECORDED = -1  # the handle of a forward that kept no graph (CUDA, inference mode)


def _differentiable_call(op: Callable[..., torch.Tensor], args, differentiable: int):
    """``op(*args)`` recorded by autograd from fresh leaves for its first ``differentiable`` arguments."""
    with _autograd_back_on(), torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in args[:differentiable]]
        return op(*leaves, *args[differentiable:]), leaves


def _record(out: torch.Tensor, leaves: list[torch.Tensor]) -> torch.Tensor:
    """A handle (0-d int64 CPU tensor) for the graph of ``out``; the entry goes with the handle."""
    key = next(_KEYS)
    _RECORDED[key] = (out, leaves)
    handle = torch.tensor(key)
    weakref.finalize(handle, _RECORDED.pop, key, None)
    return handle


def opaque_op(name: str, op: Callable[..., torch.Tensor], arguments: str, differentiable: int):
    """``op`` registered as the custom op ``attnlab::<name>``, differentiable in its first
    ``differentiable`` arguments (tensors), for ``torch.compile`` to call without tracing it.

    ``arguments`` is the op's argument list in ``torch.library`` schema form (``"Tensor s, Tensor?
    mask, float eps, ..."``); the third argument is the ``v`` whose shape and dtype the output has
    (every attention op's output: (B, H, T, Dv) in v's dtype). The custom op returns the output and
    the handle of its recorded graph (module docstring); the function returned here returns the
    output only. A module imported twice gets back the op it registered the first time.
    """
    qualified = f"{NAMESPACE}::{name}"
    if (registered := registered_op(name)) is None:
        registered = _register(qualified, op, arguments, differentiable)
    return lambda *args: registered(*args)[0]


def _register(qualified: str, op: Callable[..., torch.Tensor], arguments: str, differentiable: int):
    grads = ", ".join(["Tensor"] * differentiable)

    @torch.library.custom_op(qualified, mutates_args=(), schema=f"({arguments}) -> (Tensor, Tensor)")
    def forward(*args):
        device = args[2].device
        if device.type != "cpu" or torch.is_inference_mode_enabled():
            with torch.no_grad():
                out = op(*args).contiguous()
            return out, torch.full((), NOT_RECORDED, dtype=torch.int64, device=device)
        out, leaves = _differentiable_call(op, args, differentiable)
        # a copy: the recorded graph saved `out`, and a compiled graph may reuse its outputs' memory
        return out.detach().clone(memory_format=torch.contiguous_format), _record(out, leaves)

    @torch.library.custom_op(
        f"{qualified}_backward",
        mutates_args=(),
        schema=f"(Tensor grad, Tensor handle, {arguments}) -> ({grads})",
    )
    def backward(grad, handle, *args):
        recorded = _RECORDED.pop(int(handle), None) if handle.device.type == "cpu" else None
        with _autograd_back_on(), torch.enable_grad():
            out, leaves = recorded if recorded is not None else _differentiable_call(op, args, differentiable)
            found = torch.autograd.grad(out, leaves, grad, allow_unused=True)
        return tuple(
            torch.zeros_like(x) if g is None else g.contiguous()
            for g, x in zip(found, args[:differentiable], strict=True)
        )

    @forward.register_fake
    def _(*args):
        v = args[2]
        return v.new_empty(v.shape), torch.empty((), dtype=torch.int64, device=v.device)

    @backward.register_fake
    def _(grad, handle, *args):
        return tuple(x.new_empty(x.shape) for x in args[:differentiable])

    def setup_context(ctx, inputs, output):
        ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
        ctx.save_for_backward(output[1], *(x for x in inputs if isinstance(x, torch.Tensor)))
        ctx.others = [None if tensor else x for tensor, x in zip(ctx.is_tensor, inputs, strict=True)]

    def differentiate(ctx, grad, _):
        handle, *saved = ctx.saved_tensors
        saved = iter(saved)
        inputs = [next(saved) if tensor else x for tensor, x in zip(ctx.is_tensor, ctx.others, strict=True)]
        return (*backward(grad, handle, *inputs), *[None] * (len(inputs) - differentiable))

    forward.register_autograd(differentiate, setup_context=setup_context)
    return forward
