// Tensor-core GEMMs over quantised (and bf16) weights: grouped by expert for routed experts,
// plain for a quantised projection of many tokens (linear_gemm_*).
//
// Routed experts for many tokens: tokens grouped by expert and grouped tensor-core GEMMs.
//
// moe_sort (one block) counts the (token, slot) pairs per expert from the router's ids, orders
// them by expert (`order[pos] = slot`; the order inside an expert does not matter, every row is
// computed on its own) and writes a tile table: one (expert, first pos, rows) entry per GT_ROWS
// rows of an expert, the unused entries of the fixed-size table marked with NO_TILE. The GEMMs
// launch one block per table entry (times the column tiles) and read their work from it, so no
// count ever returns to the host.
//
// moe_gemm_gate_up: act[pos] = silu(gate_e x_t) * (up_e x_t) for the rows of a tile, x gathered
// from the bf16 copy of the activations, act written as bf16 in sorted order.
// moe_gemm_down_{1,2}: ys[slot] = weight[slot] * (down_e act[pos]), f32; 64 or 128 columns a block.
// moe_combine: out[t] = sum over j in order of ys[t * k + j].
// linear_gemm_{q4,q8}_{1,2}: out = x W^T for a quantised W, x from its bf16 copy, f32 out; a block
// takes GT_ROWS tokens and 64 or 128 output columns.
//
// GEMM tiles: GT_ROWS rows x 64 columns of each B matrix (gate and up, or down), K in steps of 64.
// Eight warps, 4 along rows (32 each, two m16 tiles) x 2 along columns (32 each, four n8 tiles).
// A tiles stream through two shared buffers with cp.async; B tiles are loaded into registers one
// step ahead, dequantised (w = q * scale + bias, rounded once to bf16) and stored into the other
// shared buffer while the tensor cores work on the current one. bf16 experts copy B like A.
#include "kestrel.cuh"

#define GT_ROWS 128
#define GT_COLS 64
#define GT_K 64
#define GT_THREADS 256
#define GT_STRIDE (GT_K + 8)  // shared row in bf16 values: 16 bytes of padding against conflicts
#define NO_TILE 0xffffffffu
#define SORT_THREADS 1024

// Inclusive prefix sum of v over the block (blockDim.x == SORT_THREADS), through `scratch`.
__device__ unsigned block_scan(unsigned v, unsigned* scratch) {
    const unsigned tid = threadIdx.x;
    scratch[tid] = v;
    __syncthreads();
    for (unsigned o = 1; o < SORT_THREADS; o <<= 1) {
        const unsigned add = tid >= o ? scratch[tid - o] : 0;
        __syncthreads();
        scratch[tid] += add;
        __syncthreads();
    }
    return scratch[tid];
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

// tiles: [max_tiles][3] = (expert, first pos, rows). Ids >= experts are left out (never produced
// by the router; moe_combine skips them too).
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    moe_sort(const unsigned* ids, unsigned* order, unsigned* tiles, unsigned slots, unsigned experts,
             unsigned max_tiles) {
    pdl_begin();
    __shared__ unsigned count[SORT_THREADS], offset[SORT_THREADS], cursor[SORT_THREADS], scratch[SORT_THREADS];
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
    const unsigned ntiles = (c + GT_ROWS - 1) / GT_ROWS;
    const unsigned tile0 = block_scan(ntiles, scratch) - ntiles;
    const unsigned total = scratch[SORT_THREADS - 1];
    for (unsigned i = 0; i < ntiles; i++) {
        unsigned* t = tiles + 3 * (tile0 + i);
        t[0] = tid;
        t[1] = offset[tid] + i * GT_ROWS;
        t[2] = min(GT_ROWS, c - i * GT_ROWS);
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

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ __nv_bfloat162 as_bf162(unsigned u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ unsigned as_u32(__nv_bfloat162 v) { return *reinterpret_cast<unsigned*>(&v); }

// Eight 4-bit values of one word (lowest bits first) as four bf16 pairs in order. Each nibble
// pair (v_j, v_j+4) is placed in the mantissas of 128.0 (0x4300: 128 + v exactly), 128 is
// subtracted (exact), then one bf16x2 fma with the group's scale and bias (a single rounding).
__device__ __forceinline__ uint4 dequant_q4(unsigned w, __nv_bfloat162 s, __nv_bfloat162 b) {
    const __nv_bfloat162 k128 = as_bf162(0x43004300u);
    unsigned d[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const unsigned t = and_or(w >> (4 * j), 0x000F000Fu, 0x43004300u);
        d[j] = as_u32(__hfma2(__hsub2(as_bf162(t), k128), s, b));
    }
    return make_uint4(prmt(d[0], d[1], 0x5410), prmt(d[2], d[3], 0x5410), prmt(d[0], d[1], 0x7632),
                      prmt(d[2], d[3], 0x7632));
}

// Four 8-bit values of one word as two bf16 pairs, through f32 (128 + v is not exact in bf16).
__device__ __forceinline__ uint2 dequant_q8(unsigned w, float s, float b) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = masked_value(w >> (8 * j), 0xFFu) * s + b;
    return make_uint2(pack2<bf16>(v[0], v[1]), pack2<bf16>(v[2], v[3]));
}

// One B matrix of an expert: weight rows [n][K] (BITS per value), bf16 scales/biases per group.
struct BMat {
    const unsigned char* w;
    const bf16* scales;
    const bf16* biases;
};

// This thread's share of one 64 x 64 B step in registers: q4 2 words, q8 4 words per matrix.
template <int BITS>
struct BRegs {
    static constexpr int WORDS = BITS == 4 ? 2 : 4;
    unsigned w[WORDS];
    float s, b;
};

// Thread layout for a quantised B step: 64 rows x (64 * BITS / 32) words; a thread takes WORDS
// consecutive words of one row (b_cursor below), whose 16 values lie in one group (group sizes
// are multiples of 16).
template <int BITS>
__device__ __forceinline__ void b_store(const BRegs<BITS>& r, bf16* bs) {
    constexpr unsigned WPR = GT_K * BITS / 32, WORDS = BRegs<BITS>::WORDS;
    const unsigned tid = threadIdx.x, row = tid / (WPR / WORDS), wi = (tid % (WPR / WORDS)) * WORDS;
    bf16* dst = bs + row * GT_STRIDE + wi * 32 / BITS;
    if constexpr (BITS == 4) {
        const __nv_bfloat162 s = __floats2bfloat162_rn(r.s, r.s), b = __floats2bfloat162_rn(r.b, r.b);
#pragma unroll
        for (int i = 0; i < WORDS; i++) reinterpret_cast<uint4*>(dst)[i] = dequant_q4(r.w[i], s, b);
    } else {
#pragma unroll
        for (int i = 0; i < WORDS; i += 2) {
            const uint2 lo = dequant_q8(r.w[i], r.s, r.b), hi = dequant_q8(r.w[i + 1], r.s, r.b);
            reinterpret_cast<uint4*>(dst)[i / 2] = make_uint4(lo.x, lo.y, hi.x, hi.y);
        }
    }
}

// This thread's share of every quantised B step of one matrix, addressed once before the K loop
// (the loop is issue-bound, so per-step address arithmetic and divisions cost time): its row's
// words at its column, and its row's scale and bias at the group its 16 values fall in.
template <int BITS>
struct BCursor {
    const unsigned* w;
    const bf16* s;
    const bf16* b;
    unsigned rem;  // where the thread's first value lies in its group
};

template <int BITS>
__device__ __forceinline__ BCursor<BITS> b_cursor(const BMat& m, unsigned n0, unsigned K, unsigned group) {
    constexpr unsigned WPR = GT_K * BITS / 32, WORDS = BRegs<BITS>::WORDS;
    const unsigned tid = threadIdx.x, row = tid / (WPR / WORDS), wi = (tid % (WPR / WORDS)) * WORDS;
    const unsigned off = wi * 32 / BITS;  // the thread's first value within a step
    const size_t g0 = (n0 + row) * (size_t)(K / group) + off / group;
    return BCursor<BITS>{reinterpret_cast<const unsigned*>(m.w) + (n0 + row) * ((size_t)K * BITS / 32) + wi,
                         m.scales + g0, m.biases + g0, off % group};
}

// The cursor's step into registers, then the cursor moves one step on.
template <int BITS>
__device__ __forceinline__ void b_fetch(BRegs<BITS>& r, BCursor<BITS>& c, unsigned group) {
    if constexpr (BRegs<BITS>::WORDS == 2) {
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
    r.s = to_f32(*c.s);
    r.b = to_f32(*c.b);
    c.w += GT_K * BITS / 32;
    for (c.rem += GT_K; c.rem >= group; c.rem -= group) {
        c.s++;
        c.b++;
    }
}

// This thread's share of every A step: GT_ROWS rows x 64 bf16 values, row r from
// `rows_src[r]` (null: zeros), addressed once.
#define A_PIECES (GT_ROWS * 8 / GT_THREADS)
struct ACursor {
    const bf16* src[A_PIECES];
    unsigned dst[A_PIECES];  // offsets into a shared A slot, in bf16 values
    bool ok[A_PIECES];
};

__device__ __forceinline__ ACursor a_cursor(const bf16* const* rows_src) {
    ACursor a;
#pragma unroll
    for (int j = 0; j < A_PIECES; j++) {
        const unsigned i = threadIdx.x + j * GT_THREADS, r = i / 8, c = (i % 8) * 8;
        const bf16* src = rows_src[r];  // row 0 always exists: it addresses the zero fills
        a.src[j] = (src ? src : rows_src[0]) + c;
        a.ok[j] = src != nullptr;
        a.dst[j] = r * GT_STRIDE + c;
    }
    return a;
}

__device__ __forceinline__ void a_issue(const ACursor& a, bf16* as, unsigned k0) {
#pragma unroll
    for (int j = 0; j < A_PIECES; j++) cp_async16(as + a.dst[j], a.src[j] + k0, a.ok[j]);
}

// bf16 B step copied as is (rows of K bf16 values).
__device__ __forceinline__ void b_copy(bf16* bs, const BMat& m, unsigned n0, unsigned k0, unsigned K) {
    const bf16* w = reinterpret_cast<const bf16*>(m.w);
    for (unsigned i = threadIdx.x; i < GT_COLS * 8; i += GT_THREADS) {
        const unsigned r = i / 8, c = (i % 8) * 8;
        cp_async16(bs + r * GT_STRIDE + c, w + (size_t)(n0 + r) * K + k0 + c, true);
    }
}

// The GEMM main loop over K for NB B matrices: acc[mt][b][nt] for this warp's 32 rows x 32 columns
// of each matrix. Of the tile's GT_ROWS rows only `rows` hold data: a warp's 16-row tiles past
// them skip the tensor-core work (the loads are shared, so every warp still takes part in them).
template <int BITS, int NB>
__device__ __forceinline__ void tile_gemm(float acc[2][NB][4][4], const bf16* const* rows_src, const BMat* mats,
                                          unsigned n0, unsigned K, unsigned group, unsigned rows, bf16* smem) {
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

    const unsigned steps = K / GT_K;
    const ACursor ac = a_cursor(rows_src);
    BCursor<BITS> bc[NB];  // quantised B only
    if constexpr (BITS != 16) {
#pragma unroll
        for (int b = 0; b < NB; b++) bc[b] = b_cursor<BITS>(mats[b], n0, K, group);
    }
    // Step 0.
    a_issue(ac, as, 0);
    if constexpr (BITS == 16) {
#pragma unroll
        for (int b = 0; b < NB; b++) b_copy(bs + b * GT_COLS * GT_STRIDE, mats[b], n0, 0, K);
    } else {
        BRegs<BITS> r[NB];
#pragma unroll
        for (int b = 0; b < NB; b++) b_fetch<BITS>(r[b], bc[b], group);
#pragma unroll
        for (int b = 0; b < NB; b++) b_store<BITS>(r[b], bs + b * GT_COLS * GT_STRIDE);
    }
    cp_async_commit();
    for (unsigned st = 0; st < steps; st++) {
        const int cur = st % 2, nxt = cur ^ 1;
        cp_async_wait<0>();
        __syncthreads();  // step st is in shared memory; everyone is done with buffer nxt
        const bool more = st + 1 < steps;
        BRegs<BITS> r[NB];
        if (more) {
            a_issue(ac, as + nxt * GT_ROWS * GT_STRIDE, (st + 1) * GT_K);
            if constexpr (BITS == 16) {
#pragma unroll
                for (int b = 0; b < NB; b++) b_copy(bs + nxt * BSTEP + b * GT_COLS * GT_STRIDE, mats[b], n0, (st + 1) * GT_K, K);
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
                for (int b = 0; b < NB; b++) b_store<BITS>(r[b], bs + nxt * BSTEP + b * GT_COLS * GT_STRIDE);
            }
        }
    }
}

__device__ __forceinline__ BMat bmat(const unsigned char* span, unsigned long long w, unsigned long long s,
                                     unsigned long long b) {
    return BMat{span + w, reinterpret_cast<const bf16*>(span + s), reinterpret_cast<const bf16*>(span + b)};
}

// Grid (max_tiles, inter / 64). xb: [tokens, hidden] bf16; act: [slots, inter] bf16, sorted order.
template <int BITS>
__device__ void gemm_gate_up(const bf16* xb, const unsigned* order, const unsigned* tiles,
                             const unsigned char* experts, bf16* act, unsigned hidden, unsigned inter, unsigned k,
                             unsigned long long span, unsigned long long gw, unsigned long long gs,
                             unsigned long long gb, unsigned long long uw, unsigned long long us,
                             unsigned long long ub, unsigned group) {
    extern __shared__ __align__(16) unsigned char gt_smem[];
    __shared__ const bf16* rows_src[GT_ROWS];
    const unsigned* tile = tiles + 3 * blockIdx.x;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2], n0 = blockIdx.y * GT_COLS;
    for (unsigned r = threadIdx.x; r < GT_ROWS; r += blockDim.x)
        rows_src[r] = r < rows ? xb + (size_t)(order[pos0 + r] / k) * hidden : nullptr;
    __syncthreads();
    const unsigned char* sp = experts + (size_t)e * span;
    const BMat mats[2] = {bmat(sp, gw, gs, gb), bmat(sp, uw, us, ub)};
    float acc[2][2][4][4];
    tile_gemm<BITS, 2>(acc, rows_src, mats, n0, hidden, group, rows, reinterpret_cast<bf16*>(gt_smem));
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const unsigned r = wm * 32 + mt * 16 + lane / 4 + 8 * hf;
            if (r >= rows) continue;
            bf16* dst = act + (size_t)(pos0 + r) * inter + n0 + wn * 32 + 2 * (lane % 4);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const float g0 = acc[mt][0][nt][2 * hf], g1 = acc[mt][0][nt][2 * hf + 1];
                const float u0 = acc[mt][1][nt][2 * hf], u1 = acc[mt][1][nt][2 * hf + 1];
                *reinterpret_cast<unsigned*>(dst + nt * 8) = pack2<bf16>(silu(g0) * u0, silu(g1) * u1);
            }
        }
}

// Grid (max_tiles, hidden / (64 * NB)). act: [slots, inter] bf16 in sorted order; ys: [slots,
// hidden] bf16 (weight times the f32 product, rounded once). NB = 2 takes 128 output columns per block as two 64-row halves of the down matrix, so
// each A step feeds twice the tensor-core work.
template <int BITS, int NB>
__device__ void gemm_down(const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,
                          const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter,
                          unsigned long long span, unsigned long long dw, unsigned long long ds,
                          unsigned long long db, unsigned group) {
    extern __shared__ __align__(16) unsigned char gt_smem[];
    __shared__ const bf16* rows_src[GT_ROWS];
    const unsigned* tile = tiles + 3 * blockIdx.x;
    const unsigned e = tile[0];
    if (e == NO_TILE) return;
    const unsigned pos0 = tile[1], rows = tile[2], n0 = blockIdx.y * GT_COLS * NB;
    for (unsigned r = threadIdx.x; r < GT_ROWS; r += blockDim.x)
        rows_src[r] = r < rows ? act + (size_t)(pos0 + r) * inter : nullptr;
    __syncthreads();
    const BMat d = bmat(experts + (size_t)e * span, dw, ds, db);
    BMat mats[NB];
    const size_t row_bytes = (size_t)inter * BITS / 8, groups = BITS == 16 ? 0 : inter / group;
#pragma unroll
    for (int b = 0; b < NB; b++)
        mats[b] = BMat{d.w + b * GT_COLS * row_bytes, d.scales + b * GT_COLS * groups, d.biases + b * GT_COLS * groups};
    float acc[2][NB][4][4];
    tile_gemm<BITS, NB>(acc, rows_src, mats, n0, inter, group, rows, reinterpret_cast<bf16*>(gt_smem));
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const unsigned r = wm * 32 + mt * 16 + lane / 4 + 8 * hf;
            if (r >= rows) continue;
            const unsigned slot = order[pos0 + r];
            const float w = weights[slot];
#pragma unroll
            for (int b = 0; b < NB; b++) {
                bf16* dst = ys + (size_t)slot * hidden + n0 + b * GT_COLS + wn * 32 + 2 * (lane % 4);
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
                    *reinterpret_cast<unsigned*>(dst + nt * 8) =
                        pack2<bf16>(w * acc[mt][b][nt][2 * hf], w * acc[mt][b][nt][2 * hf + 1]);
            }
        }
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

// Grid (ceil(tokens / GT_ROWS), out_dim / (64 * NB)). xb: [tokens, in_dim] bf16; out: [tokens,
// out_dim] f32; W: [out_dim][in_dim] quantised rows, group scales and biases.
template <int BITS, int NB>
__device__ void gemm_linear(const bf16* xb, const unsigned char* w, const bf16* scales, const bf16* biases,
                            float* out, unsigned tokens, unsigned in_dim, unsigned out_dim, unsigned group) {
    extern __shared__ __align__(16) unsigned char gt_smem[];
    __shared__ const bf16* rows_src[GT_ROWS];
    const unsigned m0 = blockIdx.x * GT_ROWS, rows = min(GT_ROWS, tokens - m0), n0 = blockIdx.y * GT_COLS * NB;
    for (unsigned r = threadIdx.x; r < GT_ROWS; r += blockDim.x)
        rows_src[r] = r < rows ? xb + (size_t)(m0 + r) * in_dim : nullptr;
    __syncthreads();
    const size_t row_bytes = (size_t)in_dim * BITS / 8, groups = in_dim / group;
    BMat mats[NB];
#pragma unroll
    for (int b = 0; b < NB; b++)
        mats[b] = BMat{w + b * GT_COLS * row_bytes, scales + b * GT_COLS * groups, biases + b * GT_COLS * groups};
    float acc[2][NB][4][4];
    tile_gemm<BITS, NB>(acc, rows_src, mats, n0, in_dim, group, rows, reinterpret_cast<bf16*>(gt_smem));
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const unsigned r = wm * 32 + mt * 16 + lane / 4 + 8 * hf;
            if (r >= rows) continue;
#pragma unroll
            for (int b = 0; b < NB; b++) {
                float* dst = out + (size_t)(m0 + r) * out_dim + n0 + b * GT_COLS + wn * 32 + 2 * (lane % 4);
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
                    *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(acc[mt][b][nt][2 * hf], acc[mt][b][nt][2 * hf + 1]);
            }
        }
}

#define LINEAR_GEMM(BITS, NB)                                                                                 \
    extern "C" __global__ void __launch_bounds__(GT_THREADS) linear_gemm_q##BITS##_##NB(                      \
        const bf16* xb, const unsigned char* w, const bf16* scales, const bf16* biases, float* out,          \
        unsigned tokens, unsigned in_dim, unsigned out_dim, unsigned group) {                                \
        pdl_begin();                                                                                          \
        gemm_linear<BITS, NB>(xb, w, scales, biases, out, tokens, in_dim, out_dim, group);                    \
    }
LINEAR_GEMM(4, 1)
LINEAR_GEMM(4, 2)
LINEAR_GEMM(8, 1)
LINEAR_GEMM(8, 2)

#define DOWN(BITS, NAME, NB)                                                                                \
    extern "C" __global__ void __launch_bounds__(GT_THREADS) moe_gemm_down_##NAME##_##NB(                   \
        const bf16* act, const unsigned* order, const unsigned* tiles, const float* weights,              \
        const unsigned char* experts, bf16* ys, unsigned hidden, unsigned inter, unsigned long long span,   \
        unsigned long long dw, unsigned long long ds, unsigned long long db, unsigned group) {             \
        pdl_begin();                                                                                          \
        gemm_down<BITS, NB>(act, order, tiles, weights, experts, ys, hidden, inter, span, dw, ds, db, group); \
    }
#define GEMMS(BITS, NAME)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GT_THREADS) moe_gemm_gate_up_##NAME(                       \
        const bf16* xb, const unsigned* order, const unsigned* tiles, const unsigned char* experts, bf16* act, \
        unsigned hidden, unsigned inter, unsigned k, unsigned long long span, unsigned long long gw,       \
        unsigned long long gs, unsigned long long gb, unsigned long long uw, unsigned long long us,        \
        unsigned long long ub, unsigned group) {                                                           \
        pdl_begin();                                                                                               \
        gemm_gate_up<BITS>(xb, order, tiles, experts, act, hidden, inter, k, span, gw, gs, gb, uw, us, ub, group); \
    }                                                                                                       \
    DOWN(BITS, NAME, 1) DOWN(BITS, NAME, 2)

GEMMS(4, q4)
GEMMS(8, q8)
GEMMS(16, bf16)
