#!/usr/bin/env bash
# The streamed-experts measurements of one device call: the pinned host-to-device bandwidth
# (`bench runtime`), resident decode and prefill A/B against an earlier binary (resident runs
# must not get slower), and a synthetic model streamed at a GPU budget, with LRU and the
# frequency policy, each generation fed greedy tokens (random weights repeat themselves, so
# most experts hit) or random ones (routing spread as over real text). Logs and JSON land in
# LOGDIR; the last lines printed are a summary table with the link bound of each run: resident
# decode time per token plus the bytes copied per token over the measured pinned bandwidth (the
# bytes of the one-run cache statistics, and each timed run's own bytes with the median of the
# runs' fractions of their bounds).
#
#   bash scripts/gpu/stream-bench.sh NEW OLD LOGDIR [MODEL [GPU_MEM [EXTRA BENCH ARGS...]]]
#   e.g. bash scripts/gpu/stream-bench.sh gpu-bundle/kestrel kestrel-old $OUT/s qwen3-30b-a3b 8GiB
set -uo pipefail
new=$1 old=$2 logs=$3 model=${4:-qwen3-30b-a3b} mem=${5:-8GiB}
shift $(( $# < 5 ? $# : 5 ))
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$logs"
"$new" bench runtime --json > "$logs/runtime.json" 2> "$logs/runtime.err"
if [ -x "$old" ]; then
  bash "$here/bench-ab.sh" "$old" "$new" 2 "$logs/ab" -- --synthetic "$model" -p 512 -n 128 -r 3 "$@" \
    > "$logs/ab.txt" 2>&1
fi
for ev in lru freq; do
  for input in greedy random; do
    timeout 400 "$new" bench --synthetic "$model" -p 512 -n 64 -r 3 --gpu-mem "$mem" \
      --expert-eviction "$ev" --tg-input "$input" --json "$@" \
      > "$logs/$ev-$input.json" 2> "$logs/$ev-$input.err" || echo "$ev $input failed: $(tail -3 "$logs/$ev-$input.err")"
  done
done
python3 - "$logs" <<'PY'
import json, os, sys
logs = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(logs, name)))
    except (OSError, ValueError):
        return None
rt = load("runtime.json") or {}
print(open(os.path.join(logs, "ab.txt")).read() if os.path.exists(os.path.join(logs, "ab.txt")) else "no A/B")
# Pinned host-to-device bandwidth, bytes/s, from bench runtime.
bw = (rt.get("results", {}).get("h2d pinned") or {}).get("value")
bw = bw * 1e9 if bw else None
print(f"pinned host-to-device: {bw / 1e9 if bw else float('nan'):.1f} GB/s")
resident = None
ab = os.path.join(logs, "ab")
if os.path.isdir(ab):
    for f in sorted(os.listdir(ab)):
        if f.startswith("after") and f.endswith(".json"):
            for t in json.load(open(os.path.join(ab, f)))["results"]:
                if t["test"].startswith("tg"):
                    resident = max(resident or 0, t["tokens_per_s"])
print(f"resident tg (best A/B round, new binary): {resident}")
for ev in ("lru", "freq"):
    for inp in ("greedy", "random"):
        r = load(f"{ev}-{inp}.json")
        if not r:
            print(f"{ev:4} {inp:6}: no result")
            continue
        res = {t["test"]: t["tokens_per_s"] for t in r["results"]}
        x = r.get("expert_cache") or {}
        per = x.get("bytes_copied_per_token", 0)
        line = f"{ev:4} {inp:6}: " + "  ".join(f"{k} {v:.1f} tok/s" for k, v in res.items())
        line += f"  hit {100 * x.get('hit_rate', 0):.1f}%  {per / 1e6:.1f} MB/token"
        if resident and bw:
            bound = 1 / (1 / resident + per / bw)
            tg = [v for k, v in res.items() if k.startswith("tg")][0]
            line += f"  link bound {bound:.1f} tok/s  ({100 * tg / bound:.1f}% of it, {100 * tg / resident:.1f}% of resident)"
            # Each timed run against its own bound (its own bytes): runs are fed different
            # tokens and the caches carry over, so their bytes differ.
            t = [t for t in r["results"] if t["test"].startswith("tg")][0]
            runs = list(zip(t["samples_tokens_per_s"], t.get("samples_bytes_copied_per_token", [])))
            if runs:
                fr = sorted(v * (1 / resident + b / bw) for v, b in runs)
                line += f"\n      per run: " + ", ".join(f"{v:.1f} tok/s at {b / 1e6:.1f} MB" for v, b in runs)
                line += f"; of each run's link bound: median {100 * fr[len(fr) // 2]:.1f}%"
        print(line)
PY
