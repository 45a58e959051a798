// Output-head selections on the GPU, so decode reads back a few bytes: argmax and top-k per row
// (one block per row, or for argmax of long rows many blocks and a second pass; the lower index
// wins ties). Top-k takes k rounds, each selecting the
// largest element ordered after the previous pick in (value descending, index ascending).
#include "kestrel.cuh"

// Is (v, i) before (bv, bi) in (value descending, index ascending) order?
__device__ __forceinline__ bool before(float v, unsigned i, float bv, unsigned bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index) of the per-thread candidates; every thread gets it.
__device__ void block_best(float& v, unsigned& i) {
    __shared__ float sv[32];
    __shared__ unsigned si[32];
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) { sv[threadIdx.x / 32] = v; si[threadIdx.x / 32] = i; }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (unsigned w = 1; w < blockDim.x / 32; w++)
        if (before(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
}

extern "C" __global__ void argmax_f32(const float* logits, unsigned* out, unsigned cols) {
    pdl_begin();
    const float* row = logits + (size_t)blockIdx.x * cols;
    float bv = -INFINITY;
    unsigned bi = 0xffffffffu;
    for (unsigned c = threadIdx.x; c < cols; c += blockDim.x)
        if (before(row[c], c, bv, bi)) { bv = row[c]; bi = c; }
    block_best(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

// Argmax of long rows in two launches: argmax_partial_f32 (grid (parts, rows)) leaves the best
// (value, index) of each `chunk` columns of a row; argmax_final_f32 (one block per row) picks the
// best of a row's parts. The order is the same total order, so the result is argmax_f32's.
extern "C" __global__ void argmax_partial_f32(const float* logits, float* part_v, unsigned* part_i, unsigned cols,
                                              unsigned chunk) {
    pdl_begin();
    const float* row = logits + (size_t)blockIdx.y * cols;
    const unsigned c0 = blockIdx.x * chunk, c1 = min(cols, c0 + chunk);
    float bv = -INFINITY;
    unsigned bi = 0xffffffffu;
    for (unsigned c = c0 + threadIdx.x; c < c1; c += blockDim.x)
        if (before(row[c], c, bv, bi)) { bv = row[c]; bi = c; }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        part_v[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = bv;
        part_i[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

extern "C" __global__ void argmax_final_f32(const float* part_v, const unsigned* part_i, unsigned* out,
                                            unsigned parts) {
    pdl_begin();
    const size_t base = (size_t)blockIdx.x * parts;
    float bv = -INFINITY;
    unsigned bi = 0xffffffffu;
    for (unsigned p = threadIdx.x; p < parts; p += blockDim.x)
        if (before(part_v[base + p], part_i[base + p], bv, bi)) { bv = part_v[base + p]; bi = part_i[base + p]; }
    block_best(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

extern "C" __global__ void top_k_f32(const float* logits, unsigned* ids, float* values, unsigned cols, unsigned k) {
    pdl_begin();
    const float* row = logits + (size_t)blockIdx.x * cols;
    float lv = INFINITY;  // the previous pick; unused before the first round
    unsigned li = 0;
    bool first = true;
    for (unsigned j = 0; j < k; j++) {
        float bv = -INFINITY;
        unsigned bi = 0xffffffffu;
        for (unsigned c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = row[c];
            const bool after_last = first || before(lv, li, v, c);
            if (after_last && before(v, c, bv, bi)) { bv = v; bi = c; }
        }
        block_best(bv, bi);
        if (threadIdx.x == 0) {
            ids[(size_t)blockIdx.x * k + j] = bi;
            values[(size_t)blockIdx.x * k + j] = bv;
        }
        lv = bv;
        li = bi;
        first = false;
    }
}
