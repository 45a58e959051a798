#!/usr/bin/env bash
# A GGUF side by side on one GPU: llama.cpp's llama-bench and `kestrel bench` on the same
# random-weight Q4_K file at Qwen3-30B-A3B's shapes, and Kestrel on the MLX 4-bit model of the
# same shapes (--synthetic), in one call on the device machine.
#
#   bash scripts/gpu/gguf-bench.sh PEER_DIR KESTREL_BIN OUTDIR [LAYERS]
#
# PEER_DIR holds the llama.cpp peer recipe (`make_gguf.py`, `run.sh`, `VERSION` from
# shared/peer/) and `llama.cpp.tar.xz`, the pruned llama.cpp tree VERSION describes. run.sh
# builds llama-bench for sm_90, writes the GGUF (/tmp/q30.gguf) and runs `llama-bench -p 512
# -n 128 -r 3 -ngl 99 -fa 1`; then Kestrel runs `bench -p 512 -n 128 -r 3` on the file and on
# `--synthetic qwen3-30b-a3b`. OUTDIR gets run.sh's logs under peer/ and kestrel-*.log.
set -euo pipefail
if [[ $# -lt 3 ]]; then
    echo "usage: bash scripts/gpu/gguf-bench.sh PEER_DIR KESTREL_BIN OUTDIR [LAYERS]" >&2
    exit 2
fi
PEER=$(cd "$1" && pwd)
KESTREL=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
OUT=$3
LAYERS=${4:-48}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

WORK=/tmp/gguf-peer
mkdir -p "$WORK"
cp "$PEER/make_gguf.py" "$PEER/run.sh" "$PEER/VERSION" "$WORK/"
rm -rf "$WORK/llama.cpp"
tar xJf "$PEER/llama.cpp.tar.xz" -C "$WORK"

bash "$WORK/run.sh" "$OUT/peer" "$LAYERS"

GGUF=${PEER_GGUF:-/tmp/q30.gguf}
echo "=== kestrel bench -m $GGUF"
/usr/bin/time -v "$KESTREL" bench -m "$GGUF" -p 512 -n 128 -r 3 > "$OUT/kestrel-gguf.log" 2>&1 || {
    tail -n 30 "$OUT/kestrel-gguf.log"
    exit 1
}
grep -E "pp|tg|Maximum resident|Elapsed" "$OUT/kestrel-gguf.log" || true
echo "=== kestrel bench --synthetic qwen3-30b-a3b --layers $LAYERS"
"$KESTREL" bench --synthetic qwen3-30b-a3b --layers "$LAYERS" -p 512 -n 128 -r 3 > "$OUT/kestrel-mlx.log" 2>&1 || {
    tail -n 30 "$OUT/kestrel-mlx.log"
    exit 1
}
grep -E "pp|tg" "$OUT/kestrel-mlx.log" || true
