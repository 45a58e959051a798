// Shared device helpers, given to every module as the in-memory header "kestrel.cuh":
// conversions, warp and block reductions, activations, L2 prefetches, and
// - 16-byte-vector dot products for matrix-vector work over bf16 rows and MLX-quantised ones
//   (w = q * scale + bias per group): x staged in shared memory (padded, pre-scaled so quantised
//   values become floats without int-to-float conversions, with each vector's plain sum for the
//   biases), rows_dot;
// - int8 activations for quantised products: x rounded per block of 32 (quantize_x8), then
//   dp4a against the weight words (dot_int8);
// - tensor-core helpers: mma.sync m16n8k16 (bf16/f16, f32 accumulators), ldmatrix, cp.async;
// - thread-block cluster helpers (sm_90): rank, barriers, stores into another block's shared
//   memory;
// - counters the blocks of a grid meet at: a release count, an acquire read.
// It includes pdl.cuh (kestrel-cuda-rt's kernels/pdl.cuh): the programmatic-launch primitives
// (pdl_wait, pdl_trigger, pdl_begin) and the contract every op kernel keeps.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef __nv_bfloat16 bf16;
typedef __half f16;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }

// ---- group scales and biases of quantised weights ----
// Plain ones are one bf16 or f32 a group in each of the matrix's scales and biases parts (S bf16
// or float). Factored ones (ScaleType::Factored, a GGUF k-quant's, S Factored) are a signed byte
// pair a group in the scales part and an f32 pair of units a super-block of 256 values in the
// biases part: scale = unit.x * s, bias = unit.y * b, each product exact in f32.
struct __align__(2) Factored {
    signed char s, b;
};
// The type a group's scale and bias are held in once read: float for factored ones.
template <typename S> struct HeldT { using type = S; };
template <> struct HeldT<Factored> { using type = float; };
template <typename S> using Held = typename HeldT<S>::type;
template <typename S> constexpr bool is_factored = false;
template <> constexpr bool is_factored<Factored> = true;

// One row's group scales and biases: `get` gives group gi's (of the row's `groups`), where k is
// the index of any value of the group within the row (a factored group's super-block is k / 256).
template <typename S>
struct GroupRow {
    const S* s;
    const S* b;
    __device__ __forceinline__ GroupRow() {}
    __device__ __forceinline__ GroupRow(const void* sp, const void* bp, size_t row, unsigned groups, unsigned K)
        : s(static_cast<const S*>(sp) + row * groups), b(static_cast<const S*>(bp) + row * groups) {}
    __device__ __forceinline__ void get(unsigned gi, unsigned, S& scale, S& bias) const {
        scale = s[gi];
        bias = b[gi];
    }
};
template <>
struct GroupRow<Factored> {
    const Factored* n;
    const float2* u;
    __device__ __forceinline__ GroupRow() {}
    __device__ __forceinline__ GroupRow(const void* sp, const void* bp, size_t row, unsigned groups, unsigned K)
        : n(static_cast<const Factored*>(sp) + row * groups), u(static_cast<const float2*>(bp) + row * (K / 256)) {}
    __device__ __forceinline__ void get(unsigned gi, unsigned k, float& scale, float& bias) const {
        const Factored f = n[gi];
        const float2 unit = u[k / 256];
        scale = unit.x * (float)f.s;
        bias = unit.y * (float)f.b;
    }
};

// Round-to-nearest-even, as the host's conversions.
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats; blockDim.x is a
// multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

#include "pdl.cuh"

// Asks L2 to fetch the 128-byte line holding p, to be kept (evict_last) until it is read.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
}

// This warp prefetches [p, p + bytes) into L2, a line per lane at a time.
__device__ __forceinline__ void prefetch_l2_range(const void* p, size_t bytes, unsigned lane, unsigned lanes) {
    const char* c = static_cast<const char*>(p);
    for (size_t off = (size_t)lane * 128; off < bytes; off += (size_t)lanes * 128) prefetch_l2(c + off);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// ---- 16-byte vector dot products for matrix-vector work ----
// A row of `cols` values is read as 16-byte vectors of VALS values: 32 for 4-bit, 16 for 8-bit,
// 8 for bf16 (BITS 16), 4 for f32 (BITS 32); 4 and 8 bits are quantised (QUANTISED), with group
// scales and biases, 16 and 32 dense. The vector x is staged in shared memory with 4 floats of padding after
// every 32 (`padded`), so the lanes' 16-byte reads of their x segments are bank-conflict free.
//
// Quantised values are turned into floats without integer-to-float conversions (a quarter-rate
// instruction that would bound the whole kernel): a value masked in place inside the low 16 bits
// of a word, OR-ed into the mantissa of 2^23 and minus 2^23, is exactly (q << shift) as a float.
// x is staged pre-multiplied by 2^-shift for its position, a power of two, so exact.

__device__ __forceinline__ unsigned padded(unsigned i) { return i + ((i >> 5) << 2); }

// (a & mask) | bits as one LOP3: written plainly, the two immediates become two instructions.
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned mask, unsigned bits) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
}

// The quantised value masked in place inside a 16-bit half word, as an exact float
// (see the comment above): 2^23 + m, minus 2^23.
__device__ __forceinline__ float masked_value(unsigned word, unsigned mask) {
    return __uint_as_float(and_or(word, mask, 0x4B000000u)) - 8388608.0f;
}

// Floats of shared memory needed to stage n values.
__host__ __device__ constexpr unsigned padded_len(unsigned n) { return n + ((n + 31) / 32) * 4; }

template <int BITS>
inline constexpr bool QUANTISED = BITS < 16;

template <int BITS>
struct VecFormat {
    static constexpr unsigned VALS = 128 / BITS;
    // Values per 16-bit half word, and the scale x is staged with at position i of a row.
    static constexpr unsigned PER_HALF = QUANTISED<BITS> ? 16 / BITS : 1;
    static __device__ __forceinline__ float x_scale(unsigned i) {
        if constexpr (!QUANTISED<BITS>) return 1.0f;
        else return __int_as_float((127 - (int)(BITS * (i % PER_HALF))) << 23);  // 2^-(BITS * position)
    }
};

// The quantised form of vec_dot_exact_by with the weights' values given: wv(q, p, h) is value p
// of the low (h = 0) or high (h = 1) half word of word q, as masked_value makes it (pre-scaled
// like x: stage_x_sums divides x by the place value). One order of terms for every caller.
template <int BITS, class WV, class XQ>
__device__ __forceinline__ void vec_dot_exact_vals(float& acc, WV wv, XQ xq4, float scale, float bias, float sx) {
    constexpr unsigned PER_HALF = VecFormat<BITS>::PER_HALF, PER_WORD = 2 * PER_HALF;
    float qx = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float xq[PER_WORD];
#pragma unroll
        for (unsigned j = 0; j < PER_WORD / 4; j++) {
            const float4 f = xq4(q * PER_WORD / 4 + j);
            xq[4 * j] = f.x;
            xq[4 * j + 1] = f.y;
            xq[4 * j + 2] = f.z;
            xq[4 * j + 3] = f.w;
        }
#pragma unroll
        for (unsigned p = 0; p < PER_HALF; p++) {
            qx = __fmaf_rn(wv(q, p, 0), xq[p], qx);
            qx = __fmaf_rn(wv(q, p, 1), xq[PER_HALF + p], qx);
        }
    }
    acc = __fadd_rn(acc, __fmaf_rn(scale, qx, __fmul_rn(bias, sx)));
}

// One 16-byte vector of a row (format BITS) times x, added to acc; xq(j) gives the vector's j-th
// four values of the staged x (float4), `scale` and `bias` are the vector's group's and `sx` the
// plain sum of x over the vector (quantised formats only: the bias multiplies it). Every caller
// adds the same terms in this order, whichever way it holds x.
template <int BITS, class XQ>
__device__ __forceinline__ void vec_dot_exact_by(float& acc, uint4 v, XQ xq4, float scale, float bias, float sx) {
    if constexpr (BITS == 16) {
        // The vector's sum first, then one addition to acc, as every other format: a caller
        // that keeps a partial sum per vector (the fused router) adds the same terms.
        float t = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float4 xq = xq4(q / 2);
            const float x0 = q % 2 ? xq.z : xq.x, x1 = q % 2 ? xq.w : xq.y;
            const unsigned word = q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
            t = __fadd_rn(t, __fmaf_rn(__uint_as_float(word << 16), x0, __fmul_rn(__uint_as_float(word & 0xffff0000u), x1)));
        }
        acc = __fadd_rn(acc, t);
    } else if constexpr (BITS == 32) {
        const float4 xq = xq4(0);
        float t = __fmul_rn(__uint_as_float(v.x), xq.x);
        t = __fmaf_rn(__uint_as_float(v.y), xq.y, t);
        t = __fmaf_rn(__uint_as_float(v.z), xq.z, t);
        t = __fmaf_rn(__uint_as_float(v.w), xq.w, t);
        acc = __fadd_rn(acc, t);
    } else {
        constexpr unsigned MASK = (1u << BITS) - 1u;
        vec_dot_exact_vals<BITS>(
            acc,
            [&](int q, unsigned p, int h) {
                const unsigned word = q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
                return masked_value(h ? word >> 16 : word, MASK << (BITS * p));
            },
            xq4, scale, bias, sx);
    }
}

// vec_dot_exact_by with x read from shared memory (vector `u` of xs as stage_x_sums leaves it)
// per word, so only 8 of its values are live at once.
template <int BITS>
__device__ __forceinline__ void vec_dot_exact(float& acc, uint4 v, const float* xs, unsigned u, float scale,
                                              float bias, float sx) {
    const float4* xp = reinterpret_cast<const float4*>(xs + padded(u * VecFormat<BITS>::VALS));
    vec_dot_exact_by<BITS>(acc, v, [&](unsigned j) { return xp[j]; }, scale, bias, sx);
}

// The plain sum of VALS values of x, four at a time in order: what vec_dot_exact's bias multiplies.
template <unsigned VALS>
__device__ __forceinline__ float plain_sum(const float4* f) {
    float sx = 0.0f;
#pragma unroll
    for (unsigned j = 0; j < VALS / 4; j++) sx += (f[j].x + f[j].y) + (f[j].z + f[j].w);
    return sx;
}

// One 16-byte vector u of x (its F4 float4s f) staged into xs, padded and pre-scaled for format
// BITS, and for quantised formats its plain sum (as plain_sum adds them) into xsum[u].
template <int BITS>
__device__ __forceinline__ void stage_vector(const float4 (&f)[VecFormat<BITS>::VALS / 4], float* xs, float* xsum,
                                             unsigned u) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS, F4 = VALS / 4;
#pragma unroll
    for (unsigned j = 0; j < F4; j++) {
        const unsigned i = u * VALS + 4 * j;  // four values of one padded run of 32
        *reinterpret_cast<float4*>(xs + padded(i)) =
            make_float4(f[j].x * VecFormat<BITS>::x_scale(i), f[j].y * VecFormat<BITS>::x_scale(i + 1),
                        f[j].z * VecFormat<BITS>::x_scale(i + 2), f[j].w * VecFormat<BITS>::x_scale(i + 3));
    }
    if constexpr (QUANTISED<BITS>) xsum[u] = plain_sum<VALS>(f);
}

// Stages x[0..n) (16-byte aligned) into xs as stage_vector does, xsum[n / VALS] the vectors'
// sums. A thread per vector, its loads issued together: one round trip to memory, and the
// products read one sum per vector instead of its values a second time. Synchronises the block.
template <int BITS>
__device__ __forceinline__ void stage_x_sums(const float* x, float* xs, float* xsum, unsigned n) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS, F4 = VALS / 4;
    for (unsigned u = threadIdx.x; u < n / VALS; u += blockDim.x) {
        float4 f[F4];
#pragma unroll
        for (unsigned j = 0; j < F4; j++) f[j] = reinterpret_cast<const float4*>(x)[u * F4 + j];
        stage_vector<BITS>(f, xs, xsum, u);
    }
    __syncthreads();
}

// stage_x_sums for `rows` rows of x (n values each) at once, row t into xs + t * stride (its sums
// after its padded_len(n) values): each thread loads up to 64 bytes of vectors before it stages
// them, so the rows take one round trip to memory, not one each. Synchronises the block.
template <int BITS>
__device__ __forceinline__ void stage_x_sums_rows(const float* x, float* xs, unsigned stride, unsigned n,
                                                  unsigned rows) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS, F4 = VALS / 4, PER = F4 >= 4 ? 16 / F4 : 4;
    const unsigned nv = n / VALS, items = rows * nv;
    for (unsigned base = threadIdx.x; base < items; base += PER * blockDim.x) {
        float4 f[PER][F4];
#pragma unroll
        for (unsigned p = 0; p < PER; p++) {
            const unsigned i = base + p * blockDim.x;
            if (i < items) {
#pragma unroll
                for (unsigned j = 0; j < F4; j++)
                    f[p][j] = reinterpret_cast<const float4*>(x + (size_t)(i / nv) * n)[i % nv * F4 + j];
            }
        }
#pragma unroll
        for (unsigned p = 0; p < PER; p++) {
            const unsigned i = base + p * blockDim.x;
            if (i < items) {
                float* xt = xs + i / nv * stride;
                stage_vector<BITS>(f[p], xt, xt + padded_len(n), i % nv);
            }
        }
    }
    __syncthreads();
}

// Dot products of rows row[0 .. R) (those below `rows`) of one matrix with the staged x, this
// lane's share: vectors lane, lane + 32, ... Reduce with warp_sum afterwards.
// `w`: the matrix (16-byte aligned rows); `scales`, `biases`: per group (quantised only; bf16 or
// float, S); `xs` and `xsum` as stage_x_sums leaves them (the biases multiply the vectors' plain
// sums). Each row's terms are added in the same order whichever rows it is taken with.
template <int BITS, int R, typename S = bf16>
__device__ __forceinline__ void rows_dot_at(const void* w, const S* scales, const S* biases, const unsigned (&row)[R],
                                            unsigned rows, const float* xs, const float* xsum, unsigned cols,
                                            unsigned group, float acc[R]) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS;
    // Vectors per lane loaded before any arithmetic: R rows x U of the lane's vectors in flight.
    constexpr unsigned U = 2;
    const unsigned lane = threadIdx.x % 32;
    const unsigned nvec = cols / VALS, groups = QUANTISED<BITS> ? cols / group : 0;
    const uint4* W = reinterpret_cast<const uint4*>(w);
    for (unsigned u0 = lane; u0 < nvec; u0 += 32 * U) {
        uint4 v[U][R];
#pragma unroll
        for (unsigned i = 0; i < U; i++)
#pragma unroll
            for (int r = 0; r < R; r++)
                if (u0 + 32 * i < nvec && row[r] < rows) v[i][r] = __ldcs(W + (size_t)row[r] * nvec + u0 + 32 * i);
#pragma unroll
        for (unsigned i = 0; i < U; i++) {
            const unsigned u = u0 + 32 * i;
            if (u >= nvec) break;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (row[r] >= rows) continue;
                float scale = 0.0f, bias = 0.0f;
                if constexpr (QUANTISED<BITS>) {
                    const size_t gi = (size_t)row[r] * groups + (u * VALS) / group;
                    scale = to_f32(scales[gi]);
                    bias = to_f32(biases[gi]);
                }
                vec_dot_exact<BITS>(acc[r], v[i][r], xs, u, scale, bias, QUANTISED<BITS> ? xsum[u] : 0.0f);
            }
        }
    }
}

// rows_dot_at of the R rows from row0.
template <int BITS, int R, typename S = bf16>
__device__ __forceinline__ void rows_dot(const void* w, const S* scales, const S* biases, unsigned row0,
                                         unsigned rows, const float* xs, const float* xsum, unsigned cols,
                                         unsigned group, float acc[R]) {
    unsigned row[R];
#pragma unroll
    for (int r = 0; r < R; r++) row[r] = row0 + r;
    rows_dot_at<BITS, R, S>(w, scales, biases, row, rows, xs, xsum, cols, group, acc);
}

// ---- int8 activations for quantised products ----
// x is quantised per block of 32 values (d = max|x| / 127, xq = round(x / d)), with the sum of
// every 16 rounded values (d * sum xq) kept for the group biases. For 4-bit weights each 8 values
// are stored as [x0 x2 x4 x6][x1 x3 x5 x7], matching the low and high nibbles of a weight word;
// for 8-bit weights in order. A 16-byte weight vector covers one block (4-bit, 32 values) or half
// a block (8-bit, 16 values).

__device__ __forceinline__ int dp4a_us(unsigned a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// One thread's 8 values (values 8i .. 8i + 7 of the vector; `ok` false past its end) rounded to
// the form below. Four neighbouring lanes share a block of 32, so every lane of the warp must call
// it (the shuffles), in step.
template <bool NIBBLES>
__device__ __forceinline__ void quantize8(const float (&v)[8], bool ok, unsigned i, int* q, float* d, float* s16) {
    float amax = 0.0f;
    if (ok) {
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int r[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        r[j] = ok ? __float2int_rn(v[j] * inv) : 0;
        sum += r[j];
    }
    // The sum of the rounded values (not of x): with it the bias term rounds like the weight
    // term, and the large offset of unsigned quantised weights cancels as in (q s + b) . x.
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (!ok) return;
    // Byte j of the 8 goes to position p(j): in order, or [x0 x2 x4 x6][x1 x3 x5 x7].
    unsigned lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int p = NIBBLES ? (j % 2) * 4 + j / 2 : j;
        const unsigned byte = (unsigned)(r[j] & 0xff) << (8 * (p % 4));
        if (p < 4) lo |= byte; else hi |= byte;
    }
    reinterpret_cast<int2*>(q)[i] = make_int2((int)lo, (int)hi);
    if (i % 4 == 0) d[i / 4] = scale;
    if (i % 2 == 0) s16[i / 2] = scale * (float)sum;
}

// Rounds x[0..n) (n a multiple of 32) to that form: `q` n bytes, `d` n / 32 scales, `s16` n / 16
// sums (global or shared memory). Thread `tid` of `threads` (a multiple of 32, the same trip
// count for all, so every lane reaches the shuffles) takes 8 values at a time; four neighbouring
// lanes share a block of 32. `tid` and `threads` may span one block or the whole grid.
template <bool NIBBLES>
__device__ __forceinline__ void quantize_x8(const float* x, unsigned n, int* q, float* d, float* s16, unsigned tid,
                                            unsigned threads) {
    for (unsigned base = 0; base < n / 8; base += threads) {
        const unsigned i = base + tid;
        const bool ok = i < n / 8;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (ok) {
            const float4 a = reinterpret_cast<const float4*>(x)[2 * i], b = reinterpret_cast<const float4*>(x)[2 * i + 1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        }
        quantize8<NIBBLES>(v, ok, i, q, d, s16);
    }
}

// The int8 form of a vector: `q` the bytes (as ints), `d` one scale per 32 values, `s16` one
// sum per 16 values.
struct QuantX {
    const int* q;
    const float* d;
    const float* s16;
};

// The x side of weight vector u: its int8 values (8 ints for 4-bit, 4 for 8-bit), scale and sum;
// loaded once and used for every row.
template <int BITS>
struct XSeg {
    int q[BITS == 4 ? 8 : 4];
    float d, sx;
};

template <int BITS>
__device__ __forceinline__ XSeg<BITS> x_segment(QuantX x, unsigned u) {
    XSeg<BITS> s;
    if constexpr (BITS == 4) {
        const int4 a = reinterpret_cast<const int4*>(x.q)[2 * u], b = reinterpret_cast<const int4*>(x.q)[2 * u + 1];
        s.q[0] = a.x; s.q[1] = a.y; s.q[2] = a.z; s.q[3] = a.w; s.q[4] = b.x; s.q[5] = b.y; s.q[6] = b.z; s.q[7] = b.w;
        s.d = x.d[u];
        s.sx = x.s16[2 * u] + x.s16[2 * u + 1];
    } else {
        const int4 a = reinterpret_cast<const int4*>(x.q)[u];
        s.q[0] = a.x; s.q[1] = a.y; s.q[2] = a.z; s.q[3] = a.w;
        s.d = x.d[u / 2];
        s.sx = x.s16[u];
    }
    return s;
}

// Weight vector v (16 bytes of BITS-bit values) times its x segment, with the group scale and bias.
template <int BITS>
__device__ __forceinline__ float dot_int8(uint4 v, const XSeg<BITS>& x, float scale, float bias) {
    int isum = 0;
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
        if constexpr (BITS == 4) {
            isum = dp4a_us(words[q] & 0x0F0F0F0Fu, x.q[2 * q], isum);
            isum = dp4a_us((words[q] >> 4) & 0x0F0F0F0Fu, x.q[2 * q + 1], isum);
        } else {
            isum = dp4a_us(words[q], x.q[q], isum);
        }
    }
    return scale * x.d * (float)isum + bias * x.sx;
}

// ---- tensor cores: mma.sync m16n8k16 with f32 accumulators, ldmatrix, asynchronous copies ----
// Fragments (PTX ISA, "mma.m16n8k16"): with g = lane / 4 and c = 2 * (lane % 4), A (16 x 16, row
// major) is 4 registers of 2 values: (g, c..c+1), (g + 8, c..), (g, c + 8..), (g + 8, c + 8..);
// B (16 x 8, column major) is 2 registers: (k = c..c+1, n = g), (k = c + 8.., n = g); the
// accumulator is (g, c), (g, c + 1), (g + 8, c), (g + 8, c + 1).

template <typename T>
__device__ __forceinline__ void mma_16816(float d[4], const unsigned a[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<bf16>(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<f16>(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to the 16-bit type T and packed, the first in the low half.
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    const T l = from_f32<T>(lo), h = from_f32<T>(hi);
    return (unsigned)*reinterpret_cast<const unsigned short*>(&l) |
           ((unsigned)*reinterpret_cast<const unsigned short*>(&h) << 16);
}

// ---- quantised weights as bf16 (the tensor-core products of gemm.cu and skinny.cu) ----

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ __nv_bfloat162 as_bf162(unsigned u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ unsigned as_u32(__nv_bfloat162 v) { return *reinterpret_cast<unsigned*>(&v); }

// Eight 4-bit values of one word (lowest bits first) as the four bf16 pairs (v_j, v_j+4), j = 0..3.
// Each nibble pair is placed in the mantissas of 128.0 (0x4300: 128 + v exactly), 128 is
// subtracted (exact), then one bf16x2 fma with the group's scale and bias (a single rounding).
__device__ __forceinline__ void dequant_q4_pairs(unsigned w, __nv_bfloat162 s, __nv_bfloat162 b, unsigned d[4]) {
    const __nv_bfloat162 k128 = as_bf162(0x43004300u);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const unsigned t = and_or(w >> (4 * j), 0x000F000Fu, 0x43004300u);
        d[j] = as_u32(__hfma2(__hsub2(as_bf162(t), k128), s, b));
    }
}

// dequant_q4_pairs through f32, for f32 group scales and biases (one rounding, to bf16).
__device__ __forceinline__ void dequant_q4_pairs_f32(unsigned w, float s, float b, unsigned d[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++)
        d[j] = pack2<bf16>(masked_value(w >> (4 * j), 0xFu) * s + b, masked_value(w >> (4 * j + 16), 0xFu) * s + b);
}

// The same eight values as four bf16 pairs in order.
__device__ __forceinline__ uint4 dequant_q4(unsigned w, __nv_bfloat162 s, __nv_bfloat162 b) {
    unsigned d[4];
    dequant_q4_pairs(w, s, b, d);
    return make_uint4(prmt(d[0], d[1], 0x5410), prmt(d[2], d[3], 0x5410), prmt(d[0], d[1], 0x7632),
                      prmt(d[2], d[3], 0x7632));
}

// Eight 4-bit values of one word as four bf16 pairs in order, through f32: for f32 group scales
// and biases, which rounding to bf16 first would round twice.
__device__ __forceinline__ uint4 dequant_q4_f32(unsigned w, float s, float b) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = masked_value(w >> (4 * j), 0xFu) * s + b;
    return make_uint4(pack2<bf16>(v[0], v[1]), pack2<bf16>(v[2], v[3]), pack2<bf16>(v[4], v[5]),
                      pack2<bf16>(v[6], v[7]));
}

// Four 8-bit values of one word as two bf16 pairs, through f32 (128 + v is not exact in bf16).
__device__ __forceinline__ uint2 dequant_q8(unsigned w, float s, float b) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = masked_value(w >> (8 * j), 0xFFu) * s + b;
    return make_uint2(pack2<bf16>(v[0], v[1]), pack2<bf16>(v[2], v[3]));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// ---- thread block clusters (sm_90) ----
#if __CUDA_ARCH__ >= 900
// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Every thread of every block of the cluster: writes before it (to any block's shared memory)
// are visible to reads after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The two halves of a cluster barrier that orders nothing, only says every block is running:
// arrive early, wait before the first access to another block's shared memory (a block's
// shared memory may only be touched once that block has started).
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// Stores v at the place of p (this block's shared memory) in the shared memory of block `rank`.
__device__ __forceinline__ void store_cluster_f32(const float* p, unsigned rank, float v) {
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
}
#endif

// ---- counters the blocks of a grid meet at ----
// The pattern (as a grid barrier's): every thread's writes, then __syncthreads, then one thread
// counts the block with a release; a waiting thread reads the count with acquire loads, then
// __syncthreads, and the block's reads after it see the counted blocks' writes. Lighter than
// __threadfence (a sequentially consistent fence) on either side.
__device__ __forceinline__ void red_add_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// ---- wgmma (sm_90a) ----
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Descriptor of a K-major operand tile in the 128-byte swizzle: start address, stride of 1024
// bytes between groups of 8 rows; the leading offset is unused in this layout.
__device__ __forceinline__ unsigned long long sw128_desc(const bf16* tile) {
    return (unsigned long long)((smem_addr(tile) & 0x3FFFFu) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
// Ordinary and cp.async writes to shared memory become visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Every group of products but the newest N is done.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// d (64 x N, this thread's N / 2 floats) += A (64 x 16, this thread's four bf16 pairs in the
// registers of mma.sync m16n8k16's A, warp w of the warpgroup holding rows 16 w ..) * B (N x 16,
// a K-major tile in shared memory)^T.
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b);
template <>
__device__ __forceinline__ void wgmma_rs<8>(float (&d)[4], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_rs<16>(float (&d)[8], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_rs<32>(float (&d)[16], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_rs<64>(float (&d)[32], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#endif

// Four 8 x 8 matrices of 16-bit values; lanes 8i .. 8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

// 16 bytes global -> shared without registers; `valid` false fills zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
// The same, kept in L1 as well (for rows several warps of a block read), ordered as a memory
// access for the compiler; with cp_async_wait_mem, for a thread that reads back what it copied.
__device__ __forceinline__ void cp_async16_ca(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// 4 bytes global -> shared without registers (both 4-byte aligned).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void cp_async_wait_mem() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
