// Linear layers out[t, o] = x[t, :] . W[o, :] over dense (f32, bf16, f16) and affine-quantised
// (4- and 8-bit) weights, and the embedding gather from either kind of table. Quantised kernels
// come in two scale types: `q4`, `q8` read bf16 group scales and biases (MLX), `q4f`, `q8f` f32
// ones (GGUF's block formats, which bf16 cannot hold exactly); S is that type.
// linear_*: one warp per output row, blocks of 8 warps; grid.y covers tokens TOKENS at a time,
// each weight row is streamed once per block and reused for those tokens.
// One token, with 16-byte weight loads and persistent blocks (a few per SM), each of which stages
// x itself in shared memory:
// - matvec_bf16 and matvec_{q4,q8,f32,bf16}_exact: x in f32 (padded, pre-scaled, and for
//   quantised weights each 16-byte vector's plain sum), warps taking tiles of 4 rows. Nothing is
//   rounded beyond f32 arithmetic, so _exact serves the logits a router chooses from (matvec_bf16
//   serves one token's too, as matvec_bf16_exact does); _exact_tokens is the same arithmetic for
//   many tokens, several a block.
// - matvec_q{4,8}_dp4a: x rounded to int8 per block of 32 inside every block, products by dp4a;
//   matvec_norm_*_dp4a the same with one row's RMS norm (and residual add) in front.
//   Each warp streams its items (4 rows x 64 vectors) with their group scales and biases through
//   a 4-slot cp.async ring in shared memory, the first items started before the programmatic
//   wait, so no load is issued at compute time.
#include "kestrel.cuh"

// The launch geometry comes from the host (`ops/linear.rs`) as -D definitions: TOKENS (linear_*),
// VEC_WARPS, VEC_ROWS, VEC_BLOCKS_PER_SM (matvec_bf16, _exact), EX_WARPS (_exact_tokens),
// DP_WARPS, DP_ROWS, DP_STAGES, DP_BLOCKS_PER_SM (_dp4a).
#if !defined(TOKENS) || !defined(VEC_WARPS) || !defined(VEC_ROWS) || !defined(VEC_BLOCKS_PER_SM) || \
    !defined(EX_WARPS) || !defined(DP_WARPS) || !defined(DP_ROWS) ||            \
    !defined(DP_STAGES) || !defined(DP_BLOCKS_PER_SM)
#error "linear.cu is compiled with the launch geometry of ops/linear.rs as -D definitions"
#endif

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

template <int BITS, typename S>
__device__ void linear_quant(const float* x, const unsigned* words, const S* scales, const S* biases,
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
        pdl_begin();                                                                                        \
        linear_dense(x, w, out, tokens, in_dim, out_dim);                                                   \
    }                                                                                                       \
    extern "C" __global__ void embed_##NAME(const W* table, const unsigned* ids, float* out, unsigned hidden, \
                                            unsigned vocab) {                                                \
        pdl_begin();                                                                                        \
        const size_t t = blockIdx.x;                                                                        \
        const unsigned id = ids[t];                                                                         \
        if (id >= vocab) return;                                                                            \
        for (unsigned i = threadIdx.x; i < hidden; i += blockDim.x)                                         \
            out[t * hidden + i] = to_f32(table[(size_t)id * hidden + i]);                                   \
    }

DENSE(float, f32)
DENSE(bf16, bf16)
DENSE(f16, f16)

#define QUANT(BITS, S, NAME)                                                                                         \
    extern "C" __global__ void linear_##NAME(const float* x, const unsigned* w, const S* scales,        \
                                              const S* biases, float* out, unsigned tokens,              \
                                              unsigned in_dim, unsigned out_dim, unsigned group) {          \
        pdl_begin();                                                                                        \
        linear_quant<BITS, S>(x, w, scales, biases, out, tokens, in_dim, out_dim, group);                      \
    }                                                                                                       \
    extern "C" __global__ void embed_##NAME(const unsigned* w, const S* scales, const S* biases,     \
                                             const unsigned* ids, float* out, unsigned hidden,              \
                                             unsigned vocab, unsigned group) {                               \
        pdl_begin();                                                                                        \
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

QUANT(4, bf16, q4)
QUANT(8, bf16, q8)
QUANT(4, float, q4f)
QUANT(8, float, q8f)

// One-token matvec with 16-byte weight loads. Persistent blocks: each stages x in shared memory
// once (stage_x_sums: padded, pre-scaled; quantised formats also each vector's plain sum), then
// its warps walk tiles of VEC_ROWS rows, VEC_WARPS * gridDim.x tiles apart. Requires in_dim to be
// a multiple of the vector width, and x and the rows 16-byte aligned.

template <int BITS, typename S = bf16>
__device__ void matvec(const float* x, const void* w, const S* scales, const S* biases, float* out,
                       unsigned in_dim, unsigned out_dim, unsigned group) {
    extern __shared__ __align__(16) float xs[];
    float* xsum = xs + padded_len(in_dim);
    stage_x_sums<BITS>(x, xs, xsum, in_dim);
    const unsigned lane = threadIdx.x % 32;
    const unsigned tiles = (out_dim + VEC_ROWS - 1) / VEC_ROWS;
    for (unsigned tile = blockIdx.x * VEC_WARPS + threadIdx.x / 32; tile < tiles; tile += gridDim.x * VEC_WARPS) {
        const unsigned row0 = tile * VEC_ROWS;
        float acc[VEC_ROWS];
#pragma unroll
        for (int r = 0; r < VEC_ROWS; r++) acc[r] = 0.0f;
        rows_dot<BITS, VEC_ROWS, S>(w, scales, biases, row0, out_dim, xs, xsum, in_dim, group, acc);
#pragma unroll
        for (int r = 0; r < VEC_ROWS; r++) {
            const float s = warp_sum(acc[r]);
            if (lane == 0 && row0 + r < out_dim) out[row0 + r] = s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * VEC_WARPS, VEC_BLOCKS_PER_SM)
matvec_bf16(const float* x, const bf16* w, float* out, unsigned in_dim, unsigned out_dim) {
    pdl_begin();
    matvec<16, bf16>(x, w, nullptr, nullptr, out, in_dim, out_dim, 1);
}

// Dense weights, one token a grid row y: exact, as matvec_q*_exact. f32 ones are a GGUF file's
// routers; bf16 ones (a bf16 checkpoint's routers and narrow gates) add the terms matvec_bf16
// adds, so a token's logits do not depend on the kernel.
#define MATVEC_DENSE_EXACT(BITS, W, NAME)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * VEC_WARPS, VEC_BLOCKS_PER_SM)                        \
        matvec_##NAME##_exact(const float* x, const W* w, float* out, unsigned in_dim, unsigned out_dim) { \
        pdl_begin();                                                                                        \
        matvec<BITS, bf16>(x + (size_t)blockIdx.y * in_dim, w, nullptr, nullptr,                            \
                           out + (size_t)blockIdx.y * out_dim, in_dim, out_dim, 1);                         \
    }
MATVEC_DENSE_EXACT(32, float, f32)
MATVEC_DENSE_EXACT(16, bf16, bf16)

// Quantised weights on f32 activations (x not rounded): the exact path of a few tokens (one per
// grid row y), for the logits a router picks experts from. Dynamic shared memory: padded_len(in_dim) + in_dim / VALS floats.
#define MATVEC_EXACT(BITS, S, NAME)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * VEC_WARPS, VEC_BLOCKS_PER_SM)                        \
        matvec_##NAME##_exact(                                                                             \
        const float* x, const unsigned* w, const S* scales, const S* biases, float* out,             \
        unsigned in_dim, unsigned out_dim, unsigned group) {                                                \
        pdl_begin();                                                                                        \
        matvec<BITS, S>(x + (size_t)blockIdx.y * in_dim, w, scales, biases, out + (size_t)blockIdx.y * out_dim, \
                     in_dim, out_dim, group);                                                               \
    }
MATVEC_EXACT(4, bf16, q4)
MATVEC_EXACT(8, bf16, q8)
MATVEC_EXACT(4, float, q4f)
MATVEC_EXACT(8, float, q8f)

// The exact path for many tokens: matvec_q*_exact's arithmetic, T tokens a block (grid row y,
// staged together in one round trip), so each weight vector a warp loads, and each
// quantised vector's values, serve all of them. Every (token, row) adds the same terms in the
// same order as rows_dot and warp_sum, so a token's logits are bit for bit those it gets alone. Dynamic shared memory: T * exact_stride(in_dim) floats.
// Names: matvec_NAME_exact_tokens_T, T 2, 4 or 8 (fewer tokens a block, more blocks for a step of
// a few dozen tokens; more, each weight vector's values made for more tokens).
__host__ __device__ constexpr unsigned exact_stride(unsigned in_dim, unsigned vals) {
    return (padded_len(in_dim) + in_dim / vals + 3) / 4 * 4;
}

template <int BITS, typename S, int T>
__device__ void matvec_exact_tokens(const float* x, const void* w, const S* scales, const S* biases,
                                    float* out, unsigned tokens, unsigned in_dim, unsigned out_dim,
                                    unsigned group) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS, U = 2;
    extern __shared__ __align__(16) float xs[];
    const unsigned stride = exact_stride(in_dim, VALS);
    const unsigned t0 = blockIdx.y * T, nt = min((unsigned)T, tokens - t0);
    stage_x_sums_rows<BITS>(x + (size_t)t0 * in_dim, xs, stride, in_dim, nt);
    const unsigned lane = threadIdx.x % 32;
    const unsigned nvec = in_dim / VALS, groups = QUANTISED<BITS> ? in_dim / group : 0;
    const unsigned tiles = (out_dim + VEC_ROWS - 1) / VEC_ROWS;
    const uint4* W = reinterpret_cast<const uint4*>(w);
    for (unsigned tile = blockIdx.x * EX_WARPS + threadIdx.x / 32; tile < tiles; tile += gridDim.x * EX_WARPS) {
        const unsigned row0 = tile * VEC_ROWS;
        float acc[T][VEC_ROWS];
#pragma unroll
        for (int t = 0; t < T; t++)
#pragma unroll
            for (int r = 0; r < VEC_ROWS; r++) acc[t][r] = 0.0f;
        // rows_dot's walk over the lane's vectors, each vector taken against every token.
        for (unsigned u0 = lane; u0 < nvec; u0 += 32 * U) {
            uint4 v[U][VEC_ROWS];
#pragma unroll
            for (unsigned i = 0; i < U; i++)
#pragma unroll
                for (int r = 0; r < VEC_ROWS; r++)
                    if (u0 + 32 * i < nvec && row0 + r < out_dim)
                        v[i][r] = __ldcs(W + (size_t)(row0 + r) * nvec + u0 + 32 * i);
#pragma unroll
            for (unsigned i = 0; i < U; i++) {
                const unsigned u = u0 + 32 * i;
                if (u >= nvec) break;
                float scale[VEC_ROWS], bias[VEC_ROWS];
#pragma unroll
                for (int r = 0; r < VEC_ROWS; r++) {
                    scale[r] = bias[r] = 0.0f;
                    if constexpr (QUANTISED<BITS>) {
                        if (row0 + r < out_dim) {
                            const size_t gi = (size_t)(row0 + r) * groups + (u * VALS) / group;
                            scale[r] = to_f32(scales[gi]);
                            bias[r] = to_f32(biases[gi]);
                        }
                    }
                }
                // A token's x as float4 j of the vector.
                auto x_of = [&](int t) {
                    return reinterpret_cast<const float4*>(xs + t * stride + padded(u * VALS));
                };
                if constexpr (QUANTISED<BITS>) {
                    // A row's values made once for every token (x read again for each row: the
                    // registers of every row's values at once cost more blocks than they save).
                    constexpr unsigned PER_HALF = VecFormat<BITS>::PER_HALF, MASK = (1u << BITS) - 1u;
#pragma unroll
                    for (int r = 0; r < VEC_ROWS; r++) {
                        if (row0 + r >= out_dim) continue;
                        float wf[4][PER_HALF][2];
#pragma unroll
                        for (int q = 0; q < 4; q++) {
                            const uint4& vv = v[i][r];
                            const unsigned word = q == 0 ? vv.x : q == 1 ? vv.y : q == 2 ? vv.z : vv.w;
#pragma unroll
                            for (unsigned p = 0; p < PER_HALF; p++)
#pragma unroll
                                for (int h = 0; h < 2; h++)
                                    wf[q][p][h] = masked_value(h ? word >> 16 : word, MASK << (BITS * p));
                        }
#pragma unroll
                        for (int t = 0; t < T; t++) {
                            if (t >= nt) break;
                            const float4* xp = x_of(t);
                            const float sx = xs[t * stride + padded_len(in_dim) + u];
                            vec_dot_exact_vals<BITS>(
                                acc[t][r], [&](int q, unsigned p, int h) { return wf[q][p][h]; },
                                [&](unsigned j) { return xp[j]; }, scale[r], bias[r], sx);
                        }
                    }
                } else {
#pragma unroll
                    for (int t = 0; t < T; t++) {
                        if (t >= nt) break;
                        const float4* xp = x_of(t);
#pragma unroll
                        for (int r = 0; r < VEC_ROWS; r++)
                            if (row0 + r < out_dim)
                                vec_dot_exact_by<BITS>(acc[t][r], v[i][r], [&](unsigned j) { return xp[j]; },
                                                       0.0f, 0.0f, 0.0f);
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < T; t++)
#pragma unroll
            for (int r = 0; r < VEC_ROWS; r++) {
                const float s = warp_sum(acc[t][r]);
                if (lane == 0 && t < nt && row0 + r < out_dim) out[(size_t)(t0 + t) * out_dim + row0 + r] = s;
            }
    }
}

#define MATVEC_EXACT_TOKENS_T(BITS, S, NAME, T)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * EX_WARPS)                                           \
        matvec_##NAME##_exact_tokens_##T(const float* x, const unsigned* w, const S* scales,            \
                                      const S* biases, float* out, unsigned tokens, unsigned in_dim,     \
                                      unsigned out_dim, unsigned group) {                                   \
        pdl_begin();                                                                                        \
        matvec_exact_tokens<BITS, S, T>(x, w, scales, biases, out, tokens, in_dim, out_dim, group);         \
    }
#define MATVEC_EXACT_TOKENS(BITS, S, NAME)                                                                   \
    MATVEC_EXACT_TOKENS_T(BITS, S, NAME, 2) MATVEC_EXACT_TOKENS_T(BITS, S, NAME, 4)                        \
    MATVEC_EXACT_TOKENS_T(BITS, S, NAME, 8)
#define MATVEC_DENSE_EXACT_TOKENS(BITS, W, NAME, T)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * EX_WARPS)                                           \
        matvec_##NAME##_exact_tokens_##T(const float* x, const W* w, float* out, unsigned tokens,        \
                                         unsigned in_dim, unsigned out_dim) {                              \
        pdl_begin();                                                                                        \
        matvec_exact_tokens<BITS, bf16, T>(x, w, nullptr, nullptr, out, tokens, in_dim, out_dim, 1);        \
    }
MATVEC_DENSE_EXACT_TOKENS(32, float, f32, 2)
MATVEC_DENSE_EXACT_TOKENS(32, float, f32, 4)
MATVEC_DENSE_EXACT_TOKENS(32, float, f32, 8)
MATVEC_DENSE_EXACT_TOKENS(16, bf16, bf16, 2)
MATVEC_DENSE_EXACT_TOKENS(16, bf16, bf16, 4)
MATVEC_DENSE_EXACT_TOKENS(16, bf16, bf16, 8)
MATVEC_EXACT_TOKENS(4, bf16, q4)
MATVEC_EXACT_TOKENS(8, bf16, q8)
MATVEC_EXACT_TOKENS(4, float, q4f)
MATVEC_EXACT_TOKENS(8, float, q8f)



// ---- one-token quantised matvec on 8-bit integer dot products ----
// x is quantised to int8 (see kestrel.cuh): a 4-bit weight word then costs two masks and two dp4a
// for its 8 values (against three float instructions per value), at the price of x's 8-bit
// rounding.

// DP_STAGES: items in flight per warp, through shared memory; DP_BLOCKS_PER_SM 3 fits
// 4 warps x 4 stages x 4.5 KB a block (4-bit, group 64).

// A warp's work is a sequence of items: tile t (DP_ROWS rows) x chunk c (64 16-byte vectors of
// each row, lane l taking vectors c * 64 + l and c * 64 + 32 + l). Items stream through a ring
// of DP_STAGES slots in shared memory with cp.async, weights and the group scales and biases
// they need, so a warp keeps three items in flight while it computes on the fourth, and no load
// is issued at compute time (it would queue behind the whole stream). A lane reads back the
// weight vectors it copied itself; the scales, copied by other lanes, after a __syncwarp.
// Needs in_dim / group and 64 * VALS / group to be multiples of the scales a 16-byte piece holds
// (8 bf16, 4 floats).
struct DpItems {
    unsigned first_tile, tile_step, tiles, chunks;
};

// One ring slot: the weight vectors [i][r][lane], then 2 * DP_ROWS segments of `seg` group values
// of `size` bytes (the scales of rows 0..DP_ROWS-1, then their biases): this many 16-byte vectors.
__host__ __device__ constexpr unsigned dp_slot_vecs(unsigned seg, unsigned size) {
    return 2 * DP_ROWS * 32 + DP_ROWS * seg * size / 8;
}

// Starts the copies of item k into its ring slot, zero-filling past the matrix. Always commits
// one group, so the wait counts stay in step even past the last item.
template <typename S>
__device__ __forceinline__ void dp_fetch(uint4* ring, const DpItems& it, unsigned k, const uint4* W,
                                         const S* scales, const S* biases, unsigned nvec, unsigned out_dim,
                                         unsigned groups, unsigned seg) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned tile = it.first_tile + (k / it.chunks) * it.tile_step, chunk = k % it.chunks;
    if (tile < it.tiles) {
        uint4* slot = ring + (k % DP_STAGES) * dp_slot_vecs(seg, sizeof(S));
#pragma unroll
        for (unsigned i = 0; i < 2; i++)
#pragma unroll
            for (int r = 0; r < DP_ROWS; r++) {
                const unsigned row = tile * DP_ROWS + r, u = chunk * 64 + 32 * i + lane;
                const bool ok = row < out_dim && u < nvec;
                cp_async16(slot + (i * DP_ROWS + r) * 32 + lane, ok ? W + (size_t)row * nvec + u : W, ok);
            }
        S* sb = reinterpret_cast<S*>(slot + 2 * DP_ROWS * 32);
        constexpr unsigned PER = 16 / sizeof(S);  // values per 16-byte piece
        const unsigned pieces = seg / PER, g0 = chunk * seg;
        for (unsigned p = lane; p < 2 * DP_ROWS * pieces; p += 32) {
            const unsigned part = p / pieces, g = g0 + (p % pieces) * PER, row = tile * DP_ROWS + part % DP_ROWS;
            const bool ok = row < out_dim && g < groups;
            const S* src = (part < DP_ROWS ? scales : biases) + (size_t)row * groups + g;
            cp_async16(sb + part * seg + (p % pieces) * PER, ok ? src : scales, ok);
        }
    }
    cp_async_commit();
}

// The RMS norm matvec_norm_*_dp4a does in front of its product (an RmsNorm or AddRmsNorm of one
// row): x = r / rms(r) * w with r = residual + add (r = add without a residual), w f32 or bf16
// (w_bf16), each factor 1 + w when zero-centred. Every block computes the whole row itself: its
// threads take 8 values at a time (value chunks tid, tid + blockDim.x, ...; up to DPN_CHUNKS
// each), the norm weights loaded before the programmatic wait and r in one round trip after it.
// The normalised row, which later kernels read and no block of this one, is written by block 0
// as soon as it has it; the new residual (with a residual) by block 0 at its end, once every
// block has counted itself in `counter` (zero at launch and again at exit) after reading its
// residual values, so no block reads a residual another has updated. A block that waits for the
// others so never keeps them from running: it is one block, and it waits only once its own work
// is done.
#ifndef DPN_CHUNKS
#error "linear.cu is compiled with DPN_CHUNKS from ops/linear.rs"
#endif
struct DpNorm {
    float* residual;  // null for an RmsNorm
    const float* add;
    const void* w;
    float* out;
    unsigned* counter;
    float eps;
    int zero_centered;
    int w_bf16;
};

// The norm's factor of value i.
__device__ __forceinline__ float dpn_factor(const DpNorm& nm, unsigned i) {
    const float v = nm.w_bf16 ? to_f32(static_cast<const bf16*>(nm.w)[i]) : static_cast<const float*>(nm.w)[i];
    return nm.zero_centered ? 1.0f + v : v;
}

// Persistent like `matvec`: each block rounds x to int8 into shared memory itself (with NORM, x
// normalised first: DpNorm), then its warps walk their items. The first items' copies are started
// before the programmatic wait (weights are never written by a kernel). Dynamic shared memory:
// DP_WARPS * DP_STAGES slots of ring (dp_slot_vecs(seg, sizeof(S)) 16-byte vectors a slot), then
// in_dim bytes + (in_dim / 32 + in_dim / 16) floats of x.
template <int BITS, typename S, bool NORM>
__device__ void matvec_dp4a(const float* xf, const unsigned* w, const S* scales, const S* biases, float* out,
                            unsigned in_dim, unsigned out_dim, unsigned group, const DpNorm nm) {
    extern __shared__ __align__(16) uint4 dp_smem[];
    constexpr unsigned VALS = 128 / BITS;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned nvec = in_dim / VALS, groups = in_dim / group, seg = 64 * VALS / group;
    const unsigned slot_vecs = dp_slot_vecs(seg, sizeof(S));
    uint4* ring = dp_smem + warp * DP_STAGES * slot_vecs;
    int* sq = reinterpret_cast<int*>(dp_smem + DP_WARPS * DP_STAGES * slot_vecs);
    float* sd = reinterpret_cast<float*>(sq + in_dim / 4);
    float* ss = sd + in_dim / 32;
    const uint4* W = reinterpret_cast<const uint4*>(w);
    const DpItems it{blockIdx.x * DP_WARPS + warp, gridDim.x * DP_WARPS, (out_dim + DP_ROWS - 1) / DP_ROWS,
                     (nvec + 63) / 64};
    const unsigned items =
        it.first_tile < it.tiles ? ((it.tiles - it.first_tile + it.tile_step - 1) / it.tile_step) * it.chunks : 0;
#pragma unroll
    for (unsigned k = 0; k + 1 < DP_STAGES; k++)
        dp_fetch(ring, it, k, W, scales, biases, nvec, out_dim, groups, seg);
    // With NORM, this thread's values of residual + add (block 0 writes them to the residual at
    // its end).
    float r[DPN_CHUNKS][8];
    if constexpr (NORM) {
        __shared__ float scratch[32];
        const unsigned n8 = in_dim / 8;
        float f[DPN_CHUNKS][8];
#pragma unroll
        for (int c = 0; c < DPN_CHUNKS; c++) {
            const unsigned i = threadIdx.x + c * blockDim.x;
#pragma unroll
            for (int j = 0; j < 8; j++) f[c][j] = i < n8 ? dpn_factor(nm, 8 * i + j) : 0.0f;
        }
        pdl_wait();
        pdl_trigger();
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < DPN_CHUNKS; c++) {
            const unsigned i = threadIdx.x + c * blockDim.x;
            float4 a[2] = {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
            if (i < n8) {
                const float4* ad = reinterpret_cast<const float4*>(nm.add) + 2 * i;
                a[0] = ad[0];
                a[1] = ad[1];
                if (nm.residual != nullptr) {
                    const float4* rd = reinterpret_cast<const float4*>(nm.residual) + 2 * i;
                    const float4 b0 = rd[0], b1 = rd[1];
                    a[0] = make_float4(b0.x + a[0].x, b0.y + a[0].y, b0.z + a[0].z, b0.w + a[0].w);
                    a[1] = make_float4(b1.x + a[1].x, b1.y + a[1].y, b1.z + a[1].z, b1.w + a[1].w);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                r[c][4 * h] = a[h].x;
                r[c][4 * h + 1] = a[h].y;
                r[c][4 * h + 2] = a[h].z;
                r[c][4 * h + 3] = a[h].w;
            }
#pragma unroll
            for (int j = 0; j < 8; j++) sum += r[c][j] * r[c][j];
        }
        const float inv = 1.0f / sqrtf(block_sum(sum, scratch) / (float)in_dim + nm.eps);
#pragma unroll
        for (int c = 0; c < DPN_CHUNKS; c++) {
            const unsigned i = threadIdx.x + c * blockDim.x;
#pragma unroll
            for (int j = 0; j < 8; j++) f[c][j] = r[c][j] * inv * f[c][j];  // x, in place of the factors
            quantize8<BITS == 4>(f[c], i < n8, i, sq, sd, ss);
        }
        // No block reads the normed row: block 0 writes it now.
        if (blockIdx.x == 0) {
#pragma unroll
            for (int c = 0; c < DPN_CHUNKS; c++) {
                const unsigned i = threadIdx.x + c * blockDim.x;
                if (i >= n8) continue;
                float4* od = reinterpret_cast<float4*>(nm.out) + 2 * i;
                od[0] = make_float4(f[c][0], f[c][1], f[c][2], f[c][3]);
                od[1] = make_float4(f[c][4], f[c][5], f[c][6], f[c][7]);
            }
        }
    } else {
        pdl_wait();
        pdl_trigger();
        if (warp == 0) prefetch_l2_range(xf, in_dim * sizeof(float), lane, 32);
        quantize_x8<BITS == 4>(xf, in_dim, sq, sd, ss, threadIdx.x, blockDim.x);
    }
    __syncthreads();
    // Every thread of the block has read its residual values (the sum needed them all): count
    // the block, without waiting for the count.
    if constexpr (NORM)
        if (threadIdx.x == 0 && nm.residual != nullptr) atomicAdd(nm.counter, 1u);
    const QuantX x{sq, sd, ss};
    float acc[DP_ROWS];
#pragma unroll
    for (int r = 0; r < DP_ROWS; r++) acc[r] = 0.0f;
    for (unsigned k = 0; k < items; k++) {
        dp_fetch(ring, it, k + DP_STAGES - 1, W, scales, biases, nvec, out_dim, groups, seg);
        cp_async_wait<DP_STAGES - 1>();  // item k's group is complete
        __syncwarp();                    // and visible to the lanes that did not copy it
        const unsigned tile = it.first_tile + (k / it.chunks) * it.tile_step, chunk = k % it.chunks;
        const unsigned row0 = tile * DP_ROWS;
        const uint4* slot = ring + (k % DP_STAGES) * slot_vecs;
        const S* sb = reinterpret_cast<const S*>(slot + 2 * DP_ROWS * 32);
#pragma unroll
        for (unsigned i = 0; i < 2; i++) {
            const unsigned u = chunk * 64 + 32 * i + lane;
            if (u >= nvec) break;
            const unsigned g = ((u - chunk * 64) * VALS) / group;  // within the chunk's segment
            const XSeg<BITS> xs = x_segment<BITS>(x, u);
#pragma unroll
            for (int r = 0; r < DP_ROWS; r++) {
                if (row0 + r >= out_dim) continue;
                acc[r] += dot_int8<BITS>(slot[(i * DP_ROWS + r) * 32 + lane], xs, to_f32(sb[r * seg + g]),
                                         to_f32(sb[(DP_ROWS + r) * seg + g]));
            }
        }
        if (chunk + 1 == it.chunks) {
#pragma unroll
            for (int r = 0; r < DP_ROWS; r++) {
                const float s = warp_sum(acc[r]);
                if (lane == 0 && row0 + r < out_dim) out[row0 + r] = s;
                acc[r] = 0.0f;
            }
        }
    }
    cp_async_wait<0>();  // no copy may still target shared memory when the block exits
    // Block 0 writes the new residual once every block has counted itself (by now, in practice:
    // the blocks start together and count before their products), then zeroes the count.
    if constexpr (NORM) {
        if (blockIdx.x == 0 && nm.residual != nullptr) {
            if (threadIdx.x == 0)
                while (*reinterpret_cast<volatile unsigned*>(nm.counter) < gridDim.x) {
                }
            __syncthreads();
#pragma unroll
            for (int c = 0; c < DPN_CHUNKS; c++) {
                const unsigned i = threadIdx.x + c * blockDim.x;
                if (i >= in_dim / 8) continue;
                float4* rd = reinterpret_cast<float4*>(nm.residual) + 2 * i;
                rd[0] = make_float4(r[c][0], r[c][1], r[c][2], r[c][3]);
                rd[1] = make_float4(r[c][4], r[c][5], r[c][6], r[c][7]);
            }
            if (threadIdx.x == 0) *nm.counter = 0;
        }
    }
}

// matvec_{format}_dp4a, and matvec_norm_{format}_dp4a with the RMS norm in front (DpNorm; x is
// then not read).
#define MATVEC_DP4A(BITS, S, NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * DP_WARPS, DP_BLOCKS_PER_SM)                          \
        matvec_##NAME##_dp4a(const float* x, const unsigned* w, const S* scales, const S* biases, float* out,  \
                             unsigned in_dim, unsigned out_dim, unsigned group) {                           \
        matvec_dp4a<BITS, S, false>(x, w, scales, biases, out, in_dim, out_dim, group, DpNorm{});            \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * DP_WARPS, DP_BLOCKS_PER_SM)                          \
        matvec_norm_##NAME##_dp4a(float* residual, const float* add, const void* nw, float* normed,          \
                                  unsigned* counter, float eps, int zero_centered, int w_bf16,              \
                                  const unsigned* w, const S* scales, const S* biases, float* out,          \
                                  unsigned in_dim, unsigned out_dim, unsigned group) {                      \
        matvec_dp4a<BITS, S, true>(nullptr, w, scales, biases, out, in_dim, out_dim, group,                  \
                                   DpNorm{residual, add, nw, normed, counter, eps, zero_centered, w_bf16}); \
    }
MATVEC_DP4A(4, bf16, q4)
MATVEC_DP4A(8, bf16, q8)
MATVEC_DP4A(4, float, q4f)
MATVEC_DP4A(8, float, q8f)
