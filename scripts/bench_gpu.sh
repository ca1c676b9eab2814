#!/usr/bin/env bash
# `make bench-gpu`: the one GPU check of issue 13, sized for about 5 minutes on one H100/H200.
#  1. attention ops, forward + backward, B·H = 64 (B = 8, H = 8), D = 64, T = 1K…64K (bf16; fp16 and
#     fp32 at 4K and 64K): SDPA (flash), sliced ReLU on Triton and on torch, ReLU-bump on both, linear,
#     causal linear on Triton and on torch; time and peak memory → <out>/ops_<dtype>/bench_attention.csv
#  2. training throughput (samples/s, TFLOP/s, MFU) of the LRA ListOps and Text presets under softmax
#     and sliced ReLU, bf16-mixed, 60 steps after 10 warm-up steps → <out>/train.csv
# Prints the GPU's name first and one summary table at the end. OUT=dir to choose the output folder.
set -uo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench_results/gpu}
"$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench-gpu: no CUDA device here; run it on a GPU machine")
print(f"GPU: {torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda}")' || exit 2
mkdir -p "$OUT"  # only once a GPU is there: a machine without one is left no empty results folder

OPS="softmax sliced_relu sliced_relu_torch sliced_relu_bump sliced_relu_bump_torch linear linear_causal linear_causal_torch"
for spec in "bfloat16:1024 4096 16384 65536" "float16:4096 65536" "float32:4096 65536"; do
  dtype=${spec%%:*}
  # shellcheck disable=SC2086
  "$PY" -m attnlab.cli.main bench attention --device cuda --dtype "$dtype" -B 8 --heads 8 --dim 64 \
    --seq-lens ${spec#*:} --backends $OPS --mode fwdbwd --repeats 5 --timeout-s 20 \
    --out-dir "$OUT/ops_$dtype" || echo "bench-gpu: ops benchmark in $dtype reported errors (see its table)"
done

for task in listops text; do
  for attn in softmax sliced_relu; do
    extra=()
    if [ "$task" = listops ]; then  # generated at the LRA lengths (500-2000 symbols), small splits
      extra=(task.data.source.subdir=listops-bench "task.data.source.sizes={train:3200,val:64,test:64}")
    fi
    "$PY" train.py "experiment=lra/$task" "attn=$attn" trainer=gpu trainer.precision=bf16-mixed logger=csv \
      task.max_steps=70 task.val_check_interval=70 callbacks.throughput.warmup_steps=10 \
      trainer.log_every_n_steps=10 test=false "hydra.run.dir=$OUT/train/$task/$attn" "${extra[@]}" \
      > "$OUT/train_${task}_${attn}.log" 2>&1
    if [ $? -ne 0 ]; then
      echo "bench-gpu: training $task/$attn failed (data missing?); end of $OUT/train_${task}_${attn}.log:"
      tail -n 3 "$OUT/train_${task}_${attn}.log"
    fi
  done
done

"$PY" - "$OUT" <<'PYEOF'
import csv, json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("\n== attention ops, fwd+bwd, B=8 H=8 D=64 (ms; peak MiB) ==")
for path in sorted(out.glob("ops_*/bench_attention.csv")):
    rows = list(csv.DictReader(path.open()))
    lengths = sorted({int(r["seq_len"]) for r in rows})
    print(f"\n{path.parent.name[4:]:<24}" + "".join(f"{t:>20}" for t in lengths))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        cells = []
        for t in lengths:
            r = next((r for r in rows if r["backend"] == backend and int(r["seq_len"]) == t), None)
            ok = r and r["status"] == "ok"
            cells.append(f"{float(r['time_ms']):9.2f}; {float(r['peak_mem_mb']):8.0f}" if ok else f"{r['status'] if r else '-':>18}")
        print(f"{backend:<24}" + "".join(f"{c:>20}" for c in cells))

print("\n== training throughput, bf16-mixed, per GPU ==")
table = [("task", "attn", "samples/s", "TFLOP/s", "MFU", "step ms", "peak MiB")]
for task in ("listops", "text"):
    for attn in ("softmax", "sliced_relu"):
        metrics = out / "train" / task / attn / "csv" / "metrics.csv"
        rows = [r for r in csv.DictReader(metrics.open()) if r.get("perf/train_samples_per_sec")] if metrics.exists() else []
        if not rows:
            table.append((task, attn, "failed", "", "", "", ""))
            continue
        last = rows[-1]
        fmt = lambda key, spec: format(float(last[key]), spec) if last.get(key) else "n/a"
        table.append((task, attn, fmt("perf/train_samples_per_sec", ".1f"), fmt("perf/train_tflops_per_sec", ".2f"),
                      fmt("perf/mfu", ".3f"), fmt("perf/step_ms", ".1f"), fmt("perf/peak_mem_mb", ".0f")))
with (out / "train.csv").open("w", newline="") as handle:
    csv.writer(handle).writerows(table)
for row in table:
    print("".join(f"{cell:>14}" for cell in row))
print(f"\nCSV: {out}/ops_*/bench_attention.csv, {out}/train.csv; plots: {out}/ops_*/bench_attention.png")
PYEOF
