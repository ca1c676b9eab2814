"""``attnlab bench training``: training samples/s per attention backend at each task's real length.

What a user choosing a backend for a task wants to know: how many training samples per second the
model trains on, at that task's sequence length. The workload is the shared encoder every task
builds on (``SequenceClassifier``: 2 layers, width 64, 2 heads, MLP 128, mean pooling; the LRA
default), with the task's own positions, trained with AdamW on random tokens of the task's length (no
padding), with a batch sized to the length (about 8K tokens a step): forward, backward and optimizer
step, the data pipeline left out. Lengths and positions (``TASKS``): ViT on CIFAR-10 (64 patches +
CLS = 65 tokens, learned positions added to the tokens), MLM (128 and 512, RoPE), ModelNet40 (1,024
points, none: a set), ListOps (2K, RoPE), Text (4K, RoPE), Path-X (16K, learned), and the round shapes
T=64 (B=128) and T=256 (B=32) with RoPE. The positions matter for the sliced backends: without RoPE
their layers fold Π's first map into the q/k projection
(``attnlab.attention.sliced_common.scores.fold_scores``), with RoPE they cannot; ``--positions`` sets
one scheme for every row.

The machine may be shared, so the backends are interleaved: each repeat runs every backend in turn
(``--steps`` timed steps after ``--warmup`` untimed ones, at most ``--max-seconds``), a run's figure
is its median step, and the table shows the best run of each backend (``--stat median`` for the
median over runs). The load average is printed before and after. It prints figures; it asserts
nothing. The sliced backends take ``--path`` (``attnlab.attention.sliced_common.path``; ``auto`` is what
training uses); ``sliced_relu`` has the authors' MLP Π, ``sliced_relu_linear`` the linear Π (both are
the paper's ViT variants).

``--compile on`` times every backend's model under ``torch.compile`` (as ``compile=true`` trains it:
`attnlab.run.compilation.compile_model`, inductor), ``--compile both`` the eager and compiled models
interleaved; a compiled row (``<backend>+compile``) is compared with compiled softmax, an eager row
with eager softmax. The compile happens in an untimed first step (``--warmup`` is at least 1 there).

A second table gives each (eager) backend's matmul FLOPs per training sample, counted on one real step
(``step_flops``), and softmax's FLOPs over each backend's: the speed-up its arithmetic allows if it ran
its matmuls as fast as softmax runs its own. A ratio the samples/s fall short of is element-wise work
and overhead; one below a goal means the model's matmuls alone rule it out on this path (element-wise
work is not counted, and the sliced backends' dense and sorted paths count different matmuls).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

from attnlab.bench.machine import load_average
from attnlab.reporting.formats import markdown_table

#: task -> (sequence length, batch size, positions): the real lengths, about 8K tokens a step, and each
#: task's position scheme (conf/task/*.yaml; timm's ViT adds learned positions, point clouds have none);
#: ``t64`` and ``t256`` are round shapes of short-sequence training (B=128 at T=64, B=32 at T=256)
TASKS: dict[str, tuple[int, int, str]] = {
    "t64": (64, 128, "rope"),
    "vit_cifar10": (65, 128, "learned"),
    "mlm_128": (128, 64, "rope"),
    "t256": (256, 32, "rope"),
    "mlm_512": (512, 16, "rope"),
    "modelnet40": (1024, 8, "none"),
    "listops": (2048, 4, "rope"),
    "text": (4096, 2, "rope"),
    "pathx": (16384, 1, "learned"),
}
POSITIONS = ("rope", "learned", "none")
BACKENDS = ("softmax", "sliced_relu", "sliced_relu_linear", "sliced_relu_bump", "linear")
#: bench row -> (attention backend, its options), beside ``sliced_relu`` (the authors' MLP Π,
#: H·D -> H·D -> H): ``sliced_relu_linear`` the linear Π (``projection=linear``), the paper's other ViT
#: variant (the ViT paper presets' ``experiment=vit/cifar10``); ``sliced_relu_h16`` (run when asked) the
#: MLP Π with a 16-wide hidden layer, a width neither the paper nor the authors' code has (an override)
VARIANTS: dict[str, tuple[str, dict]] = {
    "sliced_relu_linear": ("sliced_relu", {"projection": "linear"}),
    "sliced_relu_h16": ("sliced_relu", {"projection_hidden": 16}),
}
KNOWN_BACKENDS = (*BACKENDS, "sliced_relu_h16")
SLICED = ("sliced_relu", "sliced_relu_bump")


COMPILED = "+compile"  # the suffix of a compiled row's name
COMPILE_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def build(
    backend: str, length: int, path: str, seed: int = 0, positions: str = "rope", compiled: bool = False
):
    """The shared encoder with ``backend`` attention and ``positions``, and its AdamW optimizer;
    ``compiled``: the model under ``torch.compile`` as ``compile=true`` compiles it."""
    import functools

    import torch

    from attnlab.attention import build_attention
    from attnlab.models.classifier import SequenceClassifier

    torch.manual_seed(seed)
    name, options = VARIANTS.get(backend, (backend, {}))
    options = {**options, "path": path} if name in SLICED else options
    attention = functools.partial(build_attention, name, **options)
    model = SequenceClassifier(
        vocab_size=256, num_classes=10, dim=64, depth=2, num_heads=2, mlp_dim=128, max_len=length,
        positions=positions, pooling="mean", dropout=0.0, attention=attention,
    )  # fmt: skip
    if compiled:
        from attnlab.run.compilation import compile_model

        compile_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(batch: int, length: int):
    """The random tokens and labels every step of a run trains on (the same for every backend)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 256, (batch, length), generator=gen)
    return tokens, torch.randint(0, 10, (batch,), generator=gen)


def _step(model, optimizer, tokens, labels) -> None:
    """One training step: forward, backward, optimizer step."""
    import torch

    loss = torch.nn.functional.cross_entropy(model(tokens), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def run_steps(
    model, optimizer, batch: int, length: int, steps: int, warmup: int, max_seconds: float
) -> float:
    """Median seconds per training step (forward, backward, optimizer step) on random tokens."""
    tokens, labels = _batch(batch, length)
    times = []
    deadline = time.perf_counter() + max_seconds
    for step in range(warmup + steps):
        start = time.perf_counter()
        _step(model, optimizer, tokens, labels)
        if step >= warmup:
            times.append(time.perf_counter() - start)
            if time.perf_counter() > deadline:
                break
    return statistics.median(times)


def step_flops(model, optimizer, batch: int, length: int) -> float:
    """Matmul FLOPs of one training step (forward and backward), counted on its real calls by torch's
    ``FlopCounterMode`` (``mm``, ``bmm``, SDPA: the work no backend can skip; element-wise ops are not
    counted). Softmax's ``softmax FLOPs / backend FLOPs`` is the speed-up a backend would have if it
    ran its matmuls exactly as fast as softmax runs its own: what the arithmetic allows.

    Torch registers SDPA's formulas for its CUDA kernels only; the CPU flash kernel and its backward
    are counted here with the same formulas (``sdpa_flop_count``, causal counted in full)."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten

    def forward(q, k, v, *_, out_shape=None, **__):
        return flop_counter.sdpa_flop_count(q, k, v)

    def backward(grad, q, k, v, *_, out_shape=None, **__):
        return flop_counter.sdpa_backward_flop_count(grad, q, k, v)

    cpu_sdpa = {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }
    with flop_counter.FlopCounterMode(display=False, custom_mapping=cpu_sdpa) as counter:
        _step(model, optimizer, *_batch(batch, length))
    return float(counter.get_total_flops())


def run(args: argparse.Namespace, log=print) -> list[dict]:
    """Samples/s per (task, backend); prints the progress, the table and the ratios to softmax."""
    import torch

    from attnlab.attention.sliced_common.path import crossover

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cross = {op: crossover(op, torch.device("cpu"), torch.float32) for op in ("relu", "bump")}
    log(
        f"attnlab bench training: {torch.get_num_threads()} threads, load average before {load_average()}; "
        f"path={args.path} (CPU float32 crossover: dense up to T={cross['relu']} for sliced_relu, "
        f"T={cross['bump']} for sliced_relu_bump); {args.steps} steps (+{args.warmup} warm-up) per run, "
        f"{args.repeats} interleaved repeats, {args.stat} of runs"
    )
    modes = COMPILE_CHOICES[getattr(args, "compile", "off")]
    labels = [_label(name, compiled) for compiled in modes for name in args.backends]
    compiles = True in modes
    warmup = max(args.warmup, 1) if compiles else args.warmup  # the compile, untimed
    rows = []
    with _compiler_settings(len(args.backends)) if compiles else contextlib.nullcontext():
        for task in args.tasks:
            rows += _run_task(args, task, modes, labels, warmup, log)
    log(f"load average after {load_average()}")
    log("")
    log(table(rows, labels))
    log("")
    log(flop_table(rows, args.backends))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        log(f"wrote {args.out}")
    return rows


def _run_task(args, task: str, modes, labels: list[str], warmup: int, log) -> list[dict]:
    """The rows of one task: every label's runs, interleaved."""
    import torch

    if True in modes:
        torch._dynamo.reset()  # the previous task's graphs
    length, batch, positions = TASKS[task]
    positions = positions if args.positions == "task" else args.positions
    built = {
        _label(name, compiled): build(name, length, args.path, positions=positions, compiled=compiled)
        for compiled in modes
        for name in args.backends
    }
    # counted on the eager model (the compiled one runs the same matmuls, some inside custom ops)
    eager = {
        name: built.get(name) or build(name, length, args.path, positions=positions) for name in args.backends
    }
    flops = {name: step_flops(*eager[name], batch, length) for name in args.backends}
    del eager
    runs: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for label in labels:
            seconds = run_steps(*built[label], batch, length, args.steps, warmup, args.max_seconds)
            runs[label].append(seconds)
            log(f"  {task:>12} T={length:<6} B={batch:<4} {label:>25}: {1000 * seconds:9.1f} ms/step")
    del built
    pick = min if args.stat == "best" else statistics.median
    rows = []
    for label in labels:
        seconds = pick(runs[label])
        rows.append(
            {"task": task, "length": length, "batch": batch, "positions": positions, "backend": label,
             "compiled": label.endswith(COMPILED), "ms_per_step": 1000 * seconds,
             "samples_per_s": batch / seconds,
             "matmul_flops_per_sample": flops[label.removesuffix(COMPILED)] / batch,
             "runs_ms": [1000 * x for x in runs[label]]}
        )  # fmt: skip
    return rows


def _label(backend: str, compiled: bool) -> str:
    """A row's name: the backend's, with ``COMPILED`` after it for its compiled model."""
    return backend + (COMPILED if compiled else "")


def _compiler_settings(models: int):
    """A context in which ``models`` compiled models of the one encoder class share its forward's
    cache: torch keeps 8 graphs per code object and past them runs the code eagerly with a warning,
    which would time eager models as compiled ones; here that is an error instead."""
    import torch

    limit = max(torch._dynamo.config.recompile_limit, 4 * models)
    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True)


def _tasks_and_others(rows: list[dict], backends) -> tuple[list[str], list[str]]:
    """The tasks in run order, and the rows compared with softmax (eager with eager, compiled with
    compiled; none where that softmax did not run)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    return tasks, [b for b in backends if _softmax_of(b) in backends and b != _softmax_of(b)]


def _softmax_of(label: str) -> str:
    """The softmax row a row is compared with: compiled softmax for a compiled row."""
    return "softmax" + (COMPILED if label.endswith(COMPILED) else "")


def table(rows: list[dict], backends) -> str:
    """Markdown: one row per task, samples/s per backend, and each backend's ratio to softmax."""
    by = {(r["task"], r["backend"]): r for r in rows}
    tasks, others = _tasks_and_others(rows, backends)
    head = ["task", "T", "batch", "positions"]
    head += [*(f"{b} samples/s" for b in backends), *(f"{b} / {_softmax_of(b)}" for b in others)]
    lines = []
    for task in tasks:
        first = by[(task, backends[0])]
        cells = [task, str(first["length"]), str(first["batch"]), first["positions"]]
        cells += [_rate(by[(task, b)]["samples_per_s"]) for b in backends]
        cells += [
            f"{by[(task, b)]['samples_per_s'] / by[(task, _softmax_of(b))]['samples_per_s']:.2f}x"
            for b in others
        ]
        lines.append(cells)
    return markdown_table(head, lines).rstrip("\n")


def flop_table(rows: list[dict], backends) -> str:
    """Markdown: matmul MFLOPs per training sample (``step_flops``) per backend, and softmax's FLOPs
    over each backend's: the speed-up its arithmetic allows at softmax's FLOP rate."""
    by = {(r["task"], r["backend"].removesuffix(COMPILED)): r["matmul_flops_per_sample"] for r in rows}
    tasks, others = _tasks_and_others(rows, backends)
    head = ["task", *(f"{b} MFLOP/sample" for b in backends), *(f"softmax / {b} FLOPs" for b in others)]
    lines = []
    for task in tasks:
        cells = [task, *(f"{by[(task, b)] / 1e6:.3g}" for b in backends)]
        cells += [f"{by[(task, 'softmax')] / by[(task, b)]:.2f}x" for b in others]
        lines.append(cells)
    return markdown_table(head, lines).rstrip("\n")


def _rate(value: float) -> str:
    """Samples/s with three significant digits or more (0.141, 3.64, 36.4, 1098)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"
