#!/usr/bin/env bash
# Compares two kestrel binaries on the same GPU, interleaved (A B A B ...) so drift in clocks or
# temperature falls on both: each round runs `bench ARGS --json` with each binary, and the
# summary gives every test's median tokens/s per binary over the rounds' medians.
#
#   bash scripts/gpu/bench-ab.sh BEFORE AFTER ROUNDS LOGDIR -- --synthetic qwen3-30b-a3b -p 512 -n 128 -r 3
set -euo pipefail
before=$1 after=$2 rounds=$3 logs=$4
shift 4
[ "${1:-}" = "--" ] && shift
mkdir -p "$logs"
for r in $(seq "$rounds"); do
  for side in before after; do
    bin=$before; [ "$side" = after ] && bin=$after
    timeout 300 "$bin" bench "$@" --json > "$logs/$side-$r.json" 2> "$logs/$side-$r.err" ||
      { echo "$side round $r failed:"; tail -5 "$logs/$side-$r.err"; exit 1; }
  done
done
python3 - "$logs" "$rounds" <<'PY'
import json, statistics, sys
logs, rounds = sys.argv[1], int(sys.argv[2])
for side in ("before", "after"):
    runs = [json.load(open(f"{logs}/{side}-{r}.json")) for r in range(1, rounds + 1)]
    tests = {}
    for run in runs:
        for t in run["results"]:
            tests.setdefault(t["test"], []).append(t["tokens_per_s"])
    line = "  ".join(f"{name} median {statistics.median(v):.1f} tok/s (rounds {', '.join(f'{x:.1f}' for x in v)})" for name, v in tests.items())
    print(f"{side:6} {runs[0]['model']}: {line}")
PY
