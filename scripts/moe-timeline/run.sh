#!/usr/bin/env bash
# Timeline of one-token MoE decode on the GPU machine (needs nvcc; no Rust): stamps the real
# kernels (stamp.py), builds timeline.cu against them and prints, per kernel of a middle layer,
# when its blocks pass each step. Run from the repository root:
#   bash scripts/moe-timeline/run.sh [OUTDIR] [norm]   (norm: the router with the norm folded in)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
b=${1:-/tmp/moe-timeline}
mkdir -p "$b"
python3 "$here/stamp.py" "$b"
cp "$here/timeline.cu" "$b/"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o "$b/timeline" "$b/timeline.cu"
"$b/timeline" ${2:-} | tee "$b/timeline.txt" | sed -n '1,2p;/^layer 2 route/,/^layer 3 route/p'
