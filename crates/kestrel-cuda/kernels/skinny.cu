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
// moe_skinny_gate_up_*: act[pos] = silu(gate_e x_t) * (up_e x_t), bf16 in that layout for down's
//   bits, for the rows of a tile of moe_sort's table (tiles of 8 * NT rows), x gathered from its
//   permuted copy;
// moe_skinny_down_*: ys[slot] = weight[slot] * (down_e act[pos]), bf16 (then moe_combine);
// linear_skinny_*: out = x W^T in f32, x from its plain bf16 copy, 8 * NT tokens a block.
// Names: <kernel>_{q4,q8}_<NT>_<KS>.
//
// On Hopper (sm_90a), the experts' products have a wgmma form for tiles of 16 to 64 rows
// (moe_wide_*, wide_permute_x_*), and so have projections of a few dozen tokens (linear_wide_*,
// on x from wide_permute_bf16_*): the section at the end of this file.
#include "kestrel.cuh"

#if !defined(SK_WARPS) || !defined(WS_STAGE) || !defined(WS_STAGES) || !defined(SK_PART) || !defined(SK_SCALE) || \
    !defined(SK_STAGED_NT) || !defined(SK_STAGE_PAD)
#error "skinny.cu is compiled with ops/skinny.rs's SK_WARPS, WS_STAGE, WS_STAGES, SK_PART, SK_SCALE, SK_STAGED_NT and SK_STAGE_PAD as -D definitions"
#endif
// The file is compiled as several modules, which NVRTC compiles side by side (the kernels of one
// module compile one after another): SK_PART 1 the skinny experts, 2 the wide experts, each for
// the formats of one scale type (SK_SCALE 0 bf16, 1 f32, 2 factored: SCALE_FORMATS below), and
// 3 the projections and the activations' layouts.
#define SK_EXPERTS 1
#define SK_WIDE_EXPERTS 2
#define SK_PROJECTIONS 3
#define NO_TILE 0xffffffffu

// One quantised matrix: rows of K values, its group scales' and biases' parts (plain bf16 or f32,
// or factored: S of the functions that read them, kestrel.cuh).
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
    Held<S> s[M][2], b[M][2];
};

// Runs a lane loads at once (D): enough bytes in flight per warp to cover memory latency at the
// occupancy its registers allow. Measured on the H200 at Qwen3-30B-A3B's shapes: two for gate
// and up of one row tile (91 us a layer at 64 tokens against 97 for one), and for the
// projections of one row tile (plain x, !PX: batched decode of 2, 4 and 8 sequences 2.0%, 1.4%
// and 0.8% faster than with one); one for the experts' down (52 us against 63 for four, whose
// registers halve the warps an SM holds; with two, 64 sequences 1% slower).
template <int M, int NT, bool PX>
__host__ __device__ constexpr int ahead() {
    return NT == 1 && (M == 2 || !PX) ? 2 : 1;
}

// acc[m][nt] += rows f0 .. f0 + 15 of matrix m times the activations of row tile nt, over
// K values [kbeg, kend) (multiples of the 64-byte run). xrow[nt]: the row of the activations
// this lane's B fragment takes (row g of tile nt), in global memory, or with XS in shared memory
// (staged by the block, ready once `ready()` returns, which is called after the first weights
// are asked for). Weights are loaded D runs at a time, the next D while the current D are
// computed.
template <int BITS, int M, int NT, bool PX, bool XS, typename S, class Ready>
__device__ __forceinline__ void skinny_product(float (&acc)[M][NT][4], const QMat (&mats)[M], unsigned f0,
                                               unsigned K, unsigned group, const bf16* const (&xrow)[NT],
                                               unsigned kbeg, unsigned kend, Ready ready) {
    constexpr unsigned VALS = 128 / BITS, RUN = 4 * VALS;
    constexpr int D = ahead<M, NT, PX>();
    const unsigned lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const size_t row_bytes = (size_t)K * BITS / 8, groups = K / group;
    const unsigned char* wrow[M][2];
    GroupRow<S> grow[M][2];
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const size_t row = f0 + g + 8 * r;
            wrow[m][r] = mats[m].w + row * row_bytes;
            grow[m][r] = GroupRow<S>(mats[m].s, mats[m].b, row, groups, K);
        }
    auto load = [&](Run<M, S>& run, unsigned k) {
        const unsigned gi = k / group;
#pragma unroll
        for (int m = 0; m < M; m++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                run.w[m][r] = ld_once(wrow[m][r] + k * BITS / 8);
                grow[m][r].get(gi, k, run.s[m][r], run.b[m][r]);
            }
    };
    // XA: one row tile of experts' activations read from global memory (down's form), each
    // lane's pieces of the next run copied a run ahead into its own slots of shared memory, as
    // its weights are loaded a run ahead into registers; each lane reads back only what it
    // copied, so no barrier. Read in the run they are multiplied in, they kept the first
    // products of every run waiting (ncu of down at 64 sequences: a third of the stall samples).
    constexpr bool XA = PX && !XS && NT == 1 && D == 1;
    __shared__ uint4 xa[XA ? SK_WARPS : 1][XA ? 2 : 1][VALS / 8][32];
    const unsigned warp = threadIdx.x / 32;
    auto stage = [&](unsigned slot, unsigned k) {
#pragma unroll
        for (int i = 0; i < (int)VALS / 8; i++)
            cp_async16_ca(&xa[warp][slot][i][lane],
                          reinterpret_cast<const uint4*>(xrow[0] + k - q * VALS) + 4 * i + q);
    };
    Run<M, S> cur[D];
    const unsigned k0 = kbeg + q * VALS;
#pragma unroll
    for (int d = 0; d < D; d++)
        if (k0 + d * RUN < kend) load(cur[d], k0 + d * RUN);
    if constexpr (XA) {
        if (k0 < kend) stage(0, k0);
        cp_async_commit();
    }
    ready();
    unsigned slot = 0;
    for (unsigned k1 = k0; k1 < kend; k1 += D * RUN) {
        Run<M, S> next[D];
#pragma unroll
        for (int d = 0; d < D; d++)
            if (k1 + (D + d) * RUN < kend) load(next[d], k1 + (D + d) * RUN);
        if constexpr (XA) {
            if (k1 + RUN < kend) stage(slot ^ 1, k1 + RUN);
            cp_async_commit();
            cp_async_wait_mem<1>();
        }
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
                    xv[nt][i] = XA   ? xa[warp][slot][i][lane]
                                : XS ? reinterpret_cast<const uint4*>(xrow[nt] + k - q * VALS)[4 * i + q]
                                : PX ? __ldg(reinterpret_cast<const uint4*>(xrow[nt] + k - q * VALS) + 4 * i + q)
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
                            if constexpr (sizeof(Held<S>) == 4)
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
        slot ^= 1;
    }
}

// A block's product: warp w takes features f0 = (blockIdx.x * (SK_WARPS / KS) + w / KS) * 16 and
// the (w % KS)-th share of K; the shares are summed into the first warp of each group, which then
// calls out(feature, tile row, v[M]) for every value (feature < 16 from f0, row < 8 * NT). Warps
// whose features lie past `features` compute nothing. Every thread of the block must call it.
// With XS, the block first copies its `rows` rows of activations (xrow_of(r), K values each; the
// tile's rows past them read its last) into dynamic shared memory, rows SK_STAGE_PAD values apart
// beyond K (so the eight lanes of a 16-byte load's phase, two rows' 64 bytes, hit distinct banks),
// and every warp reads them there. Read from global memory (the block's warps, and the blocks of
// other features of the same tile, each load them), about half missed L1 and each run waited on
// L2. ncu of Qwen3-30B-A3B's gate/up at 64 sequences, with all eight rows staged (161 registers
// then, three blocks a multiprocessor): long-scoreboard stalls 4.4 -> 0.7 an issue, 97-103 -> 86
// us; down, whose rows are a third as long, gained nothing so (51 -> 52 us). The warps that
// compute wait for the copies on barrier 1, which the others only arrive at.
template <int BITS, int M, int NT, int KS, bool PX, bool XS, typename S, class Rows, class Out>
__device__ __forceinline__ void skinny_block(const QMat (&mats)[M], unsigned features, unsigned K, unsigned group,
                                             unsigned rows, Rows xrow_of, Out out) {
    static_assert(SK_WARPS % KS == 0, "K shares divide the block's warps");
    static_assert(!XS || PX, "staged activations are the experts' (PX layout)");
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
    extern __shared__ __align__(16) unsigned char sk_smem[];
    bf16* xs = reinterpret_cast<bf16*>(sk_smem);
    const unsigned xs_stride = K + SK_STAGE_PAD;
    if constexpr (XS) {
        const unsigned pieces = K / 8;
        for (unsigned i = threadIdx.x; i < min(rows, 8u * NT) * pieces; i += blockDim.x) {
            const unsigned r = i / pieces, u = i % pieces;
            cp_async16(xs + r * xs_stride + 8 * u, xrow_of(r) + 8 * u, true);
        }
        cp_async_commit();
        if (!active) {
            cp_async_wait<0>();
            asm volatile("bar.arrive 1, %0;" ::"r"(blockDim.x) : "memory");
        }
    }
    if (active) {
        const bf16* xrow[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
            xrow[nt] = XS ? xs + min(nt * 8 + lane / 4, rows - 1) * xs_stride : xrow_of(nt * 8 + lane / 4);
        const unsigned runs = K / RUN;
        skinny_product<BITS, M, NT, PX, XS, S>(acc, mats, f0, K, group, xrow, runs * ks / KS * RUN,
                                               runs * (ks + 1) / KS * RUN, [&] {
                                                   if constexpr (XS) {
                                                       cp_async_wait<0>();
                                                       asm volatile("bar.sync 1, %0;" ::"r"(blockDim.x) : "memory");
                                                   }
                                               });
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
// inter] bf16 in sorted order, in the PX layout of down's ABITS-bit weights.
template <int BITS, typename S, int NT, int KS, int ABITS>
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
    skinny_block<BITS, 2, NT, KS, true, (NT <= SK_STAGED_NT), S>(
        mats, inter, hidden, group, rows,
        [&](unsigned r) { return xb + (size_t)(order[pos0 + min(r, rows - 1)] / k) * hidden; },
        [&](unsigned f, unsigned r, const float (&v)[2]) {
            if (r < rows) act[(size_t)(pos0 + r) * inter + px_index<ABITS>(f)] = __float2bfloat16_rn(silu(v[0]) * v[1]);
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
    skinny_block<BITS, 1, NT, KS, true, false, S>(
        mats, hidden, inter, group, rows, [&](unsigned r) { return act + (size_t)(pos0 + min(r, rows - 1)) * inter; },
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
    skinny_block<BITS, 1, NT, KS, false, false, S>(
        mats, out_dim, in_dim, group, rows, [&](unsigned r) { return xb + (size_t)(m0 + min(r, rows - 1)) * in_dim; },
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

#if SK_PART == SK_PROJECTIONS
extern "C" __global__ void skinny_permute_x_q4(const float* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x<4>(x, out, rows, K);
}
extern "C" __global__ void skinny_permute_x_q8(const float* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x<8>(x, out, rows, K);
}
#endif

// Blocks a multiprocessor must hold of a skinny gate/up kernel: four (registers capped at 128) for
// the staged 4-bit bf16-scale kernels of one K share, which fit them without spilling; else as
// many as their registers allow.
#define SK_GATE_UP_BLOCKS(BITS, S, NT, KS) (BITS == 4 && NT <= SK_STAGED_NT && KS == 1 && sizeof(Held<S>) == 2 ? 4 : 1)
#define SKINNY_GATE_UP(BITS, S, NAME, NT, KS, ABITS)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS, SK_GATE_UP_BLOCKS(BITS, S, NT, KS))       \
        moe_skinny_gate_up_##NAME##_##NT##_##KS(                                                            \
        const bf16* xb, const unsigned* order, const unsigned* tiles, const unsigned char* experts, bf16* act, \
        unsigned hidden, unsigned inter, unsigned k, unsigned long long span, unsigned long long gw,        \
        unsigned long long gs, unsigned long long gb, unsigned long long uw, unsigned long long us,         \
        unsigned long long ub, unsigned group) {                                                            \
        pdl_begin();                                                                                         \
        skinny_gate_up<BITS, S, NT, KS, ABITS>(xb, order, tiles, experts, act, hidden, inter, k, span, gw, gs, gb, uw, \
                                            us, ub, group);                                                  \
    }
#define SKINNY_MOE(BITS, S, NAME, NT, KS)                                                                             \
    SKINNY_GATE_UP(BITS, S, NAME, NT, KS, BITS)                                                              \
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
// group scales and biases), q4f, q8f (f32 ones) or, for the experts only, q4k, q8k (factored).
// moe_skinny_gate_up_NAME_actA_NT_KS: gate and up beside a down of the other bits A (GGUF's Q6_K
// down beside Q4_K gate and up), the activations written in down's layout.
// (ACT: NAME_actA, A = 12 - BITS.)
#define SKINNY_MOE_FORMAT(BITS, S, NAME, ACT)                                                                 \
    SKINNY_MOE(BITS, S, NAME, 1, 1) SKINNY_MOE(BITS, S, NAME, 1, 4) SKINNY_MOE(BITS, S, NAME, 2, 1)            \
    SKINNY_MOE(BITS, S, NAME, 2, 4) SKINNY_MOE(BITS, S, NAME, 4, 1) SKINNY_MOE(BITS, S, NAME, 4, 4)            \
    SKINNY_GATE_UP(BITS, S, ACT, 1, 1, 12 - BITS) SKINNY_GATE_UP(BITS, S, ACT, 1, 4, 12 - BITS)                \
    SKINNY_GATE_UP(BITS, S, ACT, 2, 1, 12 - BITS) SKINNY_GATE_UP(BITS, S, ACT, 2, 4, 12 - BITS)                \
    SKINNY_GATE_UP(BITS, S, ACT, 4, 1, 12 - BITS) SKINNY_GATE_UP(BITS, S, ACT, 4, 4, 12 - BITS)

// The formats, each as (BITS, S, NAME, ACT), written once for the skinny and wide kernels:
// projections take the plain ones (bf16 and f32 scales), an experts' module those of SK_SCALE.
#define BF16_FORMATS(F) F(4, bf16, q4, q4_act8) F(8, bf16, q8, q8_act4)
#define F32_FORMATS(F) F(4, float, q4f, q4f_act8) F(8, float, q8f, q8f_act4)
#define PLAIN_FORMATS(F) BF16_FORMATS(F) F32_FORMATS(F)
#if SK_SCALE == 0
#define SCALE_FORMATS(F) BF16_FORMATS(F)
#elif SK_SCALE == 1
#define SCALE_FORMATS(F) F32_FORMATS(F)
#else
#define SCALE_FORMATS(F) F(4, Factored, q4k, q4k_act8) F(8, Factored, q8k, q8k_act4)
#endif
#define SKINNY_LINEAR_FORMAT(BITS, S, NAME, ACT)                                                              \
    SKINNY_LINEAR(BITS, S, NAME, 1, 1) SKINNY_LINEAR(BITS, S, NAME, 1, 4) SKINNY_LINEAR(BITS, S, NAME, 2, 1)   \
    SKINNY_LINEAR(BITS, S, NAME, 2, 4) SKINNY_LINEAR(BITS, S, NAME, 4, 1) SKINNY_LINEAR(BITS, S, NAME, 4, 4)
#if SK_PART == SK_EXPERTS
SCALE_FORMATS(SKINNY_MOE_FORMAT)
#elif SK_PART == SK_PROJECTIONS
PLAIN_FORMATS(SKINNY_LINEAR_FORMAT)
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ---- the experts on wgmma (sm_90a): wide tiles ----
//
// For the 8 to 32 rows an expert gets in a large batched step or a short prefill chunk, where the
// products above load each row's activations once per warp and gemm.cu's 128-row tiles
// dequantise every weight into shared memory for rows that are mostly padding. A warpgroup takes
// 64 features (16 a warp; the lanes' shares of the weights as above, dequantised into the register
// A operand of wgmma m64nNk16) of one matrix against a tile of N rows of moe_sort's table (the B
// operand, from shared memory); gate/up's blocks are two warpgroups, one a matrix, sharing the
// rows. The rows stream through WS_STAGES stages of WS_STAGE values by cp.async, in the 128-byte
// swizzle. They are stored in the order the A registers take their K values (the PW layout,
// pw_index), so a stage is a plain copy of each row's next 256 bytes. The weights of a stage are
// loaded about WS_AHEAD stages ahead into registers, then dequantised and multiplied, 8 slices of
// 16 values, as one group of products (tiles of 32 and 64 rows) or two (16; see wide_product).
// Registers bound the blocks a multiprocessor holds, so per-thread state is kept small (one
// weight pointer, offsets for the scales, row addresses read from shared memory at each copy). Measured against the skinny products and the GEMM tiles at Qwen3-30B-A3B's
// shapes (ops/skinny.rs moe_wide_rows): faster from 8 to 32 rows an expert, slower at 4 and 64.
static_assert(WS_STAGE == 128, "a stage is a 4-bit run or two 8-bit runs: two 64-value slabs");
#define WS_AHEAD 2

// Where value k of a row of activations lies in the PW layout for BITS-bit weights. A run of
// 4 * VALS values (a 16-byte piece of each of four lanes) is 8 (4-bit) or 4 (8-bit) slices of 16
// positions, one product's K each. Lane q's value v of the run goes where its dequantised pair
// sits in the A registers: 4-bit word j = v / 8 gives the pairs (e, e + 4) of its nibbles e < 4,
// pair e in slice 2 j + e / 2 at positions 2 q, 2 q + 1 (+ 8 for odd e); 8-bit word j = v / 4
// gives the pairs (0, 1) and (2, 3), in slice j at 2 q and 2 q + 8.
template <int BITS>
__device__ __forceinline__ unsigned pw_index(unsigned k) {
    constexpr unsigned VALS = 128 / BITS, RUN = 4 * VALS;
    const unsigned kr = k % RUN, q = kr / VALS, v = kr % VALS;
    unsigned slice, pos;
    if constexpr (BITS == 4) {
        const unsigned e = v % 8, pair = e % 4;
        slice = 2 * (v / 8) + pair / 2;
        pos = 8 * (pair % 2) + 2 * q + e / 4;
    } else {
        const unsigned e = v % 4;
        slice = v / 4;
        pos = 8 * (e / 2) + 2 * q + e % 2;
    }
    return k - kr + 16 * slice + pos;
}

// A stage's weights for one lane: a run of 4-bit or two of 8-bit values.
template <int BITS, typename S>
struct WStage {
    Run<1, S> run[WS_STAGE / (512 / BITS)];
};

// The A operands of one 64-value slab of a stage (slices 4 sl .. 4 sl + 3): 4-bit words 2 sl and
// 2 sl + 1 of the run, or the 8-bit run sl.
template <int BITS, typename S>
__device__ __forceinline__ void wide_dequant(unsigned (&a)[4][4], const WStage<BITS, S>& st, int sl) {
#pragma unroll
    for (int jj = 0; jj < (BITS == 4 ? 2 : 4); jj++) {
        const Run<1, S>& run = st.run[BITS == 4 ? 0 : sl];
        const int j = BITS == 4 ? 2 * sl + jj : jj;
        unsigned wd[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const uint4& w = run.w[0][r];
            wd[r] = j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
        }
        if constexpr (BITS == 4) {
            unsigned pa[2][4];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if constexpr (sizeof(Held<S>) == 4)
                    dequant_q4_pairs_f32(wd[r], run.s[0][r], run.b[0][r], pa[r]);
                else
                    dequant_q4_pairs(wd[r], __bfloat162bfloat162(run.s[0][r]), __bfloat162bfloat162(run.b[0][r]), pa[r]);
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                a[2 * jj + h][0] = pa[0][2 * h];
                a[2 * jj + h][1] = pa[1][2 * h];
                a[2 * jj + h][2] = pa[0][2 * h + 1];
                a[2 * jj + h][3] = pa[1][2 * h + 1];
            }
        } else {
            uint2 d[2];
#pragma unroll
            for (int r = 0; r < 2; r++) d[r] = dequant_q8(wd[r], to_f32(run.s[0][r]), to_f32(run.b[0][r]));
            a[jj][0] = d[0].x;
            a[jj][1] = d[1].x;
            a[jj][2] = d[0].y;
            a[jj][3] = d[1].y;
        }
    }
}

// acc += rows f0 + 16 * (warp % 4) .. of `mat` (this warp's 16 features of its warpgroup's 64)
// times the N rows rows_src[r] (null: zeros) over K values kbeg .. kbeg + stages * WS_STAGE of
// the K a row holds (all multiples of WS_STAGE). The block's WG warpgroups share the rows: they
// copy each stage together into smem (1024-byte aligned). Stage
// t + 2 is copied while stage t is multiplied (four slots, so the slot refilled was last read by
// stage t - 2, whose products are done). ONE_GROUP false: each stage's two slabs are separate
// groups of products, the second dequantised while the first runs, which makes ptxas serialise
// every product (its warning C7513: registers of a later product written while one is in flight).
// ONE_GROUP true: a stage's two slabs are dequantised after the last stage's products are done,
// then run as one group of eight unserialised products. Measured on an H200 at Qwen3-30B-A3B's
// shapes: tiles of 32 and 64 rows faster as one group (gate/up 137 to 125 us a layer at 256
// sequences, 120 to 112 at 512 tokens), tiles of 16 not (128 sequences 2.5% slower).
template <int BITS, int N, int WG, typename S, bool ONE_GROUP>
__device__ __forceinline__ void wide_product(float (&acc)[N / 2], const QMat& mat, unsigned f0, unsigned K,
                                             unsigned group, const bf16* const* rows_src, bf16* smem,
                                             unsigned kbeg, unsigned stages) {
    static_assert(WS_STAGES == 4, "stages are copied two ahead into four slots");
    constexpr unsigned VALS = 128 / BITS, RUN = 4 * VALS, RPS = WS_STAGE / RUN, THREADS = 128 * WG;
    // bf16 values of 64 columns of the rows; 16-byte copies a thread
    constexpr unsigned SLAB = N * 64, PIECES = (N * 16 + THREADS - 1) / THREADS;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4, g = lane / 4, q = lane % 4;
    const unsigned row_bytes = K * BITS / 8, groups = K / group;
    // Rows f0 + 16 * warp + g and 8 further of the weights.
    const unsigned frow = f0 + 16 * warp + g;
    const unsigned char* w0 = mat.w + frow * row_bytes;
    // Their groups from `sg` (factored: the multiples so, the units from frow's), addressed at
    // each load: registers bound the blocks a multiprocessor holds.
    const unsigned sg = frow * groups;
    // This thread's 16-byte pieces of a stage: row r, piece u of its 256 bytes (64-column slab
    // u / 8, at piece u % 8 swizzled by the row).
    auto copy = [&](unsigned t) {
        bf16* slot = smem + t % WS_STAGES * 2 * SLAB;
#pragma unroll
        for (unsigned j = 0; j < PIECES; j++) {
            const unsigned i = threadIdx.x + THREADS * j, r = i / 16, u = i % 16;
            if (N * 16 % THREADS == 0 || i < N * 16) {
                const bf16* row = rows_src[r];
                cp_async16(slot + u / 8 * SLAB + r * 64 + (((u % 8) ^ (r % 8)) << 3),
                           (row ? row : rows_src[0]) + 8 * u + kbeg + t * WS_STAGE, row != nullptr);
            }
        }
    };
    auto load = [&](WStage<BITS, S>& st, unsigned t) {
#pragma unroll
        for (unsigned rr = 0; rr < RPS; rr++) {
            const unsigned k = kbeg + t * WS_STAGE + rr * RUN + q * VALS, gi = sg + k / group;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                st.run[rr].w[0][r] = ld_once(w0 + 8 * r * row_bytes + k * BITS / 8);
                if constexpr (is_factored<S>) {
                    const Factored f = static_cast<const Factored*>(mat.s)[gi + 8 * r * groups];
                    const float2 unit =
                        static_cast<const float2*>(mat.b)[(size_t)(frow + 8 * r) * (K / 256) + k / 256];
                    st.run[rr].s[0][r] = unit.x * (float)f.s;
                    st.run[rr].b[0][r] = unit.y * (float)f.b;
                } else {
                    st.run[rr].s[0][r] = static_cast<const S*>(mat.s)[gi + 8 * r * groups];
                    st.run[rr].b[0][r] = static_cast<const S*>(mat.b)[gi + 8 * r * groups];
                }
            }
        }
    };
#pragma unroll
    for (unsigned t = 0; t < 2; t++) {
        if (t < stages) copy(t);
        cp_async_commit();
    }
    WStage<BITS, S> ahead[WS_AHEAD];
#pragma unroll
    for (unsigned d = 0; d < WS_AHEAD; d++)
        if (d < stages) load(ahead[d], d);
    unsigned a[2][4][4];
    for (unsigned t0 = 0; t0 < stages; t0 += WS_AHEAD) {
#pragma unroll
        for (unsigned d = 0; d < WS_AHEAD; d++) {
            const unsigned t = t0 + d;
            if (t >= stages) break;
            // Every product but stage t - 1's second slab is done (slot t + 2 and a[0] are free;
            // in one group, every product but stage t - 1's), and stage t is in shared memory for
            // every thread.
            if constexpr (!ONE_GROUP) wgmma_wait<1>();
            cp_async_wait<1>();
            fence_proxy_async();
            __syncthreads();
            if (t + 2 < stages) copy(t + 2);
            cp_async_commit();
            const unsigned long long desc = sw128_desc(smem + t % WS_STAGES * 2 * SLAB);
            if constexpr (ONE_GROUP) {
                // Stage t - 1's products are done before both slabs are dequantised: ptxas then
                // lets the stage's eight products run back to back.
                wgmma_wait<0>();
#pragma unroll
                for (int sl = 0; sl < 2; sl++) wide_dequant<BITS, S>(a[sl], ahead[d], sl);
                if (t + WS_AHEAD < stages) load(ahead[d], t + WS_AHEAD);
                wgmma_fence();
#pragma unroll
                for (int sl = 0; sl < 2; sl++)
#pragma unroll
                    for (int s = 0; s < 4; s++) wgmma_rs<N>(acc, a[sl][s], desc + sl * (SLAB / 8) + 2 * s);
                wgmma_commit();
            } else {
#pragma unroll
                for (int sl = 0; sl < 2; sl++) {
                    if (sl == 1) wgmma_wait<1>();  // stage t - 1's second slab: a[1] is free
                    wide_dequant<BITS, S>(a[sl], ahead[d], sl);
                    // The stage's weights are all in a[] now: their registers take stage t + WS_AHEAD.
                    if (sl == 1 && t + WS_AHEAD < stages) load(ahead[d], t + WS_AHEAD);
                    wgmma_fence();
#pragma unroll
                    for (int s = 0; s < 4; s++) wgmma_rs<N>(acc, a[sl][s], desc + sl * (SLAB / 8) + 2 * s);
                    wgmma_commit();
                }
            }
        }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");
}

// The product of a tile's first NR rows over K's stages [kbeg / WS_STAGE, + stages), then
// out(feature, tile row, v[WG]) for every value of the block's 64 features (blockIdx.x * 64 ..):
// v[w] the product with mats[w], taken by warpgroup w (the second's handed to the first through
// shared memory).
template <int BITS, int NR, int WG, typename S, bool ONE_GROUP, class Out>
__device__ __forceinline__ void wide_rows(const QMat (&mats)[WG], unsigned K, unsigned group,
                                          const bf16* const* rows_src, bf16* smem, unsigned kbeg, unsigned stages,
                                          Out out) {
    const unsigned f0 = blockIdx.x * 64, lane = threadIdx.x % 32, wg = threadIdx.x / 128, t = threadIdx.x % 128;
    float acc[NR / 2];
#pragma unroll
    for (int i = 0; i < NR / 2; i++) acc[i] = 0.0f;
    wide_product<BITS, NR, WG, S, ONE_GROUP>(acc, mats[wg], f0, K, group, rows_src, smem, kbeg, stages);
    float* other = reinterpret_cast<float*>(smem);  // [NR / 2][128], over the stages
    if constexpr (WG == 2) {
        __syncthreads();  // every product is done: the stages are free
        if (wg == 1) {
#pragma unroll
            for (int i = 0; i < NR / 2; i++) other[i * 128 + t] = acc[i];
        }
        __syncthreads();
        if (wg == 1) return;
    }
    // Accumulator 4 i + e: feature lane / 4 (+ 8 for e >= 2) of the warp's 16, row 8 i + 2 (lane
    // % 4) + e % 2.
    const unsigned f = f0 + 16 * (threadIdx.x / 32 % 4) + lane / 4;
#pragma unroll
    for (int i = 0; i < NR / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v[WG];
            v[0] = acc[4 * i + e];
            if constexpr (WG == 2) v[1] = other[(4 * i + e) * 128 + t];
            out(f + 8 * (e / 2), 8 * i + 2 * (lane % 4) + e % 2, v);
        }
}

// A block's product over a tile of up to N rows: on products N / 2 wide when the tile's `rows`
// fit them (a tile of an expert's last rows), else N.
template <int BITS, int N, int WG, typename S, bool ONE_GROUP, class Out>
__device__ __forceinline__ void wide_block(const QMat (&mats)[WG], unsigned K, unsigned group, unsigned rows,
                                           const bf16* const* rows_src, unsigned char* smem_raw, unsigned kbeg,
                                           unsigned stages, Out out) {
    bf16* smem = reinterpret_cast<bf16*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
    if constexpr (N > 8) {
        if (rows <= N / 2) {
            wide_rows<BITS, N / 2, WG, S, ONE_GROUP>(mats, K, group, rows_src, smem, kbeg, stages, out);
            return;
        }
    }
    wide_rows<BITS, N, WG, S, ONE_GROUP>(mats, K, group, rows_src, smem, kbeg, stages, out);
}

// Grid (inter / 64, max_tiles), 256 threads (gate on the first warpgroup, up on the second),
// wide_smem(N) bytes (ops/skinny.rs). xb: [tokens, hidden] bf16 in the PW layout; act: [slots,
// inter] bf16 in sorted order and the PW layout of down's ABITS-bit weights.
template <int BITS, typename S, int N, int ABITS>
__device__ void wide_gate_up(const bf16* xb, const unsigned* order, const unsigned* tiles,
                             const unsigned char* experts, bf16* act, unsigned hidden, unsigned inter, unsigned k,
                             unsigned long long span, unsigned long long gw, unsigned long long gs,
                             unsigned long long gb, unsigned long long uw, unsigned long long us,
                             unsigned long long ub, unsigned group) {
    extern __shared__ __align__(16) unsigned char ws_smem[];
    __shared__ const bf16* rows_src[N];
    const unsigned* tile = tiles + 3 * blockIdx.y;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2];
    for (unsigned r = threadIdx.x; r < N; r += blockDim.x)
        rows_src[r] = r < rows ? xb + (size_t)(order[pos0 + r] / k) * hidden : nullptr;
    __syncthreads();
    const unsigned char* sp = experts + (size_t)e * span;
    const QMat mats[2] = {qmat(sp, gw, gs, gb), qmat(sp, uw, us, ub)};
    wide_block<BITS, N, 2, S, (N >= 32)>(mats, hidden, group, rows, rows_src, ws_smem, 0, hidden / WS_STAGE, [&](unsigned f, unsigned r, const float (&v)[2]) {
        if (r < rows) act[(size_t)(pos0 + r) * inter + pw_index<ABITS>(f)] = __float2bfloat16_rn(silu(v[0]) * v[1]);
    });
}

// Grid (hidden / 64, max_tiles), 128 threads, wide_smem(N) bytes. act: [slots, inter] bf16 in
// sorted order and the PW layout; ys: [slots, hidden] bf16 (weight times the f32 product, rounded
// once).
template <int BITS, typename S, int N>
__device__ void wide_down(const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,
                          const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter,
                          unsigned long long span, unsigned long long dw, unsigned long long ds,
                          unsigned long long db, unsigned group) {
    extern __shared__ __align__(16) unsigned char ws_smem[];
    __shared__ const bf16* rows_src[N];
    __shared__ unsigned row_slot[N];
    __shared__ float row_weight[N];
    const unsigned* tile = tiles + 3 * blockIdx.y;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2];
    for (unsigned r = threadIdx.x; r < N; r += blockDim.x) {
        rows_src[r] = r < rows ? act + (size_t)(pos0 + r) * inter : nullptr;
        if (r < rows) {
            row_slot[r] = order[pos0 + r];
            row_weight[r] = weights[row_slot[r]];
        }
    }
    __syncthreads();
    const QMat mats[1] = {qmat(experts + (size_t)e * span, dw, ds, db)};
    wide_block<BITS, N, 1, S, (N >= 32)>(mats, inter, group, rows, rows_src, ws_smem, 0, inter / WS_STAGE, [&](unsigned f, unsigned r, const float (&v)[1]) {
        if (r < rows) ys[(size_t)row_slot[r] * hidden + f] = __float2bfloat16_rn(row_weight[r] * v[0]);
    });
}

// Grid (out_dim / 64, ceil(tokens / N), splits), 128 threads, wide_smem(N) bytes: a projection
// of a few dozen tokens on wgmma. xb: [tokens, in_dim] bf16 in the PW layout; out: [tokens,
// out_dim] f32. With more than one split (too few blocks to fill the GPU), block z takes the z-th
// of `splits` equal ranges of K (whole stages) and writes its partial tile to `part` ([splits]
// [tiles][N][64]); the last block of a tile to finish (counted in counters[tile], left at zero
// again) adds the partials in order of z, so the sum is the same whichever finishes last.
template <int BITS, typename S, int N>
__device__ void wide_linear(const bf16* xb, const unsigned char* w, const S* scales, const S* biases, float* out,
                            float* part, unsigned* counters, unsigned tokens, unsigned in_dim, unsigned out_dim,
                            unsigned group) {
    extern __shared__ __align__(16) unsigned char ws_smem[];
    __shared__ const bf16* rows_src[N];
    __shared__ bool last;
    const unsigned m0 = blockIdx.y * N, rows = min((unsigned)N, tokens - m0), f0 = blockIdx.x * 64;
    const unsigned splits = gridDim.z, z = blockIdx.z, stages = in_dim / WS_STAGE / splits;
    for (unsigned r = threadIdx.x; r < N; r += blockDim.x)
        rows_src[r] = r < rows ? xb + (size_t)(m0 + r) * in_dim : nullptr;
    __syncthreads();
    const QMat mats[1] = {QMat{w, scales, biases}};
    const unsigned tile = blockIdx.y * gridDim.x + blockIdx.x, tiles = gridDim.x * gridDim.y;
    auto partial = [&](unsigned zz) { return part + ((size_t)zz * tiles + tile) * N * 64; };
    float* mine = splits > 1 ? partial(z) : nullptr;
    wide_block<BITS, N, 1, S, (N >= 32)>(mats, in_dim, group, rows, rows_src, ws_smem, z * stages * WS_STAGE, stages,
                                         [&](unsigned f, unsigned r, const float (&v)[1]) {
                                             if (r >= rows) return;
                                             if (splits == 1)
                                                 out[(size_t)(m0 + r) * out_dim + f] = v[0];
                                             else
                                                 __stcg(mine + r * 64 + (f - f0), v[0]);
                                         });
    if (splits == 1) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + tile, 1u) == splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Thread t adds values t, t + 128, ... of the tile (row e / 64, feature e % 64) over the
    // splits, all of a split's loads issued before any add.
    constexpr unsigned PER = N * 64 / 128;
    float sum[PER];
#pragma unroll
    for (unsigned i = 0; i < PER; i++) sum[i] = 0.0f;
    for (unsigned zz = 0; zz < splits; zz++) {
        const float* p = partial(zz);
        float v[PER];
#pragma unroll
        for (unsigned i = 0; i < PER; i++)
            v[i] = (threadIdx.x + 128 * i) / 64 < rows ? __ldcg(p + threadIdx.x + 128 * i) : 0.0f;
#pragma unroll
        for (unsigned i = 0; i < PER; i++) sum[i] += v[i];
    }
#pragma unroll
    for (unsigned i = 0; i < PER; i++) {
        const unsigned e = threadIdx.x + 128 * i, r = e / 64;
        if (r < rows) out[(size_t)(m0 + r) * out_dim + f0 + e % 64] = sum[i];
    }
    if (threadIdx.x == 0) counters[tile] = 0;
}

// x ([rows, K], f32 or bf16) rounded to bf16 in the PW layout for BITS-bit weights: eight values
// a thread (rows * K / 8 threads; K a multiple of the run).
template <int BITS, typename T>
__device__ void permute_x_pw(const T* x, bf16* out, unsigned rows, unsigned K) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * K / 8) return;
    const size_t row = i * 8 / K;
    const unsigned k0 = i * 8 % K;
    bf16 v[8];
    if constexpr (sizeof(T) == 4) {
        const float4* src = reinterpret_cast<const float4*>(x + i * 8);
        const float4 a = src[0], b = src[1];
        const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (unsigned j = 0; j < 8; j++) v[j] = __float2bfloat16_rn(f[j]);
    } else {
        const uint4 u = *reinterpret_cast<const uint4*>(x + i * 8);
        memcpy(v, &u, sizeof(u));
    }
    bf16* dst = out + row * K;
#pragma unroll
    for (unsigned j = 0; j < 8; j++) dst[pw_index<BITS>(k0 + j)] = v[j];
}

#if SK_PART == SK_PROJECTIONS
extern "C" __global__ void wide_permute_x_q4(const float* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x_pw<4>(x, out, rows, K);
}
extern "C" __global__ void wide_permute_x_q8(const float* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x_pw<8>(x, out, rows, K);
}
extern "C" __global__ void wide_permute_bf16_q4(const bf16* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x_pw<4>(x, out, rows, K);
}
extern "C" __global__ void wide_permute_bf16_q8(const bf16* x, bf16* out, unsigned rows, unsigned K) {
    pdl_begin();
    permute_x_pw<8>(x, out, rows, K);
}
#endif

#define WIDE_GATE_UP(BITS, S, NAME, N, ABITS)                                                               \
    extern "C" __global__ void __launch_bounds__(256, 2) moe_wide_gate_up_##NAME##_##N(                       \
        const bf16* xb, const unsigned* order, const unsigned* tiles, const unsigned char* experts, bf16* act, \
        unsigned hidden, unsigned inter, unsigned k, unsigned long long span, unsigned long long gw,        \
        unsigned long long gs, unsigned long long gb, unsigned long long uw, unsigned long long us,         \
        unsigned long long ub, unsigned group) {                                                            \
        pdl_begin();                                                                                         \
        wide_gate_up<BITS, S, N, ABITS>(xb, order, tiles, experts, act, hidden, inter, k, span, gw, gs, gb, uw, us, \
                                        ub, group);                                                          \
    }
#define WIDE_MOE(BITS, S, NAME, N)                                                                         \
    WIDE_GATE_UP(BITS, S, NAME, N, BITS)                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 4) moe_wide_down_##NAME##_##N(                          \
        const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,               \
        const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter, unsigned long long span,    \
        unsigned long long dw, unsigned long long ds, unsigned long long db, unsigned group) {              \
        pdl_begin();                                                                                         \
        wide_down<BITS, S, N>(act, order, tiles, weights, experts, ys, hidden, inter, span, dw, ds, db, group); \
    }
// Kernel names: moe_wide_{gate_up,down}_NAME_N, N the rows of a tile; moe_wide_gate_up_ACT_N
// (ACT: NAME_actA) beside a down of the other bits A, as the skinny ones.
#define WIDE_FORMAT(BITS, S, NAME, ACT)                                                                    \
    WIDE_MOE(BITS, S, NAME, 16) WIDE_MOE(BITS, S, NAME, 32) WIDE_MOE(BITS, S, NAME, 64)                      \
    WIDE_GATE_UP(BITS, S, ACT, 16, 12 - BITS) WIDE_GATE_UP(BITS, S, ACT, 32, 12 - BITS)                      \
    WIDE_GATE_UP(BITS, S, ACT, 64, 12 - BITS)
#if SK_PART == SK_WIDE_EXPERTS
SCALE_FORMATS(WIDE_FORMAT)
#endif
// linear_wide_NAME: projections in tiles of 64 tokens (32 where a tile's rows fit them).
#define LINEAR_WIDE(BITS, S, NAME, ACT)                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 4) linear_wide_##NAME(                                  \
        const bf16* xb, const unsigned char* w, const S* scales, const S* biases, float* out, float* part,    \
        unsigned* counters, unsigned tokens, unsigned in_dim, unsigned out_dim, unsigned group) {          \
        pdl_begin();                                                                                         \
        wide_linear<BITS, S, 64>(xb, w, scales, biases, out, part, counters, tokens, in_dim, out_dim, group);  \
    }
#if SK_PART == SK_PROJECTIONS
PLAIN_FORMATS(LINEAR_WIDE)
#endif
#endif
