"""How the attention ops meet ``torch.compile``: what the compiler traces, and what it calls as one op.

Plain torch code (softmax, linear and Performer on the CPU, the dense sliced evaluation) is traced,
so inductor fuses it with the layer around it. It only must not read a tensor's value on the host:
the CPU fast paths that skip work when, say, no score is NaN ask `host_reads_allowed` first.

The sorted and causal sliced ops and the Triton launches cannot be traced: their work and their
saved state depend on the data (sort orders, lists of tied pairs sized by the data, a first-use
check against the torch code). Under compile they run as ``torch.library`` custom ops
(`opaque_op`): a fake implementation gives the output's shape, and the registered backward is a
second custom op. A custom op keeps no Python state between its forward and its backward, so that
backward recomputes the op's forward with autograd on and differentiates it: one extra forward of
the op per training step, the price of compiling the layer around it in one graph
(docs/benchmarks.md, "CPU: torch.compile").
"""

from __future__ import annotations

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
    state), so ``enable_grad`` alone records nothing there; the backward's recompute needs them.
    torch has no public guard for this; ``_ForceDispatchKeyGuard`` is what its own higher-order ops
    use to the same end."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    included = torch._C._dispatch_tls_local_include_set()
    return torch._C._ForceDispatchKeyGuard(included, excluded - _AUTOGRAD_KEYS)


def registered_op(name: str):
    """The op ``attnlab::<name>`` if a module registered it already (imported a second time), else None."""
    namespace = getattr(torch.ops, NAMESPACE)
    return getattr(namespace, name).default if hasattr(namespace, name) else None


def opaque_op(name: str, op: Callable[..., torch.Tensor], arguments: str, differentiable: int):
    """``op`` registered as the custom op ``attnlab::<name>``, differentiable in its first
    ``differentiable`` arguments (tensors), for ``torch.compile`` to call without tracing it.

    ``arguments`` is the op's argument list in ``torch.library`` schema form (``"Tensor s, Tensor?
    mask, float eps, ..."``); the third argument is the ``v`` whose shape and dtype the output has
    (every attention op's output: (B, H, T, Dv) in v's dtype). The forward runs ``op`` itself;
    the backward runs it again with autograd on and differentiates it (module docstring). A module
    imported twice gets back the op it registered the first time.
    """
    qualified = f"{NAMESPACE}::{name}"
    if (registered := registered_op(name)) is not None:
        return registered
    grads = ", ".join(["Tensor"] * differentiable)

    @torch.library.custom_op(qualified, mutates_args=(), schema=f"({arguments}) -> Tensor")
    def forward(*args):
        with torch.no_grad():
            return op(*args).contiguous()

    @torch.library.custom_op(
        f"{qualified}_backward", mutates_args=(), schema=f"(Tensor grad, {arguments}) -> ({grads})"
    )
    def backward(grad, *args):
        with _autograd_back_on(), torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in args[:differentiable]]
            out = op(*leaves, *args[differentiable:])
            found = torch.autograd.grad(out, leaves, grad, allow_unused=True)
        return tuple(
            torch.zeros_like(x) if g is None else g.contiguous() for g, x in zip(found, leaves, strict=True)
        )

    @forward.register_fake
    def _(*args):
        return args[2].new_empty(args[2].shape)

    @backward.register_fake
    def _(grad, *args):
        return tuple(x.new_empty(x.shape) for x in args[:differentiable])

    def setup_context(ctx, inputs, output):
        ctx.is_tensor = [isinstance(x, torch.Tensor) for x in inputs]
        ctx.save_for_backward(*(x for x in inputs if isinstance(x, torch.Tensor)))
        ctx.others = [None if tensor else x for tensor, x in zip(ctx.is_tensor, inputs, strict=True)]

    def differentiate(ctx, grad):
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if tensor else x for tensor, x in zip(ctx.is_tensor, ctx.others, strict=True)]
        return (*backward(grad, *inputs), *[None] * (len(inputs) - differentiable))

    forward.register_autograd(differentiate, setup_context=setup_context)
    return forward
