// Skinny tensor-core products: a few rows (tokens) against 4- or 8-bit weights, for batched
// decode steps and short chunks, where the tiles of gemm.cu (128 rows, a shared-memory round trip
// and a barrier per 64-value step) leave the GPU waiting on latency.
//
// The weights are the A operand of mma.sync m16n8k16 and the rows the B operand (n = 8 rows per
// tile, NT tiles of 8), so a warp takes 16 weight rows (output features) and up to 8 * NT rows of
// activations, and reads each weight once from memory straight into registers: no shared memory,
// no barrier in the K loop. Lanes g = lane / 4 take weight rows g and g + 8; lane q = lane % 4
// takes the q-th 16-byte piece of every 64-byte run of a row (32 4-bit or 16 8-bit values), and
// the activations of the same values. Which of the 16 K values of an mma a lane holds is up to us
// as long as A and B agree: a 4-bit word gives the bf16 pairs (v_j, v_j+4) its cheap
// dequantisation makes (dequant_q4_pairs), and the activations are paired the same way, with one
// byte permute each or, for the experts, stored paired (px_index); an 8-bit word gives (v0, v1),
// (v2, v3), the activations' own order.
// Dequantisation is the one gemm.cu uses, so both paths round every weight the same way.
//
// A block is SK_WARPS warps: SK_WARPS / KS groups of 16 features, each split over KS warps along
// K (partial sums added through shared memory) when a product has too few features x tiles to
// fill the GPU otherwise.
//
// skinny_permute_x_*: x rounded to bf16 in the layout the expert kernels read (px_index);
// moe_skinny_gate_up_*: act[pos] = silu(gate_e x_t) * (up_e x_t), bf16 in that layout, for the
//   rows of a tile of moe_sort's table (tiles of 8 * NT rows), x gathered from its permuted copy;
// moe_skinny_down_*: ys[slot] = weight[slot] * (down_e act[pos]), bf16 (then moe_combine);
// linear_skinny_*: out = x W^T in f32, x from its plain bf16 copy, 8 * NT tokens a block.
// Names: <kernel>_{q4,q8}_<NT>_<KS>.
#include "kestrel.cuh"

#if !defined(SK_WARPS)
#error "skinny.cu is compiled with ops/skinny.rs's SK_WARPS as a -D definition"
#endif
#define NO_TILE 0xffffffffu

// One quantised matrix: rows of K values, scales and biases per group of a row (bf16 or f32: S
// of the functions that read them).
struct QMat {
    const unsigned char* w;
    const void* s;
    const void* b;
};

// Where value k of a row of activations lies in the skinny kernels' own layout ("PX"), in which
// the 16-byte pieces a lane takes of a run of 4 * VALS values are stored so that the four lanes of
// a weight row load 64 contiguous bytes at once, and a 4-bit word's activation pairs (v_e, v_e+4)
// are already side by side: value VALS q + 8 i + e of a run goes to piece 4 i + q, place e (8-bit)
// or 2 e, 2 (e - 4) + 1 (4-bit).
template <int BITS>
__device__ __forceinline__ unsigned px_index(unsigned k) {
    constexpr unsigned VALS = 128 / BITS, RUN = 4 * VALS;
    const unsigned kr = k % RUN, q = kr / VALS, i = kr % VALS / 8, e = kr % 8;
    const unsigned p = BITS == 4 ? (e < 4 ? 2 * e : 2 * (e - 4) + 1) : e;
    return k - kr + 8 * (4 * i + q) + p;
}

// A 16-byte load of weights, which are read once: not kept in L1, where the activations live.
__device__ __forceinline__ uint4 ld_once(const unsigned char* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// One lane's share of one run of K: a 16-byte piece of rows g and g + 8 of each matrix, with the
// scale and bias of the group it lies in.
template <int M, typename S>
struct Run {
    uint4 w[M][2];
    S s[M][2], b[M][2];
};

// Runs a lane loads at once (D): enough bytes in flight per warp to cover memory latency at the
// occupancy its registers allow. Measured on the H200 at Qwen3-30B-A3B's shapes: two for gate
// and up of one row tile (91 us a layer at 64 tokens against 97 for one); one for down (52 us
// against 63 for four, whose registers halve the warps an SM holds).
template <int M, int NT>
__host__ __device__ constexpr int ahead() {
    return NT == 1 && M == 2 ? 2 : 1;
}

// acc[m][nt] += rows f0 .. f0 + 15 of matrix m times the activations of row tile nt, over
// K values [kbeg, kend) (multiples of the 64-byte run). xrow[nt]: the row of the activations
// this lane's B fragment takes (row g of tile nt). Weights are loaded D runs at a time, the next
// D while the current D are computed.
template <int BITS, int M, int NT, bool PX, typename S>
__device__ __forceinline__ void skinny_product(float (&acc)[M][NT][4], const QMat (&mats)[M], unsigned f0,
                                               unsigned K, unsigned group, const bf16* const (&xrow)[NT],
                                               unsigned kbeg, unsigned kend) {
    constexpr unsigned VALS = 128 / BITS, RUN = 4 * VALS;
    constexpr int D = ahead<M, NT>();
    const unsigned lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const size_t row_bytes = (size_t)K * BITS / 8, groups = K / group;
    const unsigned char* wrow[M][2];
    const S* srow[M][2];
    const S* brow[M][2];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const size_t row = f0 + g + 8 * r;
            wrow[m][r] = mats[m].w + row * row_bytes;
            srow[m][r] = static_cast<const S*>(mats[m].s) + row * groups;
            brow[m][r] = static_cast<const S*>(mats[m].b) + row * groups;
        }
    auto load = [&](Run<M, S>& run, unsigned k) {
        const unsigned gi = k / group;
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                run.w[m][r] = ld_once(wrow[m][r] + k * BITS / 8);
                run.s[m][r] = srow[m][r][gi];
                run.b[m][r] = brow[m][r][gi];
            }
    };
    Run<M, S> cur[D];
    const unsigned k0 = kbeg + q * VALS;
#pragma unroll
    for (int d = 0; d < D; d++)
        if (k0 + d * RUN < kend) load(cur[d], k0 + d * RUN);
    for (unsigned k1 = k0; k1 < kend; k1 += D * RUN) {
        Run<M, S> next[D];
#pragma unroll
        for (int d = 0; d < D; d++)
            if (k1 + (D + d) * RUN < kend) load(next[d], k1 + (D + d) * RUN);
#pragma unroll
        for (int d = 0; d < D; d++) {
            const unsigned k = k1 + d * RUN;
            if (k >= kend) break;
            const Run<M, S>& run = cur[d];
            uint4 xv[NT][VALS / 8];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int i = 0; i < (int)VALS / 8; i++)
                    xv[nt][i] = PX ? __ldg(reinterpret_cast<const uint4*>(xrow[nt] + k - q * VALS) + 4 * i + q)
                                   : __ldg(reinterpret_cast<const uint4*>(xrow[nt] + k) + i);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                unsigned wd[M][2];
#pragma unroll
                for (int m = 0; m < M; m++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const uint4& w = run.w[m][r];
                        wd[m][r] = j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
                    }
                if constexpr (BITS == 4) {
                    // Word j holds values 8j .. 8j + 7 of the lane's 32; the activations' uint4 j.
                    unsigned pa[M][2][4];
#pragma unroll
                    for (int m = 0; m < M; m++)
#pragma unroll
                        for (int r = 0; r < 2; r++) {
                            if constexpr (sizeof(S) == 4)
                                dequant_q4_pairs_f32(wd[m][r], run.s[m][r], run.b[m][r], pa[m][r]);
                            else
                                dequant_q4_pairs(wd[m][r], __bfloat162bfloat162(run.s[m][r]),
                                                 __bfloat162bfloat162(run.b[m][r]), pa[m][r]);
                        }
                    unsigned xp[NT][4];
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const uint4 X = xv[nt][j];
                        if constexpr (PX) {
                            xp[nt][0] = X.x;
                            xp[nt][1] = X.y;
                            xp[nt][2] = X.z;
                            xp[nt][3] = X.w;
                        } else {
                            xp[nt][0] = prmt(X.x, X.z, 0x5410);
                            xp[nt][1] = prmt(X.x, X.z, 0x7632);
                            xp[nt][2] = prmt(X.y, X.w, 0x5410);
                            xp[nt][3] = prmt(X.y, X.w, 0x7632);
                        }
                    }
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int m = 0; m < M; m++) {
                            const unsigned a[4] = {pa[m][0][2 * h], pa[m][1][2 * h], pa[m][0][2 * h + 1],
                                                   pa[m][1][2 * h + 1]};
#pragma unroll
                            for (int nt = 0; nt < NT; nt++)
                                mma_16816<bf16>(acc[m][nt], a, xp[nt][2 * h], xp[nt][2 * h + 1]);
                        }
                } else {
                    // Word j holds values 4j .. 4j + 3 of the lane's 16: half of the activations'
                    // uint4 j / 2.
#pragma unroll
                    for (int m = 0; m < M; m++) {
                        const uint2 d0 = dequant_q8(wd[m][0], to_f32(run.s[m][0]), to_f32(run.b[m][0]));
                        const uint2 d1 = dequant_q8(wd[m][1], to_f32(run.s[m][1]), to_f32(run.b[m][1]));
                        const unsigned a[4] = {d0.x, d1.x, d0.y, d1.y};
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) {
                            const uint4 X = xv[nt][j / 2];
                            mma_16816<bf16>(acc[m][nt], a, j % 2 ? X.z : X.x, j % 2 ? X.w : X.y);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int d = 0; d < D; d++) cur[d] = next[d];
    }
}

// A block's product: warp w takes features f0 = (blockIdx.x * (SK_WARPS / KS) + w / KS) * 16 and
// the (w % KS)-th share of K; the shares are summed into the first warp of each group, which then
// calls out(feature, tile row, v[M]) for every value (feature < 16 from f0, row < 8 * NT). Warps
// whose features lie past `features` compute nothing. Every thread of the block must call it.
template <int BITS, int M, int NT, int KS, bool PX, typename S, class Rows, class Out>
__device__ __forceinline__ void skinny_block(const QMat (&mats)[M], unsigned features, unsigned K, unsigned group,
                                             Rows xrow_of, Out out) {
    static_assert(SK_WARPS % KS == 0, "K shares divide the block's warps");
    constexpr unsigned RUN = 4 * 128 / BITS;
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, ks = warp % KS;
    const unsigned f0 = (blockIdx.x * (SK_WARPS / KS) + warp / KS) * 16;
    float acc[M][NT][4];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][nt][i] = 0.0f;
    const bool active = f0 < features;
    if (active) {
        const bf16* xrow[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) xrow[nt] = xrow_of(nt * 8 + lane / 4);
        const unsigned runs = K / RUN;
        skinny_product<BITS, M, NT, PX, S>(acc, mats, f0, K, group, xrow, runs * ks / KS * RUN, runs * (ks + 1) / KS * RUN);
    }
    if constexpr (KS > 1) {
        __shared__ float part[SK_WARPS][M * NT * 4][32];
        if (ks != 0) {
#pragma unroll
            for (int m = 0; m < M; m++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) part[warp][(m * NT + nt) * 4 + i][lane] = acc[m][nt][i];
        }
        __syncthreads();
        if (ks != 0) return;
#pragma unroll
        for (unsigned o = 1; o < KS; o++)
#pragma unroll
            for (int m = 0; m < M; m++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[m][nt][i] += part[warp + o][(m * NT + nt) * 4 + i][lane];
    }
    if (!active) return;
    // Accumulator i of tile nt: feature g (+ 8 for i >= 2), row 8 nt + 2 (lane % 4) + i % 2.
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float v[M];
#pragma unroll
            for (int m = 0; m < M; m++) v[m] = acc[m][nt][i];
            out(f0 + lane / 4 + 8 * (i / 2), nt * 8 + 2 * (lane % 4) + i % 2, v);
        }
}

__device__ __forceinline__ QMat qmat(const unsigned char* base, unsigned long long w, unsigned long long s,
                                     unsigned long long b) {
    return QMat{base + w, base + s, base + b};
}

// Grid (ceil(inter / (16 * SK_WARPS / KS)), max_tiles). xb: [tokens, hidden] bf16; act: [slots,
// inter] bf16 in sorted order.
template <int BITS, typename S, int NT, int KS>
__device__ void skinny_gate_up(const bf16* xb, const unsigned* order, const unsigned* tiles,
                               const unsigned char* experts, bf16* act, unsigned hidden, unsigned inter,
                               unsigned k, unsigned long long span, unsigned long long gw, unsigned long long gs,
                               unsigned long long gb, unsigned long long uw, unsigned long long us,
                               unsigned long long ub, unsigned group) {
    const unsigned* tile = tiles + 3 * blockIdx.y;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2];
    const unsigned char* sp = experts + (size_t)e * span;
    const QMat mats[2] = {qmat(sp, gw, gs, gb), qmat(sp, uw, us, ub)};
    skinny_block<BITS, 2, NT, KS, true, S>(
        mats, inter, hidden, group,
        [&](unsigned r) { return xb + (size_t)(order[pos0 + min(r, rows - 1)] / k) * hidden; },
        [&](unsigned f, unsigned r, const float (&v)[2]) {
            if (r < rows) act[(size_t)(pos0 + r) * inter + px_index<BITS>(f)] = __float2bfloat16_rn(silu(v[0]) * v[1]);
        });
}

// Grid (ceil(hidden / (16 * SK_WARPS / KS)), max_tiles). act: [slots, inter] bf16 in sorted order;
// ys: [slots, hidden] bf16 (weight times the f32 product, rounded once).
template <int BITS, typename S, int NT, int KS>
__device__ void skinny_down(const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,
                            const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter,
                            unsigned long long span, unsigned long long dw, unsigned long long ds,
                            unsigned long long db, unsigned group) {
    const unsigned* tile = tiles + 3 * blockIdx.y;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2];
    const QMat mats[1] = {qmat(experts + (size_t)e * span, dw, ds, db)};
    skinny_block<BITS, 1, NT, KS, true, S>(
        mats, hidden, inter, group, [&](unsigned r) { return act + (size_t)(pos0 + min(r, rows - 1)) * inter; },
        [&](unsigned f, unsigned r, const float (&v)[1]) {
            if (r >= rows) return;
            const unsigned slot = order[pos0 + r];
            ys[(size_t)slot * hidden + f] = __float2bfloat16_rn(weights[slot] * v[0]);
        });
}

// Grid (ceil(out_dim / (16 * SK_WARPS / KS)), ceil(tokens / (8 * NT))). xb: [tokens, in_dim]
// bf16; out: [tokens, out_dim] f32.
template <int BITS, typename S, int NT, int KS>
__device__ void skinny_linear(const bf16* xb, const unsigned char* w, const S* scales, const S* biases,
                              float* out, unsigned tokens, unsigned in_dim, unsigned out_dim, unsigned group) {
    const unsigned m0 = blockIdx.y * 8 * NT, rows = min(8u * NT, tokens - m0);
    const QMat mats[1] = {QMat{w, scales, biases}};
    skinny_block<BITS, 1, NT, KS, false, S>(
        mats, out_dim, in_dim, group, [&](unsigned r) { return xb + (size_t)(m0 + min(r, rows - 1)) * in_dim; },
        [&](unsigned f, unsigned r, const float (&v)[1]) {
            if (r < rows) out[(size_t)(m0 + r) * out_dim + f] = v[0];
        });
}

// x (f32 [rows, K]) rounded to bf16 in the PX layout for BITS-bit weights: one 16-byte piece of
// the output a thread (rows * K / 8 threads; K a multiple of the run).
template <int BITS>
__device__ void permute_x(const float* x, bf16* out, unsigned rows, unsigned K) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * K / 8) return;
    // Piece u of its run holds the eight consecutive values VALS q + 8 i' .. of the run, with
    // u = 4 i' + q; their place in the piece as px_index says.
    constexpr unsigned VALS = 128 / BITS, RUN = 4 * VALS;
    const size_t base = i * 8 - i * 8 % RUN;
    const unsigned u = i % (RUN / 8), q = u % 4, ii = u / 4;
    const float4* src = reinterpret_cast<const float4*>(x + base + VALS * q + 8 * ii);
    const float4 a = src[0], b = src[1];
    uint4 v;
    if constexpr (BITS == 4) {
        v = make_uint4(pack2<bf16>(a.x, b.x), pack2<bf16>(a.y, b.y), pack2<bf16>(a.z, b.z), pack2<bf16>(a.w, b.w));
    } else {
        v = make_uint4(pack2<bf16>(a.x, a.y), pack2<bf16>(a.z, a.w), pack2<bf16>(b.x, b.y), pack2<bf16>(b.z, b.w));
    }
    reinterpret_cast<uint4*>(out)[i] = v;
}

extern "C" __global__ void skinny_permute_x_q4(const float* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x<4>(x, out, rows, K);
}
extern "C" __global__ void skinny_permute_x_q8(const float* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x<8>(x, out, rows, K);
}

#define SKINNY_MOE(BITS, S, NAME, NT, KS)                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS) moe_skinny_gate_up_##NAME##_##NT##_##KS(   \
        const bf16* xb, const unsigned* order, const unsigned* tiles, const unsigned char* experts, bf16* act, \
        unsigned hidden, unsigned inter, unsigned k, unsigned long long span, unsigned long long gw,        \
        unsigned long long gs, unsigned long long gb, unsigned long long uw, unsigned long long us,         \
        unsigned long long ub, unsigned group) {                                                            \
        pdl_begin();                                                                                         \
        skinny_gate_up<BITS, S, NT, KS>(xb, order, tiles, experts, act, hidden, inter, k, span, gw, gs, gb, uw, us, \
                                     ub, group);                                                             \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS) moe_skinny_down_##NAME##_##NT##_##KS(      \
        const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,               \
        const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter, unsigned long long span,    \
        unsigned long long dw, unsigned long long ds, unsigned long long db, unsigned group) {              \
        pdl_begin();                                                                                         \
        skinny_down<BITS, S, NT, KS>(act, order, tiles, weights, experts, ys, hidden, inter, span, dw, ds, db,   \
                                  group);                                                                    \
    }
#define SKINNY_LINEAR(BITS, S, NAME, NT, KS)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS) linear_skinny_##NAME##_##NT##_##KS(        \
        const bf16* xb, const unsigned char* w, const S* scales, const S* biases, float* out,               \
        unsigned tokens, unsigned in_dim, unsigned out_dim, unsigned group) {                               \
        pdl_begin();                                                                                         \
        skinny_linear<BITS, S, NT, KS>(xb, w, scales, biases, out, tokens, in_dim, out_dim, group);             \
    }
// Kernel names: moe_skinny_{gate_up,down}_NAME_NT_KS, linear_skinny_NAME_NT_KS; NAME q4, q8 (bf16
// group scales and biases) or q4f, q8f (f32 ones).
#define SKINNY_FORMAT(BITS, S, NAME)                                                                          \
    SKINNY_MOE(BITS, S, NAME, 1, 1) SKINNY_MOE(BITS, S, NAME, 1, 4) SKINNY_MOE(BITS, S, NAME, 2, 1)            \
    SKINNY_MOE(BITS, S, NAME, 2, 4) SKINNY_MOE(BITS, S, NAME, 4, 1) SKINNY_MOE(BITS, S, NAME, 4, 4)            \
    SKINNY_LINEAR(BITS, S, NAME, 1, 1) SKINNY_LINEAR(BITS, S, NAME, 1, 4) SKINNY_LINEAR(BITS, S, NAME, 2, 1)   \
    SKINNY_LINEAR(BITS, S, NAME, 2, 4) SKINNY_LINEAR(BITS, S, NAME, 4, 1) SKINNY_LINEAR(BITS, S, NAME, 4, 4)

SKINNY_FORMAT(4, bf16, q4)
SKINNY_FORMAT(8, bf16, q8)
SKINNY_FORMAT(4, float, q4f)
SKINNY_FORMAT(8, float, q8f)
