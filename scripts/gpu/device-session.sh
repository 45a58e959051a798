#!/usr/bin/env bash
# One call on the GPU machine that checks and measures a build: every GPU test binary of the
# bundle (KESTREL_REQUIRE_GPU=1, one test at a time), the whole-model benchmark on synthetic
# Qwen3-30B-A3B weights with its per-kernel profile, and with --train the built-in model's
# training. Everything lands in $OUT (logs.tgz, and kestrel-tiny.tgz once trained).
#
#   scripts/gpu/gpu-bundle.sh                               # here: build the bundle
#   device run (carry gpu-bundle):  bash scripts/gpu/device-session.sh [--train]
#
# The training runs in its own process session (it outlives a call that ends before it does)
# beside the tests; the benchmark waits for it so it has the GPU alone. When the call ends
# first, a later call on the same machine with --collect waits for it, returns the model and
# runs the benchmark.
set -u
here=$(cd "$(dirname "$0")" && pwd)
B=$here/../../gpu-bundle
OUT=${OUT:?set by the device machine}
L=$OUT/logs
T=/tmp/kestrel-train
mkdir -p "$L"
export HOME=${HOME:-/root} KESTREL_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
step() { echo "$1 rc=$2 t=$(( $(date +%s) - t0 ))s" | tee -a "$L/summary.txt"; }
training() { pgrep -f train-builtin-model.py > /dev/null; }
wait_training() { # at most $1 seconds
  while training && [ $(( $(date +%s) - t0 )) -lt "$1" ]; do sleep 5; done
}
collect() {
  cp "$T/train.log" "$L/train.log" 2>/dev/null
  # $OUT returns files of at most 16 MiB, two folders down: the model travels as one archive.
  if [ -f "$T/kestrel-tiny/RECIPE.md" ]; then
    (cd "$T" && tar czf "$OUT/kestrel-tiny.tgz" kestrel-tiny) && step "model collected" 0
  else
    step "model not ready" 1
  fi
}
finish() { (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs); }

bench() {
  timeout 240 "$B/kestrel" bench --synthetic qwen3-30b-a3b -p 512 -n 128 -r 5 --profile --json \
    > "$L/bench30.json" 2> "$L/bench30.err"; step bench30 $?
}
if [ "${1:-}" = "--collect" ]; then
  wait_training 300; collect; training || bench; finish; exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$L/smi.txt" 2>&1
if [ "${1:-}" = "--train" ]; then
  mkdir -p "$T"
  setsid nohup python3 "$here/../fixtures/train-builtin-model.py" "$T/kestrel-tiny" > "$T/train.log" 2>&1 < /dev/null &
fi
for f in "$B"/tests/*; do
  t=$(basename "$f")
  timeout 300 "$f" --test-threads=1 --nocapture > "$L/$t.log" 2>&1; step "$t" $?
done
wait_training 420
if training; then step "training still running: no benchmark (call again with --collect)" 1; else bench; fi
[ "${1:-}" = "--train" ] && collect
finish
