"""``attnlab bench threads``: training steps on a quiet CPU and beside busy processes, per thread setting.

Why a benchmark of its own: OpenMP's wait policy is read once, when torch loads, so each setting runs
in a fresh process; and the load must be real, so the benchmark starts its own busy processes (pure
Python spin loops, one core each) and stops them when done. The workload is ``make train``'s model
(ListOps default: 2-layer, 64-dim encoder, sliced ReLU, RoPE, batch 64 of 30-200 tokens), trained
with AdamW on random tokens: the step costs what a real step costs, without the data pipeline.

Settings compared (``attnlab.threads``): ``attnlab`` (what train.py applies: the usable CPUs as a cap,
a short OpenMP spin, and the governor that follows the free CPUs, ticked at every step as the
training callback does), ``passive`` (the same with ``OMP_WAIT_POLICY=PASSIVE``), ``torch``
(``ATTNLAB_THREADS=off``: torch's own defaults) and ``one-thread`` (``OMP_NUM_THREADS=1``). Runs are
interleaved; each figure is a run's median step time, then the median over repeats. It prints
figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping

from attnlab.bench.machine import load_average

#: name -> environment changes for the measured process
SETTINGS: dict[str, dict[str, str]] = {
    "attnlab": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "torch": {"ATTNLAB_THREADS": "off"},
    "one-thread": {"OMP_NUM_THREADS": "1"},
}
THREAD_KEYS = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "ATTNLAB_THREADS",
    "ATTNLAB_THREADS_SET",
)
BUSY_LOOP = "while True: pass"


def training_steps(steps: int, warmup: int, max_seconds: float, seed: int = 0) -> dict:
    """Time ``steps`` training steps of the default ListOps model; runs in the measured process."""
    import torch

    from attnlab.models.classifier import SequenceClassifier
    from attnlab.threads import ThreadGovernor, applied

    torch.manual_seed(seed)
    batch, vocab, max_len = 64, 20, 200
    model = SequenceClassifier(
        vocab_size=vocab, num_classes=10, dim=64, depth=2, num_heads=2, mlp_dim=128, max_len=256,
        positions="rope", pooling="mean", dropout=0.0, attention="sliced_relu",
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = torch.randint(30, max_len + 1, (batch,))
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    tokens = torch.randint(1, vocab, (batch, max_len)) * mask
    labels = torch.randint(0, 10, (batch,))
    settings = applied()
    governor = ThreadGovernor(settings.cap, torch.set_num_threads) if settings and settings.adaptive else None
    times = []
    deadline = time.perf_counter() + max_seconds
    for step in range(warmup + steps):
        if governor is not None:
            governor.tick()
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(tokens, mask), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            if time.perf_counter() > deadline:
                break
    return {
        "ms_per_step": 1000 * statistics.median(times),
        "steps": len(times),
        "threads": torch.get_num_threads(),
        "governor": governor.report() if governor else None,
        "batch": batch,
    }


_WORKER = (
    "import json, sys, attnlab.threads as t; t.configure(); "
    "from attnlab.bench.threads import training_steps; "
    "a = sys.argv; print(json.dumps(training_steps(int(a[1]), int(a[2]), float(a[3]))))"
)


def setting_environment(setting: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The measured process's environment: ``environ`` without any thread variable (whatever the
    caller holds), plus ``setting``'s own."""
    env = {k: v for k, v in environ.items() if k not in THREAD_KEYS}
    env.update(SETTINGS[setting])
    return env


def measure(setting: str, steps: int, warmup: int, max_seconds: float) -> dict:
    """One fresh process with ``setting``'s environment; its result as a dict."""
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, str(steps), str(warmup), str(max_seconds)],
        env=setting_environment(setting, os.environ), capture_output=True, text=True, check=False,
        timeout=max_seconds + 600,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"the {setting} run failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["steps"] = int(result["steps"])
    return result


class BusyProcesses:
    """``count`` processes that each keep one core busy, for as long as the ``with`` block lasts."""

    def __init__(self, count: int):
        self.count, self.procs = count, []

    def __enter__(self):
        self.procs = [
            subprocess.Popen([sys.executable, "-c", BUSY_LOOP], env={**os.environ, "OMP_NUM_THREADS": "1"})
            for _ in range(self.count)
        ]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def run(args: argparse.Namespace, log=print) -> dict[tuple[str, str], float]:
    """Median ms per step for every (condition, setting); prints the table and the ratios."""
    from attnlab.threads import usable_cpus

    conditions = ["quiet", f"busy x{args.busy}"] if args.busy else ["quiet"]
    log(
        f"attnlab bench threads: {usable_cpus()} usable CPUs, load average before {load_average()}; "
        f"{args.steps} steps (+{args.warmup} warm-up) per run, {args.repeats} interleaved repeats"
    )
    samples: dict[tuple[str, str], list[float]] = {}
    threads: dict[str, int] = {}
    for condition in conditions:
        with BusyProcesses(args.busy if condition != "quiet" else 0) as busy:
            if busy.procs:
                log(f"  busy processes {', '.join(str(p.pid) for p in busy.procs)} (stopped at the end)")
            for _ in range(args.repeats):
                for setting in args.settings:
                    result = measure(setting, args.steps, args.warmup, args.max_seconds)
                    samples.setdefault((condition, setting), []).append(result["ms_per_step"])
                    threads[setting] = result["threads"]
                    note = f"  ({result['governor']})" if result.get("governor") else ""
                    log(f"  {condition:>8} {setting:>10}: {result['ms_per_step']:8.1f} ms/step{note}")
    medians = {key: statistics.median(values) for key, values in samples.items()}
    log("")
    log(f"| setting | threads at the end | {' | '.join(f'{c} ms/step' for c in conditions)} |")
    log(f"|---|---|{'---|' * len(conditions)}")
    for setting in args.settings:
        cells = " | ".join(f"{medians[(c, setting)]:.1f}" for c in conditions)
        log(f"| {setting} | {threads[setting]} | {cells} |")
    for condition in conditions:
        for setting, against in (("attnlab", "torch"), ("attnlab", "one-thread")):
            if (condition, setting) in medians and (condition, against) in medians:
                ratio = medians[(condition, against)] / medians[(condition, setting)]
                log(f"{condition}: {setting} runs {ratio:.2f}x as fast as {against}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            {"condition": c, "setting": s, "ms_per_step": m, "runs": samples[(c, s)]}
            for (c, s), m in medians.items()
        ]
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        log(f"wrote {args.out}")
    return medians
