#!/usr/bin/env bash
# The commands of BENCHMARKS.md's table, in five parts that each fit one device call (at most
# 10 minutes): 1 = rows A-F (resident models, runtime, ops), 2 = rows G-H and 3 = row I
# (experts streamed from host memory), 4 = row J (experts read from local disk), 5 = rows K-N
# (decode at depth, prompt lengths, batched decode, the server at 1, 8, 64 and 256 clients; row O
# needs llama.cpp beside it: `gguf-bench.sh`). Each row's
# JSON and stderr land in LOGDIR as ROW.json / ROW.err (or a folder ROW for the rows measured by
# a script), and `summary.txt` gets one line a row with its exit status. Parts 2-4 measure the
# pinned host-to-device bandwidth their link bounds need.
#
#   bash scripts/gpu/bench-table.sh KESTREL PART LOGDIR
#   e.g. bash scripts/gpu/bench-table.sh gpu-bundle/kestrel 1 $OUT/t1
set -uo pipefail
bin=$1 part=$2 logs=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$logs"
t0=$(date +%s)
row() { # row letter, seconds allowed, bench arguments...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$bin" bench "$@" --json > "$logs/$name.json" 2> "$logs/$name.err"
  echo "$name rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a "$logs/summary.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$logs/smi.txt" 2>&1
case $part in
  1)
    row E 60 runtime -r 20
    row A 150 --synthetic qwen3-30b-a3b -p 512 -n 128 -r 5
    row B 90 --synthetic qwen3-30b-a3b -p 4096 -n 0 -r 3
    row C 120 --synthetic qwen3-next-80b-a3b -p 512 -n 128 -r 3
    row D 90 --synthetic qwen3.5-397b-a17b --layers 12 -p 512 -n 128 -r 3
    row F 120 ops -r 50
    ;;
  2)
    row E 60 runtime -r 5
    row G 150 --synthetic qwen3-30b-a3b -p 512 -n 64 -r 3 --gpu-mem 8GiB --tg-input random
    row H 200 --synthetic qwen3-next-80b-a3b -p 4096 -n 64 -r 3 --gpu-mem 16GiB --tg-input random
    ;;
  3)
    bash "$here/stream-layers.sh" "$bin" "$logs/I" qwen3.5-397b-a17b 60 10 27GiB 20 47GiB lru \
      > "$logs/I.txt" 2>&1
    echo "I rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a "$logs/summary.txt"
    ;;
  4)
    bash "$here/disk-bench.sh" "$bin" "$logs/J" qwen3-next-80b-a3b 48 16GiB 8GiB > "$logs/J.txt" 2>&1
    echo "J rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a "$logs/summary.txt"
    ;;
  5)
    for d in 0 512 2048 8192; do
      row "K-d$d" 90 --synthetic qwen3-30b-a3b -p 0 -n 128 -r 3 -d "$d"
    done
    row L 120 --synthetic qwen3-30b-a3b -p 256,512,1024,2048 -n 128 -r 3
    row M 180 --synthetic qwen3-30b-a3b -p 512 -n 128 -b 1,2,3,4,6,8,12,16,32,64,128,256 -r 3
    for c in 1 8 64 256; do
      n=$(( c == 1 ? 8 : 2 * c ))
      timeout 200 "$bin" bench serve --synthetic qwen3-30b-a3b --server-arg=-c=2560 \
        --server-arg=--max-num-seqs=256 -c "$c" -n "$n" --prompt-len 512 --output-len 128 --seed 7 \
        --json > "$logs/N-c$c.json" 2> "$logs/N-c$c.err"
      echo "N -c $c rc=$? t=$(( $(date +%s) - t0 ))s" | tee -a "$logs/summary.txt"
    done
    ;;
  *) echo "part must be 1, 2, 3, 4 or 5" >&2; exit 2 ;;
esac
