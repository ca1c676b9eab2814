"""Every backend's layer under ``torch.compile(fullgraph=True)``: no graph break (``fullgraph`` raises
on one, naming it), forward and backward, and the same outputs and gradients as eager.

One compiled module holds a layer per case (causal or not, masked or not: two of the four in the
fast suite, all four in ``slow``; for the sliced backends the dense path, which the compiler traces,
and the sorted path, which it calls as a custom op), each with its own parameters, so one compile
checks every case and a case's gradients are its own. ``aot_eager`` runs the same graphs, autograd
and custom-op registrations as inductor without generating C++ (seconds instead of a minute); the
inductor cases are ``slow``.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from attnlab.attention.common import compiler, native, rope
from attnlab.attention.common.rope import RotaryEmbedding
from attnlab.attention.registry import build_attention
from attnlab.attention.sliced_common.decoding import prefill_state, state_of
from attnlab.attention.sliced_common.path import crossover
from attnlab.attention.sliced_relu.decoding import prefix_stats

DIM, HEADS, LENGTH = 16, 2, 40
BACKENDS = ("softmax", "sliced_relu", "sliced_relu_bump", "linear", "performer")
SLICED = ("sliced_relu", "sliced_relu_bump")
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _cases(backend: str, every: bool) -> list[dict]:
    """Causal or not × masked or not (``every``), or two of them that between them take each
    (bidirectional unmasked, causal masked: the fast suite's); × the sliced backends' two paths."""
    paths = ("dense", "sorted") if backend in SLICED else (None,)
    pairs = (
        [(c, m) for c in (False, True) for m in (False, True)] if every else [(False, False), (True, True)]
    )
    return [{"causal": c, "masked": m, "path": path} for c, m in pairs for path in paths]


class _Cases(nn.Module):
    """One layer per case, called on the same input; returns each case's output."""

    def __init__(self, backend: str, every: bool):
        super().__init__()
        self.cases = _cases(backend, every)
        layers = []
        for i, case in enumerate(self.cases):
            torch.manual_seed(i)
            options = {"causal": case["causal"]}
            if case["path"] is not None:
                options["path"] = case["path"]
            layers.append(build_attention(backend, DIM, HEADS, **options))
        self.layers = nn.ModuleList(layers)

    def forward(self, x, mask):
        cases = zip(self.layers, self.cases, strict=True)
        return [layer(x, mask if case["masked"] else None) for layer, case in cases]


def _run(model, call, x, mask):
    """Each case's output and the gradients of ``model``'s parameters and of the input, from one
    backward through ``call`` (the model or its compiled form)."""
    xs = x.clone().requires_grad_()
    outs = call(xs, mask)
    sum(out.square().sum() for out in outs).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return [out.detach() for out in outs], grads, xs.grad


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, LENGTH, DIM, generator=generator)
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[1, LENGTH * 2 // 3 :] = False
    return x, mask


def _check_equal(backend: str, compile_backend: str, tolerance: float, every: bool = False, device="cpu"):
    model = _Cases(backend, every).to(device)
    x, mask = (tensor.to(device) for tensor in _inputs())
    eager = _run(model, model, x, mask)
    compiled = _run(model, torch.compile(model, backend=compile_backend, fullgraph=True), x, mask)
    for case, want, got in zip(model.cases, eager[0], compiled[0], strict=True):
        assert torch.allclose(got, want, rtol=0, atol=tolerance * want.abs().max()), (backend, case)
    # a parameter's gradient against the largest gradient of the model: the slicer's last bias
    # has a gradient of rounding size only (standardised scores do not depend on it)
    scale = max(g.abs().max() for g in eager[1].values())
    for name, want in eager[1].items():
        assert torch.allclose(compiled[1][name], want, rtol=0, atol=tolerance * scale), (backend, name)
    assert torch.allclose(compiled[2], eager[2], rtol=0, atol=tolerance * eager[2].abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_layer_equals_eager(backend):
    torch._dynamo.reset()
    _check_equal(backend, "aot_eager", tolerance=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_layer_equals_eager_in_every_case(backend, compile_backend):
    torch._dynamo.reset()
    _check_equal(
        backend, compile_backend, tolerance=1e-6 if compile_backend == "aot_eager" else 1e-5, every=True
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
def test_inductor_compiled_layer_equals_eager_on_cuda(backend):
    """On CUDA the sorted paths are the Triton kernels, called whole as the custom ops."""
    torch._dynamo.reset()
    _check_equal(backend, "inductor", tolerance=1e-4, every=True, device="cuda")


#: decoding cases: backend, layer options, the sliced steps' code (C++ kernels or torch code)
STEP_CASES = [
    ("softmax", {}, None),
    ("linear", {}, None),
    ("performer", {}, None),
    ("sliced_relu", {"standardise": "prefix"}, "native"),
    ("sliced_relu", {"standardise": "prefix"}, "torch"),
    ("sliced_relu_bump", {}, "native"),
]
MORE_STEP_CASES = [
    ("sliced_relu", {"standardise": "none"}, "native"),
    ("sliced_relu", {"standardise": "none"}, "torch"),
    ("sliced_relu_bump", {}, "torch"),
]
PROMPT = 5  # prefilled tokens; the steps after it cross the sliced runs' merges and the KV cache's growth


def _decode(layer, x, step):
    """The outputs of ``step`` over x's tokens after the prefilled prompt, and the last state."""
    with torch.no_grad():
        _, state = layer.prefill(x[:, :PROMPT])
        outs = []
        for i in range(PROMPT, x.shape[1]):
            out, state = step(x[:, i], state)
            outs.append(out)
    return torch.stack(outs, 1), state


def _check_compiled_steps(backend, options, code, compile_backend, device="cpu"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = build_attention(backend, DIM, HEADS, causal=True, **options).eval().to(device)
    x = torch.randn(2, LENGTH, DIM, generator=torch.Generator().manual_seed(1)).to(device)
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(layer.step, backend=counter, fullgraph=True, dynamic=True)
    with contextlib.nullcontext() if code != "torch" else native.torch_code():
        want, _ = _decode(layer, x, layer.step)
        got, _ = _decode(layer, x, compiled)
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max()), (backend, options, code)
    # a few graphs (the KV cache's: full, room to spare, its last spare row), not one per token
    assert counter.frame_count <= 4, (backend, counter.frame_count)


@pytest.mark.parametrize(
    ("backend", "options", "code"),
    STEP_CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in MORE_STEP_CASES],
)
def test_compiled_decoding_steps_equal_eager(backend, options, code):
    """``layer.step`` under ``torch.compile(fullgraph=True, dynamic=True)`` (as ``compile=true``
    compiles): the sliced steps call their sorted runs as one custom op, which finds the state by
    its handle and updates the running statistics in place; the steps' outputs are eager's, and each
    new token reuses the graphs."""
    _check_compiled_steps(backend, options, code, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "options", "code"), STEP_CASES + MORE_STEP_CASES)
def test_inductor_compiled_decoding_steps_equal_eager(backend, options, code):
    _check_compiled_steps(backend, options, code, "inductor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("backend", "options"), [(b, o) for b, o, code in STEP_CASES if code != "torch"])
def test_inductor_compiled_decoding_steps_on_cuda(backend, options):
    """On CUDA the sliced steps' torch code runs inside the custom op (the state's tensors on the GPU,
    its handle on the host)."""
    _check_compiled_steps(backend, options, None, "inductor", device="cuda")


def test_a_freed_decoding_state_is_named_by_its_handle():
    layer = build_attention("sliced_relu", DIM, HEADS, causal=True).eval()
    _, state = layer.prefill(torch.randn(1, 3, DIM))
    handle = state.op.handle.clone()
    assert state_of(handle) is state.op
    del state
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {int(handle)}: it was freed"):
        state_of(handle)


def test_each_custom_op_passes_torch_opcheck():
    """``opcheck`` checks what the compiler relies on: the schema (no hidden mutation or aliasing),
    the fake implementation's shapes against the real op's, and the registered autograd. Not its
    AOT comparison of outputs: the second output, the handle of the recorded graph, is a new key on
    every call by design (the compiled layers' outputs and gradients are checked against eager above)."""
    generator = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 2, 24, generator=generator), torch.randn(2, 2, 24, generator=generator)
    q, k = torch.randn(2, 2, 24, 8, generator=generator), torch.randn(2, 2, 24, 8, generator=generator)
    v = torch.randn(2, 2, 24, 8, generator=generator)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, 17:] = False
    bandwidth = torch.full((2,), 0.7)
    s, t, v, q, k, bandwidth = (x.requires_grad_() for x in (s, t, v, q, k, bandwidth))
    ops = {
        "sliced_relu_attention": (s, t, v, mask, 1e-4, True, "auto", "zero", "sorted"),
        "sliced_relu_bump_attention": (
            s,
            t,
            v,
            bandwidth,
            mask,
            True,
            "auto",
            "mass",
            1e-4,
            "zero",
            "sorted",
        ),
        "linear_attention": (q, k, v, mask, True, 1e-6, 8, "auto", "zero"),
    }
    for name, args in ops.items():
        torch.library.opcheck(getattr(torch.ops.attnlab, name).default, args, test_utils=OPCHECKS)


def test_each_decoding_step_op_passes_torch_opcheck():
    """The sliced steps' custom ops: the schema declares what they write (the running statistics, and
    the handle, which orders the steps of one state), the fake gives the output's shape. Each call
    advances the state, as a step does."""
    generator = torch.Generator().manual_seed(2)
    t, v = torch.randn(1, 2, 7, generator=generator), torch.randn(1, 2, 7, 8, generator=generator)
    s_t, t_t, v_t = torch.randn(1, 2), torch.randn(1, 2), torch.randn(1, 2, 8)
    relu = prefill_state(t, v, "relu")
    stats = tuple(x.contiguous() for x in prefix_stats(torch.randn(1, 2, 7), t))
    bump = prefill_state(t, v, "bump")
    ops = {
        "sliced_relu_decode_step": (relu.handle, s_t, t_t, v_t, *stats, 1e-4),
        "sliced_relu_bump_decode_step": (bump.handle, s_t, t_t, v_t, torch.full((2,), 0.5), "count", 1e-2),
    }
    for name, args in ops.items():
        torch.library.opcheck(getattr(torch.ops.attnlab, name).default, args, test_utils=OPCHECKS)


def test_host_reads_are_off_only_while_compiling():
    x = torch.ones(2)
    assert compiler.host_reads_allowed(x)
    seen = []

    def record(y):
        seen.append(compiler.host_reads_allowed(y))
        return y + 1

    torch.compile(record, backend="eager", fullgraph=True)(x)
    assert seen == [False]


class _Layers(nn.Module):
    """A layer of each of ``backends`` (``path="auto"``), called on the same input."""

    def __init__(self, backends):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(build_attention(backend, DIM, HEADS) for backend in backends)

    def forward(self, x, mask):
        return sum(layer(x, mask).sum() for layer in self.layers)


def _graphs_over_lengths(backends, lengths) -> int:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = torch.compile(_Layers(backends), backend="eager", dynamic=True)
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        x = torch.randn(2, length, DIM, generator=generator)
        mask = torch.ones(2, length, dtype=torch.bool)
        mask[1, length // 2 :] = False
        with torch.no_grad():
            model(x, mask)
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _sides_of_the_crossovers(backends, lengths) -> int:
    """How many ways ``lengths`` fall about the CPU float32 dense/sorted crossovers of ``backends``'
    sliced ops (the C++ kernels' where they build, the torch code's otherwise): one graph each."""
    ops = {"sliced_relu": "relu", "sliced_relu_bump": "bump"}
    limits = [crossover(ops[b], "cpu", torch.float32) for b in backends if b in ops]
    return len({tuple(length <= limit for limit in limits) for length in lengths})


@pytest.mark.slow
def test_new_lengths_reuse_the_compiled_graphs():
    """With dynamic shapes a new length compiles nothing new; only the sliced ops' dense/sorted
    crossover splits the graph. (A length formatted into a dispatch message, the Performer's call
    counter read as a constant, or the kernels' file name formatted while tracing once made every
    length or call a new graph.) Guards are dynamo's: the ``eager`` backend finds them."""
    lengths = (20, 40, 71, 45, 90, 87)
    expected = _sides_of_the_crossovers(("sliced_relu",), lengths)
    assert expected == 2  # lengths on both sides of sliced ReLU's crossover (32 or 64)
    assert _graphs_over_lengths(("sliced_relu", "performer"), lengths) == expected


@pytest.mark.slow
def test_every_backend_reuses_the_compiled_graphs():
    """Every backend, on either side of both crossovers: a graph for each side."""
    lengths = (20, 40, 71, 150, 45, 90, 161, 87)
    expected = _sides_of_the_crossovers(BACKENDS, lengths)
    assert expected == 3  # below both, between them, above both
    assert _graphs_over_lengths(BACKENDS, lengths) == expected


def test_performer_redraws_on_schedule_under_compile():
    """The redraw schedule runs inside the compiled graph (a custom op) and keeps eager's draws."""
    torch._dynamo.reset()
    eager = build_attention("performer", DIM, HEADS, redraw_interval=2)
    compiled_layer = build_attention("performer", DIM, HEADS, redraw_interval=2)
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, LENGTH, DIM, generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        assert torch.allclose(compiled(x), eager(x), rtol=0, atol=1e-6)
    maps = (eager.feature_map, compiled_layer.feature_map)
    assert [(m.calls, m.draws) for m in maps] == [(5, 2), (5, 2)]
    assert torch.equal(maps[0].projection, maps[1].projection)


def _counted_op(name: str):
    """An opaque op ``x * w`` that counts its calls (``calls[0]``); ``v`` gives the output's shape."""
    calls = [0]

    def times(x, w, v):
        calls[0] += 1
        return x * w

    return compiler.opaque_op(name, times, "Tensor x, Tensor w, Tensor v", differentiable=2), calls


def test_the_backward_differentiates_the_forwards_graph_instead_of_running_it_again():
    """One call of the op per compiled step, forward and backward; the recorded graph is freed by
    the backward or with the output, and an inference call keeps none."""
    op, calls = _counted_op("test_counted_times")
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    compiled = torch.compile(lambda x, w: op(x, w, x).sin().sum(), backend="aot_eager", fullgraph=True)
    before = len(compiler._RECORDED)
    compiled(x, w).backward()
    assert calls[0] == 1
    assert torch.allclose(x.grad, (x * w).cos() * w) and torch.allclose(w.grad, (x * w).cos() * x)
    assert len(compiler._RECORDED) == before
    with torch.no_grad():
        compiled(x, w)
    with torch.inference_mode():
        compiled(x, w)
    gc.collect()
    assert calls[0] == 3 and len(compiler._RECORDED) == before
    loss = compiled(x, w)  # a graph kept for a backward that never comes goes with the output
    assert len(compiler._RECORDED) == before + 1
    del loss
    gc.collect()
    assert len(compiler._RECORDED) == before


def test_a_lost_graph_is_recomputed():
    """A backward whose handle names no recorded graph (CUDA's, or one run twice) runs the op again."""
    op, calls = _counted_op("test_counted_lost")
    forward = torch.ops.attnlab.test_counted_lost.default
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    out, handle = forward(x, w, x)
    compiler._RECORDED.pop(int(handle))
    out.sum().backward()
    assert calls[0] == 2 and torch.allclose(x.grad, w) and torch.allclose(w.grad, x)


def test_compiled_rope_reads_its_tables_as_one_op():
    """Under compile the RoPE tables come from one ``attnlab::rope_tables`` call, not from cos and
    sin in the graph (inductor would evaluate those at every element of q and k), and the rotation
    equals eager's at every length, the cache growing between them."""
    rotary = RotaryEmbedding(8)
    graphs = []

    def keep_graph(graph_module, example_inputs):
        graphs.append(graph_module.graph)
        return graph_module.forward

    compiled = torch.compile(rotary, backend=keep_graph, dynamic=True, fullgraph=True)
    for length in (5, 40, 7):
        q, k = torch.randn(2, 3, length, 8), torch.randn(2, 3, length, 8)
        for got, want in zip(compiled(q, k), rotary(q, k), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    targets = {str(node.target) for graph in graphs for node in graph.nodes if node.op == "call_function"}
    assert "attnlab.rope_tables.default" in targets
    assert not any("cos" in target or "sin" in target for target in targets), targets


def test_rope_tables_off_the_cpu_are_computed_not_copied_from_the_cache():
    """Off the CPU the op computes its tables (a CUDA graph replaying it must not read a cache that
    has since grown); ``meta`` takes that branch without a GPU."""
    cos, sin = torch.ops.attnlab.rope_tables.default(6, 8, 10000.0, torch.float32, torch.device("meta"))
    assert cos.device.type == sin.device.type == "meta" and cos.shape == sin.shape == (6, 8)
    assert not any(device.type == "meta" for _, _, device, _ in rope._CACHE)
