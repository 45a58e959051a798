// decode-ceiling.cu: what the dependency structure of the two decode ops costs on this GPU before
// any arithmetic. Each op is rebuilt as a skeleton that keeps every dependency of the real
// kernels (what must be read after the programmatic wait, what one block must learn from the
// others) and the real byte counts, with the least arithmetic that still uses every byte. A
// kernel with that structure and real arithmetic can only take longer than its skeleton.
//
// Measured on NVIDIA H200s on 2026-11-22 at commit 7d21c14 (four runs on three machines; the
// real kernels it is compared with were measured at 404de41). Results: docs/perf-log.md, "What
// the decode ops' dependencies cost before any arithmetic (2026-11-22)".
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o decode-ceiling scripts/experiments/decode-ceiling.cu
//   ./decode-ceiling
//
// Decode attention, 8,192 cached tokens, 4 KV heads of 8 query heads each, head dim 128, bf16
// (16.8 MB of K and V): a grid of one wave, each block one (split of the keys, KV head). Its K
// and V rows are loaded into registers before the wait (as the real kernel streams the rows
// earlier runs wrote); after it, q (which the kernel before writes), a sum of every loaded
// value times q, one block barrier, the block's record (for each of 8 heads 128 + 2 floats,
// padded to 132, as the real kernel writes) to memory, a count of the KV head's records, and
// once all are in, each block merges a share of the output from every split's records, a lane
// per split.
//
// MoE decode, top-8 of 128 experts, hidden 2048, expert width 768, 4-bit in groups of 64 with
// bf16 scales and biases (the 21.2 MB of 8 experts): three kernels as the real op runs.
//   route:   a cluster of 8 blocks, the router's 8-bit rows (with scales and biases) loaded before
//            the wait; after it a piece of x, a sum per row, the 128 sums gathered in block 0
//            through distributed shared memory and the top 8 taken by one warp (8 rounds of a
//            warp argmax), ids and weights written.
//   gate/up: a warp for 2 rows of gate and of up of one slot: after the wait, the slot's id and
//            a piece of x, then the rows (with scales and biases); silu(gate) * up written.
//   down:    a warp per output row, its 8 x 24 (slot, vector) pairs over the lanes; ids and the
//            rows loaded before the wait (the router finished before gate/up's wait let this
//            kernel start), a piece of the activations after it, the weighted sum written.
// Every loaded vector is only summed (as the attention skeleton sums its rows): a first version
// with the real products on f32 x took longer than the real kernels (28.6 µs alone with the
// router), so it bounded nothing.
// "no router" runs gate/up and down on ids written once before (what the experts alone allow).
//
// Timing as `kestrel bench ops` times an op: CUDA events around one graph replay after 256 MB of
// other memory was read (L2 flushed), median of 50 replays after 10. "alone": one op in the
// graph; "4 layers": four chained (each over its own bytes, the output of one the input of the
// next, programmatic launches), per layer. Results: docs/perf-log.md (above).
// The host half is left out when NVRTC compiles the file, so `scripts/gpu/nvrtc-check.py
// --include scripts/experiments` checks the kernels without a GPU (with CCCL's include folder
// too, for cooperative_groups' nv/target).
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "cuda-bench.cuh"

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace cg = cooperative_groups;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- decode attention ----
constexpr unsigned HD = 128, GROUP = 8, KV_HEADS = 4, CTX = 8192, ROW16 = HD * 2 / 16;  // uint4s a row
constexpr unsigned REC = GROUP * (HD + 4);  // floats of a record: acc, then max and sum (padded)

// Grid (splits, KV_HEADS), 512 threads; LOADS uint4s a thread in flight.
template <int LOADS, int PER_SM>
__global__ void __launch_bounds__(512, PER_SM)
    attention(const uint4* k, const uint4* v, const float* q, float* rec, unsigned* counters, float* out) {
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned splits = gridDim.x, split = blockIdx.x, h = blockIdx.y;
    const unsigned chunk = (CTX + splits - 1) / splits, key0 = min(split * chunk, CTX), keys = min(chunk, CTX - key0);
    const unsigned nk = keys * ROW16;  // uint4s of K (and of V) this block reads
    const uint4* kb = k + ((size_t)h * CTX + key0) * ROW16;
    const uint4* vb = v + ((size_t)h * CTX + key0) * ROW16;
    uint4 d[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; j++) {
        const unsigned i = tid + j * 512;
        d[j] = i < nk ? __ldcs(kb + i) : i < 2 * nk ? __ldcs(vb + i - nk) : make_uint4(0, 0, 0, 0);
    }
    wait_prev();
    let_next();
    const float* qh = q + h * GROUP * HD;
    const float qv = __ldcg(qh + tid) + __ldcg(qh + tid + 512);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < LOADS; j++) s += sum4(d[j]);
    for (unsigned i = tid + LOADS * 512; i < 2 * nk; i += 512) s += sum4(__ldcs(i < nk ? kb + i : vb + i - nk));
    s *= qv * 1e-30f;

    __shared__ float red[512];
    red[tid] = s;
    __syncthreads();
    float* recs = rec + (size_t)h * splits * REC;
    for (unsigned i = tid; i < REC; i += 512) recs[(size_t)split * REC + i] = red[i % 512] + red[(i * 7) % 512];
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        atomicAdd(counters + 2 * h, 1u);
        while (*reinterpret_cast<volatile unsigned*>(counters + 2 * h) < splits) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
    // A warp per float4 of the output, a lane per split.
    constexpr unsigned PIECES = REC / 4;
    const unsigned share = (PIECES + splits - 1) / splits, first = split * share, last = min(first + share, PIECES);
    for (unsigned p = first + warp; p < last; p += 16) {
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (unsigned s2 = lane; s2 < splits; s2 += 32) {
            const float4 y = __ldcg(reinterpret_cast<const float4*>(recs + (size_t)s2 * REC) + p);
            a.x += y.x;
            a.y += y.y;
            a.z += y.z;
            a.w += y.w;
        }
        a.x = warp_sum(a.x);
        a.y = warp_sum(a.y);
        a.z = warp_sum(a.z);
        a.w = warp_sum(a.w);
        if (lane == 0 && p < GROUP * HD / 4) reinterpret_cast<float4*>(out + h * GROUP * HD)[p] = a;
    }
    if (tid == 0 && atomicAdd(counters + 2 * h + 1, 1u) == splits - 1) {
        counters[2 * h] = 0;
        counters[2 * h + 1] = 0;
    }
}

#ifdef __CUDACC_RTC__
template __global__ void attention<16, 1>(const uint4*, const uint4*, const float*, float*, unsigned*, float*);
template __global__ void attention<8, 2>(const uint4*, const uint4*, const float*, float*, unsigned*, float*);
template __global__ void attention<4, 4>(const uint4*, const uint4*, const float*, float*, unsigned*, float*);
#endif

// ---- MoE decode ----
constexpr unsigned HID = 2048, INTER = 768, EXPERTS = 128, TOPK = 8, GSZ = 64;
constexpr size_t MAT_W = (size_t)INTER * HID / 2, MAT_S = (size_t)INTER * HID / GSZ * 2;  // bytes
constexpr size_t MAT = MAT_W + 2 * MAT_S, SPAN = 3 * MAT;  // gate, up, down; each weights, scales, biases
constexpr size_t ROUTER = (size_t)EXPERTS * HID + 2 * (size_t)EXPERTS * (HID / GSZ) * 2;

// A 4-byte word of scales or biases as a small float (used, never mind its meaning).
__device__ __forceinline__ float word(unsigned w) { return __uint_as_float(w & 0x3fffffffu); }

// Cluster of 8 blocks of 16 warps: warp w of block b takes router row b * 16 + w (2048 8-bit
// values: 4 vectors a lane, with one word of the row's 128 bytes of scales and biases).
__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512)
    route(const unsigned char* router, const float* x, unsigned* ids, float* weights) {
    __shared__ float logits[16];
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32, row = blockIdx.x * 16 + warp;
    const uint4* w = reinterpret_cast<const uint4*>(router) + (size_t)row * (HID / 16);
    const unsigned* sb = reinterpret_cast<const unsigned*>(router + (size_t)EXPERTS * HID);
    uint4 v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = __ldcs(w + lane + 32 * i);
    const unsigned g = __ldcs(sb + row * 32 + lane);
    wait_prev();
    let_next();
    const float4 xv = __ldcg(reinterpret_cast<const float4*>(x) + tid);
    float acc = word(g);
#pragma unroll
    for (int i = 0; i < 4; i++) acc += sum4(v[i]);
    acc = warp_sum(acc * (xv.x + xv.y + xv.z + xv.w));
    if (lane == 0) logits[warp] = acc;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    if (blockIdx.x == 0 && warp == 0) {
        float l[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const unsigned e = lane * 4 + i;
            l[i] = *cluster.map_shared_rank(logits + e % 16, e / 16);
            if (!(l[i] == l[i])) l[i] = -INFINITY;
        }
        float chosen = 0.0f, first = 0.0f;
        for (unsigned j = 0; j < TOPK; j++) {
            float best = -INFINITY;
            unsigned bi = 0xffffffffu;
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (l[i] > best || (l[i] == best && lane * 4 + i < bi)) best = l[i], bi = lane * 4 + i;
#pragma unroll
            for (int o = 16; o > 0; o /= 2) {
                const float ob = __shfl_xor_sync(0xffffffffu, best, o);
                const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ob > best || (ob == best && oi < bi)) best = ob, bi = oi;
            }
            if (j == 0) first = best;
            const float wgt = best == -INFINITY ? 0.0f : __expf(best - first);
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (bi == lane * 4 + i) l[i] = -INFINITY;
            if (lane == j) {
                ids[j] = bi == 0xffffffffu ? j : bi;
                chosen = wgt;
            }
        }
        const float total = warp_sum(lane < TOPK ? chosen : 0.0f);
        if (lane < TOPK) weights[lane] = chosen / total;
    }
    cluster.sync();  // block 0 has read every block's logits
}

// Grid (INTER / (8 * 2), TOPK), 8 warps of 2 rows of gate and of up of one slot: a row is 64
// vectors (2 a lane) and 128 bytes of scales and biases (a word a lane).
__global__ void __launch_bounds__(256)
    gate_up(const unsigned char* experts, const unsigned* ids, const float* x, float* act) {
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32, slot = blockIdx.y;
    const unsigned row0 = (blockIdx.x * 8 + warp) * 2;
    wait_prev();
    let_next();
    const float xv = __ldcg(x + tid * (HID / 256));
    const unsigned char* sp = experts + (size_t)__ldcg(ids + slot) * SPAN;
    uint4 v[2][2][2];  // [gate/up][row][vector]
    unsigned g[2][2];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
#pragma unroll
            for (int i = 0; i < 2; i++)
                v[m][r][i] = __ldcs(reinterpret_cast<const uint4*>(sp + m * MAT) + (size_t)(row0 + r) * (HID / 32) +
                                    lane + 32 * i);
            g[m][r] = __ldcs(reinterpret_cast<const unsigned*>(sp + m * MAT + MAT_W) + (row0 + r) * 32 + lane);
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float gv = warp_sum((sum4(v[0][r][0]) + sum4(v[0][r][1])) * xv + word(g[0][r]));
        const float uv = warp_sum((sum4(v[1][r][0]) + sum4(v[1][r][1])) * xv + word(g[1][r]));
        if (lane == 0) act[slot * INTER + row0 + r] = gv / (1.0f + __expf(-gv)) * uv;
    }
}

// A warp per output row, 8 warps a block: the row's 8 x 24 (slot, vector) pairs, 6 a lane, and
// its 8 x 48 bytes of scales and biases, 3 words a lane.
__global__ void __launch_bounds__(256)
    down(const unsigned char* experts, const unsigned* ids, const float* weights, const float* act, float* out) {
    const unsigned tid = threadIdx.x, lane = tid % 32, row = blockIdx.x * 8 + tid / 32;
    constexpr unsigned NV = INTER / 32, PAIRS = TOPK * NV / 32, WORDS = INTER / GSZ;  // 24, 6, 12
    uint4 v[PAIRS];
    float gate[PAIRS];
    unsigned g[3];
#pragma unroll
    for (int i = 0; i < PAIRS; i++) {
        const unsigned p = lane + 32 * i, j = p / NV, u = p % NV;
        const unsigned char* mp = experts + (size_t)__ldcg(ids + j) * SPAN + 2 * MAT;
        v[i] = __ldcs(reinterpret_cast<const uint4*>(mp) + (size_t)row * NV + u);
        gate[i] = __ldcg(weights + j);
    }
#pragma unroll
    for (int i = 0; i < 3; i++) {
        const unsigned e = lane + 32 * i, j = e / WORDS;
        const unsigned char* mp = experts + (size_t)__ldcg(ids + j) * SPAN + 2 * MAT + MAT_W;
        g[i] = __ldcs(reinterpret_cast<const unsigned*>(mp) + row * WORDS + e % WORDS);
    }
    wait_prev();
    let_next();
    float total = word(g[0]) + word(g[1]) + word(g[2]);
#pragma unroll
    for (int i = 0; i < PAIRS; i++) {
        const unsigned p = lane + 32 * i, j = p / NV, u = p % NV;
        total += gate[i] * sum4(v[i]) * __ldcg(act + j * INTER + u * 32 + lane % 32);
    }
    total = warp_sum(total);
    if (lane == 0) out[row] = total * 1e-6f;
}

// Bytes that read as small finite bf16s and floats (every high byte 0x3c).
__global__ void fill(unsigned* p, size_t n, unsigned seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = (h & 0x00ff00ffu) | 0x3c003c00u;
    }
}

#ifndef __CUDACC_RTC__
void report(const char* what, double us, double bytes, double target) {
    printf("%-46s %7.2f us  %5.0f GB/s  %5.1f%% of 4.26 TB/s  (60%% is %.2f us)\n", what, us, bytes / us / 1e3,
           bytes / us / 1e3 / 4260 * 100, target);
}

template <int LOADS, int PER_SM>
void attention_row(ColdTimer& t, uint4** kv, float** qs, float* rec, unsigned* counters) {
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attention<LOADS, PER_SM>, 512, 0));
    if (per_sm < PER_SM) {
        printf("attention, %d blocks an SM: only %d fit, skipped\n", PER_SM, per_sm);
        return;
    }
    const unsigned splits = t.sms * PER_SM / KV_HEADS;
    const size_t half = (size_t)KV_HEADS * CTX * ROW16;
    const double bytes = 2.0 * half * 16;
    for (int chain : {1, 4}) {
        const double us = t.graph_median_us(
            [&] {
                for (int c = 0; c < chain; c++)
                    launch_pdl(t.st, c > 0, dim3(splits, KV_HEADS), dim3(512), 0, attention<LOADS, PER_SM>,
                           (const uint4*)kv[c], (const uint4*)(kv[c] + half), (const float*)qs[c],
                           rec + (size_t)c * KV_HEADS * splits * REC, counters + 8 * c, qs[c + 1]);
            },
            chain);
        char what[96];
        snprintf(what, sizeof what, "attention, %u splits a head, %s", splits, chain == 1 ? "alone" : "4 layers, per layer");
        report(what, us, bytes, bytes / 0.6 / 4.26e6);
    }
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    ColdTimer t;
    printf("%s, %d SMs\n", prop.name, t.sms);

    // Attention: per layer its own K and V, q the previous layer's output.
    const size_t kv_bytes = 2ull * KV_HEADS * CTX * HD * 2;
    uint4* kv[4];
    float* qs[5];
    float* rec;
    unsigned* counters;
    for (int c = 0; c < 4; c++) {
        CK(cudaMalloc(&kv[c], kv_bytes));
        fill<<<1024, 256>>>(reinterpret_cast<unsigned*>(kv[c]), kv_bytes / 4, 10 + c);
    }
    for (auto& q : qs) {
        CK(cudaMalloc(&q, KV_HEADS * GROUP * HD * 4));
        fill<<<16, 256>>>(reinterpret_cast<unsigned*>(q), KV_HEADS * GROUP * HD, 7);
    }
    CK(cudaMalloc(&rec, 4ull * 4 * t.sms * REC * 4));
    CK(cudaMalloc(&counters, 4 * 8 * 4));
    CK(cudaMemset(counters, 0, 4 * 8 * 4));
    printf("\ndecode attention skeleton: %.1f MB of K and V a layer\n", kv_bytes / 1e6);
    attention_row<16, 1>(t, kv, qs, rec, counters);
    attention_row<8, 2>(t, kv, qs, rec, counters);
    attention_row<4, 4>(t, kv, qs, rec, counters);
    CK(cudaDeviceSynchronize());
    for (int c = 0; c < 4; c++) CK(cudaFree(kv[c]));

    // MoE: per layer its own 128 experts and router; x the previous layer's output.
    const size_t ex_bytes = EXPERTS * SPAN;
    unsigned char *ex[4], *router[4];
    float *xs[5], *act, *weights[4];
    unsigned* ids[4];
    for (int c = 0; c < 4; c++) {
        CK(cudaMalloc(&ex[c], ex_bytes));
        fill<<<1024, 256>>>(reinterpret_cast<unsigned*>(ex[c]), ex_bytes / 4, 20 + c);
        CK(cudaMalloc(&router[c], ROUTER));
        fill<<<64, 256>>>(reinterpret_cast<unsigned*>(router[c]), ROUTER / 4, 30 + c);
        CK(cudaMalloc(&ids[c], TOPK * 4));
        CK(cudaMalloc(&weights[c], TOPK * 4));
    }
    for (auto& x : xs) {
        CK(cudaMalloc(&x, HID * 4));
        fill<<<8, 256>>>(reinterpret_cast<unsigned*>(x), HID, 3);
    }
    CK(cudaMalloc(&act, 4 * TOPK * INTER * 4));
    const double moe_bytes = TOPK * 3.0 * MAT;
    printf("\nMoE decode skeleton: %.1f MB of 8 experts a layer (the router's %.2f MB not counted)\n",
           moe_bytes / 1e6, ROUTER / 1e6);
    for (int routed : {1, 0}) {
        if (!routed) {
            // Fixed ids, as the last routed replay left them.
            CK(cudaDeviceSynchronize());
        }
        for (int chain : {1, 4}) {
            const double us = t.graph_median_us(
                [&] {
                    for (int c = 0; c < chain; c++) {
                        if (routed)
                            launch_pdl(t.st, c > 0, dim3(8), dim3(512), 0, route, (const unsigned char*)router[c],
                                   (const float*)xs[c], ids[c], weights[c]);
                        launch_pdl(t.st, routed || c > 0, dim3(INTER / 16, TOPK), dim3(256), 0, gate_up,
                               (const unsigned char*)ex[c], (const unsigned*)ids[c], (const float*)xs[c],
                               act + (size_t)c * TOPK * INTER);
                        launch_pdl(t.st, true, dim3(HID / 8), dim3(256), 0, down, (const unsigned char*)ex[c],
                               (const unsigned*)ids[c], (const float*)weights[c],
                               (const float*)(act + (size_t)c * TOPK * INTER), xs[c + 1]);
                    }
                },
                chain);
            char what[96];
            snprintf(what, sizeof what, "MoE, %s, %s", routed ? "router + experts" : "no router",
                     chain == 1 ? "alone" : "4 layers, per layer");
            report(what, us, moe_bytes, moe_bytes / 0.6 / 4.26e6);
        }
    }
    CK(cudaDeviceSynchronize());
    std::vector<unsigned> h(TOPK);
    CK(cudaMemcpy(h.data(), ids[3], TOPK * 4, cudaMemcpyDeviceToHost));
    printf("last layer's ids:");
    for (unsigned i : h) printf(" %u", i);
    printf("\n");
    return 0;
}
#endif
