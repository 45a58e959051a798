#!/usr/bin/env bash
# Experts streamed from a model directory on local disk, in one device call: writes a synthetic
# model there (`kestrel synth`), measures one `dd` stream with O_DIRECT over a shard for
# reference, the pinned host-to-device bandwidth (`bench runtime`), resident decode from the
# directory (the whole model on the GPU), then decode with experts streamed at a GPU and a host
# budget, generation fed random tokens (routing spread as over real text) and greedy ones. The
# bench measures the disk's read bandwidth itself (large parallel direct reads of the weight
# files) just before and just after the run whose reads it counts, over other bytes each time.
# The last lines printed are a table with each streamed run's bound: the resident time per
# token, plus the bytes copied from host memory over the pinned bandwidth, plus the bytes read
# from disk over the mean of the two measurements; the reads' rate is also set against the
# higher of the two.
#
#   bash scripts/gpu/disk-bench.sh KESTREL LOGDIR MODEL LAYERS GPU_MEM HOST_MEM [DIR]
#   e.g. bash scripts/gpu/disk-bench.sh gpu-bundle/kestrel $OUT/d qwen3-next-80b-a3b 48 16GiB 8GiB
set -uo pipefail
bin=$1 logs=$2 model=$3 layers=$4 gpu=$5 host=$6 dir=${7:-$PWD/disk-model}
mkdir -p "$logs"
df -h "$(dirname "$dir")" > "$logs/df.txt"
rm -rf "$dir"
/usr/bin/time -v "$bin" synth "$model" --layers "$layers" --out "$dir" > "$logs/synth.txt" 2>&1 ||
  { echo "synth failed"; tail -5 "$logs/synth.txt"; exit 1; }
sync
shard=$(ls -S "$dir"/*.safetensors | head -1)
dd if="$shard" of=/dev/null bs=4M iflag=direct 2> "$logs/dd.txt"
"$bin" bench runtime --json > "$logs/runtime.json" 2> "$logs/runtime.err"
timeout 300 "$bin" bench -m "$dir" -p 0 -n 64 -r 3 --tg-input random --json \
  > "$logs/resident.json" 2> "$logs/resident.err" || echo "resident failed: $(tail -3 "$logs/resident.err")"
for input in random greedy; do
  timeout 300 "$bin" bench -m "$dir" -p 0 -n 64 -r 3 --gpu-mem "$gpu" --host-mem "$host" \
    --tg-input "$input" --json > "$logs/streamed-$input.json" 2> "$logs/streamed-$input.err" ||
    echo "streamed $input failed: $(tail -3 "$logs/streamed-$input.err")"
done
rm -rf "$dir"
python3 - "$logs" <<'PY'
import json, os, sys
logs = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(logs, name)))
    except (OSError, ValueError):
        return None
print(open(os.path.join(logs, "dd.txt")).read().strip().splitlines()[-1])
rt = load("runtime.json") or {}
bw = (rt.get("results", {}).get("h2d pinned") or {}).get("value")
bw = bw * 1e9 if bw else None
print(f"pinned host-to-device: {bw / 1e9 if bw else float('nan'):.1f} GB/s")
def tg(r):
    return [t["tokens_per_s"] for t in r["results"] if t["test"].startswith("tg")][0]
res = load("resident.json")
resident = tg(res) if res else None
print(f"resident tg64 from the directory: {resident}")
for inp in ("random", "greedy"):
    r = load(f"streamed-{inp}.json")
    if not r:
        print(f"{inp:6}: no result")
        continue
    x = r.get("expert_cache") or {}
    d = r.get("disk") or {}
    dbw = d.get("bytes_per_s")
    copied, disk = x.get("bytes_copied_per_token", 0), x.get("disk_bytes_per_token", 0)
    line = (f"{inp:6}: tg64 {tg(r):.2f} tok/s  hit {100 * x.get('hit_rate', 0):.1f}%  "
            f"{copied / 1e6:.1f} MB/token copied, {disk / 1e6:.1f} MB of it read from disk "
            f"({1e3 * x.get('disk_read_s_per_token', 0):.1f} ms reading, "
            f"{1e3 * x.get('host_s_per_token', 0):.1f} ms host, per token)  "
            f"disk {dbw / 1e9 if dbw else float('nan'):.2f} GB/s ({'direct' if d.get('direct') else 'buffered'}; "
            f"before {(d.get('before') or {}).get('bytes_per_s', 0) / 1e9:.2f}, "
            f"after {(d.get('after') or {}).get('bytes_per_s', 0) / 1e9:.2f})")
    if resident and bw and dbw:
        bound_t = 1 / resident + (copied - disk) / bw + disk / dbw
        line += f"  bound {1 / bound_t:.2f} tok/s ({100 * tg(r) * bound_t:.1f}% of it)"
        if x.get("disk_read_s_per_token"):
            rate = disk / x['disk_read_s_per_token']
            top = max((d.get(k) or {}).get('bytes_per_s', 0) for k in ('before', 'after')) or dbw
            line += (f"  reads at {rate / 1e9:.2f} GB/s ({100 * rate / dbw:.1f}% of the disk's mean, "
                     f"{100 * rate / top:.1f}% of the higher)")
    print(line)
PY
