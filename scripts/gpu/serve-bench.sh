#!/usr/bin/env bash
# The server's measurements in one device call: `bench` tg128 of a synthetic model beside
# `bench serve` at one client (what the server costs at batch 1) and at eight, and a check that
# prompts of many lengths are served (more lengths than a session keeps programs for), the
# server healthy after them. JSON and logs land in LOGDIR; a summary is printed.
#
#   bash scripts/gpu/serve-bench.sh KESTREL LOGDIR [MODEL]
#   e.g. bash scripts/gpu/serve-bench.sh gpu-bundle/kestrel $OUT/serve qwen3-30b-a3b
set -uo pipefail
bin=$1 logs=$2 model=${3:-qwen3-30b-a3b}
mkdir -p "$logs"
timeout 300 "$bin" bench --synthetic "$model" -p 512 -n 128 -r 3 --json \
  > "$logs/bench.json" 2> "$logs/bench.err"
echo "bench rc=$?"
for c in 1 8; do
  n=$(( c == 1 ? 8 : 32 ))
  timeout 400 "$bin" bench serve --synthetic "$model" -c "$c" -n "$n" --prompt-len 512 --output-len 128 \
    --json > "$logs/serve-c$c.json" 2> "$logs/serve-c$c.err"
  echo "bench serve -c $c rc=$?"
done
"$bin" serve --synthetic "$model" --port 0 > /dev/null 2> "$logs/lengths-server.err" &
server=$!
python3 - "$logs" <<'PY'
import json, os, re, sys, time, urllib.request
logs = sys.argv[1]
def log():
    return open(os.path.join(logs, "lengths-server.err")).read()
for _ in range(600):
    m = re.search(r"http://[0-9.:]+", log())
    if m:
        break
    time.sleep(0.5)
base = m.group(0)
def call(path, body=None):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
for _ in range(1200):
    try:
        if call("/health")[0] == 200:
            break
    except Exception:
        pass
    time.sleep(0.5)
ok = 0
for n in range(3, 3 + 5 * 20, 5):
    status, v = call("/v1/completions", {"prompt": list(range(100, 100 + n)), "max_tokens": 4, "temperature": 0})
    ok += status == 200 and v["usage"]["prompt_tokens"] == n and v["usage"]["completion_tokens"] == 4
print(f"prompts of 20 lengths: {ok} of 20 answered; health {call('/health')[0]}")
PY
kill "$server"; wait "$server" 2>/dev/null
python3 - "$logs" <<'PY'
import json, os, sys
logs = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(logs, n)))
    except (OSError, ValueError):
        return None
b = load("bench.json")
tg = next((t["tokens_per_s"] for t in (b or {}).get("results", []) if t["test"].startswith("tg")), None)
print(f"bench tg128: {tg}")
for c in (1, 8):
    s = load(f"serve-c{c}.json")
    if not s:
        print(f"serve -c {c}: no result")
        continue
    line = (f"serve -c {c}: {s['completed']}/{s['requests']} requests, {s['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT median {s['ttft_ms']['median']:.1f} ms p99 {s['ttft_ms']['p99']:.1f}, "
            f"ITL median {s['itl_ms']['median']:.2f} ms p99 {s['itl_ms']['p99']:.2f}")
    if tg and c == 1:
        # One stream's decode rate is 1 / ITL; the aggregate includes each prompt's prefill.
        line += f"; 1/ITL = {1000 / s['itl_ms']['median']:.1f} tok/s = {100000 / s['itl_ms']['median'] / tg:.1f}% of tg128"
    print(line)
PY
