// Mixture of experts for few tokens, and the router's choice of many (router_bounds_*,
// router_choose_*, at the end).
// router_f32_{4,8,16}: one warp per token holds up to 128, 256 or 512 experts in registers and
// chooses (choose(): k rounds of warp argmax, the lower index wins ties; a softmax over all only
// when the weights are not renormalised).
// route_{q4,q8,bf16,f32}_*: the same choice for a few tokens, with the router's product in the
// same kernel (sm_90; q4 and q8 with bf16 group scales). A cluster of 8 blocks a token computes the logits on
// x in f32 as the exact matvecs (matvec_bf16, matvec_f32, matvec_q*_exact) do; each warp's first router row is held in registers from
// before the programmatic wait (its later rows prefetched into L2), and x is staged with each
// 16-byte vector's plain sum in one round trip. Every block stores its logits into block 0's
// shared memory, and block 0 chooses by counting each expert's rank among a few candidates
// instead of k rounds of argmax (choose_block). route_norm_*: the residual add and RMS norm in
// front, done by every block, so the norm costs no launch: the products run on the weighted row,
// block 0 scales the logits by 1 / rms at the end, and the other blocks write the new residual
// and the normalised row while block 0 chooses. A streamed layer's route_*_slots then resolves
// the choice into the layer's cache of expert slots in block 0 (RouteSlots, slots.cuh), its books
// read into shared memory before the wait; the experts' *_streamed kernels read the misses.
// Experts, with 16-byte weight loads: gate_up computes act[t * k + j] = silu(gate_e x_t) * (up_e x_t)
// for every (token, slot); down computes out[t] = sum_j weights[t, j] * down_e act[t * k + j],
// slots summed in order, so results do not depend on scheduling. Each expert is one contiguous
// span of `span` bytes; each matrix sits at the given byte offsets (weight, scales, biases; bf16
// experts use only the weight offset).
// BITS is 4 or 8 for quantised experts and 16 for bf16; quantised experts' group scales and
// biases are bf16 (MLX; kernels `*_q4`, `*_q8`), f32 (`*_q4f`, `*_q8f`) or factored (a GGUF k-quant's:
// `*_q4k`, `*_q8k`; kestrel.cuh's Factored), SC in the templates. Quantised experts run on int8
// activations: gate_up rounds x_t to int8 in every block and writes act already as int8 (a block
// of 32 per block of the grid); down gives each output row a warp, spreads its (slot, vector)
// pairs over the lanes and requests the first pairs' weights before the programmatic wait. bf16
// experts issue every warp's weight loads, then stage x (down: the activations) in f32 while they
// are in flight.
#include "slots.cuh"

// The choice's order. Weights renormalised over the chosen need no softmax over all experts:
// the logits order the experts as their probabilities do (the softmax is monotonic; only its
// rounding could make two probabilities equal), and the chosen weights are exp(l - l_first)
// over their own sum. A logit's key is its bits made to order as unsigned integers do; a
// probability's key is its bits plus one (non-negative floats order as their bits). 0 marks an
// absent expert (and NaN). choose() and choose_block() both order so, the lower index first
// among equal keys.
__device__ __forceinline__ unsigned logit_key(float x, bool present) {
    const unsigned u = __float_as_uint(x);
    return present && !isnan(x) ? (u & 0x80000000u ? ~u : u | 0x80000000u) : 0u;
}
__device__ __forceinline__ float key_logit(unsigned key) {
    return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

// PER_LANE experts per lane: up to 32 * PER_LANE experts; fewer per lane means fewer compares in
// each of the k rounds.
// One warp: token t's choice from its logits, p[i] holding expert lane + 32 * i's (any value for
// experts past the last).
template <int PER_LANE>
__device__ __forceinline__ void choose(float p[PER_LANE], unsigned* ids, float* weights, size_t t, unsigned experts,
                                       unsigned k, int normalize) {
    const unsigned lane = threadIdx.x % 32;
    unsigned key[PER_LANE];
    if (normalize) {
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) key[i] = logit_key(p[i], lane + 32 * i < experts);
    } else {
        float m = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            if (lane + 32 * i >= experts) p[i] = -INFINITY;
            m = fmaxf(m, p[i]);
        }
        m = warp_max(m);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            p[i] = lane + 32 * i < experts ? expf(p[i] - m) : -1.0f;
            s += fmaxf(p[i], 0.0f);
        }
        s = warp_sum(s);
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            if (p[i] >= 0.0f) p[i] /= s;
            key[i] = p[i] >= 0.0f ? __float_as_uint(p[i]) + 1u : 0u;
        }
    }
    // Each round takes the largest remaining key, the lowest index among equals (taken experts'
    // keys become 0), so two warp reductions decide a round.
    float total = 0.0f, chosen = 0.0f, first = 0.0f;
    for (unsigned j = 0; j < k; j++) {
        unsigned mine = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) mine = max(mine, key[i]);
        const unsigned best_key = __reduce_max_sync(0xffffffffu, mine);
        unsigned cand = 0xffffffffu;
#pragma unroll
        for (int i = PER_LANE - 1; i >= 0; i--)
            if (key[i] == best_key) cand = lane + 32 * i;  // ends at this lane's lowest index
        const unsigned bi = __reduce_min_sync(0xffffffffu, cand);
#pragma unroll
        for (int i = 0; i < PER_LANE; i++)
            if (lane + 32 * i == bi) key[i] = 0;  // taken
        float best;
        if (normalize) {
            const float l = key_logit(best_key);
            if (j == 0) first = l;
            best = expf(l - first);
        } else {
            best = __uint_as_float(best_key - 1u);
        }
        if (lane == j) chosen = best;  // slot j's weight lives in lane j until written
        if (lane == 0) ids[t * k + j] = bi;
        total += best;
    }
    if (lane < k) weights[t * k + lane] = normalize ? chosen / total : chosen;
}

template <int PER_LANE>
__device__ void router(const float* logits, unsigned* ids, float* weights, unsigned experts, unsigned k,
                       int normalize) {
    pdl_wait();
    pdl_trigger();
    const unsigned lane = threadIdx.x;
    const size_t t = blockIdx.x;
    const float* l = logits + t * experts;
    float p[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const unsigned e = lane + 32 * i;
        p[i] = e < experts ? l[e] : 0.0f;
    }
    choose<PER_LANE>(p, ids, weights, t, experts, k, normalize);
}

#define ROUTER(PER_LANE)                                                                                   \
    extern "C" __global__ void router_f32_##PER_LANE(const float* logits, unsigned* ids, float* weights,  \
                                                     unsigned experts, unsigned k, int normalize) {       \
        router<PER_LANE>(logits, ids, weights, experts, k, normalize);                                    \
    }
ROUTER(4)
ROUTER(8)
ROUTER(16)

// route_{q4,q8,bf16}_{4,8,16}: a few tokens' router, product and choice in one kernel (sm_90), a
// cluster a token (grid (ROUTE_BLOCKS, tokens); the *_slots twins take one token). A
// cluster of ROUTE_BLOCKS blocks computes the logits with x in f32 as matvec_*_exact does, though
// a warp's first row sums its lanes' vectors in a different order (warp w of block b takes rows
// b * ROUTE_WARPS + w, then every ROUTE_BLOCKS * ROUTE_WARPS rows on), into block 0's shared
// memory (once a split cluster barrier says every block has started); after a second cluster
// barrier block 0 writes the logits out and chooses (choose_block).
// Dynamic shared memory: x staged (padded_len(in_dim) floats), then for quantised weights the
// plain sum of x over each 16-byte vector's values (in_dim / VALS floats).
// route_norm_*: the same with the residual add and RMS norm in front (AddRmsNorm, one row), so
// the norm costs no launch of its own: every block adds the row itself and multiplies it by the
// norm's weight, the products run on that and block 0 scales the logits by 1 / rms; the other
// blocks write the new residual and the normalised row out once every block has read the
// residual (after the cluster barrier). Dynamic shared memory: as route_* with the sums' part
// rounded up to 4 floats, then the weighted row and the sum, in_dim floats each. The *_slots
// twins add the layer's books after all of that (at word RouteSlots::at).
#define ROUTE_PRE 8  // vectors per lane of a warp's first row held in registers from before the wait
// ROUTE_BLOCKS (blocks of the cluster), ROUTE_WARPS (warps per block) and ROUTE_NORM_VEC
// (route_norm_*: float4s of the row per thread, in_dim <= 4 * ROUTE_NORM_VEC * blockDim.x) come
// from the host (`ops/moe.rs`) as -D definitions, as do the few-token expert kernels' GU_WARPS,
// GU_ROWS, DOWN_WARPS, GQ_WARPS and GQ_ROWS.
#if !defined(ROUTE_BLOCKS) || !defined(ROUTE_WARPS) || !defined(ROUTE_NORM_VEC) || !defined(GU_WARPS) || \
    !defined(GU_ROWS) || !defined(DOWN_WARPS) || !defined(GQ_WARPS) || !defined(GQ_ROWS)
#error "moe.cu is compiled with the launch geometry of ops/moe.rs as -D definitions"
#endif
#if __CUDA_ARCH__ >= 900
// The residual add and RMS norm route_norm_* does in front of the product.
struct RouteNorm {
    float* residual;   // read, then (blocks 1.., at the end) written: residual + add
    const float* add;
    const void* w;     // the norm's weight, f32 or bf16 (w_bf16)
    float* out;        // the normalised row, written by blocks 1.. at the end
    float eps;
    int zero_centered;
    int w_bf16;
};

// A streamed layer's books for route_*, which resolve the choice into the layer's cache of
// slots right after choosing (slots_resolve_token): block 0 reads the books into shared memory
// before the programmatic wait (only the same layer's previous step wrote them, a graph replay
// ago), resolves, and writes the slots, the misses for the *_streamed expert kernels and the
// books (both copies of the table, as expert_slots keeps them). Only the route_*_slots kernels
// have one.
struct RouteSlots {
    unsigned* books;     // the table: the books, then their copy
    unsigned at;         // word offset of the books' place in dynamic shared memory
    unsigned slots;      // slots of the layer's cache
    unsigned half_life;  // the policy (0: LRU)
    unsigned* out;       // the slot of each chosen expert, in the choice's order
    unsigned* miss;      // each chosen expert if it missed, else SLOT_NONE (see Source)
};

// The norm's weight for this thread's float4s (i = threadIdx.x + j * blockDim.x), as the
// multiplier it is ((1 + w) when zero-centred); loaded before the programmatic wait.
__device__ __forceinline__ void norm_weights(const RouteNorm& nm, unsigned n, float4 s[ROUTE_NORM_VEC]) {
#pragma unroll
    for (unsigned j = 0; j < ROUTE_NORM_VEC; j++) {
        const unsigned i = threadIdx.x + j * blockDim.x;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (i < n / 4) {
            if (nm.w_bf16) {
                const uint2 b = reinterpret_cast<const uint2*>(nm.w)[i];
                v[0] = __uint_as_float(b.x << 16);
                v[1] = __uint_as_float(b.x & 0xffff0000u);
                v[2] = __uint_as_float(b.y << 16);
                v[3] = __uint_as_float(b.y & 0xffff0000u);
            } else {
                const float4 f = reinterpret_cast<const float4*>(nm.w)[i];
                v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
            }
        }
        const float o = nm.zero_centered ? 1.0f : 0.0f;
        s[j] = make_float4(o + v[0], o + v[1], o + v[2], o + v[3]);
    }
}

// route_norm_*'s staging: sum = residual + add and g = sum * s for the row (every thread's
// float4s loaded together: one round trip), g staged as stage_x_sums stages x, and the sum kept
// in shared memory to be written out at the end. The product is linear, so it runs on g and its
// results are scaled by 1 / rms(sum) at the end (choose_block): the sum of squares needs no block
// reduction before the products, only each warp's share in red[warp]. Synchronises the block.
template <int BITS>
__device__ __forceinline__ void stage_norm_sums(const RouteNorm& nm, const float4 s[ROUTE_NORM_VEC], float* xs,
                                                float* xsum, float* gs, float* sums, unsigned n, float* red) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS;
    const unsigned n4 = n / 4;
    float4 a[ROUTE_NORM_VEC], b[ROUTE_NORM_VEC];
#pragma unroll
    for (unsigned j = 0; j < ROUTE_NORM_VEC; j++) {
        const unsigned i = threadIdx.x + j * blockDim.x;
        if (i < n4) {
            a[j] = reinterpret_cast<const float4*>(nm.residual)[i];
            b[j] = reinterpret_cast<const float4*>(nm.add)[i];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (unsigned j = 0; j < ROUTE_NORM_VEC; j++) {
        const unsigned i = threadIdx.x + j * blockDim.x;
        if (i < n4) {
            const float4 v = make_float4(a[j].x + b[j].x, a[j].y + b[j].y, a[j].z + b[j].z, a[j].w + b[j].w);
            reinterpret_cast<float4*>(sums)[i] = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            const float4 g = make_float4(v.x * s[j].x, v.y * s[j].y, v.z * s[j].z, v.w * s[j].w);
            reinterpret_cast<float4*>(gs)[i] = g;
            *reinterpret_cast<float4*>(xs + padded(4 * i)) =
                make_float4(g.x * VecFormat<BITS>::x_scale(4 * i), g.y * VecFormat<BITS>::x_scale(4 * i + 1),
                            g.z * VecFormat<BITS>::x_scale(4 * i + 2), g.w * VecFormat<BITS>::x_scale(4 * i + 3));
        }
    }
    ss = warp_sum(ss);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
    if constexpr (QUANTISED<BITS>) {
        __syncthreads();
        for (unsigned u = threadIdx.x; u < n / VALS; u += blockDim.x)
            xsum[u] = plain_sum<VALS>(reinterpret_cast<const float4*>(gs) + u * (VALS / 4));
    }
    __syncthreads();
}

// 1 / rms of route_norm_*'s row from the warps' shares of its sum of squares (red), summed as
// block_sum sums; every warp computes it itself.
__device__ __forceinline__ float norm_inv(const float* red, unsigned n, float eps) {
    const unsigned lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const float ss = warp_sum(lane < warps ? red[lane] : 0.0f);
    return 1.0f / sqrtf(ss / (float)n + eps);
}

// One token's choice by a whole block from the logits `l` in shared memory times `scale`
// (experts <= 32 * PER_LANE <= blockDim.x, k <= 32), which it also writes out to `logits` (and
// the chosen ids to `chosen` in shared memory too): the
// same choice as choose(), but each expert's rank is counted instead of k rounds of argmax. The
// key and the index (the lower first among equal keys) make one 64-bit order, so no two are
// equal. Only candidates are compared: the experts are cut into
// groups of 8, and an expert below the best of k groups has k experts above it. So the count is
// short even when many keys are equal (a saturated softmax rounds most probabilities to 0): at
// most (k - 1) * 8 + 1 candidates.
template <int PER_LANE>
__device__ void choose_block(const float* l, float scale, float* logits, unsigned* ids, float* weights,
                             unsigned experts, unsigned k, int normalize, unsigned* chosen) {
    constexpr unsigned N = 32 * PER_LANE, LANES = 8, GROUPS = N / LANES;
    __shared__ float red[32];
    __shared__ unsigned long long group_best[GROUPS], cand[N];
    __shared__ unsigned ncand;
    __shared__ float top[32];
    const unsigned e = threadIdx.x;
    const bool present = e < experts;
    const float x = present ? l[e] * scale : -INFINITY;
    if (present) logits[e] = x;
    // The keys as choose() makes them (see logit_key).
    unsigned key;
    if (normalize) {
        key = logit_key(x, present);
    } else {
        const float m = block_max(x, red);
        float p = present ? expf(x - m) : -1.0f;
        const float s = block_sum(fmaxf(p, 0.0f), red);
        if (p >= 0.0f) p /= s;
        key = p >= 0.0f ? __float_as_uint(p) + 1u : 0u;
    }
    // The low half orders equal keys by index, the lower first.
    const unsigned long long order = (unsigned long long)key << 32 | (0xffffffffu - e);
    unsigned long long g = order;
#pragma unroll
    for (unsigned o = LANES / 2; o > 0; o >>= 1) {
        const unsigned long long h = __shfl_xor_sync(0xffffffffu, g, o);
        g = h > g ? h : g;
    }
    if (e < N && e % LANES == 0) group_best[e / LANES] = g;
    if (e == 0) ncand = 0;
    __syncthreads();
    bool candidate = false;
    if (present) {
        unsigned above = 0;
#pragma unroll
        for (unsigned i = 0; i < GROUPS; i++) above += group_best[i] > order;
        candidate = above < k;
        if (candidate) cand[atomicAdd(&ncand, 1u)] = order;
    }
    __syncthreads();
    if (candidate) {
        const unsigned n = ncand;
        unsigned rank = 0;
#pragma unroll 4
        for (unsigned i = 0; i < n; i++) rank += cand[i] > order;
        if (rank < k) {
            ids[rank] = e;
            chosen[rank] = e;
            top[rank] = normalize ? x : __uint_as_float(key - 1u);
        }
    }
    __syncthreads();
    if (e < k) {
        if (normalize) {
            float total = 0.0f;
            for (unsigned j = 0; j < k; j++) total += expf(top[j] - top[0]);
            weights[e] = expf(top[e] - top[0]) / total;
        } else {
            weights[e] = top[e];
        }
    }
}

// NORM: x is the norm's output (nm), not an input.
// The token is blockIdx.y: its rows of x (or of the norm's buffers), logits, ids and weights.
template <int BITS, int PER_LANE, bool NORM, bool SLOTS>
__device__ void route_one(const float* x, const void* w, const bf16* scales, const bf16* biases, float* logits,
                          unsigned* ids, float* weights, unsigned in_dim, unsigned experts, unsigned group,
                          unsigned k, int normalize, RouteNorm nm, RouteSlots sl) {
    static_assert(PER_LANE <= ROUTE_WARPS, "choose_block takes a thread per expert");
    {
        const size_t t = blockIdx.y;
        if constexpr (NORM) {
            nm.residual += t * in_dim;
            nm.add += t * in_dim;
            nm.out += t * in_dim;
        } else {
            x += t * in_dim;
        }
        logits += t * experts;
        ids += t * k;
        weights += t * k;
    }
    extern __shared__ __align__(16) float xs[];
    __shared__ float chosen_from[32 * PER_LANE];
    constexpr unsigned VALS = VecFormat<BITS>::VALS;
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, rank = cluster_rank();
    const unsigned nvec = in_dim / VALS, groups = QUANTISED<BITS> ? in_dim / group : 1;
    const unsigned first = rank * ROUTE_WARPS + warp, stride = ROUTE_BLOCKS * ROUTE_WARPS;
    const size_t row_bytes = (size_t)in_dim * BITS / 8;
    // The weights need nothing from earlier kernels. While this waits for x, the warp's first row
    // (this lane's vectors, with their groups' scales and biases) is loaded into registers and
    // the later rows' bytes are on their way to L2, so the products start as soon as x is staged.
    const bool held = first < experts && nvec <= 32 * ROUTE_PRE;
    uint4 v[ROUTE_PRE];
    float sc[ROUTE_PRE], bs[ROUTE_PRE];
#pragma unroll
    for (unsigned i = 0; i < ROUTE_PRE; i++) {
        const unsigned u = lane + 32 * i;
        sc[i] = bs[i] = 0.0f;
        if (held && u < nvec) {
            v[i] = __ldcs(static_cast<const uint4*>(w) + (size_t)first * nvec + u);
            if constexpr (QUANTISED<BITS>) {
                const size_t gi = (size_t)first * groups + (u * VALS) / group;
                sc[i] = to_f32(scales[gi]);
                bs[i] = to_f32(biases[gi]);
            }
        }
    }
    for (unsigned r = held ? first + stride : first; r < experts; r += stride)
        prefetch_l2_range(static_cast<const char*>(w) + r * row_bytes, row_bytes, lane, 32);
    float4 norm_w[ROUTE_NORM_VEC];
    if constexpr (NORM) norm_weights(nm, in_dim, norm_w);
    // A streamed layer's books, on their way into block 0's shared memory while it waits.
    const bool resolves = SLOTS && rank == 0;
    const unsigned words = SLOTS_HEADER + 2 * sl.slots + 2 * experts;
    unsigned* books = reinterpret_cast<unsigned*>(xs) + sl.at;
    if (resolves) {
        for (unsigned i = threadIdx.x; i < words; i += blockDim.x) cp_async4(books + i, sl.books + i);
        cp_async_commit();
    }
    cluster_arrive_relaxed();  // waited for before the first store into block 0
    pdl_wait();
    pdl_trigger();
    float* xsum = xs + padded_len(in_dim);
    float* gs = xsum + ((nvec + 3) & ~3u);
    float* sums = gs + in_dim;
    __shared__ float red[32];
    if constexpr (NORM) {
        stage_norm_sums<BITS>(nm, norm_w, xs, xsum, gs, sums, in_dim, red);
        // The weighted row has been summed: its place keeps the norm's multipliers for the end,
        // so no registers hold them through the products.
#pragma unroll
        for (unsigned j = 0; j < ROUTE_NORM_VEC; j++) {
            const unsigned i = threadIdx.x + j * blockDim.x;
            if (i < in_dim / 4) reinterpret_cast<float4*>(gs)[i] = norm_w[j];
        }
    } else {
        stage_x_sums<BITS>(x, xs, xsum, in_dim);
    }
    cluster_wait();
    for (unsigned r = first; r < experts; r += stride) {
        float acc[1] = {0.0f};
        if (held && r == first) {
            // One partial sum per vector, added at the end: independent chains, not one long one.
            // Vectors past the row's end are skipped with a branch, not issued under a false
            // predicate.
            float part[ROUTE_PRE];
#pragma unroll
            for (unsigned i = 0; i < ROUTE_PRE; i++) part[i] = 0.0f;
#pragma unroll
            for (unsigned i = 0; i < ROUTE_PRE; i++) {
                if (32 * i >= nvec) break;
                const unsigned u = lane + 32 * i;
                if (u < nvec)
                    vec_dot_exact<BITS>(part[i], v[i], xs, u, sc[i], bs[i], QUANTISED<BITS> ? xsum[u] : 0.0f);
            }
#pragma unroll
            for (unsigned i = 0; i < ROUTE_PRE; i++) acc[0] += part[i];
        } else {
            rows_dot<BITS, 1>(w, scales, biases, r, experts, xs, xsum, in_dim, group, acc);
        }
        const float s = warp_sum(acc[0]);
        if (lane == 0) store_cluster_f32(chosen_from + r, 0, s);
    }
    // Only shared-memory stores are in flight here: a global store before a releasing barrier
    // would make every thread wait for it to reach memory.
    cluster_sync();
    // Every block has the whole row's sums, multipliers and sum of squares, and has passed the
    // barrier, so every block has read the residual: the other blocks write the new residual and
    // the normalised row (as add_rms_norm computes it: sum * inv * s) while block 0 chooses.
    const float scale = NORM ? norm_inv(red, in_dim, nm.eps) : 1.0f;
    if constexpr (NORM) {
        if (rank != 0) {
            for (unsigned j = 0; j < ROUTE_NORM_VEC; j++) {
                const unsigned i = (rank - 1) * blockDim.x + threadIdx.x + j * (ROUTE_BLOCKS - 1) * blockDim.x;
                if (i >= in_dim / 4) break;
                const float4 v = reinterpret_cast<const float4*>(sums)[i], m = reinterpret_cast<const float4*>(gs)[i];
                reinterpret_cast<float4*>(nm.residual)[i] = v;
                reinterpret_cast<float4*>(nm.out)[i] =
                    make_float4(v.x * scale * m.x, v.y * scale * m.y, v.z * scale * m.z, v.w * scale * m.w);
            }
        }
    }
    if (rank != 0) return;
    __shared__ unsigned chosen[32];
    choose_block<PER_LANE>(chosen_from, scale, logits, ids, weights, experts, k, normalize, chosen);
    if constexpr (!SLOTS) return;
    __shared__ unsigned slot[32], fill_slot[32], fill_expert[32], nfill;
    cp_async_wait<0>();
    slots_resolve_token(books, chosen, k, sl.slots, experts, sl.half_life, slot, fill_slot, fill_expert, &nfill);
    for (unsigned i = threadIdx.x; i < words; i += blockDim.x) {
        sl.books[i] = books[i];
        sl.books[words + i] = books[i];
    }
    if (threadIdx.x < k) {
        unsigned m = SLOT_NONE;
        for (unsigned f = 0; f < nfill; f++)
            if (fill_expert[f] == chosen[threadIdx.x]) m = chosen[threadIdx.x];
        sl.out[threadIdx.x] = slot[threadIdx.x];
        sl.miss[threadIdx.x] = m;
    }
}

// Each route_* kernel has a route_*_slots twin for streamed layers, which takes the layer's books
// last (RouteSlots); the resident kernels are compiled without them.
#define ROUTE_SLOT_PARAMS \
    , unsigned *books, unsigned books_at, unsigned slots, unsigned half_life, unsigned *slot_out, unsigned *miss
#define ROUTE_SLOTS RouteSlots{books, books_at, slots, half_life, slot_out, miss}
#define ROUTE_NO_SLOT_PARAMS
#define ROUTE_NO_SLOTS RouteSlots{}
#define ROUTE_Q_KERNELS(BITS, PER_LANE, SUFFIX, S, PARAMS, SL)                                              \
    extern "C" __global__ void __cluster_dims__(ROUTE_BLOCKS, 1, 1) __launch_bounds__(32 * ROUTE_WARPS)      \
        route_q##BITS##_##PER_LANE##SUFFIX(const float* x, const unsigned* w, const bf16* scales,           \
                                           const bf16* biases, float* logits, unsigned* ids, float* weights, \
                                           unsigned in_dim, unsigned experts, unsigned group, unsigned k,   \
                                           int normalize PARAMS) {                                          \
        route_one<BITS, PER_LANE, false, S>(x, w, scales, biases, logits, ids, weights, in_dim, experts,    \
                                            group, k, normalize, RouteNorm{}, SL);                          \
    }                                                                                                        \
    extern "C" __global__ void __cluster_dims__(ROUTE_BLOCKS, 1, 1) __launch_bounds__(32 * ROUTE_WARPS)      \
        route_norm_q##BITS##_##PER_LANE##SUFFIX(float* residual, const float* add, const void* nw, float* h, \
                                                const unsigned* w, const bf16* scales, const bf16* biases,  \
                                                float* logits, unsigned* ids, float* weights,               \
                                                unsigned in_dim, unsigned experts, unsigned group,          \
                                                unsigned k, int normalize, float eps, int zero_centered,    \
                                                int w_bf16 PARAMS) {                                        \
        route_one<BITS, PER_LANE, true, S>(nullptr, w, scales, biases, logits, ids, weights, in_dim,        \
                                           experts, group, k, normalize,                                    \
                                           RouteNorm{residual, add, nw, h, eps, zero_centered, w_bf16}, SL); \
    }
#define ROUTE_DENSE_KERNELS(W, BITS, NAME, PER_LANE, SUFFIX, S, PARAMS, SL)                                                  \
    extern "C" __global__ void __cluster_dims__(ROUTE_BLOCKS, 1, 1) __launch_bounds__(32 * ROUTE_WARPS)      \
        route_##NAME##_##PER_LANE##SUFFIX(const float* x, const W* w, float* logits, unsigned* ids,           \
                                      float* weights, unsigned in_dim, unsigned experts, unsigned k,        \
                                      int normalize PARAMS) {                                               \
        route_one<BITS, PER_LANE, false, S>(x, w, nullptr, nullptr, logits, ids, weights, in_dim, experts, 1,  \
                                          k, normalize, RouteNorm{}, SL);                                   \
    }                                                                                                        \
    extern "C" __global__ void __cluster_dims__(ROUTE_BLOCKS, 1, 1) __launch_bounds__(32 * ROUTE_WARPS)      \
        route_norm_##NAME##_##PER_LANE##SUFFIX(float* residual, const float* add, const void* nw, float* h,      \
                                           const W* w, float* logits, unsigned* ids, float* weights,     \
                                           unsigned in_dim, unsigned experts, unsigned k, int normalize,    \
                                           float eps, int zero_centered, int w_bf16 PARAMS) {               \
        route_one<BITS, PER_LANE, true, S>(nullptr, w, nullptr, nullptr, logits, ids, weights, in_dim,        \
                                         experts, 1, k, normalize,                                          \
                                         RouteNorm{residual, add, nw, h, eps, zero_centered, w_bf16}, SL);  \
    }
#define ROUTE_Q(BITS, PER_LANE)                                                                              \
    ROUTE_Q_KERNELS(BITS, PER_LANE, , false, ROUTE_NO_SLOT_PARAMS, ROUTE_NO_SLOTS)                           \
    ROUTE_Q_KERNELS(BITS, PER_LANE, _slots, true, ROUTE_SLOT_PARAMS, ROUTE_SLOTS)
#define ROUTE_DENSE(W, BITS, NAME, PER_LANE)                                                                 \
    ROUTE_DENSE_KERNELS(W, BITS, NAME, PER_LANE, , false, ROUTE_NO_SLOT_PARAMS, ROUTE_NO_SLOTS)              \
    ROUTE_DENSE_KERNELS(W, BITS, NAME, PER_LANE, _slots, true, ROUTE_SLOT_PARAMS, ROUTE_SLOTS)
ROUTE_Q(4, 4)
ROUTE_Q(4, 8)
ROUTE_Q(4, 16)
ROUTE_Q(8, 4)
ROUTE_Q(8, 8)
ROUTE_Q(8, 16)
ROUTE_DENSE(bf16, 16, bf16, 4)
ROUTE_DENSE(bf16, 16, bf16, 8)
ROUTE_DENSE(bf16, 16, bf16, 16)
ROUTE_DENSE(float, 32, f32, 4)
ROUTE_DENSE(float, 32, f32, 8)
ROUTE_DENSE(float, 32, f32, 16)
#endif

// Decode-sized expert kernels issue every warp's weight loads first, then stage x (or the
// activations) in shared memory while those loads are in flight. A quantised value is turned into
// a float without an int-to-float conversion: ((word >> shift) & mask) OR-ed into the mantissa of
// 2^23, minus 2^23.

// One 16-byte weight vector times its x segment: `v` holds VALS values of format BITS from row
// `row` (group scales and biases per row for quantised formats), `x` the matching VALS floats.
template <int BITS>
__device__ __forceinline__ float vec_dot(uint4 v, const float* x, const bf16* scales, const bf16* biases,
                                         size_t group_index) {
    const float4* xp = reinterpret_cast<const float4*>(x);
    if constexpr (BITS == 16) {
        float a = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float4 xq = xp[q / 2];
            const unsigned word = q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
            a += __uint_as_float(word << 16) * (q % 2 ? xq.z : xq.x) + __uint_as_float(word & 0xffff0000u) * (q % 2 ? xq.w : xq.y);
        }
        return a;
    } else {
        constexpr unsigned PER_WORD = 32 / BITS, MASK = (1u << BITS) - 1u;
        float sx = 0.0f, qx = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const unsigned word = q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
#pragma unroll
            for (unsigned j = 0; j < PER_WORD / 4; j++) {
                const float4 f = xp[q * PER_WORD / 4 + j];
                const float xs[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
                for (unsigned e = 0; e < 4; e++) {
                    sx += xs[e];
                    qx += masked_value(word >> (BITS * (4 * j + e)), MASK) * xs[e];
                }
            }
        }
        return to_f32(scales[group_index]) * qx + to_f32(biases[group_index]) * sx;
    }
}

// One matrix of one expert: weight rows of `cols` values, and group scales and biases.
struct Mat {
    const uint4* w;
    const bf16* scales;
    const bf16* biases;
};

__device__ __forceinline__ Mat mat(const unsigned char* span, unsigned long long w, unsigned long long s,
                                   unsigned long long b) {
    return Mat{reinterpret_cast<const uint4*>(span + w), reinterpret_cast<const bf16*>(span + s),
               reinterpret_cast<const bf16*>(span + b)};
}

// Where one (token, slot)'s expert is read from. In a resident layer, and for a hit of a
// streamed one, its span in `experts` (the cache's slot); for a streamed layer's miss (miss[tk],
// written by route_*_slots, names the expert, else SLOT_NONE), the expert's packed span in
// mapped host memory, every byte read also written into the slot (`write`, the slot's span;
// null otherwise), so the cache holds the expert for the steps after this one.
struct Source {
    const unsigned char* read;
    unsigned char* write;
};

template <bool STREAMED>
__device__ __forceinline__ Source source(const unsigned char* experts, unsigned slot, unsigned long long span,
                                         const unsigned char* host, const unsigned* miss, size_t tk) {
    const unsigned char* sp = experts + (size_t)slot * span;
    if constexpr (STREAMED) {
        const unsigned e = miss[tk];
        if (e != SLOT_NONE) return Source{host + (size_t)e * span, const_cast<unsigned char*>(sp)};
    }
    return Source{sp, nullptr};
}

// The address in the slot of a byte read at `p` from a miss's host span.
template <typename T>
__device__ __forceinline__ T* in_slot(const Source& s, const T* p) {
    return reinterpret_cast<T*>(s.write + (reinterpret_cast<const unsigned char*>(p) - s.read));
}

// Row `row` of M matrices, each times its own x (staged in shared memory, padded, `cols` values),
// in two phases so a warp's weight loads are in flight while the block stages x: `issue` loads the
// lane's vectors u0, u0 + 32, ... (U of them) of every matrix; `consume` adds their dot products to
// the lane partials acc[m].
template <int M, int U>
__device__ __forceinline__ void issue(const Mat* mats, unsigned row, unsigned u0, unsigned nvec, const bool* active,
                                      uint4 v[U][M]) {
#pragma unroll
    for (unsigned i = 0; i < U; i++)
#pragma unroll
        for (int m = 0; m < M; m++)
            if (active[m] && u0 + 32 * i < nvec) v[i][m] = __ldcs(mats[m].w + (size_t)row * nvec + u0 + 32 * i);
}

// The vectors `issue` loaded, written into the slot of each matrix's Source (`src[m]`; a null
// write: a hit, nothing to write).
template <int M, int U>
__device__ __forceinline__ void put(const Mat* mats, const Source* src, unsigned row, unsigned u0, unsigned nvec,
                                    const bool* active, const uint4 v[U][M]) {
#pragma unroll
    for (unsigned i = 0; i < U; i++)
#pragma unroll
        for (int m = 0; m < M; m++)
            if (src[m].write && active[m] && u0 + 32 * i < nvec) {
                const uint4* p = mats[m].w + (size_t)row * nvec + u0 + 32 * i;
                *in_slot(src[m], p) = v[i][m];
            }
}

template <int BITS, int M, int U>
__device__ __forceinline__ void consume(const uint4 v[U][M], const Mat* mats, unsigned row, unsigned u0,
                                        unsigned nvec, const float* const* xs, unsigned cols, unsigned group,
                                        const bool* active, float* acc) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS;
    const unsigned groups = BITS == 16 ? 1 : cols / group;
#pragma unroll
    for (unsigned i = 0; i < U; i++) {
        const unsigned u = u0 + 32 * i;
        if (u >= nvec) break;
        const size_t gi = BITS == 16 ? 0 : (size_t)row * groups + (u * VALS) / group;
#pragma unroll
        for (int m = 0; m < M; m++)
            if (active[m]) acc[m] += vec_dot<BITS>(v[i][m], xs[m] + padded(u * VALS), mats[m].scales, mats[m].biases, gi);
    }
}

#define DOWN_CHUNK 4   // experts whose loads a warp issues together
#define UNROLL 2       // gate/up: vectors per lane and matrix in flight

// act[tk, r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t), tk = t * k + slot, e = ids[tk].
// Grid (inter / (GU_WARPS * GU_ROWS), tokens * k); dynamic shared memory: padded_len(hidden) floats.
template <int BITS, bool STREAMED>
__device__ void gate_up(const float* x, const unsigned* ids, const unsigned char* experts, float* act,
                        unsigned hidden, unsigned inter, unsigned k, unsigned long long span,
                        unsigned long long gw, unsigned long long gs, unsigned long long gb, unsigned long long uw,
                        unsigned long long us, unsigned long long ub, unsigned group, const unsigned char* host,
                        const unsigned* miss) {
    extern __shared__ float xs_shared[];
    const size_t tk = blockIdx.y;
    const unsigned lane = threadIdx.x % 32;
    const unsigned row0 = (blockIdx.x * GU_WARPS + threadIdx.x / 32) * GU_ROWS;
    const Source src = source<STREAMED>(experts, ids[tk], span, host, miss, tk);
    const unsigned char* sp = src.read;
    Source srcs[2 * GU_ROWS];
    const unsigned groups = BITS == 16 ? 1 : hidden / group, nvec = hidden / VecFormat<BITS>::VALS;
    // Gate rows then up rows, each matrix shifted to its row so all use row 0 below.
    Mat mats[2 * GU_ROWS];
    const float* xs[2 * GU_ROWS];
    bool active[2 * GU_ROWS];
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
        const Mat g = mat(sp, gw, gs, gb), u = mat(sp, uw, us, ub);
        const size_t row = row0 + r;
        mats[r] = Mat{g.w + row * nvec, g.scales + row * groups, g.biases + row * groups};
        mats[GU_ROWS + r] = Mat{u.w + row * nvec, u.scales + row * groups, u.biases + row * groups};
        xs[r] = xs[GU_ROWS + r] = xs_shared;
        active[r] = active[GU_ROWS + r] = row0 + r < inter;
        srcs[r] = srcs[GU_ROWS + r] = src;
    }
    float acc[2 * GU_ROWS];
#pragma unroll
    for (int m = 0; m < 2 * GU_ROWS; m++) acc[m] = 0.0f;
    uint4 v[UNROLL][2 * GU_ROWS];
    issue<2 * GU_ROWS, UNROLL>(mats, 0, lane, nvec, active, v);
    const float* xt = x + (tk / k) * hidden;
    for (unsigned i = threadIdx.x; i < hidden; i += blockDim.x) xs_shared[padded(i)] = xt[i];
    __syncthreads();
    if constexpr (STREAMED) put<2 * GU_ROWS, UNROLL>(mats, srcs, 0, lane, nvec, active, v);
    consume<BITS, 2 * GU_ROWS, UNROLL>(v, mats, 0, lane, nvec, xs, hidden, group, active, acc);
    for (unsigned u0 = lane + 32 * UNROLL; u0 < nvec; u0 += 32 * UNROLL) {
        issue<2 * GU_ROWS, UNROLL>(mats, 0, u0, nvec, active, v);
        if constexpr (STREAMED) put<2 * GU_ROWS, UNROLL>(mats, srcs, 0, u0, nvec, active, v);
        consume<BITS, 2 * GU_ROWS, UNROLL>(v, mats, 0, u0, nvec, xs, hidden, group, active, acc);
    }
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
        const float gv = warp_sum(acc[r]), uv = warp_sum(acc[GU_ROWS + r]);
        if (lane == 0 && row0 + r < inter) act[tk * inter + row0 + r] = silu(gv) * uv;
    }
}

// out[t, r] = sum_j weights[t, j] * (down_{e_j}[r] . act[t * k + j]), slots summed in order.
// One warp per output row; grid (hidden / DOWN_WARPS, tokens); dynamic shared memory:
// k * padded_len(inter) floats.
template <int BITS, bool STREAMED>
__device__ void down_combine(const float* act, const unsigned* ids, const float* weights,
                             const unsigned char* experts, float* out, unsigned hidden, unsigned inter, unsigned k,
                             unsigned long long span, unsigned long long dw, unsigned long long ds,
                             unsigned long long db, unsigned group, const unsigned char* host, const unsigned* miss) {
    extern __shared__ float acts[];
    const size_t t = blockIdx.y;
    const unsigned lane = threadIdx.x % 32;
    const unsigned row = blockIdx.x * DOWN_WARPS + threadIdx.x / 32;
    const bool row_ok = row < hidden;
    const unsigned nvec = inter / VecFormat<BITS>::VALS, plen = padded_len(inter);
    float total = 0.0f;
    for (unsigned j0 = 0; j0 < k; j0 += DOWN_CHUNK) {
        Mat mats[DOWN_CHUNK];
        Source srcs[DOWN_CHUNK];
        const float* xs[DOWN_CHUNK];
        bool active[DOWN_CHUNK];
        float acc[DOWN_CHUNK];
#pragma unroll
        for (unsigned c = 0; c < DOWN_CHUNK; c++) {
            active[c] = row_ok && j0 + c < k;
            srcs[c] = j0 + c < k ? source<STREAMED>(experts, ids[t * k + j0 + c], span, host, miss, t * k + j0 + c)
                                 : Source{experts, nullptr};
            mats[c] = mat(srcs[c].read, dw, ds, db);
            xs[c] = acts + (j0 + c) * plen;
            acc[c] = 0.0f;
        }
        uint4 v[1][DOWN_CHUNK];
        issue<DOWN_CHUNK, 1>(mats, row, lane, nvec, active, v);
        if (j0 == 0) {
            // Stage every slot's activations while the first weight loads are in flight.
            for (unsigned j = 0; j < k; j++)
                for (unsigned i = threadIdx.x; i < inter; i += blockDim.x)
                    acts[j * plen + padded(i)] = act[(t * k + j) * inter + i];
            __syncthreads();
        }
        // Expert rows are short (inter values): one vector per lane and expert at a time.
        if constexpr (STREAMED) put<DOWN_CHUNK, 1>(mats, srcs, row, lane, nvec, active, v);
        consume<BITS, DOWN_CHUNK, 1>(v, mats, row, lane, nvec, xs, inter, group, active, acc);
        for (unsigned u0 = lane + 32; u0 < nvec; u0 += 32) {
            issue<DOWN_CHUNK, 1>(mats, row, u0, nvec, active, v);
            if constexpr (STREAMED) put<DOWN_CHUNK, 1>(mats, srcs, row, u0, nvec, active, v);
            consume<BITS, DOWN_CHUNK, 1>(v, mats, row, u0, nvec, xs, inter, group, active, acc);
        }
#pragma unroll
        for (unsigned c = 0; c < DOWN_CHUNK; c++)
            if (j0 + c < k) total += weights[t * k + j0 + c] * warp_sum(acc[c]);
    }
    if (lane == 0 && row_ok) out[t * hidden + row] = total;
}

// ---- quantised experts on int8 activations (see kestrel.cuh) ----
// Two launches: gate_up rounds x_t to int8 in every block (it is small and read from L2, and the
// block's first weight loads are already in flight), and writes the activations already rounded
// to int8, one block of 32 per block of the grid, so down reads them as they are. Both keep the
// programmatic-launch contract (pdl.cuh). (gate_up prefetching the down matrices into L2
// measured no difference: the op is bound by latency, not by its memory traffic.)

// GQ_ROWS: rows of gate and of up per warp; GQ_WARPS * GQ_ROWS = 32, one int8 block of act.
static_assert(GQ_WARPS * GQ_ROWS == 32, "a block of moe_gate_up_q* writes one int8 block of 32 activations");

// act[tk, r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t) for 32 rows of one (token, slot), written
// as int8 (aq bytes, ad scale, as16 sums; inter a multiple of 32) in the order down's ACT_BITS-bit
// weights read it. Grid (inter / 32, tokens * k),
// GQ_WARPS warps; dynamic shared memory: 32 floats, GQ_WARPS * 4 * 2 * (hidden / group) SC
// (each warp's rows' group scales and biases; factored ones as floats), hidden bytes + (hidden /
// 32 + hidden / 16) floats; for factored scales then, 16-byte aligned, the warps' rows' units
// (GQ_WARPS * 2 * GQ_ROWS * hidden / 256 float2) and multiples (as many rows of hidden / group).
template <int BITS, typename SC, int ACT_BITS, bool STREAMED>
__device__ void gate_up_int8(const float* x, const unsigned* ids, const unsigned char* experts, int* aq, float* ad,
                             float* as16, unsigned hidden, unsigned inter, unsigned k, unsigned long long span,
                             unsigned long long gw, unsigned long long gs, unsigned long long gb,
                             unsigned long long uw, unsigned long long us, unsigned long long ub, unsigned group,
                             const unsigned char* host, const unsigned* miss) {
    // The 32 activations first: they are read as float4s.
    extern __shared__ __align__(16) float sact[];
    pdl_wait();
    pdl_trigger();
    const unsigned groups = hidden / group, nvec = hidden / VecFormat<BITS>::VALS;
    // Factored scales are staged as the f32 values they make.
    using SH = Held<SC>;
    SH* sgroups = reinterpret_cast<SH*>(sact + 32);
    int* sq = reinterpret_cast<int*>(sgroups + GQ_WARPS * 2 * GQ_ROWS * 2 * groups);
    float* sd = reinterpret_cast<float*>(sq + hidden / 4);
    float* ss = sd + hidden / 32;
    const size_t tk = blockIdx.y, t = tk / k;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned row0 = blockIdx.x * 32 + warp * GQ_ROWS;
    // Factored scales: this warp's rows' units and multiples as stored, copied here first.
    const unsigned supers = hidden / 256;
    float2* units0 = reinterpret_cast<float2*>((reinterpret_cast<size_t>(ss + hidden / 16) + 15) & ~(size_t)15);
    float2* raw_units = units0 + warp * 2 * GQ_ROWS * supers;
    Factored* raw_pairs = reinterpret_cast<Factored*>(units0 + GQ_WARPS * 2 * GQ_ROWS * supers) + warp * 2 * GQ_ROWS * groups;
    // x_t is asked for first, so its lines are not queued behind the weights.
    prefetch_l2_range(x + t * hidden, hidden * sizeof(float), threadIdx.x, blockDim.x);
    const Source src = source<STREAMED>(experts, ids[tk], span, host, miss, tk);
    const unsigned char* sp = src.read;
    Mat mats[2 * GQ_ROWS];
    Source srcs[2 * GQ_ROWS];
    bool active[2 * GQ_ROWS];
#pragma unroll
    for (int r = 0; r < GQ_ROWS; r++) {
        const Mat g = mat(sp, gw, gs, gb), u = mat(sp, uw, us, ub);
        const size_t row = row0 + r;
        // The scales and biases are staged below, not read through the Mat.
        mats[r] = Mat{g.w + row * nvec, nullptr, nullptr};
        mats[GQ_ROWS + r] = Mat{u.w + row * nvec, nullptr, nullptr};
        active[r] = active[GQ_ROWS + r] = true;
        srcs[r] = srcs[GQ_ROWS + r] = src;
    }
    uint4 v[UNROLL][2 * GQ_ROWS];
    issue<2 * GQ_ROWS, UNROLL>(mats, 0, lane, nvec, active, v);
    // This warp's rows' group scales and biases, [m][scale, bias][groups], copied now with the
    // weights in flight (cp.async, so nothing waits for them until they are used): a load
    // issued at compute time would queue behind every weight in flight.
    SH* sg = sgroups + warp * (2 * GQ_ROWS * 2 * groups);
    constexpr unsigned PER4 = 4 / sizeof(SH);  // values a 4-byte copy moves
    if constexpr (is_factored<SC>) {
        // The multiples (two groups a 4-byte copy; groups is even) and the units, as stored;
        // made into scales and biases below.
        for (unsigned e = lane; e < 2 * GQ_ROWS * groups / 2; e += 32) {
            const unsigned m = e / (groups / 2), pr = e % (groups / 2);
            cp_async4(raw_pairs + m * groups + 2 * pr, reinterpret_cast<const Factored*>(sp + (m < GQ_ROWS ? gs : us)) +
                                                          (size_t)(row0 + m % GQ_ROWS) * groups + 2 * pr);
        }
        for (unsigned e = lane; e < 2 * GQ_ROWS * supers * 2; e += 32) {
            const unsigned m = e / (2 * supers), j = e % (2 * supers);
            cp_async4(reinterpret_cast<float*>(raw_units + m * supers) + j,
                      reinterpret_cast<const float*>(sp + (m < GQ_ROWS ? gb : ub)) +
                          (size_t)(row0 + m % GQ_ROWS) * 2 * supers + j);
        }
        cp_async_commit();
    } else if (groups % PER4 == 0) {
        const unsigned per = groups / PER4;  // 4-byte pieces per row of scales or biases
        for (unsigned e = lane; e < 2 * GQ_ROWS * 2 * per; e += 32) {
            const unsigned sel = e / per, m = sel / 2, pr = e % per;
            const unsigned long long off = m < GQ_ROWS ? (sel % 2 ? gb : gs) : (sel % 2 ? ub : us);
            cp_async4(sg + sel * groups + PER4 * pr,
                      reinterpret_cast<const SH*>(sp + off) + (size_t)(row0 + m % GQ_ROWS) * groups + PER4 * pr);
        }
        cp_async_commit();
    } else {
        for (unsigned e = lane; e < 2 * GQ_ROWS * 2 * groups; e += 32) {
            const unsigned sel = e / groups, m = sel / 2;
            const unsigned long long off = m < GQ_ROWS ? (sel % 2 ? gb : gs) : (sel % 2 ? ub : us);
            sg[e] = reinterpret_cast<const SH*>(sp + off)[(size_t)(row0 + m % GQ_ROWS) * groups + e % groups];
        }
    }
    quantize_x8<BITS == 4>(x + t * hidden, hidden, sq, sd, ss, threadIdx.x, blockDim.x);
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (is_factored<SC>) {
        for (unsigned e = lane; e < 2 * GQ_ROWS * groups; e += 32) {
            const unsigned m = e / groups, g = e % groups;
            const Factored f = raw_pairs[e];
            const float2 unit = raw_units[m * supers + g * group / 256];
            sg[2 * m * groups + g] = unit.x * (float)f.s;
            sg[2 * m * groups + groups + g] = unit.y * (float)f.b;
        }
        __syncwarp();
    }
    if constexpr (STREAMED) {
        // A miss: this warp's rows' scales and biases into the slot too (factored: their
        // multiples and units as copied).
        if (src.write) {
            if constexpr (is_factored<SC>) {
                for (unsigned e = lane; e < 2 * GQ_ROWS * groups; e += 32) {
                    const unsigned m = e / groups;
                    const Factored* p = reinterpret_cast<const Factored*>(sp + (m < GQ_ROWS ? gs : us)) +
                                        (size_t)(row0 + m % GQ_ROWS) * groups + e % groups;
                    *in_slot(src, p) = raw_pairs[e];
                }
                for (unsigned e = lane; e < 2 * GQ_ROWS * supers; e += 32) {
                    const unsigned m = e / supers;
                    const float2* p = reinterpret_cast<const float2*>(sp + (m < GQ_ROWS ? gb : ub)) +
                                      (size_t)(row0 + m % GQ_ROWS) * supers + e % supers;
                    *in_slot(src, p) = raw_units[e];
                }
            } else {
                for (unsigned e = lane; e < 2 * GQ_ROWS * 2 * groups; e += 32) {
                    const unsigned sel = e / groups, m = sel / 2;
                    const unsigned long long off = m < GQ_ROWS ? (sel % 2 ? gb : gs) : (sel % 2 ? ub : us);
                    reinterpret_cast<SH*>(src.write + off)[(size_t)(row0 + m % GQ_ROWS) * groups + e % groups] = sg[e];
                }
            }
        }
    }
    const QuantX xq{sq, sd, ss};
    float acc[2 * GQ_ROWS];
#pragma unroll
    for (int m = 0; m < 2 * GQ_ROWS; m++) acc[m] = 0.0f;
    for (unsigned u0 = lane;;) {
        if constexpr (STREAMED) put<2 * GQ_ROWS, UNROLL>(mats, srcs, 0, u0, nvec, active, v);
#pragma unroll
        for (unsigned i = 0; i < UNROLL; i++) {
            const unsigned u = u0 + 32 * i;
            if (u >= nvec) break;
            const unsigned g = (u * VecFormat<BITS>::VALS) / group;
            const XSeg<BITS> xs = x_segment<BITS>(xq, u);
#pragma unroll
            for (int m = 0; m < 2 * GQ_ROWS; m++)
                acc[m] += dot_int8<BITS>(v[i][m], xs, to_f32(sg[m * 2 * groups + g]),
                                         to_f32(sg[m * 2 * groups + groups + g]));
        }
        u0 += 32 * UNROLL;
        if (u0 >= nvec) break;
        issue<2 * GQ_ROWS, UNROLL>(mats, 0, u0, nvec, active, v);
    }
#pragma unroll
    for (int r = 0; r < GQ_ROWS; r++) {
        const float gv = warp_sum(acc[r]), uv = warp_sum(acc[GQ_ROWS + r]);
        if (lane == 0) sact[warp * GQ_ROWS + r] = silu(gv) * uv;
    }
    __syncthreads();
    if (warp == 0) {
        const size_t b = (tk * inter) / 32 + blockIdx.x;  // this block's int8 block of act
        quantize_x8<ACT_BITS == 4>(sact, 32, aq + 8 * b, ad + b, as16 + 2 * b, lane, 32);
    }
}

#define DQ_PAIRS 6  // (slot, vector) pairs per lane of down whose loads are in flight together

// Copies n values of type T into shared memory, each thread's four loads issued before its stores.
template <typename T>
__device__ __forceinline__ void stage_n(T* d, const T* s, unsigned n) {
    for (unsigned i0 = threadIdx.x; i0 < n; i0 += 4 * blockDim.x) {
        T v[4];
#pragma unroll
        for (unsigned j = 0; j < 4; j++)
            if (i0 + j * blockDim.x < n) v[j] = s[i0 + j * blockDim.x];
#pragma unroll
        for (unsigned j = 0; j < 4; j++)
            if (i0 + j * blockDim.x < n) d[i0 + j * blockDim.x] = v[j];
    }
}

// Copies `bytes` (a multiple of 4) into shared memory, in 16-byte pieces when alignment allows.
__device__ __forceinline__ void stage(void* dst, const void* src, unsigned bytes) {
    if ((((size_t)dst | (size_t)src | bytes) & 15) == 0)
        stage_n(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16);
    else
        stage_n(static_cast<unsigned*>(dst), static_cast<const unsigned*>(src), bytes / 4);
}

// out[t, r] = sum_j weights[t, j] * (down_{e_j}[r] . act[t * k + j]) with the activations
// already quantised (aq, ad, as16 for every (token, slot)). One warp per output row; its k * nvec
// (slot, vector) pairs are spread over the lanes, DQ_PAIRS each at a time, so every lane has
// work and a lane's registers hold only its own pairs. Each lane sums its pairs' weighted
// products in pair order, then the warp sums the lanes: the order is fixed, so results do not
// depend on scheduling. Dynamic shared memory: k * (inter bytes + (inter / 32 + inter / 16)
// floats). The first pairs' weights, with the ids and routing weights that pick them, are read
// before the programmatic wait: the router wrote them, and it finished before gate/up (the kernel
// this one follows, which reads them too) passed its own wait and let this one launch, so the
// down matrices stream in while gate/up runs. The activations, gate/up's output, are read after.
template <int BITS, typename SC, bool STREAMED>
__device__ void down_int8(const int* aq, const float* ad, const float* as16, const unsigned* ids,
                          const float* weights, const unsigned char* experts, float* out, unsigned hidden,
                          unsigned inter, unsigned k, unsigned long long span, unsigned long long dw,
                          unsigned long long ds, unsigned long long db, unsigned group, const unsigned char* host,
                          const unsigned* miss) {
    extern __shared__ int sq[];
    const unsigned qn = inter / 4, dn = inter / 32, sn = inter / 16;
    float* sd = reinterpret_cast<float*>(sq + k * qn);
    float* ss = sd + k * dn;
    const size_t t = blockIdx.y;
    const unsigned lane = threadIdx.x % 32;
    const unsigned row = blockIdx.x * DOWN_WARPS + threadIdx.x / 32;
    const bool row_ok = row < hidden;
    const unsigned nvec = inter / VecFormat<BITS>::VALS, groups = inter / group, pairs = k * nvec;
    // Rows past the end read row 0 and drop the result.
    const size_t wrow = (size_t)(row_ok ? row : 0) * nvec, grow = (size_t)(row_ok ? row : 0) * groups;
    const size_t urow = (size_t)(row_ok ? row : 0) * (inter / 256);  // factored: the row's units
    float total = 0.0f;
    for (unsigned p0 = 0; p0 < pairs; p0 += 32 * DQ_PAIRS) {
        // Every pair's vector, its group's scale and bias and its slot's weight are loaded
        // together, branch-free (pairs past the end read slot 0's vector 0 with weight 0): a load
        // issued only at compute time would queue behind everything in flight.
        uint4 v[DQ_PAIRS];
        float scale[DQ_PAIRS], bias[DQ_PAIRS], gate[DQ_PAIRS];
#pragma unroll
        for (unsigned i = 0; i < DQ_PAIRS; i++) {
            const unsigned p = p0 + lane + 32 * i, pp = p < pairs ? p : 0, j = pp / nvec, u = pp % nvec;
            const unsigned char* sp =
                source<STREAMED>(experts, __ldcg(ids + t * k + j), span, host, miss, t * k + j).read;
            const unsigned g = (u * VecFormat<BITS>::VALS) / group;
            v[i] = __ldcs(reinterpret_cast<const uint4*>(sp + dw) + wrow + u);
            if constexpr (is_factored<SC>) {
                const Factored f = reinterpret_cast<const Factored*>(sp + ds)[grow + g];
                const float2 unit = reinterpret_cast<const float2*>(sp + db)[urow + u * VecFormat<BITS>::VALS / 256];
                scale[i] = unit.x * (float)f.s;
                bias[i] = unit.y * (float)f.b;
            } else {
                scale[i] = to_f32(reinterpret_cast<const SC*>(sp + ds)[grow + g]);
                bias[i] = to_f32(reinterpret_cast<const SC*>(sp + db)[grow + g]);
            }
            gate[i] = p < pairs ? __ldcg(weights + t * k + j) : 0.0f;
        }
        if (p0 == 0) {
            // Stage every slot's activations while the first weight loads are in flight.
            pdl_wait();
            pdl_trigger();
            stage(sq, aq + t * k * qn, k * qn * 4);
            stage(sd, ad + t * k * dn, k * dn * 4);
            stage(ss, as16 + t * k * sn, k * sn * 4);
            __syncthreads();
        }
#pragma unroll
        for (unsigned i = 0; i < DQ_PAIRS; i++) {
            const unsigned p = p0 + lane + 32 * i, pp = p < pairs ? p : 0, j = pp / nvec, u = pp % nvec;
            if constexpr (STREAMED) {
                // A miss: the pair's vector, scale and bias into the slot too (lanes sharing a
                // group write the same scale and bias).
                const Source src = source<STREAMED>(experts, __ldcg(ids + t * k + j), span, host, miss, t * k + j);
                if (src.write && p < pairs && row_ok) {
                    const unsigned g = (u * VecFormat<BITS>::VALS) / group;
                    *in_slot(src, reinterpret_cast<const uint4*>(src.read + dw) + wrow + u) = v[i];
                    if constexpr (is_factored<SC>) {
                        // The multiples and units, read again.
                        const Factored* f = reinterpret_cast<const Factored*>(src.read + ds) + grow + g;
                        const float2* unit = reinterpret_cast<const float2*>(src.read + db) + urow +
                                             u * VecFormat<BITS>::VALS / 256;
                        *in_slot(src, f) = *f;
                        *in_slot(src, unit) = *unit;
                    } else {
                        *in_slot(src, reinterpret_cast<const SC*>(src.read + ds) + grow + g) = from_f32<SC>(scale[i]);
                        *in_slot(src, reinterpret_cast<const SC*>(src.read + db) + grow + g) = from_f32<SC>(bias[i]);
                    }
                }
            }
            const QuantX x{sq + j * qn, sd + j * dn, ss + j * sn};
            total += gate[i] * dot_int8<BITS>(v[i], x_segment<BITS>(x, u), scale[i], bias[i]);
        }
    }
    total = warp_sum(total);
    if (lane == 0 && row_ok) out[t * hidden + row] = total;
}

// Each expert kernel has a *_streamed twin for a streamed layer's one-token step, which takes
// the host's packed experts and the misses route_*_slots wrote last (see Source).
#define EXPERT_STREAM_PARAMS , const unsigned char *host, const unsigned *miss
#define EXPERT_STREAM_ARGS , host, miss
#define EXPERT_NO_STREAM_PARAMS
#define EXPERT_NO_STREAM_ARGS , nullptr, nullptr
// The int8 kernels pick their parameters by S (`EXPERT_PARAMS_true` for the streamed twin).
#define EXPERT_PARAMS_true , const unsigned char *host, const unsigned *miss
#define EXPERT_PARAMS_false
#define EXPERT_ARGS_true , host, miss
#define EXPERT_ARGS_false , nullptr, nullptr
// gate/up writes its activations in the order down's ACT_BITS-bit weights read them:
// `moe_gate_up_NAME` for down's own bits, `moe_gate_up_NAME_actB` for a down matrix of B bits
// (a GGUF layer's Q4_K gate and up beside a Q6_K down).
#define GATE_UP_INT8_KERNEL(BITS, SC, ACT_BITS, NAME, SUFFIX, S)                                              \
    extern "C" __global__ void __launch_bounds__(32 * GQ_WARPS, 2) moe_gate_up_##NAME##SUFFIX(              \
        const float* x, const unsigned* ids, const unsigned char* experts, int* aq, float* ad, float* as16, \
        unsigned hidden, unsigned inter, unsigned k, unsigned long long span, unsigned long long gw,         \
        unsigned long long gs, unsigned long long gb, unsigned long long uw, unsigned long long us,         \
        unsigned long long ub, unsigned group EXPERT_PARAMS_##S) {                                          \
        gate_up_int8<BITS, SC, ACT_BITS, S>(x, ids, experts, aq, ad, as16, hidden, inter, k, span, gw, gs, gb, \
                                            uw, us, ub, group EXPERT_ARGS_##S);                             \
    }
#define DOWN_INT8_KERNEL(BITS, SC, NAME, SUFFIX, S)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * DOWN_WARPS, 5) moe_down_##NAME##SUFFIX(                \
        const int* aq, const float* ad, const float* as16, const unsigned* ids, const float* weights,        \
        const unsigned char* experts, float* out, unsigned hidden, unsigned inter, unsigned k,               \
        unsigned long long span, unsigned long long dw, unsigned long long ds, unsigned long long db,        \
        unsigned group EXPERT_PARAMS_##S) {                                                                  \
        down_int8<BITS, SC, S>(aq, ad, as16, ids, weights, experts, out, hidden, inter, k, span, dw, ds, db, \
                               group EXPERT_ARGS_##S);                                                       \
    }
#define EXPERTS_INT8(BITS, SC, NAME)                                                                         \
    GATE_UP_INT8_KERNEL(BITS, SC, BITS, NAME, , false) GATE_UP_INT8_KERNEL(BITS, SC, BITS, NAME, _streamed, true) \
    DOWN_INT8_KERNEL(BITS, SC, NAME, , false) DOWN_INT8_KERNEL(BITS, SC, NAME, _streamed, true)
#define GATE_UP_INT8_FOR(BITS, SC, ACT_BITS, NAME)                                                            \
    GATE_UP_INT8_KERNEL(BITS, SC, ACT_BITS, NAME, , false)                                                   \
    GATE_UP_INT8_KERNEL(BITS, SC, ACT_BITS, NAME, _streamed, true)

EXPERTS_INT8(4, bf16, q4)
EXPERTS_INT8(8, bf16, q8)
EXPERTS_INT8(4, float, q4f)
EXPERTS_INT8(8, float, q8f)
EXPERTS_INT8(4, Factored, q4k)
EXPERTS_INT8(8, Factored, q8k)
GATE_UP_INT8_FOR(4, bf16, 8, q4_act8)
GATE_UP_INT8_FOR(8, bf16, 4, q8_act4)
GATE_UP_INT8_FOR(4, float, 8, q4f_act8)
GATE_UP_INT8_FOR(8, float, 4, q8f_act4)
GATE_UP_INT8_FOR(4, Factored, 8, q4k_act8)
GATE_UP_INT8_FOR(8, Factored, 4, q8k_act4)

#define EXPERTS_KERNELS(BITS, NAME, SUFFIX, S, PARAMS, ARGS)                                                 \
    extern "C" __global__ void __launch_bounds__(128, 8) moe_gate_up_##NAME##SUFFIX(                         \
        const float* x, const unsigned* ids, const unsigned char* experts, float* act, unsigned hidden,      \
        unsigned inter, unsigned k, unsigned long long span, unsigned long long gw, unsigned long long gs,   \
        unsigned long long gb, unsigned long long uw, unsigned long long us, unsigned long long ub,          \
        unsigned group PARAMS) {                                                                             \
        pdl_begin();                                                                                        \
        gate_up<BITS, S>(x, ids, experts, act, hidden, inter, k, span, gw, gs, gb, uw, us, ub, group ARGS); \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128, 8) moe_down_##NAME##SUFFIX(                            \
        const float* act, const unsigned* ids, const float* weights, const unsigned char* experts,           \
        float* out, unsigned hidden, unsigned inter, unsigned k, unsigned long long span,                    \
        unsigned long long dw, unsigned long long ds, unsigned long long db, unsigned group PARAMS) {        \
        pdl_begin();                                                                                        \
        down_combine<BITS, S>(act, ids, weights, experts, out, hidden, inter, k, span, dw, ds, db,          \
                              group ARGS);                                                                  \
    }
#define EXPERTS(BITS, NAME)                                                                                  \
    EXPERTS_KERNELS(BITS, NAME, , false, EXPERT_NO_STREAM_PARAMS, EXPERT_NO_STREAM_ARGS)                     \
    EXPERTS_KERNELS(BITS, NAME, _streamed, true, EXPERT_STREAM_PARAMS, EXPERT_STREAM_ARGS)

EXPERTS(16, bf16)

// ---- Router logits of many tokens: bounded on the tensor cores, exact where they decide ----
// A router that renormalises its top k needs exact logits (the one-token kernel's f32
// arithmetic, so a token's experts do not depend on what it is batched with) only for the
// experts that can still be among the top k. With w = q s + b in groups (q from 0 to 2^BITS - 1):
// - router_bounds_*: for each (token, expert) an estimate a = sum over groups of
//   s (sum q x_1 + sum q x_2 + sum q x_3) + b sum x, where x = x_1 + x_2 + x_3 + r splits x into
//   three bf16 parts (|r| <= 2^-24 |x|) and q is exact in bf16, the products on mma.sync; and
//   m = sum over groups of (|s| (2^BITS - 1) + |b|) sum |x|, which bounds every intermediate
//   magnitude of the estimate and of the exact kernel. Each differs from the real product by at
//   most a few units of 2^-24 m per rounding on its longest chain (the split; the tensor cores'
//   f32 sums, each mma's error under 2^-23 of its terms; the folds of every group and the splits'
//   partial sums; the exact kernel's products, its lane's vectors and warp_sum), which the host
//   counts (`ops/router.rs`, `beta`) and passes as beta, four times over: |exact - a| <= beta m.
//   A block takes RB_TOKENS tokens x RB_EXPERTS experts over one of grid.z ranges of K, the
//   next 64 values' inputs loaded into registers while the tensor cores work on the current
//   ones, and writes its partial sums to [z][tokens][experts].
// - router_choose_*: a block a token sums the partials, takes the k-th largest lower bound
//   a - beta m - RB_TINY and computes exactly (rows_dot_at, then warp_sum: matvec's order)
//   every expert whose upper bound reaches it, or every expert when a bound is not finite; the
//   others are below k exact logits and cannot be chosen. choose() then picks from the exact
//   logits of those, as router_f32 picks from all of them: the same experts, the same weights.
#if !defined(RB_TOKENS) || !defined(RB_EXPERTS) || !defined(RB_THREADS) || !defined(RB_K) || !defined(RB_SPLITS) || \
    !defined(RC_WARPS)
#error "moe.cu is compiled with the bounded router's geometry of ops/moe.rs as -D definitions"
#endif
static_assert(RB_TOKENS == 32 && RB_EXPERTS == 64 && RB_THREADS == 128 && RB_K == 64,
              "router_bounds' warps are written for 32 tokens x 64 experts, four warps, 64 values a step");
#define RB_STRIDE (RB_K + 8)            // shared row in bf16 values, padded against bank conflicts
#define RB_TINY 7.888609052210118e-31f  // 2^-100: room for products below f32's normal range

// This thread's share of one step's inputs: 16 values of x (token tid / 4, values 16 (tid % 4)
// on), 32 weights (expert tid / 2, values 32 (tid % 2) on) and their two segments' scale and bias.
template <int BITS>
struct RbRegs {
    float4 x[4];
    uint4 w[BITS / 4];
    float s[2], b[2];
};

template <int BITS, typename S>
__device__ __forceinline__ void rb_load(RbRegs<BITS>& r, const float* x, const unsigned char* w, const S* scales,
                                        const S* biases, unsigned t0, unsigned e0, unsigned k0, unsigned tokens,
                                        unsigned in_dim, unsigned experts, unsigned group) {
    const unsigned tid = threadIdx.x, t = t0 + tid / 4, e = e0 + tid / 2, kw = k0 + 32 * (tid % 2);
    const float4* xp = reinterpret_cast<const float4*>(x + (size_t)t * in_dim + k0 + 16 * (tid % 4));
#pragma unroll
    for (int j = 0; j < 4; j++) r.x[j] = t < tokens ? xp[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const uint4* wp = reinterpret_cast<const uint4*>(w + ((size_t)e * in_dim + kw) * BITS / 8);
#pragma unroll
    for (int j = 0; j < BITS / 4; j++) r.w[j] = e < experts ? wp[j] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const size_t gi = (size_t)e * (in_dim / group) + (kw + 16 * h) / group;
        r.s[h] = e < experts ? to_f32(scales[gi]) : 0.0f;
        r.b[h] = e < experts ? to_f32(biases[gi]) : 0.0f;
    }
}

struct RbShared {
    bf16 x[3][RB_TOKENS][RB_STRIDE], w[RB_EXPERTS][RB_STRIDE];  // x's three parts, the q
    float xsum[RB_TOKENS][RB_K / 16], xabs[RB_TOKENS][RB_K / 16];                // a token's segment
    float s[RB_EXPERTS][RB_K / 16], b[RB_EXPERTS][RB_K / 16], c[RB_EXPERTS][RB_K / 16];  // an expert's
};

// The quantised value (word >> shift) & mask (at most 8 bits) as bf16 bits, exactly: it has at
// most 8 significant bits, so its float's low half is zero.
__device__ __forceinline__ unsigned rb_q_bf16(unsigned word, unsigned shift, unsigned mask) {
    return __float_as_uint(__uint_as_float(0x4B000000u | ((word >> shift) & mask)) - 8388608.0f) >> 16;
}

template <int BITS>
__device__ __forceinline__ void rb_store(const RbRegs<BITS>& r, RbShared& sh) {
    const unsigned tid = threadIdx.x;
    {
        const unsigned t = tid / 4, q = tid % 4;
        const float v[16] = {r.x[0].x, r.x[0].y, r.x[0].z, r.x[0].w, r.x[1].x, r.x[1].y, r.x[1].z, r.x[1].w,
                             r.x[2].x, r.x[2].y, r.x[2].z, r.x[2].w, r.x[3].x, r.x[3].y, r.x[3].z, r.x[3].w};
        unsigned part[3][8];
        float sum = 0.0f, abs_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            // Each part the rest of x after the parts before it (exact in f32), rounded to bf16.
            float r0 = v[2 * j], r1 = v[2 * j + 1];
#pragma unroll
            for (int p = 0; p < 3; p++) {
                const __nv_bfloat162 h = __floats2bfloat162_rn(r0, r1);
                part[p][j] = *reinterpret_cast<const unsigned*>(&h);
                r0 -= __low2float(h);
                r1 -= __high2float(h);
            }
            sum += v[2 * j] + v[2 * j + 1];
            abs_sum += fabsf(v[2 * j]) + fabsf(v[2 * j + 1]);
        }
#pragma unroll
        for (int p = 0; p < 3; p++) {
            uint4* d = reinterpret_cast<uint4*>(&sh.x[p][t][16 * q]);
            d[0] = make_uint4(part[p][0], part[p][1], part[p][2], part[p][3]);
            d[1] = make_uint4(part[p][4], part[p][5], part[p][6], part[p][7]);
        }
        sh.xsum[t][q] = sum;
        sh.xabs[t][q] = abs_sum;
    }
    {
        const unsigned e = tid / 2, half = tid % 2;
        unsigned q[16];  // 32 values as bf16 pairs, in order
        if constexpr (BITS == 8) {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const uint4& u = r.w[j / 4];
                const unsigned word = j % 4 == 0 ? u.x : j % 4 == 1 ? u.y : j % 4 == 2 ? u.z : u.w;
                q[2 * j] = rb_q_bf16(word, 0, 0xffu) | rb_q_bf16(word, 8, 0xffu) << 16;
                q[2 * j + 1] = rb_q_bf16(word, 16, 0xffu) | rb_q_bf16(word, 24, 0xffu) << 16;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const unsigned word = j == 0 ? r.w[0].x : j == 1 ? r.w[0].y : j == 2 ? r.w[0].z : r.w[0].w;
#pragma unroll
                for (int p = 0; p < 4; p++)
                    q[4 * j + p] = rb_q_bf16(word, 8 * p, 0xfu) | rb_q_bf16(word, 8 * p + 4, 0xfu) << 16;
            }
        }
        uint4* d = reinterpret_cast<uint4*>(&sh.w[e][32 * half]);
#pragma unroll
        for (int j = 0; j < 4; j++) d[j] = make_uint4(q[4 * j], q[4 * j + 1], q[4 * j + 2], q[4 * j + 3]);
        constexpr float QMAX = (float)((1u << BITS) - 1u);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sh.s[e][2 * half + h] = r.s[h];
            sh.b[e][2 * half + h] = r.b[h];
            sh.c[e][2 * half + h] = fabsf(r.s[h]) * QMAX + fabsf(r.b[h]);
        }
    }
}

// Grid (ceil(tokens / RB_TOKENS), ceil(experts / RB_EXPERTS), splits), RB_THREADS threads; split
// z takes steps [z * steps, (z + 1) * steps) of K (in_dim a multiple of RB_K, groups of whole
// 16-value segments).
// approx, bound: [splits][tokens][experts].
template <int BITS, typename S>
__device__ void router_bounds(const float* x, const unsigned char* w, const S* scales, const S* biases,
                              float* approx, float* bound, unsigned tokens, unsigned in_dim, unsigned experts,
                              unsigned group, unsigned steps) {
    __shared__ __align__(16) RbShared sh;
    const unsigned t0 = blockIdx.x * RB_TOKENS, e0 = blockIdx.y * RB_EXPERTS, z = blockIdx.z;
    const unsigned first = z * steps, last = min(first + steps, in_dim / RB_K);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, wm = warp / 2, wn = warp % 2;
    float acc[4][4], bnd[4][4];
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = bnd[n][i] = 0.0f;
    pdl_begin();
    // The tensor cores add a group's products in c (q exact: one scale for all of them), folded
    // into acc and bnd at the group's end (or the split's) with the group's sums of x and |x|.
    float c[4][4], xsum[2] = {0.0f, 0.0f}, xabs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) c[n][i] = 0.0f;
    unsigned left = (group - first * RB_K % group) / 16;  // segments before this group ends
    RbRegs<BITS> r;
    if (first < last) rb_load<BITS, S>(r, x, w, scales, biases, t0, e0, first * RB_K, tokens, in_dim, experts, group);
    for (unsigned st = first; st < last; st++) {
        rb_store<BITS>(r, sh);
        __syncthreads();
        if (st + 1 < last)
            rb_load<BITS, S>(r, x, w, scales, biases, t0, e0, (st + 1) * RB_K, tokens, in_dim, experts, group);
#pragma unroll 1
        for (int kk = 0; kk < RB_K / 16; kk++) {
            unsigned a[3][4];
#pragma unroll
            for (int p = 0; p < 3; p++) ldmatrix_x4(a[p], &sh.x[p][16 * wm + lane % 16][kk * 16 + (lane / 16) * 8]);
#pragma unroll
            for (int n = 0; n < 4; n += 2) {
                unsigned b[4];
                ldmatrix_x4(b, &sh.w[32 * wn + 8 * n + lane % 8 + (lane / 16) * 8][kk * 16 + ((lane / 8) % 2) * 8]);
#pragma unroll
                for (int p = 0; p < 3; p++) {
                    mma_16816<bf16>(c[n], a[p], b[0], b[1]);
                    mma_16816<bf16>(c[n + 1], a[p], b[2], b[3]);
                }
            }
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                xsum[hf] += sh.xsum[16 * wm + lane / 4 + 8 * hf][kk];
                xabs[hf] += sh.xabs[16 * wm + lane / 4 + 8 * hf][kk];
            }
            if (--left > 0 && !(st + 1 == last && kk == RB_K / 16 - 1)) continue;
            left = group / 16;
            // Accumulator i: token row lane / 4 (+ 8 from i = 2), expert column 2 (lane % 4) + i % 2.
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const unsigned col = 32 * wn + 8 * n + 2 * (lane % 4) + j;
                    const float gs = sh.s[col][kk], gb = sh.b[col][kk], gc = sh.c[col][kk];
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        const unsigned i = 2 * hf + j;
                        acc[n][i] += gs * c[n][i] + gb * xsum[hf];
                        bnd[n][i] += gc * xabs[hf];
                        c[n][i] = 0.0f;
                    }
                }
#pragma unroll
            for (int hf = 0; hf < 2; hf++) xsum[hf] = xabs[hf] = 0.0f;
        }
        __syncthreads();
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const unsigned t = t0 + 16 * wm + lane / 4 + 8 * hf;
        if (t >= tokens) continue;
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const unsigned e = e0 + 32 * wn + 8 * n + 2 * (lane % 4) + j;
                if (e >= experts) continue;
                const size_t o = ((size_t)z * tokens + t) * experts + e;
                approx[o] = acc[n][2 * hf + j];
                bound[o] = bnd[n][2 * hf + j];
            }
    }
}

// Floats of shared memory a router_choose block takes: x staged (padded), the vectors' sums,
// the candidates' exact logits, the lower and upper bounds, the candidate list and its length,
// rounded up to 16 bytes.
__host__ __device__ constexpr unsigned rc_floats(unsigned in_dim, unsigned vals, unsigned experts) {
    return (padded_len(in_dim) + in_dim / vals + 4 * experts + 1 + 3) / 4 * 4;
}

// Grid `tokens`, a block of RC_WARPS warps a token. approx and bound as router_bounds writes them
// (`splits` partial sums, at most RB_SPLITS); ids, weights: [tokens, k]. Every thread stages part
// of x and sums the partials of some experts; warp 0 takes the k-th largest lower bound and lists
// the candidates; the warps share out their exact sums, R rows at a time; warp 0 chooses.
template <int BITS, typename S, int PER_LANE>
__device__ void router_choose(const float* x, const void* w, const S* scales, const S* biases, const float* approx,
                              const float* bound, unsigned splits, float beta, unsigned* ids, float* weights,
                              unsigned tokens, unsigned in_dim, unsigned experts, unsigned group, unsigned k) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS, F4 = VALS / 4, THREADS = 32 * RC_WARPS;
    constexpr int R = 4;
    extern __shared__ __align__(16) float rc_smem[];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, nvec = in_dim / VALS, t = blockIdx.x;
    float* xs = rc_smem;
    float* xsum = xs + padded_len(in_dim);
    float* exact = xsum + nvec;
    float* lo_s = exact + experts;
    float* hi_s = lo_s + experts;
    unsigned* list = reinterpret_cast<unsigned*>(hi_s + experts);
    unsigned* count = list + experts;
    pdl_begin();
    for (unsigned u = threadIdx.x; u < nvec; u += THREADS) {
        float4 f[F4];
#pragma unroll
        for (unsigned j = 0; j < F4; j++) f[j] = reinterpret_cast<const float4*>(x + (size_t)t * in_dim)[u * F4 + j];
        stage_vector<BITS>(f, xs, xsum, u);
    }
    int bad = 0;
    for (unsigned e = threadIdx.x; e < experts; e += THREADS) {
        float a[RB_SPLITS], m[RB_SPLITS];
#pragma unroll
        for (unsigned z = 0; z < RB_SPLITS; z++) {
            const size_t o = ((size_t)z * tokens + t) * experts + e;
            a[z] = z < splits ? approx[o] : 0.0f;
            m[z] = z < splits ? bound[o] : 0.0f;
        }
        float as = 0.0f, ms = 0.0f;
#pragma unroll
        for (unsigned z = 0; z < RB_SPLITS; z++) {
            as += a[z];
            ms += m[z];
        }
        const float room = beta * ms + RB_TINY;
        lo_s[e] = as - room;
        hi_s[e] = as + room;
        bad |= !(isfinite(as - room) && isfinite(as + room));
    }
    bad = __syncthreads_or(bad);
    bool cand[PER_LANE];
    if (warp == 0) {
        // The k-th largest lower bound: k rounds, each taking one instance of the largest left.
        unsigned key[PER_LANE];
        float hi[PER_LANE];
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const unsigned e = lane + 32 * i;
            key[i] = e < experts ? logit_key(lo_s[e], true) : 0u;
            hi[i] = e < experts ? hi_s[e] : 0.0f;
        }
        unsigned kth = 0;
        for (unsigned j = 0; j < k && !bad; j++) {
            unsigned mine = 0;
#pragma unroll
            for (int i = 0; i < PER_LANE; i++) mine = max(mine, key[i]);
            kth = __reduce_max_sync(0xffffffffu, mine);
            unsigned c = 0xffffffffu;
#pragma unroll
            for (int i = PER_LANE - 1; i >= 0; i--)
                if (key[i] == kth) c = lane + 32 * i;
            const unsigned bi = __reduce_min_sync(0xffffffffu, c);
#pragma unroll
            for (int i = 0; i < PER_LANE; i++)
                if (lane + 32 * i == bi) key[i] = 0;
        }
        const float tau = key_logit(kth);
        // The candidates, listed in order of expert.
        unsigned n = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const unsigned e = lane + 32 * i;
            cand[i] = e < experts && (bad || hi[i] >= tau);
            const unsigned mask = __ballot_sync(0xffffffffu, cand[i]);
            if (cand[i]) list[n + __popc(mask & ((1u << lane) - 1u))] = e;
            n += __popc(mask);
        }
        if (lane == 0) *count = n;
    }
    __syncthreads();
    const unsigned n = *count;
    for (unsigned c0 = warp * R; c0 < n; c0 += RC_WARPS * R) {
        unsigned row[R];
        float dot[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            row[r] = c0 + r < n ? list[c0 + r] : experts;
            dot[r] = 0.0f;
        }
        rows_dot_at<BITS, R, S>(w, scales, biases, row, experts, xs, xsum, in_dim, group, dot);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float sum = warp_sum(dot[r]);
            if (lane == 0 && row[r] < experts) exact[row[r]] = sum;
        }
    }
    __syncthreads();
    if (warp != 0) return;
    float p[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) p[i] = cand[i] ? exact[lane + 32 * i] : __uint_as_float(0x7fc00000u);
    choose<PER_LANE>(p, ids, weights, t, experts, k, 1);
}

#define ROUTER_CHOOSE(BITS, S, NAME, PER_LANE)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * RC_WARPS, 8) router_choose_##NAME##_##PER_LANE(           \
        const float* x, const unsigned* w, const S* scales, const S* biases, const float* approx,            \
        const float* bound, unsigned splits, float beta, unsigned* ids, float* weights, unsigned tokens,      \
        unsigned in_dim, unsigned experts, unsigned group, unsigned k) {                                     \
        router_choose<BITS, S, PER_LANE>(x, w, scales, biases, approx, bound, splits, beta, ids, weights,    \
                                         tokens, in_dim, experts, group, k);                                 \
    }
#define ROUTER_BOUNDED(BITS, S, NAME)                                                                        \
    extern "C" __global__ void __launch_bounds__(RB_THREADS, 4) router_bounds_##NAME(                        \
        const float* x, const unsigned* w, const S* scales, const S* biases, float* approx, float* bound,    \
        unsigned tokens, unsigned in_dim, unsigned experts, unsigned group, unsigned steps) {                \
        router_bounds<BITS, S>(x, reinterpret_cast<const unsigned char*>(w), scales, biases, approx, bound,  \
                               tokens, in_dim, experts, group, steps);                                       \
    }                                                                                                        \
    ROUTER_CHOOSE(BITS, S, NAME, 4) ROUTER_CHOOSE(BITS, S, NAME, 8) ROUTER_CHOOSE(BITS, S, NAME, 16)
ROUTER_BOUNDED(4, bf16, q4)
ROUTER_BOUNDED(8, bf16, q8)
ROUTER_BOUNDED(4, float, q4f)
ROUTER_BOUNDED(8, float, q8f)
