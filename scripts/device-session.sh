#!/usr/bin/env bash
# One call on the GPU machine that checks and measures a build: every GPU test binary of the
# bundle (KESTREL_REQUIRE_GPU=1, one test at a time), the whole-model benchmark on synthetic
# Qwen3-30B-A3B weights with its per-kernel profile, and with --train the built-in model's
# training. Everything lands in $OUT (logs.tgz, and kestrel-tiny/ when trained).
#
#   scripts/gpu-bundle.sh                                   # here: build the bundle
#   device run (carry gpu-bundle, scripts):  bash scripts/device-session.sh [--train]
set -u
B=$(cd "$(dirname "$0")/.." && pwd)/gpu-bundle
OUT=${OUT:?set by the device machine}
L=$OUT/logs
mkdir -p "$L"
export HOME=${HOME:-/root} KESTREL_REQUIRE_GPU=1
t0=$(date +%s)
step() { echo "$1 rc=$2 t=$(( $(date +%s) - t0 ))s" | tee -a "$L/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$L/smi.txt" 2>&1
for t in gpu_ops gpu_layers gpu_runtime parity_cuda dtypes chunked_prefill; do
  [ -x "$B/tests/$t" ] || continue
  timeout 300 "$B/tests/$t" --test-threads=1 --nocapture > "$L/$t.log" 2>&1; step "$t" $?
done
timeout 300 "$B/kestrel" bench --synthetic qwen3-30b-a3b -p 512 -n 128 -r 5 --profile --json \
  > "$L/bench30.json" 2> "$L/bench30.err"; step bench30 $?
if [ "${1:-}" = "--train" ]; then
  timeout 900 python3 "$(dirname "$0")/train-builtin-model.py" "$OUT/kestrel-tiny" > "$L/train.log" 2>&1
  step train $?
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
