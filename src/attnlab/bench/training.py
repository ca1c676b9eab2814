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

Two tasks mix lengths as real data does (``MIXED``): ``glue_like`` (sentences: log-normal lengths
around 24 tokens, at most 128, B=32) and ``text_like`` (LRA Text's byte-level reviews: around 1,000
tokens, at most 4,096, B=8), each run on a fixed set of seeded batches padded to each batch's longest;
they run when ``--tasks`` names them, and by default under ``--packing``. ``--packing on`` times them
packed instead (``task.data.packing=true``: first-fit rows as long as the
batch's longest, attention within each sequence), ``--packing both`` padded and packed interleaved; a packed
row (``<backend>+packed``) is compared with packed softmax and with its own padded row, and the log
says how full the rows were (real tokens over row slots).

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
from attnlab.run.compile_modes import COMPILE_CHOICES, COMPILED

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
KNOWN_BACKENDS = (*BACKENDS, "performer", "sliced_relu_h16")  # the last two run when asked
SLICED = ("sliced_relu", "sliced_relu_bump")


#: task -> (median length, spread): tasks whose batches mix lengths, log-normal around the median
#: (sigma = spread) and clipped to [4, the task's length]: sentence pairs as GLUE tokenises them, and
#: LRA Text's IMDB reviews as bytes (median about 1,000, a long tail cut at 4,096)
MIXED: dict[str, tuple[int, float]] = {"glue_like": (24, 0.6), "text_like": (1000, 0.75)}
FIXED_TASKS = list(TASKS)  # what --tasks runs by default (with --packing on or both: MIXED)
TASKS.update({"glue_like": (128, 32, "rope"), "text_like": (4096, 8, "rope")})
DRAWS = 8  # seeded batches of a mixed task, cycled through by the steps of a run

PACKED = "+packed"  # the suffix of a packed row's name
PACKING_CHOICES = COMPILE_CHOICES


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


def random_batch(batch: int, length: int):
    """The random tokens and labels every step of a run trains on (the same for every backend)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 256, (batch, length), generator=gen)
    return {"input_ids": tokens}, torch.randint(0, 10, (batch,), generator=gen)


def mixed_batches(task: str, packed: bool) -> list[tuple[dict, object]]:
    """``DRAWS`` seeded batches of a `MIXED` task (the same lengths and tokens for every backend):
    model inputs, padded to each batch's longest with a mask or packed (`attnlab.data.packing`), and
    labels."""
    import numpy as np
    import torch

    from attnlab.attention import PackedLayout
    from attnlab.data.examples import pad_collate
    from attnlab.data.packing import pack_collate

    length, batch, _ = TASKS[task]
    median, spread = MIXED[task]
    rng = np.random.default_rng(1)
    draws = []
    for _ in range(DRAWS):
        sizes = np.clip(rng.lognormal(np.log(median), spread, batch).astype(int), 4, length)
        examples = [
            {"input_ids": torch.as_tensor(rng.integers(1, 256, n)), "label": int(rng.integers(10))}
            for n in sizes
        ]
        collated = (pack_collate if packed else pad_collate)(examples)
        inputs = {"input_ids": collated["input_ids"]}
        if packed:
            inputs["packing"] = PackedLayout.from_batch(collated)
        else:
            inputs["mask"] = collated["mask"]
        draws.append((inputs, collated["labels"]))
    return draws


def fill(draws: list[tuple[dict, object]]) -> float:
    """Real tokens over the slots of the rows, over a task's batches."""
    real = sum(int(inputs["input_ids"].gt(0).sum()) for inputs, _ in draws)
    return real / sum(inputs["input_ids"].numel() for inputs, _ in draws)


def task_batches(task: str, packed: bool) -> list[tuple[dict, object]]:
    """What a run of ``task`` trains on: its `MIXED` batches, or one batch at its fixed length."""
    if task in MIXED:
        return mixed_batches(task, packed)
    length, batch, _ = TASKS[task]
    return [random_batch(batch, length)]


def _step(model, optimizer, inputs: dict, labels) -> None:
    """One training step: forward, backward, optimizer step."""
    import torch

    loss = torch.nn.functional.cross_entropy(model(**inputs), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def run_steps(
    model, optimizer, batches: list[tuple[dict, object]], steps: int, warmup: int, max_seconds: float
) -> float:
    """Median seconds per training step (forward, backward, optimizer step), the steps cycling
    through ``batches``."""
    times = []
    deadline = time.perf_counter() + max_seconds
    for step in range(warmup + steps):
        start = time.perf_counter()
        _step(model, optimizer, *batches[step % len(batches)])
        if step >= warmup:
            times.append(time.perf_counter() - start)
            if time.perf_counter() > deadline:
                break
    return statistics.median(times)


def step_flops(model, optimizer, inputs: dict, labels) -> float:
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
        _step(model, optimizer, inputs, labels)
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
    modes = [
        (compiled, packed)
        for compiled in COMPILE_CHOICES[getattr(args, "compile", "off")]
        for packed in PACKING_CHOICES[getattr(args, "packing", "off")]
    ]
    if args.tasks is None:  # --tasks not given
        args.tasks = list(MIXED) if any(packed for _, packed in modes) else list(FIXED_TASKS)
    fixed = [task for task in args.tasks if task not in MIXED]
    if any(packed for _, packed in modes) and fixed:
        raise ValueError(
            f"--packing needs tasks that mix lengths ({', '.join(MIXED)}); {', '.join(fixed)} "
            "has one length, nothing to pack"
        )
    labels = [_label(name, *mode) for mode in modes for name in args.backends]
    compiles = any(compiled for compiled, _ in modes)
    warmup = max(args.warmup, 1) if compiles else args.warmup  # the compile, untimed
    rows = []
    with _compiler_settings(len(args.backends)) if compiles else contextlib.nullcontext():
        for task in args.tasks:
            rows += _run_task(args, task, modes, labels, warmup, log)
    log(f"load average after {load_average()}")
    log("")
    log(table(rows, labels))
    for line in fill_lines(rows):
        log(line)
    log("")
    log(flop_table(rows, list(dict.fromkeys(label.replace(COMPILED, "") for label in labels))))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        log(f"wrote {args.out}")
    return rows


def _run_task(args, task: str, modes, labels: list[str], warmup: int, log) -> list[dict]:
    """The rows of one task: every label's runs, interleaved."""
    import torch

    if any(compiled for compiled, _ in modes):
        torch._dynamo.reset()  # the previous task's graphs
    length, batch, positions = TASKS[task]
    positions = positions if args.positions == "task" else args.positions
    batches = {packed: task_batches(task, packed) for packed in dict.fromkeys(p for _, p in modes)}
    built = {
        _label(name, compiled, packed): build(name, length, args.path, positions=positions, compiled=compiled)
        for compiled, packed in modes
        for name in args.backends
    }
    # counted on an eager model (a compiled one runs the same matmuls, some inside custom ops)
    flops = {}
    for name in args.backends:
        for packed, draws in batches.items():
            eager = built.get(_label(name, False, packed)) or build(
                name, length, args.path, positions=positions
            )
            flops[(name, packed)] = step_flops(*eager, *draws[0])
    runs: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for label in labels:
            draws = batches[label.endswith(PACKED)]
            seconds = run_steps(*built[label], draws, args.steps, warmup, args.max_seconds)
            runs[label].append(seconds)
            log(f"  {task:>12} T={length:<6} B={batch:<4} {label:>32}: {1000 * seconds:9.1f} ms/step")
    del built
    pick = min if args.stat == "best" else statistics.median
    rows = []
    for label in labels:
        seconds, packed = pick(runs[label]), label.endswith(PACKED)
        rows.append(
            {"task": task, "length": length, "batch": batch, "positions": positions, "backend": label,
             "compiled": COMPILED in label, "packed": packed, "ms_per_step": 1000 * seconds,
             "samples_per_s": batch / seconds, "fill": fill(batches[packed]),
             "matmul_flops_per_sample": flops[(_backend(label), packed)] / batch,
             "runs_ms": [1000 * x for x in runs[label]]}
        )  # fmt: skip
    return rows


def _label(backend: str, compiled: bool, packed: bool = False) -> str:
    """A row's name: the backend's, then ``COMPILED`` for its compiled model and ``PACKED`` for
    packed batches."""
    return backend + (COMPILED if compiled else "") + (PACKED if packed else "")


def _backend(label: str) -> str:
    """The backend of a row's name (before its suffixes)."""
    return label.split("+")[0]


def _compiler_settings(models: int):
    """A context in which ``models`` compiled models of the one encoder class share its forward's
    cache: torch keeps 8 graphs per code object and past them runs the code eagerly with a warning,
    which would time eager models as compiled ones; here that is an error instead."""
    import torch

    limit = max(torch._dynamo.config.recompile_limit, 4 * models)
    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True)


def _tasks_and_others(rows: list[dict], backends) -> tuple[list[str], list[str]]:
    """The tasks in run order, and the rows compared with softmax (eager with eager, compiled with
    compiled, packed with packed; none where that softmax did not run)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    return tasks, [b for b in backends if _softmax_of(b) in backends and b != _softmax_of(b)]


def _softmax_of(label: str) -> str:
    """The softmax row a row is compared with: the one with the row's suffixes (compiled, packed)."""
    return "softmax" + label[len(_backend(label)) :]


def table(rows: list[dict], backends) -> str:
    """Markdown: one row per task, samples/s per backend, and each backend's ratio to softmax."""
    by = {(r["task"], r["backend"]): r for r in rows}
    tasks, others = _tasks_and_others(rows, backends)
    packed = [b for b in backends if b.endswith(PACKED) and b.removesuffix(PACKED) in backends]
    head = ["task", "T", "batch", "positions"]
    head += [*(f"{b} samples/s" for b in backends), *(f"{b} / {_softmax_of(b)}" for b in others)]
    head += [f"{b} / {b.removesuffix(PACKED)}" for b in packed]
    lines = []
    for task in tasks:
        first = by[(task, backends[0])]
        cells = [task, str(first["length"]), str(first["batch"]), first["positions"]]
        cells += [_rate(by[(task, b)]["samples_per_s"]) for b in backends]
        rate = {b: by[(task, b)]["samples_per_s"] for b in backends}
        cells += [f"{rate[b] / rate[_softmax_of(b)]:.2f}x" for b in others]
        cells += [f"{rate[b] / rate[b.removesuffix(PACKED)]:.2f}x" for b in packed]
        lines.append(cells)
    return markdown_table(head, lines).rstrip("\n")


def fill_lines(rows: list[dict]) -> list[str]:
    """How full the rows of each mixed task were, padded and packed (one line each)."""
    seen = {(r["task"], r["packed"]): r["fill"] for r in rows if r["task"] in MIXED}
    return [
        f"{task}: rows {100 * value:.1f}% real tokens {'packed' if packed else 'padded'}"
        for (task, packed), value in seen.items()
    ]


def flop_table(rows: list[dict], backends) -> str:
    """Markdown: matmul MFLOPs per training sample (``step_flops``) per backend, and softmax's FLOPs
    over each backend's: the speed-up its arithmetic allows at softmax's FLOP rate."""
    by = {(r["task"], r["backend"].replace(COMPILED, "")): r["matmul_flops_per_sample"] for r in rows}
    tasks, others = _tasks_and_others(rows, backends)
    head = ["task", *(f"{b} MFLOP/sample" for b in backends)]
    head += [f"{_softmax_of(b)} / {b} FLOPs" for b in others]
    lines = []
    for task in tasks:
        cells = [task, *(f"{by[(task, b)] / 1e6:.3g}" for b in backends)]
        cells += [f"{by[(task, _softmax_of(b))] / by[(task, b)]:.2f}x" for b in others]
        lines.append(cells)
    return markdown_table(head, lines).rstrip("\n")


def _rate(value: float) -> str:
    """Samples/s with three significant digits or more (0.141, 3.64, 36.4, 1098)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"
