#!/usr/bin/env bash
# `make bench-gpu`: the one GPU check, inside BUDGET_S seconds (default 480) on one H100/H200; each
# step gets what is left, so a slow step cuts the ones after it instead of the whole check overrunning.
#  0. the GPU's name, versions and device-copy bandwidth → <out>/gpu.json
#  1. correctness first: each Triton op (sliced ReLU, ReLU-bump, causal linear) against the torch op
#     and the float64 definitions on small odd shapes in bf16, fp16 and fp32, one process per op
#     (`attnlab.cli.gpu_check`) → <out>/check/<op>.json; an op that fails is left out of the timings
#     (its torch variant still runs), with its figures
#  2. attention ops, forward + backward, B·H = 64 (B = 8, H = 8), D = 64, T = 1K…64K in bf16: SDPA
#     (flash), sliced ReLU and ReLU-bump on Triton and on torch, linear, causal linear on Triton and on
#     torch; each backend in its own process (a fault, sticky in CUDA, cannot fail the others), every
#     length's kernels compiled by an untimed first call → <out>/ops_bfloat16/<backend>/
#  3. training throughput (samples/s, TFLOP/s, MFU) of the LRA ListOps and Text presets under softmax
#     and sliced ReLU, bf16-mixed, 40 steps after 10 warm-up steps → <out>/train/ (Text needs its data)
#  4. the ops again in fp16 and fp32 at 4K and 64K → <out>/ops_float16, <out>/ops_float32
#  5. every figure in <out>/results.json and one summary: the checks, time, the byte floor
#     (`attnlab bench bytes`), the bandwidth it implies and its fraction of the copy bandwidth;
#     training throughput.
# OUT=dir chooses the output folder, PY the Python (default .venv/bin/python: built by `make venv`,
# never here, since a GPU node may have no network). Under SLURM each job compiles into its own
# Triton cache.
set -uo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench_results/gpu}
BUDGET_S=${BUDGET_S:-480}
START=$(date +%s)
if ! command -v "$PY" > /dev/null; then
  echo "bench-gpu: no Python environment at $PY: run 'make venv' first (or set PY=...)" >&2
  exit 2
fi
"$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench-gpu: no CUDA device here; run it on a GPU machine")' || exit 2
mkdir -p "$OUT"  # only once a GPU is there: a machine without one is left no empty results folder
# a new check replaces the last one's results in $OUT: nothing stale is summarised as measured now
rm -rf "$OUT/check" "$OUT"/ops_* "$OUT/train" "$OUT/results.json" "$OUT/gpu.json"
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${TRITON_CACHE_DIR:-}" ]; then
  export TRITON_CACHE_DIR="${TMPDIR:-/tmp}/attnlab-triton-${SLURM_JOB_ID}"  # as train.py does in a job
fi
SUMMARY_S=${SUMMARY_S:-30}  # kept for the last step
MIN_STEP_S=${MIN_STEP_S:-20}  # a step with less left than this is skipped
exec 3>&1  # run_step's notices reach the terminal even when a step's output goes to a log

# run_step NAME CMD...: CMD under the time left (minus the summary's share), or skipped once it is spent.
# Returns CMD's status; 124 when the budget stopped it (what it measured is kept), 125 when skipped.
run_step() {
  local name=$1 left
  shift
  left=$((BUDGET_S - SUMMARY_S - ($(date +%s) - START)))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    echo "bench-gpu: $name skipped (the ${BUDGET_S}s budget is spent)" >&3
    return 125
  fi
  local began=$(date +%s)
  timeout -k 15 "$left" "$@"  # SIGTERM at the budget (what was measured is kept), SIGKILL 15 s later
  local rc=$?
  echo "bench-gpu: $name: $(($(date +%s) - began)) s (rc $rc, $((BUDGET_S - ($(date +%s) - START))) s of the budget left)" >&3
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "bench-gpu: $name stopped at the budget (${left}s left for it); what it measured is kept" >&3
    return 124
  fi
  return $rc
}

"$PY" -m attnlab.cli.gpu_results probe "$OUT" || exit 2

# 1. correctness: a Triton op that fails its check is not timed (its torch variant still is)
OPS="softmax sliced_relu sliced_relu_torch sliced_relu_bump sliced_relu_bump_torch linear linear_causal linear_causal_torch"
for op in sliced_relu sliced_relu_bump linear_causal; do
  run_step "check of $op" "$PY" -m attnlab.cli.gpu_check "$OUT" --backend "$op"
  case $? in
    0) ;;
    1) OPS=$(echo " $OPS " | sed "s/ $op / /")
       echo "bench-gpu: $op failed its correctness check: not timed (figures in $OUT/check/$op.json)" ;;
    *) OPS=$(echo " $OPS " | sed "s/ $op / /")
       echo "bench-gpu: the check of $op did not finish: not timed" ;;
  esac
done

ops() {  # ops DTYPE LENGTHS...: every backend of $OPS in its own process
  local dtype=$1 backend rc
  shift
  for backend in $OPS; do
    run_step "$backend in $dtype" "$PY" -m attnlab.cli.main bench attention --device cuda --dtype "$dtype" \
      -B 8 --heads 8 --dim 64 --seq-lens "$@" --backends "$backend" --mode fwdbwd --repeats 5 \
      --timeout-s 20 --out-dir "$OUT/ops_$dtype/$backend"
    rc=$?
    if [ $rc -ne 0 ] && [ $rc -lt 124 ]; then
      echo "bench-gpu: $backend in $dtype reported errors (see its table)"
    fi
  done
}

ops bfloat16 1024 4096 16384 65536

for task in listops text; do
  for attn in softmax sliced_relu; do
    extra=()
    if [ "$task" = listops ]; then  # generated at the LRA lengths (500-2000 symbols), small splits
      extra=(task.data.source.subdir=listops-bench "task.data.source.sizes={train:1600,val:64,test:64}")
    fi
    log="$OUT/train/$task/$attn.log"  # beside the run dir: gpu_results reports a run without figures
    mkdir -p "$OUT/train/$task"
    run_step "training $task/$attn" "$PY" train.py "experiment=lra/$task" "attn=$attn" trainer=gpu \
      trainer.precision=bf16-mixed logger=csv task.max_steps=50 task.val_check_interval=50 \
      callbacks.throughput.warmup_steps=10 trainer.log_every_n_steps=10 test=false \
      "hydra.run.dir=$OUT/train/$task/$attn" "${extra[@]}" > "$log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] && [ $rc -lt 124 ]; then  # (stopped or skipped at the budget: it said so itself)
      echo "bench-gpu: training $task/$attn failed (data missing?); end of $log:"
      tail -n 3 "$log"
    fi
  done
done

# 4. fp16 and fp32: the Triton ops that passed their check, and softmax beside them
OPS=$(for op in $OPS; do case $op in softmax | sliced_relu | sliced_relu_bump | linear_causal) echo "$op" ;; esac; done)
ops float16 4096 65536
ops float32 4096 65536

"$PY" -m attnlab.cli.gpu_results collect "$OUT"
echo "bench-gpu: $(($(date +%s) - START)) s in all (budget ${BUDGET_S} s)"
