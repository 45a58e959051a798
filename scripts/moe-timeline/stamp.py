#!/usr/bin/env python3
"""Writes a copy of kernels/moe.cu and kestrel.cuh with %globaltimer stamps into a build folder,
for timeline.cu (see run.sh). The stamps go in at fixed lines of the kernels; a kernel edit
that moves one of them makes this stop with the line it could not find."""
import os, sys

here = os.path.dirname(os.path.abspath(__file__))
kernels = os.path.join(here, "..", "..", "crates", "kestrel-cuda", "kernels")
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "build")
os.makedirs(out, exist_ok=True)

# The host pass of nvcc must see the sm_90 kernels' declarations too.
def replaced(text, name, old, new):
    if text.count(old) != 1:
        sys.exit(f"stamp.py: not found once in {name}:\n{old}")
    return text.replace(old, new)


cuh = open(os.path.join(kernels, "kestrel.cuh")).read()
cuh = replaced(cuh, "kestrel.cuh", "\n#if __CUDA_ARCH__ >= 900\n// This block's rank", "\n#if 1\n// This block's rank")
open(os.path.join(out, "kestrel.cuh"), "w").write(cuh)

src = open(os.path.join(kernels, "moe.cu")).read()


def rep(old, new):
    global src
    src = replaced(src, "moe.cu", old, new)


# route_*: 0 start, 1 after the wait, 2 x staged, 6 first row's product, 3 products done,
# 4 after the cluster barrier, 5 choice written.
rep("    const size_t row_bytes = (size_t)in_dim * BITS / 8;\n", "    const size_t row_bytes = (size_t)in_dim * BITS / 8;\n    TL_BEGIN(0);\n")
rep("    cluster_arrive_relaxed();  // waited for before the first store into block 0\n    pdl_wait();\n", "    cluster_arrive_relaxed();  // waited for before the first store into block 0\n    pdl_wait();\n    STAMP(1);\n")
rep("        stage_x_sums<BITS>(x, xs, xsum, in_dim);\n    }\n    cluster_wait();\n", "        stage_x_sums<BITS>(x, xs, xsum, in_dim);\n    }\n    cluster_wait();\n    STAMP(2);\n")
rep("        const float s = warp_sum(acc[0]);\n        if (lane == 0) store_cluster_f32", "        if (r == first) STAMP(6);\n        const float s = warp_sum(acc[0]);\n        if (lane == 0) store_cluster_f32")
rep("    // Only shared-memory stores are in flight here", "    STAMP(3);\n    // Only shared-memory stores are in flight here")
rep("    if (rank != 0) return;\n    choose_block", "    if (rank != 0) return;\n    STAMP(4);\n    choose_block")
rep("    choose_block<PER_LANE>(chosen_from, scale, logits, ids, weights, experts, k, normalize);\n}\n",
    "    choose_block<PER_LANE>(chosen_from, scale, logits, ids, weights, experts, k, normalize);\n    STAMP(5);\n}\n")
# gate/up: 0 start, 1 after the wait, 2 weights asked for (the ids are back), 3 x rounded and
# the scales in, 4 products done, 5 activations written.
rep("    extern __shared__ __align__(16) float sact[];\n", "    extern __shared__ __align__(16) float sact[];\n    TL_BEGIN(1);\n")
rep("    pdl_wait();\n    pdl_trigger();\n    const unsigned groups = hidden / group, nvec", "    pdl_wait();\n    pdl_trigger();\n    STAMP(1);\n    const unsigned groups = hidden / group, nvec")
rep("    issue<2 * GQ_ROWS, UNROLL>(mats, 0, lane, nvec, active, v);\n    // This warp", "    issue<2 * GQ_ROWS, UNROLL>(mats, 0, lane, nvec, active, v);\n    STAMP(2);\n    // This warp")
rep("    cp_async_wait<0>();\n    __syncthreads();\n    const QuantX xq{sq, sd, ss};\n", "    cp_async_wait<0>();\n    __syncthreads();\n    STAMP(3);\n    const QuantX xq{sq, sd, ss};\n")
rep("""        issue<2 * GQ_ROWS, UNROLL>(mats, 0, u0, nvec, active, v);
    }
#pragma unroll
    for (int r = 0; r < GQ_ROWS; r++) {""", """        issue<2 * GQ_ROWS, UNROLL>(mats, 0, u0, nvec, active, v);
    }
    STAMP(4);
#pragma unroll
    for (int r = 0; r < GQ_ROWS; r++) {""")
rep("        quantize_x8<BITS == 4>(sact, 32, aq + 8 * b, ad + b, as16 + 2 * b, lane, 32);\n", "        quantize_x8<BITS == 4>(sact, 32, aq + 8 * b, ad + b, as16 + 2 * b, lane, 32);\n        STAMP(5);\n")
# down: 0 start, 1 weights asked for (the ids are back), 2 after the wait, 3 activations staged,
# 4 products done, 5 end.
rep("    extern __shared__ int sq[];\n", "    extern __shared__ int sq[];\n    TL_BEGIN(2);\n")
rep("""        if (p0 == 0) {
            // Stage every slot's activations while the first weight loads are in flight.
            pdl_wait();
            pdl_trigger();""", """        if (p0 == 0) STAMP(1);
        if (p0 == 0) {
            // Stage every slot's activations while the first weight loads are in flight.
            pdl_wait();
            pdl_trigger();
            STAMP(2);""")
rep("            stage(ss, as16 + t * k * sn, k * sn * 4);\n            __syncthreads();\n", "            stage(ss, as16 + t * k * sn, k * sn * 4);\n            __syncthreads();\n            STAMP(3);\n")
rep("    total = warp_sum(total);\n    if (lane == 0 && row_ok) out[t * hidden + row] = total;\n}\n", "    STAMP(4);\n    total = warp_sum(total);\n    if (lane == 0 && row_ok) out[t * hidden + row] = total;\n    STAMP(5);\n}\n")
rep("\n#if __CUDA_ARCH__ >= 900\n// The residual add and RMS norm", "\n#if 1\n// The residual add and RMS norm")
open(os.path.join(out, "moe_stamped.cu"), "w").write(src)
