"""`attnlab bench attention`: time and peak memory of the attention ops against sequence length.

For every backend and sequence length T the op runs on random inputs of shape (B, H, T, D)
(scores (B, H, T) for the sliced backends) in two modes: `fwd`, an inference forward under
`torch.no_grad()`, and `fwdbwd`, a forward plus a backward pass to every input. The
`linear_decode` row is one recurrent decoding step (`linear_attention_step`, in place as the layers
step) at position T, after a prefix of T tokens prefilled untimed: its time and memory stay flat in
T. `sliced_relu_decode` is one step of causal sliced ReLU (`sliced_relu_attention_step`: sorted
runs, O(D log² T)) and `softmax_decode` one step of softmax attention over a preallocated KV cache
of T tokens; the `state_mb` column is the decoding state each keeps of the past ((D + 4) numbers per
token and head in float32, and 2·D; constant for linear). The sliced step at T = 2^k merges no run
(the amortised cost includes merges, up to O(T·D) for the step that completes a run).
`sliced_relu_causal` and `sliced_relu_bump_causal` run the causal parallel ops; the `*_rows` names
(`sliced_relu_rows`, `sliced_relu_causal_rows`, and the bump's) the ops on packed rows of T slots
holding 8 sequences end to end. Under the table come the ratios of `attnlab.bench.ratios`
(official/sliced ReLU peak memory, causal/bidirectional time, packed rows/sorted time at the same T)
and, on the CPU, each sliced cell's time over its memory floor (`attnlab.bench.floor`: its bytes at
the copy bandwidth measured in the same run). Time is the
median of `--repeats` calls after one warm-up call (CUDA is synchronised around each call). The
timed calls of one length take turns, one call of each cell per round, so that a slow spell of a
shared machine falls on every backend of the round instead of on one (the ratios printed under the
table compare cells measured side by side). So one length's inputs of every backend are held at once,
and each call finds the caches as the other backends' calls left them (a cold start for short T).
Decoding rows take their repeats back to back, as a decoder's loop steps.
Peak memory is the largest amount of tensor memory allocated *on top of* what was live before
the call (so the inputs themselves are excluded), measured during the warm-up call: on CUDA with
`torch.cuda.max_memory_allocated`, on CPU by replaying the allocation and free events that the
torch profiler records for every tensor (`profile_memory=True`). It is tensor memory, not the
process RSS.

A call that runs out of memory marks its cell `oom`; a cell whose warm-up call takes longer than
`--timeout-s` is marked `timeout`, and so are the longer sequence lengths of that backend and mode
(also skipped when the times at shorter lengths, extrapolated with their observed growth
exponent, or linearly from a single point, would already exceed the limit). The limit is checked
between calls; a running call is never interrupted.

On CPU, page faults of freshly allocated large tensors can cost as much as the arithmetic
(virtual machines especially): glibc hands allocations over 32 MiB back to the kernel when they
are freed, so every call faults its buffers in again, and whether a buffer sits just under or over
that line depends on T and on what ran before. The `attnlab` command tells glibc to keep freed
memory for reuse as it starts (`attnlab.allocator`; the user's `MALLOC_*` settings win), which
removes this noise for every backend alike; `THP_MEM_ALLOC_ENABLE=1` (PyTorch backs large tensors
with transparent huge pages) is another way. The title line says which applies.

``--compile on`` times each op under ``torch.compile`` as ``compile=true`` compiles a model (inductor,
dynamic shapes; its compile in an untimed first call), ``--compile both`` eager and compiled side by
side (``<backend>+compile`` rows): what the compiler gains on the op itself, where it traces the op
(softmax, linear, the sliced dense path) and where it calls it whole (the sliced sorted and causal
ops, custom ops). Decoding steps are timed eager only.

Results are printed as a table and written to `<out-dir>/bench_attention.csv` and a log-log plot
`<out-dir>/bench_attention.png`. Timings are never asserted: on a shared machine they are noisy,
so read them as orders of magnitude unless the machine is quiet.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from attnlab.allocator import applied as malloc_settings
from attnlab.bench import floor
from attnlab.bench.backends import BACKENDS, INFERENCE_ONLY, op, state_bytes
from attnlab.bench.ratios import ratio_lines
from attnlab.run.compile_modes import COMPILE_CHOICES, COMPILED

DEFAULT_BACKENDS = [
    "softmax",
    "sliced_relu",
    "sliced_relu_bump",
    "linear",
    "sliced_relu_concat",
    "sliced_relu_causal",
    "sliced_relu_bump_causal",
    "linear_decode",
    "sliced_relu_decode",
    "softmax_decode",
]
DEFAULT_SEQ_LENS = [1024, 4096, 16384, 65536]
MODES = ("fwd", "fwdbwd")
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
CSV_NAME = "bench_attention.csv"
PNG_NAME = "bench_attention.png"
# environment settings that change CPU timings (see the module docstring); shown in the title line
ALLOCATOR_SETTINGS = ("THP_MEM_ALLOC_ENABLE",)


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


@dataclass
class Cell:
    backend: str
    mode: str
    seq_len: int
    batch: int
    heads: int
    dim: int
    dtype: str
    device: str
    status: str = "ok"  # ok | oom | timeout | error | n/a
    time_ms: float = math.nan  # median over the timed repeats
    time_ms_min: float = math.nan
    repeats: int = 0
    peak_mem_mb: float = math.nan
    state_mb: float = math.nan  # decoding rows: the state kept of the past
    note: str = field(default="")


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError | MemoryError) and (
        "out of memory" in text or "can't allocate memory" in text or isinstance(err, MemoryError)
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_call(op: Callable, inputs: list[torch.Tensor], mode: str) -> Callable[[], None]:
    """A closure running one forward (no grad) or one forward + backward to every input."""
    if mode == "fwd":

        def call() -> None:
            with torch.no_grad():
                op(*inputs)

        return call

    grad_out = torch.ones_like(inputs[2])  # every op returns the shape of v, inputs[2]; built untimed

    def call() -> None:
        op(*inputs).backward(grad_out)
        for x in inputs:  # freed now (the next call starts from none): the cells of a length take
            x.grad = None  # turns, each holding its inputs

    return call


def _cpu_peak_bytes(call: Callable[[], None]) -> int:
    """Run ``call`` under the profiler; peak of the running sum of tensor allocations and frees."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's own chatter is not our output
    from torch.profiler import ProfilerActivity, profile

    # acc_events: one cycle only either way; without it torch warns that it clears events between cycles
    options = {"profile_memory": True, "record_shapes": False, "acc_events": True}
    with profile(activities=[ProfilerActivity.CPU], **options) as prof:
        call()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _measure_peak(call: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(seconds, peak MiB above the memory live before) of one call."""
    if device.type == "cuda":
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        elapsed = time.perf_counter() - start
        return elapsed, (torch.cuda.max_memory_allocated(device) - base) / 2**20
    start = time.perf_counter()
    peak = _cpu_peak_bytes(call)
    return time.perf_counter() - start, peak / 2**20


def warm_up(
    cell: Cell, call: Callable[[], None], timeout_s: float, compile_first: bool = False
) -> float | None:
    """The warm-up call (also the memory measurement): its seconds, or None when it took longer
    than ``timeout_s`` (the cell is marked ``timeout``).

    ``compile_first`` (every CUDA cell): one more call before, outside the time limit, that compiles
    the Triton kernels this length needs (seconds each), so a slow compile never marks a cell, and
    with it the longer ones, timed out.
    """
    device = torch.device(cell.device)
    if compile_first:
        start = time.perf_counter()
        call()
        _synchronize(device)
        if (compile_s := time.perf_counter() - start) > 1.0:
            cell.note = f"first call (compiling) {compile_s:.1f}s, not timed"
    warm_s, cell.peak_mem_mb = _measure_peak(call, device)
    if warm_s > timeout_s:
        cell.status, cell.time_ms, cell.note = "timeout", warm_s * 1e3, f"warm-up took {warm_s:.1f}s"
        return None
    return warm_s


def time_in_turns(
    turns: list[tuple[Cell, Callable[[], None], float]], repeats: int, timeout_s: float
) -> None:
    """Up to ``repeats`` timed calls of each warmed-up ``(cell, call, warm-up seconds)``, the cells
    taking turns (one call of each, then the next round): on a shared machine a slow spell falls on
    every cell of the round alike, so the ratios between them hold where back-to-back repeats would
    give one cell the spell and the next a quiet minute. A cell leaves the rounds when its time
    limit is spent or a call fails (marked as ``run_bench`` marks a failure, its call dropped). Each
    cell's median, minimum and count are up to date after every round: a run stopped part way
    keeps the rounds done."""
    # per cell: [cell, call, seconds spent (the warm-up's, then every timed call's), timed seconds]
    active = [[cell, call, warm_s, []] for cell, call, warm_s in turns]
    turns.clear()  # only the rounds hold the calls now: a failed cell's inputs are freed at once
    for _ in range(repeats):
        for entry in list(active):
            cell, call, _, taken = entry
            device = torch.device(cell.device)
            try:
                _synchronize(device)
                start = time.perf_counter()
                call()
                _synchronize(device)
            except Exception as err:  # noqa: BLE001 - any failure becomes a marked cell
                active.remove(entry)
                _mark_failure(cell, err)
                cell.time_ms = cell.time_ms_min = math.nan  # a failed cell shows no time
                cell.repeats = 0
                continue
            taken.append(time.perf_counter() - start)
            entry[2] += taken[-1]
            cell.time_ms, cell.time_ms_min = statistics.median(taken) * 1e3, min(taken) * 1e3
            cell.repeats = len(taken)
            if entry[2] > timeout_s and len(taken) < repeats:
                cell.note = f"stopped after {len(taken)} of {repeats} repeats (time limit)"
                active.remove(entry)


def measure_cell(
    cell: Cell, call: Callable[[], None], repeats: int, timeout_s: float, compile_first: bool = False
) -> Cell:
    """One cell alone: `warm_up`, then up to ``repeats`` timed calls (`time_in_turns`)."""
    warm_s = warm_up(cell, call, timeout_s, compile_first)
    if warm_s is not None:
        time_in_turns([(cell, call, warm_s)], repeats, timeout_s)
    return cell


def _mark_failure(cell: Cell, err: BaseException) -> None:
    if not _is_oom(err):
        cell.status, cell.note = "error", f"{type(err).__name__}: {err}"[:200]
    else:
        cell.status, cell.note = "oom", str(err).splitlines()[0][:120]
    if torch.device(cell.device).type == "cuda":
        torch.cuda.empty_cache()


def _extrapolate(history: list[tuple[int, float]], length: int) -> float:
    """Seconds expected at ``length`` from the (T, seconds) measured at shorter T: the growth
    exponent of the last two points (at least 1: nothing is faster than linear), or linear
    growth from a single point. 0 without history."""
    if not history:
        return 0.0
    last_len, last_s = history[-1]
    exponent = 1.0
    if len(history) >= 2:
        prev_len, prev_s = history[-2]
        if prev_s > 0 and last_len > prev_len:
            exponent = max(1.0, math.log(last_s / prev_s) / math.log(last_len / prev_len))
    return last_s * (length / last_len) ** exponent


def _compiled_op(name: str, compiled: dict[str, Callable]) -> Callable:
    """The op ``name`` under ``torch.compile`` as ``compile=true`` compiles a model (inductor, dynamic
    shapes), one per op for the whole run, so a longer T reuses the graphs of a shorter one."""
    if name not in compiled:
        compiled[name] = torch.compile(op(name), dynamic=True)
    return compiled[name]


def _compiler_settings(ops: int):
    """Room for ``ops`` compiled ops' graphs (their forwards, forward + backward, each side of the
    sliced crossovers) in torch's per-function limit, and an error past it: a backend and its forced
    variants are one function to torch, which would otherwise run them eagerly without a word."""
    limit = max(torch._dynamo.config.recompile_limit, 8 * ops)
    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True)


def run_bench(
    args: argparse.Namespace, log: Callable[[str], None] = print, cells: list[Cell] | None = None
) -> list[Cell]:
    """Measure every cell, appending each to ``cells`` (a caller's list keeps what was measured
    when the run is stopped part way) and logging its row."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cells = [] if cells is None else cells
    # (backend, mode) -> the status that stopped it / its (T, seconds) measured so far
    stopped: dict[tuple[str, str], str] = {}
    last_time: dict[tuple[str, str], list[tuple[int, float]]] = {}
    rows = [(backend, compiled) for backend in args.backends for compiled in COMPILE_CHOICES[args.compile]]
    compiled_ops: dict[str, Callable] = {}
    for length in args.seq_lens:
        # this length's cells in table order, and those warmed up, to be timed in turns
        row_cells: list[Cell] = []
        turns: list[tuple[Cell, Callable[[], None], float]] = []
        for backend, compiled in rows:
            op_name, build = BACKENDS[backend]
            label = backend + (COMPILED if compiled else "")
            stepping = backend in INFERENCE_ONLY  # a decoding step: timed eager only
            backend_op = _compiled_op(op_name, compiled_ops) if compiled and not stepping else op(op_name)
            inputs = None
            for mode in args.mode:
                key = (label, mode)
                cell = Cell(label, mode, length, args.batch, args.heads, args.dim, args.dtype, args.device)
                cells.append(cell)
                row_cells.append(cell)
                if stepping and (mode == "fwdbwd" or compiled):
                    cell.status, cell.note = (
                        "n/a",
                        "inference only" if mode == "fwdbwd" else "decoding: eager only",
                    )
                    continue
                if key in stopped:
                    cell.status, cell.note = stopped[key], "skipped after a shorter T"
                    continue  # skipped cells are in the table too, marked
                predicted = _extrapolate(last_time.get(key, []), length)
                if predicted > args.timeout_s:
                    cell.status = "timeout"
                    cell.note = f"skipped: extrapolated to {predicted:.0f}s from shorter T"
                    stopped[key] = "timeout"
                    continue
                try:
                    if inputs is None:
                        generator = torch.Generator().manual_seed(args.seed)
                        inputs = build(args.batch, args.heads, length, args.dim, dtype, device, generator)
                    if backend in INFERENCE_ONLY:
                        cell.state_mb = state_bytes(inputs[-1]) / 2**20
                    if mode == "fwdbwd":
                        for x in inputs:
                            x.requires_grad_(x.is_floating_point())  # not the rows' segment ids
                    # an untimed first call where it may compile: every length of a Triton backend on
                    # CUDA (new kernel specialisations, seconds each), and every compiled cell
                    call = _make_call(backend_op, inputs, mode)
                    first = compiled or (device.type == "cuda" and not backend.endswith("_torch"))
                    warm_s = warm_up(cell, call, args.timeout_s, compile_first=first)
                    if warm_s is not None and stepping:  # a decoder's loop: steps back to back
                        time_in_turns([(cell, call, warm_s)], args.repeats, args.timeout_s)
                    elif warm_s is not None:
                        turns.append((cell, call, warm_s))
                except Exception as err:  # noqa: BLE001 - any failure becomes a marked cell
                    _mark_failure(cell, err)
                    inputs = None  # free whatever the failed call left behind
        time_in_turns(turns, args.repeats, args.timeout_s)  # empties turns: the inputs freed
        for cell in row_cells:
            key = (cell.backend, cell.mode)
            if cell.status == "ok":
                last_time.setdefault(key, []).append((length, cell.time_ms_min / 1e3))
            elif cell.status in ("oom", "timeout"):
                stopped[key] = cell.status
            log(_format_row(cell))
    return cells


# --------------------------------------------------------------------------------------------
# Output: table, CSV, plot
# --------------------------------------------------------------------------------------------

_HEADER = (
    f"{'backend':<27} {'mode':<7} {'T':>7} {'status':<8} {'time_ms':>11} {'peak_mem_mb':>12} "
    f"{'state_mb':>9}  note"
)


def _format_row(cell: Cell) -> str:
    time_text = f"{cell.time_ms:11.2f}" if cell.status == "ok" else f"{'-':>11}"
    mem_text = f"{cell.peak_mem_mb:12.1f}" if not math.isnan(cell.peak_mem_mb) else f"{'-':>12}"
    state_text = f"{cell.state_mb:9.2f}" if not math.isnan(cell.state_mb) else f"{'-':>9}"
    head = f"{cell.backend:<27} {cell.mode:<7} {cell.seq_len:>7} {cell.status:<8}"
    return f"{head} {time_text} {mem_text} {state_text}  {cell.note}"


def write_csv(cells: list[Cell], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(cells[0]).keys()) if cells else ["backend"])
        writer.writeheader()
        for cell in cells:
            writer.writerow(asdict(cell))


def write_plot(cells: list[Cell], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"fwd": "--", "fwdbwd": "-"}
    series = sorted({(c.backend, c.mode) for c in cells})
    backends = sorted({c.backend for c in cells})
    colours = {name: f"C{i % 10}" for i, name in enumerate(backends)}  # one colour per backend
    for backend, mode in series:
        ok = [c for c in cells if c.backend == backend and c.mode == mode and c.status == "ok"]
        if not ok:
            continue
        lengths = [c.seq_len for c in ok]
        label = f"{backend} ({mode})"
        style = {"linestyle": styles[mode], "marker": "o", "color": colours[backend], "label": label}
        ax_time.plot(lengths, [c.time_ms for c in ok], **style)
        mem = [(c.seq_len, c.peak_mem_mb) for c in ok if c.peak_mem_mb > 0]
        if mem:
            ax_mem.plot(*zip(*mem, strict=True), **style)
    for ax, ylabel in ((ax_time, "time per call (ms, median)"), (ax_mem, "peak extra tensor memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    if ax_time.lines:
        ax_time.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM (``timeout``, a scheduler) raises SystemExit, so the caller can save what it has."""

    def stop(signum, frame):
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(args: argparse.Namespace) -> int:
    """The whole benchmark: title, one row per cell (a length's rows once its cells have taken their
    turns), ratios, CSV and plot; the exit code
    (1 when a cell failed with an error, 143 or 130 when stopped, with the cells so far written)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attnlab bench attention: --device cuda asked for, but CUDA is not available")
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    title = f"attention ops, B={args.batch} H={args.heads} D={args.dim} {args.dtype} on {args.device}"
    if args.device == "cuda":
        title += f" ({torch.cuda.get_device_name()})"
    if args.device == "cpu":
        tuning = "".join(f", {k}={os.environ[k]}" for k in ALLOCATOR_SETTINGS if k in os.environ)
        malloc = malloc_settings()
        tuning += f", {malloc.summary}" if malloc else ""
        title += f" ({torch.get_num_threads()} threads{tuning})"
    print(title)
    print(_HEADER)
    cells: list[Cell] = []
    csv_path, png_path = args.out_dir / CSV_NAME, args.out_dir / PNG_NAME
    compiles = COMPILE_CHOICES[args.compile][-1]
    try:
        with (
            _sigterm_as_exit(),
            _compiler_settings(len(args.backends)) if compiles else contextlib.nullcontext(),
        ):
            run_bench(args, cells=cells)
    except (KeyboardInterrupt, SystemExit) as stop:  # SIGTERM (time limit) or Ctrl-C: keep the cells
        for cell in cells:
            if cell.status == "ok" and cell.repeats == 0:
                cell.status, cell.note = "stopped", "interrupted while measuring"
            elif cell.status == "ok" and cell.repeats < args.repeats and not cell.note:
                cell.note = f"stopped after {cell.repeats} of {args.repeats} repeats (interrupted)"
        write_csv(cells, csv_path)
        print(f"attnlab bench attention: stopped; the {len(cells)} cells so far are in {csv_path}")
        return 143 if isinstance(stop, SystemExit) else 130
    for line in ratio_lines(cells):
        print(line)
    if args.device == "cpu":
        for line in floor.floor_lines(cells, torch.get_num_threads()):
            print(line)
    write_csv(cells, csv_path)
    write_plot(cells, png_path, title)
    print(f"wrote {csv_path} and {png_path}")
    return 1 if any(c.status == "error" for c in cells) else 0
