#!/usr/bin/env bash
# A synthetic model too large for the host streamed at two depths, to find its per-layer decode
# time and what a whole model would do: the first L layers of the configuration built in
# memory with experts in host memory (page-locked) and a GPU budget giving each layer's cache
# the same share of its experts at both depths; decode fed random tokens. Per-token time is
# fixed + L * per-layer, so two depths give both, and the whole model's figure is
# fixed + LAYERS * per-layer. The deeper one is also run resident, for its link bound
# (resident time per token plus bytes copied per token over the pinned bandwidth).
#
#   bash scripts/gpu/stream-layers.sh KESTREL LOGDIR MODEL ALL_LAYERS L1 GPU1 L2 GPU2 [POLICY...]
#   e.g. bash scripts/gpu/stream-layers.sh gpu-bundle/kestrel $OUT/x qwen3.5-397b-a17b 60 \
#          10 24GiB 20 44GiB lru freq
set -uo pipefail
bin=$1 logs=$2 model=$3 all=$4 l1=$5 g1=$6 l2=$7 g2=$8
shift 8
policies=${*:-lru}
mkdir -p "$logs"
"$bin" bench runtime --json > "$logs/runtime.json" 2> "$logs/runtime.err"
run() { # name, layers, extra args...
  local name=$1 layers=$2
  shift 2
  timeout 400 "$bin" bench --synthetic "$model" --layers "$layers" -p 0 -n 64 -r 3 --tg-input random \
    --json "$@" > "$logs/$name.json" 2> "$logs/$name.err" || echo "$name failed: $(tail -3 "$logs/$name.err")"
  grep -h "streaming experts" "$logs/$name.err" | head -1
}
run "resident-$l2" "$l2"
for p in $policies; do
  run "$p-$l2" "$l2" --gpu-mem "$g2" --expert-eviction "$p"
  run "$p-$l1" "$l1" --gpu-mem "$g1" --expert-eviction "$p"
done
python3 - "$logs" "$all" "$l1" "$l2" $policies <<'PY'
import json, os, sys
logs, full, l1, l2, policies = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
def load(name):
    try:
        return json.load(open(os.path.join(logs, name + ".json")))
    except (OSError, ValueError):
        return None
rt = load("runtime") or {}
bw = (rt.get("results", {}).get("h2d pinned") or {}).get("value")
bw = bw * 1e9 if bw else None
print(f"pinned host-to-device: {bw / 1e9 if bw else float('nan'):.1f} GB/s")
def tg(r):
    return [t["tokens_per_s"] for t in r["results"] if t["test"].startswith("tg")][0]
res = load(f"resident-{l2}")
resident = tg(res) if res else None
print(f"resident tg64, {l2} layers: {resident}")
for p in policies:
    a, b = load(f"{p}-{l1}"), load(f"{p}-{l2}")
    for r, l in ((a, l1), (b, l2)):
        if not r:
            print(f"{p} {l} layers: no result")
            continue
        x = r.get("expert_cache") or {}
        copied = x.get("bytes_copied_per_token", 0)
        line = (f"{p} {l} layers: tg64 {tg(r):.1f} tok/s  hit {100 * x.get('hit_rate', 0):.1f}%  "
                f"{x.get('slots_per_layer')} slots a layer  {copied / 1e6:.1f} MB/token")
        if l == l2 and resident and bw:
            bound = 1 / (1 / resident + copied / bw)
            line += f"  link bound {bound:.1f} tok/s ({100 * tg(r) / bound:.1f}% of it)"
        print(line)
    if a and b:
        t1, t2 = 1 / tg(a), 1 / tg(b)
        per = (t2 - t1) / (l2 - l1)
        fixed = t1 - l1 * per
        print(f"{p}: {1e3 * per:.3f} ms a layer, {1e3 * fixed:.3f} ms fixed: "
              f"{full} layers imply {1 / (fixed + full * per):.1f} tok/s")
PY
