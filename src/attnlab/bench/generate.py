"""``attnlab bench generate``: time per new token and decoding-state memory of a causal LM against context.

For each backend and context n, a `CausalLM` (``--dim``, ``--depth``, ``--heads``, RoPE, random weights)
gets, in every layer, the decoding state after n tokens, built untimed from random q, k, v by the same
code that prefills a prompt (a softmax KV cache with room for the timed steps); then ``--repeats``
recurrent steps are timed one by one (`CausalLM.step`, a whole token: embedding, every block, head), and
the median is reported. ``attn us`` is the backend's own share of one layer's step (`decoding.attention_step`
on q, k, v of the new token: the KV-cache read, the (S, z) update, the sorted-run search...), timed alone
the same way; ``state MB`` the whole model's decoding state (a KV cache's used rows). The last lines
give each backend's per-token time as a multiple of softmax's at the largest context. Nothing is asserted:
the figures depend on the machine and its load, printed beside them.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from attnlab.bench.machine import load_average

DEFAULT_CONTEXTS = [1024, 4096, 16384, 65536, 131072]
CSV_NAME, PNG_NAME = "generate.csv", "generate.png"
COLUMNS = ("backend", "context", "model_ms_per_token", "attn_us_per_token", "state_mb", "status")


def build_model(backend: str, args, max_len: int):
    import torch

    from attnlab.attention import build_attention
    from attnlab.models.causal_lm import CausalLM

    torch.manual_seed(args.seed)
    options = {"redraw_interval": None} if backend == "performer" else {}
    model = CausalLM(
        args.vocab, partial(build_attention, backend, **options), dim=args.dim, depth=args.depth,
        num_heads=args.heads, max_len=max_len, positions="rope", mlp_ratio=args.mlp_ratio,
    )  # fmt: skip
    return model.eval()


def context_state(model, context: int, spare: int, generator):
    """(position, per-block states) as if ``context`` tokens had been decoded; random q, k, v per layer."""
    import torch

    from attnlab.attention.decoding import DECODERS, KVCache

    blocks = []
    for block in model.encoder.blocks:
        layer = block.attn
        shape = (1, layer.num_heads, context, layer.head_dim)
        q, k, v = (torch.randn(shape, generator=generator) for _ in range(3))
        state = DECODERS[layer.name][0](layer, q, k, v)
        if isinstance(state, KVCache):  # room for the timed steps: no buffer doubling inside the timing
            grown = [torch.empty(*shape[:2], context + spare, shape[-1]) for _ in range(2)]
            grown[0][:, :, :context].copy_(state.k)
            grown[1][:, :, :context].copy_(state.v)
            state = KVCache(grown[0], grown[1], context)
        blocks.append((None, state))
    return context, blocks


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after two warm-up calls; ``fn`` carries its own state."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_cell(backend: str, context: int, args) -> dict:
    import torch

    from attnlab.attention.decoding import attention_step, state_nbytes

    generator = torch.Generator().manual_seed(args.seed)
    spare = 2 * (args.repeats + 2) + 2
    model = build_model(backend, args, context + spare)
    with torch.no_grad():
        state = [context_state(model, context, spare, generator)]
        token = torch.randint(0, args.vocab, (1,), generator=generator)

        def model_step():
            state[0] = model.step(token, state[0])[1]

        nbytes = state_nbytes(state[0][1])  # at the context itself, before the timed steps add to it
        model_s = _timed(model_step, args.repeats)
        layer = model.encoder.blocks[0].attn
        layer_state = [state[0][1][0][1]]
        q, k, v = (torch.randn(1, layer.num_heads, layer.head_dim, generator=generator) for _ in range(3))

        def attn_step():
            layer_state[0] = attention_step(layer, q, k, v, layer_state[0])[1]

        attn_s = _timed(attn_step, args.repeats)
    return {
        "backend": backend,
        "context": context,
        "model_ms_per_token": 1e3 * model_s,
        "attn_us_per_token": 1e6 * attn_s,
        "state_mb": nbytes / 2**20,
        "status": "ok",
    }


def ratio_lines(rows: list[dict]) -> list[str]:
    """Softmax's per-token time over each backend's, at the largest context both reached."""
    ok = [r for r in rows if r["status"] == "ok"]
    soft = {r["context"]: r for r in ok if r["backend"] == "softmax"}
    lines = []
    for backend in dict.fromkeys(r["backend"] for r in ok):
        shared = [r for r in ok if r["backend"] == backend and r["context"] in soft]
        if backend == "softmax" or not shared:
            continue
        row = max(shared, key=lambda r: r["context"])
        base = soft[row["context"]]
        lines.append(
            f"{backend} at {row['context']:,}: softmax's time per token / {backend}'s = "
            f"{base['model_ms_per_token'] / row['model_ms_per_token']:,.1f}x (whole model), "
            f"{base['attn_us_per_token'] / row['attn_us_per_token']:,.1f}x (attention step); "
            f"state {base['state_mb'] / row['state_mb']:,.1f}x smaller"
        )
    return lines


def write_outputs(rows: list[dict], out_dir: Path, title: str) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out_dir / CSV_NAME, out_dir / PNG_NAME
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        ok = [r for r in rows if r["backend"] == backend and r["status"] == "ok"]
        for ax, key in zip(axes, ("model_ms_per_token", "state_mb"), strict=True):
            ax.plot([r["context"] for r in ok], [r[key] for r in ok], marker="o", label=backend)
    for ax, label in zip(axes, ("ms per new token (whole model)", "decoding state (MB)"), strict=True):
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return csv_path, png_path


def main(args: argparse.Namespace) -> int:
    import torch

    from attnlab.models.causal_lm import causal_backends

    unknown = [b for b in args.backends if b not in causal_backends()]
    if unknown:
        print(
            f"attnlab bench generate: error: no causal form: {', '.join(unknown)} "
            f"(known: {', '.join(causal_backends())})",
            file=sys.stderr,
        )
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    title = (
        f"generation, B=1 dim={args.dim} depth={args.depth} heads={args.heads} vocab={args.vocab} float32 "
        f"on cpu ({torch.get_num_threads()} threads), load {load_average()}"
    )
    print(title)
    print(f"{'backend':<18}{'context':>9}{'model ms/token':>16}{'attn us/token':>15}{'state MB':>11}")
    rows: list[dict] = []
    for backend in args.backends:
        skip, skip_reason = False, "time limit"
        for context in args.contexts:
            if skip:
                row = dict.fromkeys(COLUMNS[2:5], float("nan")) | {"status": f"skipped ({skip_reason})"}
                rows.append({"backend": backend, "context": context, **row})
                continue
            start = time.perf_counter()
            try:
                row = run_cell(backend, context, args)
            except Exception as err:  # noqa: BLE001 - out of memory or a backend's error: a marked row
                status = "oom" if isinstance(err, torch.OutOfMemoryError | MemoryError) else "error"
                note = f"{status}: {type(err).__name__}: {err}".splitlines()[0][:160]
                row = {"backend": backend, "context": context, **dict.fromkeys(COLUMNS[2:5], float("nan"))}
                row["status"], skip, skip_reason = note, True, f"after {status} at a shorter context"
                rows.append(row)
                print(f"{backend:<18}{context:>9,}  {note}", flush=True)
                continue
            skip = time.perf_counter() - start > args.timeout_s
            rows.append(row)
            print(
                f"{backend:<18}{context:>9,}{row['model_ms_per_token']:>16.3f}"
                f"{row['attn_us_per_token']:>15.1f}{row['state_mb']:>11.2f}",
                flush=True,
            )
    for line in ratio_lines(rows):
        print(line)
    csv_path, png_path = write_outputs(rows, args.out_dir, title)
    print(f"load {load_average()} at the end; wrote {csv_path} and {png_path}")
    return 0
