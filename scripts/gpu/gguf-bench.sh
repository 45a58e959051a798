#!/usr/bin/env bash
# A GGUF side by side on one GPU: llama.cpp's llama-bench and `kestrel bench` on the same
# random-weight files at Qwen3-30B-A3B's shapes, and Kestrel on the MLX 4-bit model of the same
# shapes (--synthetic), in one call on the device machine.
#
#   bash scripts/gpu/gguf-bench.sh PEER_DIR KESTREL_BIN OUTDIR [LAYERS]
#
# PEER_DIR holds the llama.cpp peer recipe's `make_gguf.py` and `VERSION` (shared/peer/) and
# `llama.cpp.tar.xz`, the pruned llama.cpp tree VERSION describes with tools/llama-bench and
# tools/quantize. The script builds llama-bench and llama-quantize for sm_90 (about 5 minutes
# on 16 cores) while make_gguf.py writes the Q4_K file (/tmp/q30.gguf: every matrix Q4_K),
# then llama-quantize requantises it to Q4_K_M (/tmp/q30-q4km.gguf: llama.cpp's own choice of
# Q6_K for some layers' ffn_down_exps and attn_v), and runs `llama-bench -p 512 -n 128 -r 3
# -ngl 99 -fa 1` and `kestrel bench -p 512 -n 128 -r 3` on it, then `kestrel bench
# --synthetic qwen3-30b-a3b`. Then it rounds the Q4_K_M file's routers to bf16 values in place
# (`scripts/gguf/round-routers-bf16.py`: what a file converted from a bf16 checkpoint holds, and
# Kestrel then reads them as bf16; make_gguf.py draws any f32) and runs `kestrel bench` on it
# again. OUTDIR gets build.log, make_gguf.log, quantize.log, llama-*.log and kestrel-*.log.
set -euo pipefail
if [[ $# -lt 3 ]]; then
    echo "usage: bash scripts/gpu/gguf-bench.sh PEER_DIR KESTREL_BIN OUTDIR [LAYERS]" >&2
    exit 2
fi
ROUND_ROUTERS=$(cd "$(dirname "$0")/../gguf" && pwd)/round-routers-bf16.py
PEER=$(cd "$1" && pwd)
KESTREL=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
OUT=$3
LAYERS=${4:-48}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

WORK=/tmp/gguf-peer
BUILD=/tmp/gguf-peer-build
Q4K=/tmp/q30.gguf
Q4KM=/tmp/q30-q4km.gguf
mkdir -p "$WORK"
cp "$PEER/make_gguf.py" "$PEER/VERSION" "$WORK/"
rm -rf "$WORK/llama.cpp"
tar xJf "$PEER/llama.cpp.tar.xz" -C "$WORK"
COMMIT=$(sed -n 's/^commit=//p' "$WORK/VERSION")
BUILD_NO=$(sed -n 's/^build=//p' "$WORK/VERSION")
echo "llama.cpp $COMMIT (b$BUILD_NO)"

python3 "$WORK/make_gguf.py" "$Q4K" --layers "$LAYERS" > "$OUT/make_gguf.log" 2>&1 &
GEN=$!
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
T0=$SECONDS
cmake -S "$WORK/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$NVCC" -DGGML_CUDA_NCCL=OFF \
    -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_COMMIT="${COMMIT:0:8}" -DLLAMA_BUILD_NUMBER="$BUILD_NO" > "$OUT/build.log" 2>&1
cmake --build "$BUILD" --target llama-bench llama-quantize -j "$(nproc)" >> "$OUT/build.log" 2>&1 \
    || { tail -n 40 "$OUT/build.log"; exit 1; }
echo "build: $((SECONDS - T0)) s"
wait "$GEN" || { tail -n 20 "$OUT/make_gguf.log"; exit 1; }
tail -n 1 "$OUT/make_gguf.log"

T0=$SECONDS
"$BUILD/bin/llama-quantize" --allow-requantize "$Q4K" "$Q4KM" Q4_K_M "$(nproc)" > "$OUT/quantize.log" 2>&1 \
    || { tail -n 20 "$OUT/quantize.log"; exit 1; }
echo "requantised to Q4_K_M in $((SECONDS - T0)) s: $(grep -c 'q6_K' "$OUT/quantize.log" || true) tensors Q6_K"

for f in "$Q4KM"; do
    tag=$(basename "$f" .gguf)
    echo "=== $tag ($(du -h "$f" | cut -f1))"
    "$BUILD/bin/llama-bench" -m "$f" -p 512 -n 128 -r 3 -ngl 99 -fa 1 > "$OUT/llama-$tag.log" 2>&1 \
        || { tail -n 20 "$OUT/llama-$tag.log"; exit 1; }
    grep -E "pp512|tg128" "$OUT/llama-$tag.log" || true
    "$KESTREL" bench -m "$f" -p 512 -n 128 -r 3 > "$OUT/kestrel-$tag.log" 2>&1 \
        || { tail -n 20 "$OUT/kestrel-$tag.log"; exit 1; }
    grep -E "^(model|pp512|tg128)" "$OUT/kestrel-$tag.log" || true
done
echo "=== kestrel bench --synthetic qwen3-30b-a3b --layers $LAYERS"
"$KESTREL" bench --synthetic qwen3-30b-a3b --layers "$LAYERS" -p 512 -n 128 -r 3 > "$OUT/kestrel-mlx.log" 2>&1 \
    || { tail -n 20 "$OUT/kestrel-mlx.log"; exit 1; }
grep -E "^(model|pp512|tg128)" "$OUT/kestrel-mlx.log" || true
echo "=== $(basename "$Q4KM" .gguf), routers rounded to bf16 values"
python3 "$ROUND_ROUTERS" "$Q4KM"
"$KESTREL" bench -m "$Q4KM" -p 512 -n 128 -r 3 > "$OUT/kestrel-q4km-bf16-routers.log" 2>&1 \
    || { tail -n 20 "$OUT/kestrel-q4km-bf16-routers.log"; exit 1; }
grep -E "^(model|pp512|tg128)" "$OUT/kestrel-q4km-bf16-routers.log" || true
