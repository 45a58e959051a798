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
// x is quantised to int8 (see kestrel.cuh): a 4-bit weight word then costs two masks and two dp4a
// for its 8 values (against three float instructions per value), at the price of x's 8-bit
// rounding.

// One warp per block of 32 values (total a multiple of 32): writes the int8 values, one scale per
// 32 and the sum of the rounded values per 16.
extern "C" __global__ void quantize_x8_f32(const float* x, int* xq, float* xd, float* xs16, unsigned total,
                                           int nibble_order) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned block = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (block * 32 >= total) return;
    const float v = x[block * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = d > 0.0f ? __float2int_rn(v / d) : 0;
    // The sum of the rounded values (not of x): with it the bias term rounds like the weight term,
    // and the large offset of unsigned quantised weights cancels as it does in (q s + b) . x.
    int half = q;
    for (int o = 8; o > 0; o >>= 1) half += __shfl_xor_sync(0xffffffffu, half, o);  // lanes 0-15 / 16-31
    unsigned pos = lane;  // destination byte of value `lane` in the block's 32 bytes
    if (nibble_order) {
        const unsigned j = lane % 8;
        pos = (lane / 8) * 8 + (j % 2) * 4 + j / 2;
    }
    reinterpret_cast<signed char*>(xq)[block * 32 + pos] = (signed char)q;
    if (lane == 0) xd[block] = d;
    if (lane % 16 == 0) xs16[block * 2 + lane / 16] = d * (float)half;
}

#define DP_WARPS 4
#define DP_ROWS 4

// Persistent like `matvec`: the block stages the int8 x in shared memory, its warps walk tiles of
// DP_ROWS rows, two of each lane's 16-byte vectors per row in flight.
template <int BITS>
__device__ void matvec_dp4a(const int* xq, const float* xd, const float* xs16, const unsigned* w,
                            const bf16* scales, const bf16* biases, float* out, unsigned in_dim, unsigned out_dim,
                            unsigned group) {
    extern __shared__ int sq[];  // in_dim / 4 ints, in_dim / 32 scales, in_dim / 16 sums
    float* sd = reinterpret_cast<float*>(sq + in_dim / 4);
    float* ss = sd + in_dim / 32;
    for (unsigned i = threadIdx.x; i < in_dim / 4; i += blockDim.x) sq[i] = xq[i];
    for (unsigned i = threadIdx.x; i < in_dim / 32; i += blockDim.x) sd[i] = xd[i];
    for (unsigned i = threadIdx.x; i < in_dim / 16; i += blockDim.x) ss[i] = xs16[i];
    __syncthreads();
    const QuantX x{sq, sd, ss};
    constexpr unsigned VALS = 128 / BITS;
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
                const unsigned g = (u * VALS) / group;
                const XSeg<BITS> xs = x_segment<BITS>(x, u);
#pragma unroll
                for (int r = 0; r < DP_ROWS; r++) {
                    if (row0 + r >= out_dim) continue;
                    const size_t gi = (size_t)(row0 + r) * groups + g;
                    acc[r] += dot_int8<BITS>(v[i][r], xs, to_f32(scales[gi]), to_f32(biases[gi]));
                }
            }
        }
#pragma unroll
        for (int r = 0; r < DP_ROWS; r++) {
            const float s = warp_sum(acc[r]);
            if (lane == 0 && row0 + r < out_dim) out[row0 + r] = s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * DP_WARPS, 8)
    matvec_q4_dp4a(const int* xq, const float* xd, const float* xs16, const unsigned* w, const bf16* scales,
                   const bf16* biases, float* out, unsigned in_dim, unsigned out_dim, unsigned group) {
    matvec_dp4a<4>(xq, xd, xs16, w, scales, biases, out, in_dim, out_dim, group);
}

extern "C" __global__ void __launch_bounds__(32 * DP_WARPS, 8)
    matvec_q8_dp4a(const int* xq, const float* xd, const float* xs16, const unsigned* w, const bf16* scales,
                   const bf16* biases, float* out, unsigned in_dim, unsigned out_dim, unsigned group) {
    matvec_dp4a<8>(xq, xd, xs16, w, scales, biases, out, in_dim, out_dim, group);
}
