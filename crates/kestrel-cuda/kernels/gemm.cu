// Tensor-core GEMMs over quantised (and bf16) weights: grouped by expert for routed experts,
// plain for a quantised projection of many tokens (linear_gemm_*).
//
// Routed experts for many tokens: tokens grouped by expert and grouped tensor-core GEMMs.
//
// moe_sort (one block) counts the (token, slot) pairs per expert from the router's ids, orders
// them by expert (`order[pos] = slot`; the order inside an expert does not matter, every row is
// computed on its own) and writes a tile table: one (expert, first pos, rows) entry per tile of
// rows of an expert (GT_ROWS here; skinny.cu's products take smaller tiles), the unused entries
// of the fixed-size table marked with NO_TILE. The GEMMs launch one block per table entry (times
// the column tiles) and read their work from it, so no count ever returns to the host.
//
// moe_gemm_gate_up: act[pos] = silu(gate_e x_t) * (up_e x_t) for the rows of a tile, x gathered
// from the bf16 copy of the activations, act written as bf16 in sorted order.
// moe_gemm_down_{1,2}: ys[slot] = weight[slot] * (down_e act[pos]), bf16; 64 or 128 columns a
// block.
// moe_combine: out[t] = sum over j in order of ys[t * k + j].
// linear_gemm_{q4,q8}_{1,2}: out = x W^T for a quantised W, x from its bf16 copy, f32 out; a block
// takes GT_ROWS tokens and 64 or 128 output columns, and all of K or, when the tiles are too few
// to fill the GPU, one of several equal ranges of it (the partial tiles added in a fixed order).
// The `_wg` forms of the GEMMs (moe_gemm_gate_up_*_wg, moe_gemm_down_*_wg, linear_gemm_q*_wg) run
// the same blocks of 128 columns on wgmma.
//
// GEMM tiles: GT_ROWS rows x 64 columns of each B matrix (gate and up, or down), K in steps of 64,
// on one of two engines with the same contract (MmaTile, WgTile below):
// - mma.sync (any sm_80 on): eight warps, 4 along rows (32 each, two m16 tiles) x 2 along columns
//   (32 each, four n8 tiles), operands through ldmatrix from padded rows;
// - wgmma (sm_90a, 128 columns: two B matrices): two warpgroups of 64 rows, each issuing
//   m64n128k16 products on operands in the 128-byte swizzled layout, which run asynchronously
//   while the threads bring the next step in.
// A tiles stream through two shared buffers with cp.async; B tiles are loaded into registers one
// step ahead, dequantised (w = q * scale + bias, rounded once to bf16) and stored into the other
// shared buffer while the tensor cores work on the current one. bf16 experts copy B like A.
// The K loop is issue-bound, so each thread works out its A and quantised B addresses once
// before it (ACursor, BCursor) and only steps them on. moe_gemm_*: the column blocks of a row
// tile are next to each other in the grid (x), so the tile's A rows (x gathered by token, or act)
// are read from memory once and from L2 by the later column blocks.
#include "kestrel.cuh"

// The tile geometry comes from the host (`ops/gemm.rs`) as -D definitions: GT_ROWS, GT_COLS,
// GT_K, GT_THREADS, SORT_THREADS, and the shared-memory sizes the host launches with
// (GT_MMA_SMEM_1, GT_MMA_SMEM_2, GT_WG_SMEM), which the tile structs below must match.
#if !defined(GT_ROWS) || !defined(GT_COLS) || !defined(GT_K) || !defined(GT_THREADS) || !defined(SORT_THREADS) || \
    !defined(DQ_PIECES)
#error "gemm.cu is compiled with the tile geometry of ops/gemm.rs (and DQ_PIECES) as -D definitions"
#endif
static_assert(GT_ROWS == 128 && GT_COLS == 64 && GT_K == 64 && GT_THREADS == 256,
              "the warp layouts below are written for 128 x 64 tiles, 64-value steps and 256 threads");
#define GT_STRIDE (GT_K + 8)  // shared row in bf16 values: 16 bytes of padding against conflicts
#define NO_TILE 0xffffffffu

// Inclusive prefix sum of v over the block (blockDim.x == SORT_THREADS, at most 32 warps): each
// warp's by shuffles, then the warps' totals by the first warp, left in scratch[0 .. warps) (the
// block's total last). Three barriers, the first for a previous call's readers of scratch.
__device__ unsigned block_scan(unsigned v, unsigned* scratch) {
    static_assert(SORT_THREADS % 32 == 0 && SORT_THREADS <= 32 * 32, "one warp scans the warps' totals");
    constexpr unsigned WARPS = SORT_THREADS / 32;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    auto warp_scan = [&](unsigned x) {
#pragma unroll
        for (unsigned o = 1; o < 32; o <<= 1) {
            const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        return x;
    };
    v = warp_scan(v);
    __syncthreads();
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const unsigned total = warp_scan(lane < WARPS ? scratch[lane] : 0);
        if (lane < WARPS) scratch[lane] = total;
    }
    __syncthreads();
    return v + (warp > 0 ? scratch[warp - 1] : 0);
}

// Slots s0 + j * SORT_THREADS + threadIdx.x (j < 8) of the router's ids, NO_TILE past the
// end: eight loads in flight per thread before their atomics.
__device__ __forceinline__ void load_ids8(const unsigned* ids, unsigned s0, unsigned slots, unsigned e[8]) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const unsigned s = s0 + j * SORT_THREADS + threadIdx.x;
        e[j] = s < slots ? ids[s] : NO_TILE;
    }
}

// tiles: [max_tiles][3] = (expert, first pos, rows), at most tile_rows rows a tile (GT_ROWS for
// the GEMMs here, fewer for skinny.cu's). Ids >= experts are left out (never produced by the
// router; moe_combine skips them too).
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_sort(const unsigned* ids, unsigned* order, unsigned* tiles, unsigned slots, unsigned experts,
             unsigned max_tiles, unsigned tile_rows) {
    pdl_begin();
    __shared__ unsigned count[SORT_THREADS], offset[SORT_THREADS], cursor[SORT_THREADS], scratch[SORT_THREADS / 32];
    const unsigned tid = threadIdx.x;
    count[tid] = 0;
    cursor[tid] = 0;
    __syncthreads();
    for (unsigned s0 = 0; s0 < slots; s0 += 8 * SORT_THREADS) {
        unsigned e[8];
        load_ids8(ids, s0, slots, e);
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (e[j] < experts) atomicAdd(&count[e[j]], 1u);
    }
    __syncthreads();
    const unsigned c = count[tid];
    offset[tid] = block_scan(c, scratch) - c;
    const unsigned ntiles = (c + tile_rows - 1) / tile_rows;
    const unsigned tile0 = block_scan(ntiles, scratch) - ntiles;
    const unsigned total = scratch[SORT_THREADS / 32 - 1];
    for (unsigned i = 0; i < ntiles; i++) {
        unsigned* t = tiles + 3 * (tile0 + i);
        t[0] = tid;
        t[1] = offset[tid] + i * tile_rows;
        t[2] = min(tile_rows, c - i * tile_rows);
    }
    for (unsigned i = total + tid; i < max_tiles; i += SORT_THREADS) tiles[3 * i] = NO_TILE;
    for (unsigned s0 = 0; s0 < slots; s0 += 8 * SORT_THREADS) {
        unsigned e[8];
        load_ids8(ids, s0, slots, e);
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (e[j] < experts) order[offset[e[j]] + atomicAdd(&cursor[e[j]], 1u)] = s0 + j * SORT_THREADS + tid;
    }
}

// One B matrix of an expert: weight rows [n][K] (BITS per value), its group scales' and biases'
// parts (plain bf16 or f32, or factored: S of the functions that read them, kestrel.cuh).
struct BMat {
    const unsigned char* w;
    const void* scales;
    const void* biases;
};

// This thread's share of one 64 x 64 B step in registers: q4 2 words, q8 4 words per matrix.
template <int BITS, typename S>
struct BRegs {
    static constexpr int WORDS = BITS == 4 ? 2 : 4;
    unsigned w[WORDS];
    float s, b;
};

// Where the 16-byte piece c (8 values) of row r of an operand tile lies, in bf16 values from the
// tile's start: rows of GT_STRIDE values (padded against bank conflicts) for the mma.sync
// engine; for wgmma (SW), rows of 128 bytes with piece c stored at c ^ (r % 8), the 128-byte
// swizzle its descriptors name (the tile starts 1024-byte aligned).
template <bool SW>
__device__ __forceinline__ unsigned tile_off(unsigned r, unsigned c) {
    return SW ? r * GT_K + ((c ^ (r & 7)) << 3) : r * GT_STRIDE + c * 8;
}

// Thread layout for a quantised B step: 64 rows x (64 * BITS / 32) words; a thread takes WORDS
// consecutive words of one row (b_cursor below), whose 16 values lie in one group (group sizes
// are multiples of 16): two 16-byte pieces of the row in shared memory.
template <int BITS, bool SW, typename S>
__device__ __forceinline__ void b_store(const BRegs<BITS, S>& r, bf16* bs) {
    constexpr unsigned WPR = GT_K * BITS / 32, WORDS = BRegs<BITS, S>::WORDS;
    const unsigned tid = threadIdx.x, row = tid / (WPR / WORDS), c0 = (tid % (WPR / WORDS)) * 2;
    uint4 v[2];
    if constexpr (BITS == 4 && sizeof(Held<S>) == 4) {
#pragma unroll
        for (int i = 0; i < 2; i++) v[i] = dequant_q4_f32(r.w[i], r.s, r.b);
    } else if constexpr (BITS == 4) {
        const __nv_bfloat162 s = __floats2bfloat162_rn(r.s, r.s), b = __floats2bfloat162_rn(r.b, r.b);
#pragma unroll
        for (int i = 0; i < 2; i++) v[i] = dequant_q4(r.w[i], s, b);
    } else {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const uint2 lo = dequant_q8(r.w[2 * i], r.s, r.b), hi = dequant_q8(r.w[2 * i + 1], r.s, r.b);
            v[i] = make_uint4(lo.x, lo.y, hi.x, hi.y);
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) *reinterpret_cast<uint4*>(bs + tile_off<SW>(row, c0 + i)) = v[i];
}

// This thread's share of every quantised B step of one matrix, addressed once before the K loop
// (the loop is issue-bound, so per-step address arithmetic and divisions cost time): its row's
// words at its column, and its row's scale and bias at the group its 16 values fall in (factored:
// the group's multiples at s, the row's units at u, k the thread's value within the row).
template <int BITS, typename S>
struct BCursor {
    const unsigned* w;
    const S* s;
    const S* b;
    unsigned rem;  // where the thread's first value lies in its group
};
template <int BITS>
struct BCursor<BITS, Factored> {
    const unsigned* w;
    const Factored* s;
    const float2* u;
    unsigned rem;
    unsigned k;
};

template <int BITS, typename S>
__device__ __forceinline__ BCursor<BITS, S> b_cursor(const BMat& m, unsigned n0, unsigned K, unsigned group) {
    constexpr unsigned WPR = GT_K * BITS / 32, WORDS = BRegs<BITS, S>::WORDS;
    const unsigned tid = threadIdx.x, row = tid / (WPR / WORDS), wi = (tid % (WPR / WORDS)) * WORDS;
    const unsigned off = wi * 32 / BITS;  // the thread's first value within a step
    const size_t g0 = (n0 + row) * (size_t)(K / group) + off / group;
    const unsigned* w = reinterpret_cast<const unsigned*>(m.w) + (n0 + row) * ((size_t)K * BITS / 32) + wi;
    if constexpr (is_factored<S>)
        return BCursor<BITS, S>{w, static_cast<const Factored*>(m.scales) + g0,
                                static_cast<const float2*>(m.biases) + (n0 + row) * (size_t)(K / 256), off % group,
                                off};
    else
        return BCursor<BITS, S>{w, static_cast<const S*>(m.scales) + g0, static_cast<const S*>(m.biases) + g0,
                                off % group};
}

// The cursor's step into registers, then the cursor moves one step on.
template <int BITS, typename S>
__device__ __forceinline__ void b_fetch(BRegs<BITS, S>& r, BCursor<BITS, S>& c, unsigned group) {
    if constexpr (BRegs<BITS, S>::WORDS == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(c.w);
        r.w[0] = v.x;
        r.w[1] = v.y;
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(c.w);
        r.w[0] = v.x;
        r.w[1] = v.y;
        r.w[2] = v.z;
        r.w[3] = v.w;
    }
    if constexpr (is_factored<S>) {
        const Factored f = *c.s;
        const float2 unit = c.u[c.k / 256];
        r.s = unit.x * (float)f.s;
        r.b = unit.y * (float)f.b;
        c.k += GT_K;
        for (c.rem += GT_K; c.rem >= group; c.rem -= group) c.s++;
    } else {
        r.s = to_f32(*c.s);
        r.b = to_f32(*c.b);
        for (c.rem += GT_K; c.rem >= group; c.rem -= group) {
            c.s++;
            c.b++;
        }
    }
    c.w += GT_K * BITS / 32;
}

// The cursor moved on by k0 values (a multiple of GT_K): where a split of K starts.
template <int BITS, typename S>
__device__ __forceinline__ void b_skip(BCursor<BITS, S>& c, unsigned k0, unsigned group) {
    c.w += k0 / 32 * BITS;
    c.rem += k0;
    c.s += c.rem / group;
    if constexpr (is_factored<S>)
        c.k += k0;
    else
        c.b += c.rem / group;
    c.rem %= group;
}

// This thread's share of every A step: GT_ROWS rows x 64 bf16 values, row r from
// `rows_src[r]` (null: zeros), addressed once.
#define A_PIECES (GT_ROWS * 8 / GT_THREADS)
struct ACursor {
    const bf16* src[A_PIECES];
    unsigned dst[A_PIECES];  // offsets into a shared A slot, in bf16 values
    bool ok[A_PIECES];
};

template <bool SW>
__device__ __forceinline__ ACursor a_cursor(const bf16* const* rows_src) {
    ACursor a;
#pragma unroll
    for (int j = 0; j < A_PIECES; j++) {
        const unsigned i = threadIdx.x + j * GT_THREADS, r = i / 8, c = (i % 8) * 8;
        const bf16* src = rows_src[r];  // row 0 always exists: it addresses the zero fills
        a.src[j] = (src ? src : rows_src[0]) + c;
        a.ok[j] = src != nullptr;
        a.dst[j] = tile_off<SW>(r, c / 8);
    }
    return a;
}

__device__ __forceinline__ void a_issue(const ACursor& a, bf16* as, unsigned k0) {
#pragma unroll
    for (int j = 0; j < A_PIECES; j++) cp_async16(as + a.dst[j], a.src[j] + k0, a.ok[j]);
}

// bf16 B step copied as is (rows of K bf16 values).
template <bool SW>
__device__ __forceinline__ void b_copy(bf16* bs, const BMat& m, unsigned n0, unsigned k0, unsigned K) {
    const bf16* w = reinterpret_cast<const bf16*>(m.w);
    for (unsigned i = threadIdx.x; i < GT_COLS * 8; i += GT_THREADS) {
        const unsigned r = i / 8, c = i % 8;
        cp_async16(bs + tile_off<SW>(r, c), w + (size_t)(n0 + r) * K + k0 + c * 8, true);
    }
}

// The GEMM main loop over K for NB B matrices: acc[mt][b][nt] for this warp's 32 rows x 32 columns
// of each matrix. Of the tile's GT_ROWS rows only `rows` hold data: a warp's 16-row tiles past
// them skip the tensor-core work (the loads are shared, so every warp still takes part in them).
template <int BITS, int NB, typename S>
__device__ __forceinline__ void tile_gemm(float acc[2][NB][4][4], const bf16* const* rows_src, const BMat* mats,
                                          unsigned n0, unsigned K, unsigned group, unsigned rows, bf16* smem,
                                          unsigned k0, unsigned steps) {
    bf16* as = smem;                            // [2][GT_ROWS][GT_STRIDE]
    bf16* bs = as + 2 * GT_ROWS * GT_STRIDE;    // [2][NB][GT_COLS][GT_STRIDE]
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned wm = warp / 2, wn = warp % 2;
    const unsigned mtiles = rows > wm * 32 ? min(2u, (rows - wm * 32 + 15) / 16) : 0;  // warp-uniform
    constexpr int BSTEP = NB * GT_COLS * GT_STRIDE;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++) acc[mt][b][nt][0] = acc[mt][b][nt][1] = acc[mt][b][nt][2] = acc[mt][b][nt][3] = 0.0f;

    const ACursor ac = a_cursor<false>(rows_src);
    BCursor<BITS, S> bc[NB];  // quantised B only
    if constexpr (BITS != 16) {
#pragma unroll
        for (int b = 0; b < NB; b++) {
            bc[b] = b_cursor<BITS, S>(mats[b], n0, K, group);
            b_skip<BITS>(bc[b], k0, group);
        }
    }
    // Step 0.
    a_issue(ac, as, k0);
    if constexpr (BITS == 16) {
#pragma unroll
        for (int b = 0; b < NB; b++) b_copy<false>(bs + b * GT_COLS * GT_STRIDE, mats[b], n0, k0, K);
    } else {
        BRegs<BITS, S> r[NB];
#pragma unroll
        for (int b = 0; b < NB; b++) b_fetch<BITS>(r[b], bc[b], group);
#pragma unroll
        for (int b = 0; b < NB; b++) b_store<BITS, false>(r[b], bs + b * GT_COLS * GT_STRIDE);
    }
    cp_async_commit();
    for (unsigned st = 0; st < steps; st++) {
        const int cur = st % 2, nxt = cur ^ 1;
        cp_async_wait<0>();
        __syncthreads();  // step st is in shared memory; everyone is done with buffer nxt
        const bool more = st + 1 < steps;
        BRegs<BITS, S> r[NB];
        if (more) {
            a_issue(ac, as + nxt * GT_ROWS * GT_STRIDE, k0 + (st + 1) * GT_K);
            if constexpr (BITS == 16) {
#pragma unroll
                for (int b = 0; b < NB; b++) b_copy<false>(bs + nxt * BSTEP + b * GT_COLS * GT_STRIDE, mats[b], n0, k0 + (st + 1) * GT_K, K);
            } else {
#pragma unroll
                for (int b = 0; b < NB; b++) b_fetch<BITS>(r[b], bc[b], group);
            }
        }
        cp_async_commit();
        const bf16* at = as + cur * GT_ROWS * GT_STRIDE;
        const bf16* bt = bs + cur * BSTEP;
#pragma unroll
        for (int kk = 0; kk < GT_K / 16 && mtiles > 0; kk++) {
            unsigned a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                ldmatrix_x4(a[mt], at + (wm * 32 + mt * 16 + lane % 16) * GT_STRIDE + kk * 16 + (lane / 16) * 8);
#pragma unroll
            for (int b = 0; b < NB; b++)
#pragma unroll
                for (int nt = 0; nt < 4; nt += 2) {
                    unsigned w[4];
                    ldmatrix_x4(w, bt + b * GT_COLS * GT_STRIDE + (wn * 32 + nt * 8 + lane % 8 + (lane / 16) * 8) * GT_STRIDE +
                                       kk * 16 + ((lane / 8) % 2) * 8);
                    mma_16816<bf16>(acc[0][b][nt], a[0], w[0], w[1]);
                    mma_16816<bf16>(acc[0][b][nt + 1], a[0], w[2], w[3]);
                    if (mtiles == 2) {
                        mma_16816<bf16>(acc[1][b][nt], a[1], w[0], w[1]);
                        mma_16816<bf16>(acc[1][b][nt + 1], a[1], w[2], w[3]);
                    }
                }
        }
        if constexpr (BITS != 16) {
            if (more) {
#pragma unroll
                for (int b = 0; b < NB; b++) b_store<BITS, false>(r[b], bs + nxt * BSTEP + b * GT_COLS * GT_STRIDE);
            }
        }
    }
}

// ---- tile engines ----
// Both compute a GT_ROWS x (NB * 64) tile: rows from `rows_src`, columns n0 .. n0 + 63 of each of
// the NB B matrices, over K. `each(f)` then hands this thread's results to f(row, col, v) in
// pairs of adjacent columns: v[b][0..1] at (row, col .. col + 1) of matrix b.

// mma.sync (sm_80 on): tile_gemm above, eight warps of 32 x 32 per matrix.
template <int BITS, int NB_, typename S = bf16>
struct MmaTile {
    using Scale = S;
    static constexpr int NB = NB_;
    static constexpr unsigned SMEM = 2 * (GT_ROWS + NB * GT_COLS) * GT_STRIDE * 2;
    static_assert(SMEM == (NB == 1 ? GT_MMA_SMEM_1 : GT_MMA_SMEM_2), "ops/gemm.rs mma_smem disagrees");
    float acc[2][NB][4][4];

    __device__ __forceinline__ void run(const bf16* const* rows_src, const BMat* mats, unsigned n0, unsigned K,
                                        unsigned group, unsigned rows, unsigned char* smem, unsigned k0 = 0,
                                        unsigned steps = 0) {
        tile_gemm<BITS, NB, S>(acc, rows_src, mats, n0, K, group, rows, reinterpret_cast<bf16*>(smem), k0,
                            steps ? steps : K / GT_K);
    }

    template <class F>
    __device__ __forceinline__ void each(F f) const {
        const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    float v[NB][2];
#pragma unroll
                    for (int b = 0; b < NB; b++) {
                        v[b][0] = acc[mt][b][nt][2 * hf];
                        v[b][1] = acc[mt][b][nt][2 * hf + 1];
                    }
                    f(wm * 32 + mt * 16 + lane / 4 + 8 * hf, wn * 32 + nt * 8 + 2 * (lane % 4), v);
                }
    }
};

template <int BITS, typename S = bf16>
using Mma1 = MmaTile<BITS, 1, S>;
template <int BITS, typename S = bf16>
using Mma2 = MmaTile<BITS, 2, S>;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// wgmma (sm_90a): two warpgroups of 64 rows each, one m64n128k16 product per 16 K values over
// both B matrices at once (they are one 128-row B tile in shared memory). The products run
// asynchronously while the threads bring the next step in: A by cp.async, quantised B through
// registers, dequantised and stored; two steps of shared memory, one barrier a step.
#define WG_TILE (GT_ROWS * GT_K)  // bf16 values of one 128 x 64 operand tile (16 KB)

// d (64 x 128, this thread's 64 floats) += A (64 x 16) * B (128 x 16)^T, both from shared memory.
__device__ __forceinline__ void wgmma_m64n128k16(float d[64], unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(1));
}

template <int BITS, typename S = bf16>
struct WgTile {
    using Scale = S;
    static constexpr int NB = 2;
    // Two steps of A and B tiles, and room to align them to 1024 bytes.
    static constexpr unsigned SMEM = 2 * 2 * WG_TILE * 2 + 1024;
    static_assert(SMEM == GT_WG_SMEM, "ops/gemm.rs WG_SMEM disagrees");
    float acc[64];

    __device__ __forceinline__ void run(const bf16* const* rows_src, const BMat* mats, unsigned n0, unsigned K,
                                        unsigned group, unsigned rows, unsigned char* smem_raw, unsigned k0 = 0,
                                        unsigned nsteps = 0) {
        bf16* smem = reinterpret_cast<bf16*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
        // Both warpgroups run every product whatever `rows` says (rows past it are zeros): a
        // branch around wgmma makes ptxas serialise them.
        const unsigned wg = threadIdx.x / 128;
#pragma unroll
        for (int i = 0; i < 64; i++) acc[i] = 0.0f;
        const unsigned steps = nsteps ? nsteps : K / GT_K;
        const ACursor ac = a_cursor<true>(rows_src);
        BCursor<BITS, S> bc[2];  // quantised B only
        if constexpr (BITS != 16) {
#pragma unroll
            for (int b = 0; b < 2; b++) {
                bc[b] = b_cursor<BITS, S>(mats[b], n0, K, group);
                b_skip<BITS>(bc[b], k0, group);
            }
        }
        // Step s's A tile, then its B tile (matrix b's 64 rows at b * 64).
        auto a_tile = [&](unsigned s) { return smem + (s & 1) * 2 * WG_TILE; };
        auto b_tile = [&](unsigned s) { return smem + (s & 1) * 2 * WG_TILE + WG_TILE; };
        a_issue(ac, a_tile(0), k0);
        if constexpr (BITS == 16) {
#pragma unroll
            for (int b = 0; b < 2; b++) b_copy<true>(b_tile(0) + b * 64 * GT_K, mats[b], n0, k0, K);
        } else {
            BRegs<BITS, S> r[2];
#pragma unroll
            for (int b = 0; b < 2; b++) b_fetch<BITS>(r[b], bc[b], group);
#pragma unroll
            for (int b = 0; b < 2; b++) b_store<BITS, true>(r[b], b_tile(0) + b * 64 * GT_K);
        }
        cp_async_commit();
        for (unsigned st = 0; st < steps; st++) {
            // Step st is in shared memory, and every warpgroup's products of step st - 1 (which
            // read the buffers step st + 1 fills) are done.
            cp_async_wait<0>();
            fence_proxy_async();
            __syncthreads();
            wgmma_fence();
            const unsigned long long da = sw128_desc(a_tile(st) + wg * 64 * GT_K), db = sw128_desc(b_tile(st));
#pragma unroll
            for (int kk = 0; kk < GT_K / 16; kk++) wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk);  // 32 bytes on
            wgmma_commit();
            const bool more = st + 1 < steps;
            BRegs<BITS, S> r[2];
            if (more) {
                a_issue(ac, a_tile(st + 1), k0 + (st + 1) * GT_K);
                if constexpr (BITS == 16) {
#pragma unroll
                    for (int b = 0; b < 2; b++) b_copy<true>(b_tile(st + 1) + b * 64 * GT_K, mats[b], n0, k0 + (st + 1) * GT_K, K);
                } else {
#pragma unroll
                    for (int b = 0; b < 2; b++) b_fetch<BITS>(r[b], bc[b], group);
                }
            }
            cp_async_commit();
            if constexpr (BITS != 16) {
                if (more) {
#pragma unroll
                    for (int b = 0; b < 2; b++) b_store<BITS, true>(r[b], b_tile(st + 1) + b * 64 * GT_K);
                }
            }
            wgmma_wait<0>();
        }
#pragma unroll
        for (int i = 0; i < 64; i++) asm volatile("" : "+f"(acc[i])::"memory");
    }

    // Accumulator i of a thread: row 16 * warp + lane / 4 (+ 8 for i % 4 >= 2) of the tile (warps
    // 4 to 7 are the second warpgroup, rows 64 to 127), column 8 * (i / 4) + 2 * (lane % 4) + i % 2
    // of 128 (matrix 0, then matrix 1).
    template <class F>
    __device__ __forceinline__ void each(F f) const {
        const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
        for (int hf = 0; hf < 2; hf++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float v[2][2];
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    v[b][0] = acc[4 * (j + 8 * b) + 2 * hf];
                    v[b][1] = acc[4 * (j + 8 * b) + 2 * hf + 1];
                }
                f(warp * 16 + lane / 4 + 8 * hf, 8 * j + 2 * (lane % 4), v);
            }
    }
};
#endif

__device__ __forceinline__ BMat bmat(const unsigned char* span, unsigned long long w, unsigned long long s,
                                     unsigned long long b) {
    return BMat{span + w, span + s, span + b};
}

// NB matrices of 64 rows each, one after the other in m: rows b * 64 .. of the weight (`row_bytes`
// a row), its scales and biases (a row's of K values in groups of `group`, as S stores them;
// none for bf16 weights, BITS 16).
template <int NB, int BITS, typename S>
__device__ __forceinline__ void b_mats(BMat mats[NB], const BMat& m, unsigned K, unsigned group) {
    const size_t row_bytes = (size_t)K * BITS / 8;
    size_t scale_bytes = 0, bias_bytes = 0;
    if constexpr (BITS != 16) {
        scale_bytes = K / group * sizeof(S);
        bias_bytes = is_factored<S> ? K / 256 * sizeof(float2) : scale_bytes;
    }
    const unsigned char* s = static_cast<const unsigned char*>(m.scales);
    const unsigned char* b = static_cast<const unsigned char*>(m.biases);
#pragma unroll
    for (int i = 0; i < NB; i++)
        mats[i] = BMat{m.w + i * GT_COLS * row_bytes, s + i * GT_COLS * scale_bytes, b + i * GT_COLS * bias_bytes};
}

// Grid (inter / 64, max_tiles): the column blocks of one row tile run together, so its gathered A
// rows come from L2 after the first. xb: [tokens, hidden] bf16; act: [slots, inter] bf16, sorted order.
template <class Tile, int BITS>
__device__ void gemm_gate_up(const bf16* xb, const unsigned* order, const unsigned* tiles,
                             const unsigned char* experts, bf16* act, unsigned hidden, unsigned inter, unsigned k,
                             unsigned long long span, unsigned long long gw, unsigned long long gs,
                             unsigned long long gb, unsigned long long uw, unsigned long long us,
                             unsigned long long ub, unsigned group) {
    static_assert(Tile::NB == 2, "gate and up are the tile's two matrices");
    extern __shared__ __align__(16) unsigned char gt_smem[];
    __shared__ const bf16* rows_src[GT_ROWS];
    const unsigned* tile = tiles + 3 * blockIdx.y;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2], n0 = blockIdx.x * GT_COLS;
    for (unsigned r = threadIdx.x; r < GT_ROWS; r += blockDim.x)
        rows_src[r] = r < rows ? xb + (size_t)(order[pos0 + r] / k) * hidden : nullptr;
    __syncthreads();
    const unsigned char* sp = experts + (size_t)e * span;
    const BMat mats[2] = {bmat(sp, gw, gs, gb), bmat(sp, uw, us, ub)};
    Tile t;
    t.run(rows_src, mats, n0, hidden, group, rows, gt_smem);
    t.each([&](unsigned r, unsigned c, const float (&v)[2][2]) {
        if (r >= rows) return;
        *reinterpret_cast<unsigned*>(act + (size_t)(pos0 + r) * inter + n0 + c) =
            pack2<bf16>(silu(v[0][0]) * v[1][0], silu(v[0][1]) * v[1][1]);
    });
}

// Grid (hidden / (64 * NB), max_tiles), for the same reason (act is 50 MB at a 4,096-token
// prefill, more than L2 holds). act: [slots, inter] bf16 in sorted order; ys: [slots,
// hidden] bf16 (weight times the f32 product, rounded once). NB = 2 takes 128 output columns per
// block as two 64-row halves of the down matrix, so each A step feeds twice the tensor-core work.
template <class Tile, int BITS>
__device__ void gemm_down(const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,
                          const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter,
                          unsigned long long span, unsigned long long dw, unsigned long long ds,
                          unsigned long long db, unsigned group) {
    constexpr int NB = Tile::NB;
    extern __shared__ __align__(16) unsigned char gt_smem[];
    __shared__ const bf16* rows_src[GT_ROWS];
    __shared__ unsigned row_slot[GT_ROWS];  // each row's slot and routing weight, for the stores
    __shared__ float row_weight[GT_ROWS];
    const unsigned* tile = tiles + 3 * blockIdx.y;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2], n0 = blockIdx.x * GT_COLS * NB;
    for (unsigned r = threadIdx.x; r < GT_ROWS; r += blockDim.x) {
        rows_src[r] = r < rows ? act + (size_t)(pos0 + r) * inter : nullptr;
        if (r < rows) {
            row_slot[r] = order[pos0 + r];
            row_weight[r] = weights[row_slot[r]];
        }
    }
    __syncthreads();
    BMat mats[NB];
    b_mats<NB, BITS, typename Tile::Scale>(mats, bmat(experts + (size_t)e * span, dw, ds, db), inter, group);
    Tile t;
    t.run(rows_src, mats, n0, inter, group, rows, gt_smem);
    t.each([&](unsigned r, unsigned c, const float (&v)[NB][2]) {
        if (r >= rows) return;
        const unsigned slot = row_slot[r];
        const float w = row_weight[r];
#pragma unroll
        for (int b = 0; b < NB; b++)
            *reinterpret_cast<unsigned*>(ys + (size_t)slot * hidden + n0 + b * GT_COLS + c) =
                pack2<bf16>(w * v[b][0], w * v[b][1]);
    });
}

// out[t, :] = sum over j = 0 .. k-1, in order, of ys[t * k + j, :] (bf16), in f32; slots with an
// id >= experts contribute nothing. Eight values per thread, every slot's load issued first.
extern "C" __global__ void moe_combine(const bf16* ys, const unsigned* ids, float* out, unsigned tokens,
                                       unsigned hidden, unsigned k, unsigned experts) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned vecs = hidden / 8;
    if (i >= (size_t)tokens * vecs) return;
    const size_t t = i / vecs, v = i % vecs;
    float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (unsigned j0 = 0; j0 < k; j0 += 8) {
        uint4 y[8];
#pragma unroll
        for (unsigned j = 0; j < 8; j++)
            if (j0 + j < k && ids[t * k + j0 + j] < experts)
                y[j] = reinterpret_cast<const uint4*>(ys + (t * k + j0 + j) * hidden)[v];
            else
                y[j] = make_uint4(0u, 0u, 0u, 0u);  // +0.0 in bf16: adding it changes nothing
#pragma unroll
        for (unsigned j = 0; j < 8; j++) {
            const unsigned w[4] = {y[j].x, y[j].y, y[j].z, y[j].w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                a[2 * q] += __uint_as_float(w[q] << 16);
                a[2 * q + 1] += __uint_as_float(w[q] & 0xffff0000u);
            }
        }
    }
    float4* dst = reinterpret_cast<float4*>(out + t * hidden) + 2 * v;
    dst[0] = make_float4(a[0], a[1], a[2], a[3]);
    dst[1] = make_float4(a[4], a[5], a[6], a[7]);
}

// Grid (ceil(tokens / GT_ROWS), out_dim / (64 * NB), splits). xb: [tokens, in_dim] bf16; out:
// [tokens, out_dim] f32; W: [out_dim][in_dim] quantised rows, group scales and biases. With more
// than one split (too few tiles to fill the GPU), block z takes the z-th of `splits` equal
// ranges of K and writes its partial tile to `part` ([splits][tiles][GT_ROWS][64 * NB]); the
// last block of a tile to finish (counted in counters[tile], left at zero again) adds the splits'
// partials in order of z, so the sum is the same whichever finishes last.
template <class Tile, int BITS>
__device__ void gemm_linear(const bf16* xb, const unsigned char* w, const void* scales, const void* biases,
                            float* out, float* part, unsigned* counters, unsigned tokens, unsigned in_dim,
                            unsigned out_dim, unsigned group) {
    constexpr int NB = Tile::NB;
    constexpr unsigned WIDTH = GT_COLS * NB;
    extern __shared__ __align__(16) unsigned char gt_smem[];
    __shared__ const bf16* rows_src[GT_ROWS];
    __shared__ bool last;
    const unsigned m0 = blockIdx.x * GT_ROWS, rows = min(GT_ROWS, tokens - m0), n0 = blockIdx.y * WIDTH;
    const unsigned splits = gridDim.z, z = blockIdx.z, kc = in_dim / splits;
    for (unsigned r = threadIdx.x; r < GT_ROWS; r += blockDim.x)
        rows_src[r] = r < rows ? xb + (size_t)(m0 + r) * in_dim : nullptr;
    __syncthreads();
    BMat mats[NB];
    b_mats<NB, BITS, typename Tile::Scale>(mats, BMat{w, scales, biases}, in_dim, group);
    Tile t;
    t.run(rows_src, mats, n0, in_dim, group, rows, gt_smem, z * kc, kc / GT_K);
    if (splits == 1) {
        t.each([&](unsigned r, unsigned c, const float (&v)[NB][2]) {
            if (r >= rows) return;
#pragma unroll
            for (int b = 0; b < NB; b++)
                *reinterpret_cast<float2*>(out + (size_t)(m0 + r) * out_dim + n0 + b * GT_COLS + c) =
                    make_float2(v[b][0], v[b][1]);
        });
        return;
    }
    const unsigned tile = blockIdx.y * gridDim.x + blockIdx.x, tiles = gridDim.x * gridDim.y;
    auto partial = [&](unsigned zz) { return part + ((size_t)zz * tiles + tile) * GT_ROWS * WIDTH; };
    float* mine = partial(z);
    t.each([&](unsigned r, unsigned c, const float (&v)[NB][2]) {
        if (r >= rows) return;
#pragma unroll
        for (int b = 0; b < NB; b++)
            __stcg(reinterpret_cast<float2*>(mine + r * WIDTH + b * GT_COLS + c), make_float2(v[b][0], v[b][1]));
    });
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + tile, 1u) == splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Every thread adds N4 float4s of the tile over the splits, all of a split's loads issued
    // before any add (a load at a time would wait out L2's latency splits * N4 times).
    constexpr unsigned N4 = GT_ROWS * WIDTH / 4 / GT_THREADS;
    float4 sum[N4];
#pragma unroll
    for (unsigned i = 0; i < N4; i++) sum[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (unsigned zz = 0; zz < splits; zz++) {
        const float4* p = reinterpret_cast<const float4*>(partial(zz));
        float4 v[N4];
#pragma unroll
        for (unsigned i = 0; i < N4; i++) v[i] = __ldcg(p + threadIdx.x + i * GT_THREADS);
#pragma unroll
        for (unsigned i = 0; i < N4; i++) {
            sum[i].x += v[i].x;
            sum[i].y += v[i].y;
            sum[i].z += v[i].z;
            sum[i].w += v[i].w;
        }
    }
#pragma unroll
    for (unsigned i = 0; i < N4; i++) {
        const unsigned e = 4 * (threadIdx.x + i * GT_THREADS), r = e / WIDTH, c = e % WIDTH;
        if (r < rows) *reinterpret_cast<float4*>(out + (size_t)(m0 + r) * out_dim + n0 + c) = sum[i];
    }
    if (threadIdx.x == 0) counters[tile] = 0;
}

// dequant_{q4,q8,q4f,q8f}: a quantised matrix ([rows, K], K a multiple of its group, groups
// multiples of 16) dequantised to bf16 [rows, K], each value rounded as b_store rounds it, so a
// product of many tokens can run on cuBLAS over the same bf16 weights the GEMM tiles would form
// (ops/linear.rs). The rows' words are contiguous, so the matrix is taken flat, in pieces of eight
// values (one 4-bit word, two 8-bit ones, all in one group): a warp takes 32 * DQ_PIECES
// consecutive pieces, a lane every 32nd, so each of its DQ_PIECES loads and 16-byte stores is one
// contiguous run of the warp's and all its loads are in flight at once. The weights are read
// before the programmatic wait (no kernel of a run writes them) and the output, scratch that
// earlier kernels may still read, written after it. Pieces are counted in 32 bits: the host
// dequantises at most 64 MiB of output (4 Mi pieces).
template <int BITS> struct PieceWords { using type = unsigned; };  // one 4-bit word
template <> struct PieceWords<8> { using type = uint2; };          // two 8-bit words
template <int BITS, typename S>
__device__ void dequant_rows(const unsigned char* w, const S* scales, const S* biases, bf16* out, unsigned rows,
                             unsigned K, unsigned group) {
    using Words = typename PieceWords<BITS>::type;
    const unsigned pieces = rows * (K / 8), lane = threadIdx.x % 32;
    const unsigned p0 = (blockIdx.x * blockDim.x + threadIdx.x - lane) * DQ_PIECES + lane;
    Words words[DQ_PIECES];
#pragma unroll
    for (unsigned i = 0; i < DQ_PIECES; i++)
        if (p0 + 32 * i < pieces) words[i] = reinterpret_cast<const Words*>(w)[p0 + 32 * i];
    uint4 v[DQ_PIECES];
#pragma unroll
    for (unsigned i = 0; i < DQ_PIECES; i++) {
        const unsigned p = p0 + 32 * i;
        if (p >= pieces) continue;
        const unsigned row = p / (K / 8), k = p % (K / 8) * 8, g = row * (K / group) + k / group;
        const float s = to_f32(scales[g]), b = to_f32(biases[g]);
        if constexpr (BITS == 4) {
            if constexpr (sizeof(Held<S>) == 4)
                v[i] = dequant_q4_f32(words[i], s, b);
            else
                v[i] = dequant_q4(words[i], __floats2bfloat162_rn(s, s), __floats2bfloat162_rn(b, b));
        } else {
            const uint2 lo = dequant_q8(words[i].x, s, b), hi = dequant_q8(words[i].y, s, b);
            v[i] = make_uint4(lo.x, lo.y, hi.x, hi.y);
        }
    }
    pdl_begin();
#pragma unroll
    for (unsigned i = 0; i < DQ_PIECES; i++)
        if (p0 + 32 * i < pieces) reinterpret_cast<uint4*>(out)[p0 + 32 * i] = v[i];
}
#define DEQUANT(BITS, S, NAME)                                                                              \
    extern "C" __global__ void dequant_##NAME(const unsigned char* w, const S* scales, const S* biases,      \
                                              bf16* out, unsigned rows, unsigned K, unsigned group) {       \
        dequant_rows<BITS, S>(w, scales, biases, out, rows, K, group);                                     \
    }
DEQUANT(4, bf16, q4)
DEQUANT(8, bf16, q8)
DEQUANT(4, float, q4f)
DEQUANT(8, float, q8f)

// Kernel names: linear_gemm_{q4,q8,q4f,q8f}_{1,2}, moe_gemm_gate_up_{q4,q8,q4f,q8f,q4k,q8k,bf16},
// moe_gemm_down_{..}_{1,2}; the wgmma engine's as `_wg` (sm_90a builds only, 128 columns a
// block). `f`: f32 group scales and biases (S float); `k`: factored (S Factored, experts only).
// TILE names the tile template.
#define LINEAR_GEMM(BITS, S, NAME, SUFFIX, TILE)                                                              \
    extern "C" __global__ void __launch_bounds__(GT_THREADS) linear_gemm_##NAME##_##SUFFIX(                   \
        const bf16* xb, const unsigned char* w, const S* scales, const S* biases, float* out,                \
        float* part, unsigned* counters, unsigned tokens, unsigned in_dim, unsigned out_dim, unsigned group) { \
        pdl_begin();                                                                                          \
        gemm_linear<TILE<BITS, S>, BITS>(xb, w, scales, biases, out, part, counters, tokens, in_dim, out_dim,  \
                                         group);                                                              \
    }
#define DOWN(BITS, S, NAME, SUFFIX, TILE)                                                                   \
    extern "C" __global__ void __launch_bounds__(GT_THREADS) moe_gemm_down_##NAME##_##SUFFIX(               \
        const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,              \
        const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter, unsigned long long span,   \
        unsigned long long dw, unsigned long long ds, unsigned long long db, unsigned group) {             \
        pdl_begin();                                                                                          \
        gemm_down<TILE<BITS, S>, BITS>(act, order, tiles, weights, experts, ys, hidden, inter, span, dw, ds, db, \
                                       group);                                                                \
    }
#define GATE_UP(BITS, S, NAME, SUFFIX, TILE)                                                                \
    extern "C" __global__ void __launch_bounds__(GT_THREADS) moe_gemm_gate_up_##NAME##SUFFIX(               \
        const bf16* xb, const unsigned* order, const unsigned* tiles, const unsigned char* experts, bf16* act, \
        unsigned hidden, unsigned inter, unsigned k, unsigned long long span, unsigned long long gw,       \
        unsigned long long gs, unsigned long long gb, unsigned long long uw, unsigned long long us,        \
        unsigned long long ub, unsigned group) {                                                           \
        pdl_begin();                                                                                               \
        gemm_gate_up<TILE<BITS, S>, BITS>(xb, order, tiles, experts, act, hidden, inter, k, span, gw, gs, gb, uw, \
                                          us, ub, group);                                                  \
    }
#define MOE_GEMMS(BITS, S, NAME) GATE_UP(BITS, S, NAME, , Mma2) DOWN(BITS, S, NAME, 1, Mma1) DOWN(BITS, S, NAME, 2, Mma2)
#define GEMMS(BITS, S, NAME)                                                                                \
    LINEAR_GEMM(BITS, S, NAME, 1, Mma1)                                                                    \
    LINEAR_GEMM(BITS, S, NAME, 2, Mma2)                                                                    \
    MOE_GEMMS(BITS, S, NAME)

GEMMS(4, bf16, q4)
GEMMS(8, bf16, q8)
GEMMS(4, float, q4f)
GEMMS(8, float, q8f)
MOE_GEMMS(4, Factored, q4k)
MOE_GEMMS(8, Factored, q8k)
GATE_UP(16, bf16, bf16, , Mma2)
DOWN(16, bf16, bf16, 1, Mma1)
DOWN(16, bf16, bf16, 2, Mma2)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GEMMS_WG(BITS, S, NAME)                                                                             \
    LINEAR_GEMM(BITS, S, NAME, wg, WgTile) GATE_UP(BITS, S, NAME, _wg, WgTile) DOWN(BITS, S, NAME, wg, WgTile)
GEMMS_WG(4, bf16, q4)
GEMMS_WG(8, bf16, q8)
GEMMS_WG(4, float, q4f)
GEMMS_WG(8, float, q8f)
GATE_UP(4, Factored, q4k, _wg, WgTile)
DOWN(4, Factored, q4k, wg, WgTile)
GATE_UP(8, Factored, q8k, _wg, WgTile)
DOWN(8, Factored, q8k, wg, WgTile)
GATE_UP(16, bf16, bf16, _wg, WgTile)
DOWN(16, bf16, bf16, wg, WgTile)
#endif
