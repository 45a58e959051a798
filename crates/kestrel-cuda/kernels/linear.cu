// Linear layers out[t, o] = x[t, :] . W[o, :] over dense (f32, bf16, f16) and MLX-quantised
// (4- and 8-bit) weights, and the embedding gather from either kind of table.
// Linear: one warp per output row, blocks of 8 warps; grid.y covers tokens TOKENS at a time,
// each weight row is streamed once per block and reused for those tokens.
#include "kestrel.cuh"

#define TOKENS 8

template <typename W>
__device__ void linear_dense(const float* x, const W* w, float* out, unsigned tokens, unsigned in_dim,
                             unsigned out_dim) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned o = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const unsigned t0 = blockIdx.y * TOKENS;
    if (o >= out_dim) return;
    const unsigned nt = min((unsigned)TOKENS, tokens - t0);
    const W* row = w + (size_t)o * in_dim;
    float acc[TOKENS];
#pragma unroll
    for (int t = 0; t < TOKENS; t++) acc[t] = 0.0f;
    for (unsigned i = lane; i < in_dim; i += 32) {
        const float wv = to_f32(row[i]);
#pragma unroll
        for (int t = 0; t < TOKENS; t++)
            if (t < nt) acc[t] += wv * x[(size_t)(t0 + t) * in_dim + i];
    }
#pragma unroll
    for (int t = 0; t < TOKENS; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) out[(size_t)(t0 + t) * out_dim + o] = s;
    }
}

template <int BITS>
__device__ void linear_quant(const float* x, const unsigned* words, const bf16* scales, const bf16* biases,
                             float* out, unsigned tokens, unsigned in_dim, unsigned out_dim, unsigned group) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned o = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const unsigned t0 = blockIdx.y * TOKENS;
    if (o >= out_dim) return;
    const unsigned nt = min((unsigned)TOKENS, tokens - t0);
    constexpr unsigned VPW = 32 / BITS, MASK = (1u << BITS) - 1u;
    const unsigned n_words = in_dim / VPW, groups = in_dim / group;
    const unsigned* row = words + (size_t)o * n_words;
    float acc[TOKENS];
#pragma unroll
    for (int t = 0; t < TOKENS; t++) acc[t] = 0.0f;
    for (unsigned wi = lane; wi < n_words; wi += 32) {
        const unsigned word = row[wi];
        const unsigned c0 = wi * VPW;
        const float s = to_f32(scales[(size_t)o * groups + c0 / group]);
        const float b = to_f32(biases[(size_t)o * groups + c0 / group]);
        float wv[VPW];
#pragma unroll
        for (unsigned j = 0; j < VPW; j++) wv[j] = (float)((word >> (BITS * j)) & MASK) * s + b;
#pragma unroll
        for (int t = 0; t < TOKENS; t++) {
            if (t < nt) {
                const float* xt = x + (size_t)(t0 + t) * in_dim + c0;
#pragma unroll
                for (unsigned j = 0; j < VPW; j++) acc[t] += wv[j] * xt[j];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TOKENS; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) out[(size_t)(t0 + t) * out_dim + o] = s;
    }
}

#define DENSE(W, NAME)                                                                                      \
    extern "C" __global__ void linear_##NAME(const float* x, const W* w, float* out, unsigned tokens,       \
                                             unsigned in_dim, unsigned out_dim) {                           \
        linear_dense(x, w, out, tokens, in_dim, out_dim);                                                   \
    }                                                                                                       \
    extern "C" __global__ void embed_##NAME(const W* table, const unsigned* ids, float* out, unsigned hidden, \
                                            unsigned vocab) {                                                \
        const size_t t = blockIdx.x;                                                                        \
        const unsigned id = ids[t];                                                                         \
        if (id >= vocab) return;                                                                            \
        for (unsigned i = threadIdx.x; i < hidden; i += blockDim.x)                                         \
            out[t * hidden + i] = to_f32(table[(size_t)id * hidden + i]);                                   \
    }

DENSE(float, f32)
DENSE(bf16, bf16)
DENSE(f16, f16)

#define QUANT(BITS)                                                                                         \
    extern "C" __global__ void linear_q##BITS(const float* x, const unsigned* w, const bf16* scales,        \
                                              const bf16* biases, float* out, unsigned tokens,              \
                                              unsigned in_dim, unsigned out_dim, unsigned group) {          \
        linear_quant<BITS>(x, w, scales, biases, out, tokens, in_dim, out_dim, group);                      \
    }                                                                                                       \
    extern "C" __global__ void embed_q##BITS(const unsigned* w, const bf16* scales, const bf16* biases,     \
                                             const unsigned* ids, float* out, unsigned hidden,              \
                                             unsigned vocab, unsigned group) {                               \
        constexpr unsigned VPW = 32 / BITS, MASK = (1u << BITS) - 1u;                                       \
        const size_t t = blockIdx.x;                                                                        \
        const unsigned id = ids[t];                                                                         \
        if (id >= vocab) return;                                                                            \
        const unsigned* row = w + (size_t)id * (hidden / VPW);                                              \
        const size_t g0 = (size_t)id * (hidden / group);                                                    \
        for (unsigned c = threadIdx.x; c < hidden; c += blockDim.x) {                                       \
            const unsigned q = (row[c / VPW] >> (BITS * (c % VPW))) & MASK;                                 \
            out[t * hidden + c] = (float)q * to_f32(scales[g0 + c / group]) + to_f32(biases[g0 + c / group]); \
        }                                                                                                   \
    }

QUANT(4)
QUANT(8)

// One-token matvec with 16-byte weight loads. Persistent blocks: each stages x in shared memory
// once (padded, pre-scaled; quantised formats also a plain copy), then its warps walk tiles of
// VEC_ROWS rows, VEC_WARPS * gridDim.x tiles apart. Requires in_dim to be a multiple of the
// vector width and rows 16-byte aligned.
#define VEC_WARPS 4
#define VEC_ROWS 4

template <int BITS>
__device__ void matvec(const float* x, const void* w, const bf16* scales, const bf16* biases, float* out,
                       unsigned in_dim, unsigned out_dim, unsigned group) {
    extern __shared__ float xs[];
    float* xs_plain = xs + padded_len(in_dim);
    if constexpr (BITS != 16)
        for (unsigned i = threadIdx.x; i < in_dim; i += blockDim.x) xs_plain[padded(i)] = x[i];
    stage_x<BITS>(x, xs, in_dim);
    const unsigned lane = threadIdx.x % 32;
    const unsigned tiles = (out_dim + VEC_ROWS - 1) / VEC_ROWS;
    for (unsigned tile = blockIdx.x * VEC_WARPS + threadIdx.x / 32; tile < tiles; tile += gridDim.x * VEC_WARPS) {
        const unsigned row0 = tile * VEC_ROWS;
        float acc[VEC_ROWS];
#pragma unroll
        for (int r = 0; r < VEC_ROWS; r++) acc[r] = 0.0f;
        rows_dot<BITS, VEC_ROWS>(w, scales, biases, row0, out_dim, xs, xs_plain, in_dim, group, acc);
#pragma unroll
        for (int r = 0; r < VEC_ROWS; r++) {
            const float s = warp_sum(acc[r]);
            if (lane == 0 && row0 + r < out_dim) out[row0 + r] = s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * VEC_WARPS, 8) matvec_bf16(const float* x, const bf16* w, float* out, unsigned in_dim, unsigned out_dim) {
    matvec<16>(x, w, nullptr, nullptr, out, in_dim, out_dim, 1);
}



// ---- one-token quantised matvec on 8-bit integer dot products ----
// x is quantised to int8 in blocks of 32 (d = max|x| / 127, xq = round(x / d)), keeping each
// block's d and exact sum; a 4-bit weight word then costs two masks and two dp4a for its 8
// values (against three float instructions per value), at the price of x's 8-bit rounding.
// For 4-bit weights each 8 values of x are stored as [x0 x2 x4 x6][x1 x3 x5 x7], matching the
// low and high nibbles of a weight word; for 8-bit weights in order.

// One warp per block of 32 values; n is a multiple of 32.
extern "C" __global__ void quantize_x8_f32(const float* x, int* xq, float* xd, float* xsum, unsigned n,
                                           int nibble_order) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned block = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (block * 32 >= n) return;
    const float v = x[block * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float sum = warp_sum(v);
    const float d = amax / 127.0f;
    const int q = d > 0.0f ? __float2int_rn(v / d) : 0;
    // Destination byte of value `lane` inside the block's 32 bytes.
    unsigned pos = lane;
    if (nibble_order) {
        const unsigned j = lane % 8;
        pos = (lane / 8) * 8 + (j % 2) * 4 + j / 2;
    }
    reinterpret_cast<signed char*>(xq)[block * 32 + pos] = (signed char)q;
    if (lane == 0) {
        xd[block] = d;
        xsum[block] = sum;
    }
}

__device__ __forceinline__ int dp4a_us(unsigned a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

#define DP_WARPS 4
#define DP_ROWS 4

// Persistent like `matvec`: the block stages xq, d and sums in shared memory, its warps walk
// tiles of DP_ROWS rows. One 16-byte weight vector is one 32-value block of x.
template <int BITS>
__device__ void matvec_dp4a(const int* xq, const float* xd, const float* xsum, const unsigned* w,
                            const bf16* scales, const bf16* biases, float* out, unsigned in_dim, unsigned out_dim,
                            unsigned group) {
    extern __shared__ int sq[];  // in_dim / 4 ints, then in_dim / 32 floats d, then sums
    float* sd = reinterpret_cast<float*>(sq + in_dim / 4);
    float* ss = sd + in_dim / 32;
    for (unsigned i = threadIdx.x; i < in_dim / 4; i += blockDim.x) sq[i] = xq[i];
    for (unsigned i = threadIdx.x; i < in_dim / 32; i += blockDim.x) {
        sd[i] = xd[i];
        ss[i] = xsum[i];
    }
    __syncthreads();
    constexpr unsigned VALS = 128 / BITS;       // values per 16-byte weight vector
    constexpr unsigned XBLOCKS = VALS / 32;     // x blocks per vector: 1 (4-bit) or 0.5 (8-bit)
    const unsigned lane = threadIdx.x % 32;
    const unsigned nvec = in_dim / VALS, groups = in_dim / group;
    const uint4* W = reinterpret_cast<const uint4*>(w);
    const unsigned tiles = (out_dim + DP_ROWS - 1) / DP_ROWS;
    for (unsigned tile = blockIdx.x * DP_WARPS + threadIdx.x / 32; tile < tiles; tile += gridDim.x * DP_WARPS) {
        const unsigned row0 = tile * DP_ROWS;
        float acc[DP_ROWS];
#pragma unroll
        for (int r = 0; r < DP_ROWS; r++) acc[r] = 0.0f;
        for (unsigned u0 = lane; u0 < nvec; u0 += 64) {
            uint4 v[2][DP_ROWS];
#pragma unroll
            for (unsigned i = 0; i < 2; i++)
#pragma unroll
                for (int r = 0; r < DP_ROWS; r++)
                    if (u0 + 32 * i < nvec && row0 + r < out_dim) v[i][r] = __ldcs(W + (size_t)(row0 + r) * nvec + u0 + 32 * i);
#pragma unroll
            for (unsigned i = 0; i < 2; i++) {
                const unsigned u = u0 + 32 * i;
                if (u >= nvec) break;
                // x of this vector: 32 (4-bit) or 16 (8-bit) int8 values.
                const int4 xa = reinterpret_cast<const int4*>(sq)[u * VALS / 16];
                const int4 xb = BITS == 4 ? reinterpret_cast<const int4*>(sq)[u * VALS / 16 + 1] : xa;
                const unsigned xblock = BITS == 4 ? u : u / 2;
                const float d = sd[xblock];
                // The sum of x over this vector's values (half a block for 8-bit: computed from xq).
                const unsigned g = (u * VALS) / group;
#pragma unroll
                for (int r = 0; r < DP_ROWS; r++) {
                    if (row0 + r >= out_dim) continue;
                    const unsigned words[4] = {v[i][r].x, v[i][r].y, v[i][r].z, v[i][r].w};
                    int isum = 0;
                    if constexpr (BITS == 4) {
                        const int xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                        for (int q = 0; q < 4; q++) {
                            isum = dp4a_us(words[q] & 0x0F0F0F0Fu, xs[2 * q], isum);
                            isum = dp4a_us((words[q] >> 4) & 0x0F0F0F0Fu, xs[2 * q + 1], isum);
                        }
                    } else {
                        const int xs[4] = {xa.x, xa.y, xa.z, xa.w};
#pragma unroll
                        for (int q = 0; q < 4; q++) isum = dp4a_us(words[q], xs[q], isum);
                    }
                    const size_t gi = (size_t)(row0 + r) * groups + g;
                    const float sx = BITS == 4 ? ss[xblock] : 0.0f;
                    acc[r] += to_f32(scales[gi]) * d * (float)isum + (BITS == 4 ? to_f32(biases[gi]) * sx : 0.0f);
                }
            }
        }
        // 8-bit: biases apply to whole groups; add bias * sum(x over the group) once per group.
        if constexpr (BITS == 8) {
            for (unsigned g = lane; g < groups; g += 32) {
                float sx = 0.0f;
                for (unsigned b = 0; b < group / 32; b++) sx += ss[g * (group / 32) + b];
#pragma unroll
                for (int r = 0; r < DP_ROWS; r++)
                    if (row0 + r < out_dim) acc[r] += to_f32(biases[(size_t)(row0 + r) * groups + g]) * sx;
            }
        }
#pragma unroll
        for (int r = 0; r < DP_ROWS; r++) {
            const float s = warp_sum(acc[r]);
            if (lane == 0 && row0 + r < out_dim) out[row0 + r] = s;
        }
        (void)XBLOCKS;
    }
}

extern "C" __global__ void __launch_bounds__(32 * DP_WARPS, 8)
    matvec_q4_dp4a(const int* xq, const float* xd, const float* xsum, const unsigned* w, const bf16* scales,
                   const bf16* biases, float* out, unsigned in_dim, unsigned out_dim, unsigned group) {
    matvec_dp4a<4>(xq, xd, xsum, w, scales, biases, out, in_dim, out_dim, group);
}

extern "C" __global__ void __launch_bounds__(32 * DP_WARPS, 8)
    matvec_q8_dp4a(const int* xq, const float* xd, const float* xsum, const unsigned* w, const bf16* scales,
                   const bf16* biases, float* out, unsigned in_dim, unsigned out_dim, unsigned group) {
    matvec_dp4a<8>(xq, xd, xsum, w, scales, biases, out, in_dim, out_dim, group);
}
