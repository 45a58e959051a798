// Full attention with a KV cache. kv_append writes new keys/values at their positions
// (attention_inputs does it together with the per-head norms and rotation of q and k: a head a
// block, a head a warp, or for many tokens four heads of a token a warp); attention
// is causal with grouped-query heads. The attention kernels, the most specialised first:
// - decode_attention_* (sm_90, at the end of this file; tensor cores, bf16/f16 caches, head dims
//   64/96/128/256, up to 16 rows of one KV head's group: decode): the cache range is split over
//   one wave of blocks, at most one per SM. Each warp streams its own batches of keys through a
//   cp.async ring, the first batches' rows of past tokens requested before the programmatic wait.
//   The warps' results merge in shared memory into a record per block; the blocks of a KV head
//   count their records and wait for each other (a counter per KV head; all are resident), then
//   each merges a share of the output, a warp per piece and a lane per split (fewer splits: more
//   pieces a warp). No combine launch. The output in f32, or (out_bf16) rounded to bf16 for the
//   products that read it, which round it anyway.
// - flash_attention_* (tensor cores, bf16/f16 caches, the same head dims, any number of tokens):
//   a block takes one KV head and 64 or 128 rows of its group, K/V tiles streaming through shared
//   memory with cp.async, over the sequence of its first token (one sequence's chunk, or one run
//   of several prompts' chunks). With fewer blocks than two per SM the cache range is split, and
//   attention_combine merges the parts. The output in f32 or, as decode's, rounded to bf16.
// - attention_split (decode, up to 4 tokens: f32 caches, and bf16/f16 caches of other head dims):
//   the cache range split over blocks, the parts merged by attention_combine.
// - attention_combine: merges split parts (max, sum, acc) of either kernel; a warp per row up to
//   8 splits (attention_combine_f32), a block per row beyond (attention_combine_many_f32).
// - the plain kernel below for everything else: one block per (token, head), four warps splitting
//   the cache rows, each with an online softmax, merged at the end; a lane holds dims lane,
//   lane + 32, ... of the head (head_dim <= 256).
#include "kestrel.cuh"

// The launch geometry comes from the host (`ops/attention.rs`) as -D definitions: WARPS and
// MAX_PER_LANE (attention_*), GROUP and DEC_WARPS (attention_split_*), COMBINE_WARPS,
// COMBINE_LOADS, COMBINE_THREADS and MAX_SPLITS (attention_combine_*), FA_WARPS, FA_KEYS and
// FA_KEYS_WIDE (flash_attention_*), DA_ROWS, DA_KEYS, DA_STAGES, DA_WARPS and DA_WARPS_WIDE
// (decode_attention_*), AI_WARPS, AI_ROW_WARPS and AI_ROW_BATCH (attention_inputs_*), and
// WIDE_HEAD_DIM, over which heads take the wide shapes.
#if !defined(WARPS) || !defined(MAX_PER_LANE) || !defined(GROUP) || !defined(DEC_WARPS) ||                 \
    !defined(COMBINE_WARPS) || !defined(COMBINE_LOADS) || !defined(COMBINE_THREADS) || !defined(MAX_SPLITS) || \
    !defined(FA_WARPS) || !defined(FA_KEYS) || !defined(FA_KEYS_WIDE) || !defined(WIDE_HEAD_DIM) ||         \
    !defined(DA_ROWS) || !defined(DA_KEYS) || !defined(DA_STAGES) || !defined(DA_WARPS) ||                 \
    !defined(DA_WARPS_WIDE) || !defined(AI_WARPS) || !defined(AI_ROW_WARPS) || !defined(AI_ROW_BATCH)
#error "attention.cu is compiled with the launch geometry of ops/attention.rs as -D definitions"
#endif

// The caches are pools of blocks of rows, [kv_heads, rows, head_dim]: position p of a sequence is
// row table[p / block] * block + p % block of its block table (`KvPages` in kestrel-core). Every
// kernel takes the pages as (table, seq, seq_step, max_blocks, shift): the block table
// [seqs, max_blocks], the sequence of token t at seq[t * seq_step] (seq_step 0: one sequence for
// every token), and block = 1 << shift.
struct Pages {
    const unsigned* blocks;  // this sequence's row of the table
    unsigned shift, max_ctx;
    // The cache row of position p (< max_ctx).
    __device__ __forceinline__ unsigned row(unsigned p) const {
        return (blocks[p >> shift] << shift) | (p & ((1u << shift) - 1));
    }
};

__device__ __forceinline__ Pages pages_of(const unsigned* table, const unsigned* seq, unsigned seq_step,
                                          unsigned max_blocks, unsigned shift, unsigned t) {
    return Pages{table + (size_t)seq[t * seq_step] * max_blocks, shift, max_blocks << shift};
}

#define PAGE_PARAMS const unsigned *table, const unsigned *seq, unsigned seq_step, unsigned max_blocks, unsigned shift
#define PAGE_ARGS table, seq, seq_step, max_blocks, shift

template <typename T>
__device__ void kv_append(const float* k, const float* v, const unsigned* positions, T* k_cache, T* v_cache,
                          PAGE_PARAMS, unsigned tokens, unsigned kv_heads, unsigned head_dim, unsigned rows) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * kv_heads * head_dim) return;
    const size_t t = i / ((size_t)kv_heads * head_dim), h = (i / head_dim) % kv_heads, d = i % head_dim;
    const unsigned p = positions[t];
    const Pages pg = pages_of(PAGE_ARGS, t);
    if (p >= pg.max_ctx) return;  // the host checks lengths before any work; never write outside the cache
    const unsigned r = pg.row(p);
    if (r >= rows) return;
    const size_t dst = (h * rows + r) * head_dim + d;
    k_cache[dst] = from_f32<T>(k[i]);
    v_cache[dst] = from_f32<T>(v[i]);
}

// The inputs of attention for new tokens in one kernel, from the fused projection qkv (a row: each
// query head's head_dim values, followed by its gate's when q_stride = 2 * head_dim; then the keys;
// then the values). A block per (token, row), the rows being the heads of q, then of k, then of
// v (decode: the most threads on a head), or with WARP a warp per (token, row), AI_WARPS a block
// (many tokens: the fewest blocks). A head is staged in shared memory, RMS-normalised when norm
// weights are given (q and k), rotated (neox halves, angle position * inv_freq in f32 as
// rope_f32 computes it) and stored: q (and its gate, copied) to q and gate, k and v into the
// caches at the token's position. head_dim <= 256; blockDim.x a multiple of 32 (32 * AI_WARPS
// with WARP).
// A norm weight's factor (zero-centred weights store w - 1).
template <typename W>
__device__ __forceinline__ float norm_factor(const W* w, unsigned i, int zero_centered) {
    return zero_centered ? 1.0f + to_f32(w[i]) : to_f32(w[i]);
}

// The columns of one token's row of the fused projection: `heads` heads of q (q_stride each: a
// head, or a head and its gate), then kv_heads heads of k and kv_heads of v.
__device__ __forceinline__ size_t qkv_cols(unsigned heads, unsigned kv_heads, unsigned head_dim, unsigned q_stride) {
    return (size_t)heads * q_stride + 2 * (size_t)kv_heads * head_dim;
}

// Where head h of q (is_q), of k (is_k) or of v starts in a token's row x of the fused projection.
__device__ __forceinline__ const float* head_source(const float* x, unsigned h, bool is_q, bool is_k, unsigned heads,
                                                    unsigned kv_heads, unsigned head_dim, unsigned q_stride) {
    return is_q ? x + (size_t)h * q_stride
                : x + (size_t)heads * q_stride + (is_k ? 0 : (size_t)kv_heads * head_dim) + (size_t)h * head_dim;
}

// 1 / RMS (eps added to the mean square) of a head a warp holds, VPL values a lane: the lane's
// squares summed in j's order, then warp_sum.
template <int VPL>
__device__ __forceinline__ float warp_rms_inverse(const float (&v)[VPL], unsigned head_dim, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPL; j++) ss += v[j] * v[j];
    return 1.0f / sqrtf(warp_sum(ss) / (float)head_dim + eps);
}

// A rotated value: `value` turned with its partner (the value half a rotation away) by the
// angle whose cosine and sine are c and sn; the first half subtracts the partner's share.
__device__ __forceinline__ float turn(float value, float partner, float c, float sn, float scaling,
                                      bool first_half) {
    return first_half ? value * (c * scaling) - partner * (sn * scaling)
                      : value * (c * scaling) + partner * (sn * scaling);
}

// Value i of a head staged in `row`, rotated at position p (neox halves over the first 2 * half
// values, angle p * inv_freq in f32 as rope_f32 computes it).
__device__ __forceinline__ float rotated(const float* row, unsigned i, unsigned half, unsigned p,
                                         const float* inv_freq, float scaling) {
    if (i >= 2 * half) return row[i];
    const bool first = i < half;
    float sn, c;
    sincosf((float)p * inv_freq[first ? i : i - half], &sn, &c);
    return turn(row[i], row[first ? i + half : i - half], c, sn, scaling, first);
}

template <typename T, typename W, bool WARP>
__device__ void attention_inputs(const float* qkv, float* q, float* gate, const W* q_norm, const W* k_norm,
                                 float eps, int zero_centered, const unsigned* positions, const float* inv_freq,
                                 T* k_cache, T* v_cache, PAGE_PARAMS, unsigned heads, unsigned kv_heads,
                                 unsigned head_dim, unsigned q_stride, unsigned rot_dim, float scaling, unsigned rows) {
    __shared__ float rows_s[WARP ? AI_WARPS : 1][256];
    __shared__ float scratch[32];
    const unsigned warp = threadIdx.x / 32;
    // This thread's first value of the head and the step to its next (a warp's lanes, or the block's threads).
    const unsigned first = WARP ? threadIdx.x % 32 : threadIdx.x, step = WARP ? 32 : blockDim.x;
    const unsigned t = blockIdx.x, r = WARP ? blockIdx.y * AI_WARPS + warp : blockIdx.y;
    if (r >= heads + 2 * kv_heads) return;  // warps only: a block-wide barrier follows otherwise
    float* row = rows_s[WARP ? warp : 0];
    const unsigned p = positions[t];
    const bool is_q = r < heads, is_k = !is_q && r < heads + kv_heads;
    const unsigned h = is_q ? r : (is_k ? r - heads : r - heads - kv_heads);
    const float* x = qkv + t * qkv_cols(heads, kv_heads, head_dim, q_stride);
    const float* src = head_source(x, h, is_q, is_k, heads, kv_heads, head_dim, q_stride);
    for (unsigned i = first; i < head_dim; i += step) row[i] = src[i];
    if (is_q && gate != nullptr) {
        float* g = gate + ((size_t)t * heads + h) * head_dim;
        for (unsigned i = first; i < head_dim; i += step) g[i] = src[head_dim + i];
    }
    const W* w = is_q ? q_norm : k_norm;
    if (w != nullptr && (is_q || is_k)) {
        // Each thread norms the values it loaded: no other thread's are read before the barrier.
        float ss = 0.0f;
        for (unsigned i = first; i < head_dim; i += step) ss += row[i] * row[i];
        ss = WARP ? warp_sum(ss) : block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
        for (unsigned i = first; i < head_dim; i += step) row[i] = row[i] * inv * norm_factor(w, i, zero_centered);
    }
    if constexpr (WARP)
        __syncwarp();
    else
        __syncthreads();
    const Pages pg = pages_of(PAGE_ARGS, t);
    // The host checks lengths before any work; never write outside the cache.
    const unsigned cache_row = !is_q && p < pg.max_ctx ? pg.row(p) : rows;
    if (!is_q && cache_row >= rows) return;
    const unsigned half = (is_q || is_k) ? rot_dim / 2 : 0;
    float* qh = q + ((size_t)t * heads + h) * head_dim;
    const size_t at = ((size_t)h * rows + cache_row) * head_dim;
    for (unsigned i = first; i < head_dim; i += step) {
        const float out = rotated(row, i, half, p, inv_freq, scaling);
        if (is_q)
            qh[i] = out;
        else
            (is_k ? k_cache : v_cache)[at + i] = from_f32<T>(out);
    }
}

// attention_inputs for many tokens with AI_ROW_WARPS warps a block, AI_ROW_BATCH rows (heads of
// q, k or v) a warp: block (t, y) takes token t's rows from y * AI_ROW_WARPS * AI_ROW_BATCH,
// warp w of them w, w + AI_ROW_WARPS, ..., each lane values lane + 32 j (j < VPL = head_dim /
// 32), so all of a warp's loads are in flight before the first is used; the rotation's angles,
// the same for every head of a token, are worked out once a block into shared memory, and up to
// head dim 128 the norms' factors are loaded once a warp. The arithmetic is that of
// attention_inputs<.., true>, in its order: a lane's squares summed in j's order, then
// warp_sum; each value normed, then rotated with its partner value i +- half, which the same
// lane holds (half a multiple of 32, half / 32 a power of two). A head a warp kept a long
// prefill's warps waiting on one head's loads each (60 us a layer at 2,048 tokens, about three
// times the bytes' time).
template <typename T, typename W, int VPL>
__device__ void attention_inputs_rows(const float* qkv, float* q, float* gate, const W* q_norm, const W* k_norm,
                                      float eps, int zero_centered, const unsigned* positions,
                                      const float* inv_freq, T* k_cache, T* v_cache, PAGE_PARAMS, unsigned heads,
                                      unsigned kv_heads, unsigned head_dim, unsigned q_stride, unsigned rot_dim,
                                      float scaling, unsigned rows) {
    // The token's rotation, cosine and sine of angle i < half (half <= 128: head dims to 256),
    // one a thread.
    static_assert(32 * AI_ROW_WARPS >= 128, "a block's threads work out up to 128 angles");
    __shared__ float turn_c[128], turn_s[128];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, t = blockIdx.x;
    const unsigned total = heads + 2 * kv_heads, r0 = blockIdx.y * AI_ROW_WARPS * AI_ROW_BATCH + warp;
    const float* x = qkv + t * qkv_cols(heads, kv_heads, head_dim, q_stride);
    // Row r: head h of q (is_q), k (is_k) or v.
    auto head_of = [&](unsigned r, bool& is_q, bool& is_k) {
        is_q = r < heads;
        is_k = !is_q && r < heads + kv_heads;
        return is_q ? r : (is_k ? r - heads : r - heads - kv_heads);
    };
    float v[AI_ROW_BATCH][VPL];
    if (r0 < total) {
#pragma unroll
        for (int b = 0; b < AI_ROW_BATCH; b++) {
            bool is_q, is_k;
            const unsigned h = head_of(min(r0 + b * AI_ROW_WARPS, total - 1), is_q, is_k);  // past the rows: the last
            const float* src = head_source(x, h, is_q, is_k, heads, kv_heads, head_dim, q_stride);
#pragma unroll
            for (int j = 0; j < VPL; j++) v[b][j] = src[lane + 32 * j];
        }
    }
    // Each of the token's angles once a block, while the loads are in flight: value i < half
    // turns by inv_freq[i], i < 2 half by inv_freq[i - half].
    const unsigned p = positions[t], half = rot_dim / 2, h32 = half / 32;
    if (threadIdx.x < half) {
        float c, sv;
        sincosf((float)p * inv_freq[threadIdx.x], &sv, &c);
        turn_c[threadIdx.x] = c;
        turn_s[threadIdx.x] = sv;
    }
    __syncthreads();
    if (r0 >= total) return;
    float cs[VPL], sn[VPL];
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        const unsigned i = lane + 32 * j, a = i < half ? i : i - half;
        cs[j] = i < 2 * half ? turn_c[a] : 0.0f;
        sn[j] = i < 2 * half ? turn_s[a] : 0.0f;
    }
    // The norms' factors, the same for every head of q (or of k): loaded once a warp where the
    // registers allow (at head dim 256 they would cost a block a multiprocessor), else a head at
    // a time.
    constexpr bool ONCE = VPL <= 4;
    float fq[VPL], fk[VPL];
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        fq[j] = ONCE && q_norm != nullptr ? norm_factor(q_norm, lane + 32 * j, zero_centered) : 1.0f;
        fk[j] = ONCE && k_norm != nullptr ? norm_factor(k_norm, lane + 32 * j, zero_centered) : 1.0f;
    }
    const Pages pg = pages_of(PAGE_ARGS, t);
    // The host checks lengths before any work; never write outside the cache.
    const unsigned cache_row = p < pg.max_ctx ? pg.row(p) : rows;
#pragma unroll
    for (int b = 0; b < AI_ROW_BATCH; b++) {
        const unsigned r = r0 + b * AI_ROW_WARPS;
        if (r >= total) continue;
        bool is_q, is_k;
        const unsigned h = head_of(r, is_q, is_k);
        if (is_q && gate != nullptr) {
            const float* src = head_source(x, h, true, false, heads, kv_heads, head_dim, q_stride) + head_dim;
            float* g = gate + ((size_t)t * heads + h) * head_dim;
#pragma unroll
            for (int j = 0; j < VPL; j++) g[lane + 32 * j] = src[lane + 32 * j];
        }
        const W* w = is_q ? q_norm : k_norm;
        if (w != nullptr && (is_q || is_k)) {
            const float inv = warp_rms_inverse(v[b], head_dim, eps);
#pragma unroll
            for (int j = 0; j < VPL; j++)
                v[b][j] = v[b][j] * inv * (ONCE ? (is_q ? fq[j] : fk[j]) : norm_factor(w, lane + 32 * j, zero_centered));
        }
        if (!is_q && cache_row >= rows) continue;
        const bool turns = is_q || is_k;
        float* qh = q + ((size_t)t * heads + h) * head_dim;
        const size_t at = ((size_t)h * rows + cache_row) * head_dim;
#pragma unroll
        for (int j = 0; j < VPL; j++) {
            const unsigned i = lane + 32 * j;
            float out = v[b][j];
            if (turns && i < 2 * half) {
                // The partner value i + half or i - half: this lane's j ^ h32 (h32 1, 2 or 4 below
                // VPL). Each candidate is read at a fixed index: an index chosen at run time would
                // put v in local memory.
                const float o1 = v[b][(j ^ 1) % VPL], o2 = v[b][(j ^ 2) % VPL], o4 = v[b][(j ^ 4) % VPL];
                const float other = h32 == 1 ? o1 : (h32 == 2 ? o2 : o4);
                out = turn(v[b][j], other, cs[j], sn[j], scaling, i < half);
            }
            if (is_q)
                qh[i] = out;
            else
                (is_k ? k_cache : v_cache)[at + i] = from_f32<T>(out);
        }
    }
}

template <typename T>
__device__ void attention(const float* q, const T* k_cache, const T* v_cache, const unsigned* positions,
                          PAGE_PARAMS, float* out, unsigned heads, unsigned kv_heads, unsigned head_dim,
                          unsigned rows, float scale) {
    __shared__ float s_m[WARPS], s_l[WARPS];
    __shared__ float s_acc[WARPS][MAX_PER_LANE * 32];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const size_t row = blockIdx.x;  // token * heads + head
    const unsigned t = row / heads, h = row % heads;
    const unsigned kvh = h / (heads / kv_heads);
    const Pages pg = pages_of(PAGE_ARGS, t);
    const unsigned n = min(positions[t] + 1, pg.max_ctx);
    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) {
        const unsigned d = lane + 32 * r;
        qv[r] = d < head_dim ? q[row * head_dim + d] : 0.0f;
        acc[r] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const T* kb = k_cache + (size_t)kvh * rows * head_dim;
    const T* vb = v_cache + (size_t)kvh * rows * head_dim;
    for (unsigned j = warp; j < n; j += WARPS) {
        const size_t at = (size_t)pg.row(j) * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) {
            const unsigned d = lane + 32 * r;
            if (d < head_dim) s += qv[r] * to_f32(kb[at + d]);
        }
        s = warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) {
            const unsigned d = lane + 32 * r;
            if (d < head_dim) acc[r] = acc[r] * corr + p * to_f32(vb[at + d]);
        }
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) s_acc[warp][lane + 32 * r] = acc[r];
    __syncthreads();
    if (warp == 0) {
        float mm = -INFINITY;
        for (int w = 0; w < WARPS; w++) mm = fmaxf(mm, s_m[w]);
        float ll = 0.0f;
        for (int w = 0; w < WARPS; w++) ll += s_m[w] == -INFINITY ? 0.0f : s_l[w] * expf(s_m[w] - mm);
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) {
            const unsigned d = lane + 32 * r;
            if (d >= head_dim) continue;
            float a = 0.0f;
            for (int w = 0; w < WARPS; w++)
                if (s_m[w] != -INFINITY) a += s_acc[w][d] * expf(s_m[w] - mm);
            out[row * head_dim + d] = a / ll;
        }
    }
}

#define ATTN(T, NAME)                                                                                       \
    extern "C" __global__ void kv_append_##NAME(const float* k, const float* v, const unsigned* positions,   \
                                                T* k_cache, T* v_cache, PAGE_PARAMS, unsigned tokens,        \
                                                unsigned kv_heads, unsigned head_dim, unsigned rows) {       \
        pdl_begin();                                                                                        \
        kv_append(k, v, positions, k_cache, v_cache, PAGE_ARGS, tokens, kv_heads, head_dim, rows);          \
    }                                                                                                       \
    extern "C" __global__ void attention_##NAME(const float* q, const T* k_cache, const T* v_cache,          \
                                                const unsigned* positions, PAGE_PARAMS, float* out,          \
                                                unsigned heads, unsigned kv_heads, unsigned head_dim,        \
                                                unsigned rows, float scale) {                                \
        pdl_begin();                                                                                        \
        attention(q, k_cache, v_cache, positions, PAGE_ARGS, out, heads, kv_heads, head_dim, rows, scale);  \
    }

ATTN(float, f32)
ATTN(bf16, bf16)
ATTN(f16, f16)

// attention_inputs_{cache}_{norm weights} (a block a head) and attention_inputs_warps_* (a warp a
// head, AI_WARPS a block); without norms (or gates) the pointers are null.
#define INPUTS(T, NAME, W, WNAME, WARP, KIND)                                                               \
    extern "C" __global__ void attention_inputs_##KIND##NAME##_##WNAME(                                     \
        const float* qkv, float* q, float* gate, const W* q_norm, const W* k_norm, float eps,              \
        int zero_centered, const unsigned* positions, const float* inv_freq, T* k_cache, T* v_cache,        \
        PAGE_PARAMS, unsigned heads, unsigned kv_heads, unsigned head_dim, unsigned q_stride,               \
        unsigned rot_dim, float scaling, unsigned rows) {                                                   \
        pdl_begin();                                                                                        \
        attention_inputs<T, W, WARP>(qkv, q, gate, q_norm, k_norm, eps, zero_centered, positions, inv_freq, \
                                     k_cache, v_cache, PAGE_ARGS, heads, kv_heads, head_dim, q_stride,      \
                                     rot_dim, scaling, rows);                                               \
    }
// attention_inputs_rows_{cache}_{norm weights}_{head dim}: grid (tokens, rows / (AI_ROW_WARPS *
// AI_ROW_BATCH)).
#define INPUTS_ROWS(T, NAME, W, WNAME, HD)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * AI_ROW_WARPS) attention_inputs_rows_##NAME##_##WNAME##_##HD( \
        const float* qkv, float* q, float* gate, const W* q_norm, const W* k_norm, float eps,              \
        int zero_centered, const unsigned* positions, const float* inv_freq, T* k_cache, T* v_cache,        \
        PAGE_PARAMS, unsigned heads, unsigned kv_heads, unsigned head_dim, unsigned q_stride,               \
        unsigned rot_dim, float scaling, unsigned rows) {                                                   \
        pdl_begin();                                                                                        \
        attention_inputs_rows<T, W, HD / 32>(qkv, q, gate, q_norm, k_norm, eps, zero_centered, positions,   \
                                             inv_freq, k_cache, v_cache, PAGE_ARGS, heads, kv_heads,        \
                                             head_dim, q_stride, rot_dim, scaling, rows);                   \
    }
#define INPUTS_BOTH(T, NAME, W, WNAME)                                                                      \
    INPUTS(T, NAME, W, WNAME, false, ) INPUTS(T, NAME, W, WNAME, true, warps_)                             \
    INPUTS_ROWS(T, NAME, W, WNAME, 64) INPUTS_ROWS(T, NAME, W, WNAME, 128) INPUTS_ROWS(T, NAME, W, WNAME, 256)
#define INPUTS_ALL(T, NAME) INPUTS_BOTH(T, NAME, float, f32) INPUTS_BOTH(T, NAME, bf16, bf16) INPUTS_BOTH(T, NAME, f16, f16)
INPUTS_ALL(float, f32)
INPUTS_ALL(bf16, bf16)
INPUTS_ALL(f16, f16)

// ---- decode on f32 caches: split over the cache length ----
// Grid (kv_heads * subgroups, splits, tokens): a block takes one KV head, up to GROUP query heads
// of its group and one chunk of the cache rows `0 ..= positions[t]`, so each K/V row is read
// once per GROUP query heads. A warp takes batches of 32 keys: lane j copies K and V rows j into
// the warp's shared rows with asynchronous 16-byte copies (all in flight at once, no registers),
// scores key j against the block's queries, the online softmax runs per query head across lanes,
// and P.V accumulates with lane d owning dims d, d + 32, ... (PL of them). The warps' partial
// results are merged and written as (max, sum, acc) per (token, head, split) for
// attention_combine. head_dim is a multiple of 8.

__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}

__device__ __forceinline__ void wait_async() { asm volatile("cp.async.wait_all;\n" ::); }

// Eight consecutive values as floats (p is 16-byte aligned).
__device__ __forceinline__ void load8(const float* p, float out[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void load8(const T* p, float out[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = to_f32(h[i]);
}

template <typename T, int PL>
__device__ void attention_split(const float* q, const T* k_cache, const T* v_cache, const unsigned* positions,
                                PAGE_PARAMS, float* part_m, float* part_l, float* part_acc, unsigned heads,
                                unsigned kv_heads, unsigned head_dim, unsigned rows, float scale, unsigned chunk) {
    extern __shared__ float smem[];
    float* qs = smem;                        // [GROUP, head_dim]
    float* wm = qs + GROUP * head_dim;       // [DEC_WARPS, GROUP]
    float* wl = wm + DEC_WARPS * GROUP;      // [DEC_WARPS, GROUP]
    float* wacc = wl + DEC_WARPS * GROUP;    // [DEC_WARPS, GROUP, head_dim]
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // Each warp's 32 K rows then 32 V rows, padded by 8 values against bank conflicts.
    const unsigned stride = head_dim + 8;
    T* ks = reinterpret_cast<T*>(wacc + DEC_WARPS * GROUP * head_dim) + warp * 64 * stride;
    T* vs = ks + 32 * stride;
    const unsigned group = heads / kv_heads, subgroups = (group + GROUP - 1) / GROUP;
    const unsigned kvh = blockIdx.x / subgroups, h0 = kvh * group + (blockIdx.x % subgroups) * GROUP;
    const unsigned G = min((unsigned)GROUP, kvh * group + group - h0);
    const unsigned split = blockIdx.y, splits = gridDim.y, t = blockIdx.z;
    const Pages pg = pages_of(PAGE_ARGS, t);
    const unsigned n = min(positions[t] + 1, pg.max_ctx);
    const unsigned start = split * chunk, end = min(start + chunk, n);
    for (unsigned i = threadIdx.x; i < GROUP * head_dim; i += blockDim.x)
        qs[i] = i < G * head_dim ? q[((size_t)t * heads + h0) * head_dim + i] * scale : 0.0f;
    __syncthreads();
    float m[GROUP], l[GROUP], acc[GROUP][PL];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int r = 0; r < PL; r++) acc[g][r] = 0.0f;
    }
    const T* kb = k_cache + (size_t)kvh * rows * head_dim;
    const T* vb = v_cache + (size_t)kvh * rows * head_dim;
    const unsigned row_chunks = head_dim * sizeof(T) / 16;
    for (unsigned base = start + warp * 32; base < end; base += DEC_WARPS * 32) {
        const unsigned key = base + lane;
        const bool valid = key < end;
        if (valid) {
            const size_t at = (size_t)pg.row(key) * head_dim;
            const char* kr = reinterpret_cast<const char*>(kb + at);
            const char* vr = reinterpret_cast<const char*>(vb + at);
            char* kd = reinterpret_cast<char*>(ks + lane * stride);
            char* vd = reinterpret_cast<char*>(vs + lane * stride);
            for (unsigned c = 0; c < row_chunks; c++) {
                copy16_async(kd + 16 * c, kr + 16 * c);
                copy16_async(vd + 16 * c, vr + 16 * c);
            }
        }
        wait_async();
        __syncwarp();
        float s[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; g++) s[g] = 0.0f;
        if (valid) {
            const T* kr = ks + lane * stride;
            for (unsigned d0 = 0; d0 < head_dim; d0 += 8) {
                float kv[8];
                load8(kr + d0, kv);
#pragma unroll
                for (int g = 0; g < GROUP; g++) {
                    const float4 qa = *reinterpret_cast<const float4*>(qs + g * head_dim + d0);
                    const float4 qb = *reinterpret_cast<const float4*>(qs + g * head_dim + d0 + 4);
                    s[g] += qa.x * kv[0] + qa.y * kv[1] + qa.z * kv[2] + qa.w * kv[3] + qb.x * kv[4] + qb.y * kv[5] +
                            qb.z * kv[6] + qb.w * kv[7];
                }
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            const float sv = valid ? s[g] : -INFINITY;
            const float m_new = fmaxf(m[g], warp_max(sv));
            const float p = valid ? expf(sv - m_new) : 0.0f;
            const float corr = expf(m[g] - m_new);
            l[g] = l[g] * corr + warp_sum(p);
#pragma unroll
            for (int r = 0; r < PL; r++) acc[g][r] *= corr;
            m[g] = m_new;
            s[g] = p;
        }
        const unsigned keys = min(32u, end - base);
        for (unsigned j = 0; j < keys; j++) {
            const T* vr = vs + j * stride;
            float vv[PL];
#pragma unroll
            for (int r = 0; r < PL; r++) {
                const unsigned d = lane + 32 * r;
                vv[r] = d < head_dim ? to_f32(vr[d]) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                const float p = __shfl_sync(0xffffffffu, s[g], j);
#pragma unroll
                for (int r = 0; r < PL; r++) acc[g][r] += p * vv[r];
            }
        }
        __syncwarp();  // the next batch overwrites the shared rows
    }
    // Merge the warps. Unused query slots (g >= G) computed on zero queries and are not written.
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        if (lane == 0) {
            wm[warp * GROUP + g] = m[g];
            wl[warp * GROUP + g] = l[g];
        }
#pragma unroll
        for (int r = 0; r < PL; r++) {
            const unsigned d = lane + 32 * r;
            if (d < head_dim) wacc[(warp * GROUP + g) * head_dim + d] = acc[g][r];
        }
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < G * head_dim; i += blockDim.x) {
        const unsigned g = i / head_dim, d = i % head_dim;
        float mm = -INFINITY;
        for (unsigned w = 0; w < DEC_WARPS; w++) mm = fmaxf(mm, wm[w * GROUP + g]);
        float ll = 0.0f, a = 0.0f;
        for (unsigned w = 0; w < DEC_WARPS; w++) {
            const float f = wm[w * GROUP + g] == -INFINITY ? 0.0f : expf(wm[w * GROUP + g] - mm);
            ll += wl[w * GROUP + g] * f;
            a += wacc[(w * GROUP + g) * head_dim + d] * f;
        }
        const size_t row = ((size_t)t * heads + h0 + g) * splits + split;
        part_acc[row * head_dim + d] = a;
        if (d == 0) {
            part_m[row] = mm;
            part_l[row] = ll;
        }
    }
}

// Four values of an output row, from float `at` of the row-major output on: f32, or with
// out_bf16 rounded to bf16 (nearest even) into the first half of the f32 buffer's bytes, where
// the products that read them take them (they would round them anyway).
__device__ __forceinline__ void store_out4(float* out, size_t at, unsigned v, float4 y, unsigned out_bf16) {
    if (out_bf16)
        reinterpret_cast<uint2*>(reinterpret_cast<bf16*>(out) + at)[v] =
            make_uint2(pack2<bf16>(y.x, y.y), pack2<bf16>(y.z, y.w));
    else
        reinterpret_cast<float4*>(out + at)[v] = y;
}

// out[t, h] = merge of the splits' partial results (max in natural-log units, sum, unnormalised
// acc). One warp per (token, head) row, COMBINE_WARPS rows a block; a lane owns 4 dims (and every
// 32nd float4 past them for head dims over 128). Latency bounds this kernel in decode, so the
// first COMBINE_LOADS splits' accumulators are asked for before the maximum is known. head_dim is
// a multiple of 4. The output as store_out4 writes it.
extern "C" __global__ void __launch_bounds__(32 * COMBINE_WARPS)
    attention_combine_f32(const float* part_m, const float* part_l, const float* part_acc, float* out,
                          unsigned head_dim, unsigned splits, unsigned rows, unsigned out_bf16) {
    pdl_begin();
    const unsigned lane = threadIdx.x % 32;
    const size_t row = (size_t)blockIdx.x * COMBINE_WARPS + threadIdx.x / 32;
    if (row >= rows) return;
    const float* pm = part_m + row * splits;
    const float* pl = part_l + row * splits;
    const unsigned vecs = head_dim / 4;
    const float4* pa = reinterpret_cast<const float4*>(part_acc + row * splits * head_dim);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 first[COMBINE_LOADS];
#pragma unroll
    for (int j = 0; j < COMBINE_LOADS; j++) first[j] = lane < vecs && j < splits ? pa[(size_t)j * vecs + lane] : zero;
    float mm = -INFINITY;
    for (unsigned s = lane; s < splits; s += 32) mm = fmaxf(mm, pm[s]);
    mm = warp_max(mm);
    // A split that saw no key has max -inf and contributes nothing.
    auto weight = [&](unsigned s) { return pm[s] == -INFINITY ? 0.0f : expf(pm[s] - mm); };
    float ll = 0.0f;
    for (unsigned s = lane; s < splits; s += 32) ll += pl[s] * weight(s);
    const float inv = 1.0f / warp_sum(ll);
    for (unsigned v = lane; v < vecs; v += 32) {
        float4 a = zero;
        for (unsigned s0 = 0; s0 < splits; s0 += COMBINE_LOADS) {
            float4 y[COMBINE_LOADS];
#pragma unroll
            for (int j = 0; j < COMBINE_LOADS; j++) {
                const unsigned s = s0 + j;
                y[j] = s0 == 0 && v == lane ? first[j] : s < splits ? pa[(size_t)s * vecs + v] : zero;
            }
#pragma unroll
            for (int j = 0; j < COMBINE_LOADS; j++) {
                const float w = s0 + j < splits ? weight(s0 + j) : 0.0f;
                a.x += w * y[j].x;
                a.y += w * y[j].y;
                a.z += w * y[j].z;
                a.w += w * y[j].w;
            }
        }
        store_out4(out, row * head_dim, v, make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv), out_bf16);
    }
}

// The same merge for rows of many splits (decode over a long cache): one block of 256 threads
// per (token, head). Each thread owns 4 dims of up to COMBINE_LOADS splits and issues all its
// loads before the maximum is known; the splits' weights exp(m_s - max) go through shared
// memory (at most MAX_SPLITS splits). head_dim is a multiple of 4 and at most 1024.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
    attention_combine_many_f32(const float* part_m, const float* part_l, const float* part_acc, float* out,
                               unsigned head_dim, unsigned splits, unsigned rows, unsigned out_bf16) {
    pdl_begin();
    (void)rows;  // one block per row: the grid is the rows (the same arguments as attention_combine_f32)
    __shared__ float f[MAX_SPLITS];
    __shared__ float scratch[32];
    __shared__ float4 red[COMBINE_THREADS];
    const size_t row = blockIdx.x;
    const float* pm = part_m + row * splits;
    const float* pl = part_l + row * splits;
    const unsigned vecs = head_dim / 4, lanes = blockDim.x / vecs;
    const unsigned v = threadIdx.x % vecs, sub = threadIdx.x / vecs;
    const float4* pa = reinterpret_cast<const float4*>(part_acc + row * splits * head_dim);
    float4 x[COMBINE_LOADS];
#pragma unroll
    for (int i = 0; i < COMBINE_LOADS; i++) {
        const unsigned s = sub + i * lanes;
        x[i] = sub < lanes && s < splits ? pa[(size_t)s * vecs + v] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float mm = -INFINITY;
    for (unsigned s = threadIdx.x; s < splits; s += blockDim.x) mm = fmaxf(mm, pm[s]);
    mm = block_max(mm, scratch);
    float ll = 0.0f;
    for (unsigned s = threadIdx.x; s < splits; s += blockDim.x) {
        f[s] = pm[s] == -INFINITY ? 0.0f : expf(pm[s] - mm);
        ll += pl[s] * f[s];
    }
    ll = block_sum(ll, scratch);  // also orders the writes of f before the reads below
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (sub < lanes) {
#pragma unroll
        for (int i = 0; i < COMBINE_LOADS; i++) {
            const unsigned s = sub + i * lanes;
            const float w = s < splits ? f[s] : 0.0f;
            a.x += w * x[i].x;
            a.y += w * x[i].y;
            a.z += w * x[i].z;
            a.w += w * x[i].w;
        }
        for (unsigned s = sub + COMBINE_LOADS * lanes; s < splits; s += lanes) {
            const float4 y = pa[(size_t)s * vecs + v];
            const float w = f[s];
            a.x += w * y.x;
            a.y += w * y.y;
            a.z += w * y.z;
            a.w += w * y.w;
        }
    }
    red[threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.x < vecs) {
        float4 t = red[threadIdx.x];
        for (unsigned k = 1; k < lanes; k++) {
            const float4 y = red[k * vecs + threadIdx.x];
            t.x += y.x;
            t.y += y.y;
            t.z += y.z;
            t.w += y.w;
        }
        const float inv = 1.0f / ll;
        store_out4(out, row * head_dim, threadIdx.x, make_float4(t.x * inv, t.y * inv, t.z * inv, t.w * inv), out_bf16);
    }
}

#define SPLIT(T, NAME, PL)                                                                                  \
    extern "C" __global__ void attention_split_##NAME##_##PL(                                               \
        const float* q, const T* k_cache, const T* v_cache, const unsigned* positions, PAGE_PARAMS,         \
        float* part_m, float* part_l, float* part_acc, unsigned heads, unsigned kv_heads, unsigned head_dim, \
        unsigned rows, float scale, unsigned chunk) {                                                       \
        pdl_begin();                                                                                       \
        attention_split<T, PL>(q, k_cache, v_cache, positions, PAGE_ARGS, part_m, part_l, part_acc, heads,  \
                               kv_heads, head_dim, rows, scale, chunk);                                     \
    }
#define SPLITS(T, NAME) SPLIT(T, NAME, 2) SPLIT(T, NAME, 3) SPLIT(T, NAME, 4) SPLIT(T, NAME, 8)

SPLITS(float, f32)
// Half caches take the tensor-core kernel for its head dims, this one for the others.
SPLITS(bf16, bf16)
SPLITS(f16, f16)

// ---- tensor-core attention (bf16/f16 caches): prefill and decode ----
// A block takes one KV head and 64 * MT query rows of it, a row being a (token, query head) pair
// of that head's group, numbered token-major (so a decode token's whole group shares one block,
// and a prefill block holds 64 * MT / group consecutive tokens: K/V tiles are read once for all
// heads of the group, and the causal limits of a block's rows differ by a few keys).
// Grid (row blocks * kv_heads, 1, splits): split s covers keys [s * chunk, (s + 1) * chunk) of the
// block's range; with one split the block writes the normalised output, with several it writes
// (max, sum, acc) per (row, split) for attention_combine_*.
//
// Four warps, 16 * MT rows each (m16n8k16 with bf16/f16 operands, f32 accumulators; MT = 2
// reuses every K/V fragment for two row tiles). Q is rounded to the cache's type once into
// shared memory; K/V tiles of BN keys stream through two shared buffers with cp.async,
// zero-filled past the range (so a poisoned cache beyond it is never read); the first two are
// issued before Q is staged. Per tile a warp computes S = Q K^T (ldmatrix from padded rows),
// masks keys past each row's limit, runs the online softmax in the exp2 domain on its two rows
// per row tile and thread, rounds P to the cache's type and accumulates P V with V fragments
// from ldmatrix.trans. A warp whose rows all end before a tile skips its arithmetic.

template <int HD, int MT>
struct FaShape {
    static constexpr int ROWS = 16 * MT * FA_WARPS;  // query rows per block
    static constexpr int BN = HD > WIDE_HEAD_DIM ? FA_KEYS_WIDE : FA_KEYS;  // keys per tile
    static constexpr int STRIDE = HD + 8;            // shared row, in 16-bit values (16 bytes padding)
};

// Keys key0 .. key0 + N - 1 of one KV head's K and V rows (HD values each; kb and vb the head's
// part of the caches, pg the sequence's pages) into rows of STRIDE values at kd and vd, by
// cp.async in 16-byte pieces dealt to NT threads (this one t): keys in [lo, hi) are copied, keys
// at or past `end` zero-filled (nothing is read for them), the others left as they are. hi <=
// end. The pieces a thread copies are known at compile time, so every one's cache row is looked
// up first (the block table's loads in flight together) and the copies issued after: a loop over
// the pieces waited for each lookup before its copy (the two-tile flash kernels spill a few
// registers around the copy for this).
template <typename T, int HD, int STRIDE, unsigned N, unsigned NT>
__device__ __forceinline__ void copy_kv_rows(T* kd, T* vd, const T* kb, const T* vb, const Pages& pg, unsigned key0,
                                             unsigned lo, unsigned hi, unsigned end, unsigned t) {
    constexpr unsigned DT = HD / 8, PIECES = N * DT, PER = (PIECES + NT - 1) / NT;
    unsigned row[PER];
#pragma unroll
    for (unsigned k = 0; k < PER; k++) {
        const unsigned i = t + k * NT, key = key0 + i / DT;
        row[k] = i < PIECES && key >= lo && key < hi ? pg.row(key) : 0;
    }
#pragma unroll
    for (unsigned k = 0; k < PER; k++) {
        const unsigned i = t + k * NT, r = i / DT, d = (i % DT) * 8, key = key0 + r;
        if (i >= PIECES) break;
        const bool valid = key >= lo && key < hi;
        if (!valid && key < end) continue;
        const size_t src = (size_t)row[k] * HD + d;
        cp_async16(kd + r * STRIDE + d, kb + src, valid);
        cp_async16(vd + r * STRIDE + d, vb + src, valid);
    }
}

// One online-softmax step of a 16-row tile, for the rows g and g + 8 a thread holds, over the NT
// 8-key columns of S in the m16n8 accumulator layout (first key key0 + 8j + c): scores scaled to
// log2 units by sl2, keys at or past each row's end (lim0, lim1) masked unless `full`, the
// running maxima m0 / m1 raised (quad-reduced), S replaced by P = exp2(S - max) packed as the A
// fragments of P V (16 keys each), and this thread's share of the sums l0 / l1 updated. Returns
// the factors the rows' accumulators are scaled by.

template <typename T, int NT>
__device__ __forceinline__ float2 softmax_step(float s[NT][4], unsigned pa[NT / 2][4], unsigned key0, unsigned c,
                                               bool full, unsigned lim0, unsigned lim1, float sl2, float& m0,
                                               float& m1, float& l0, float& l1) {
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const unsigned key = key0 + j * 8 + c + e;
            float v0 = s[j][e] * sl2, v1 = s[j][2 + e] * sl2;
            if (!full) {
                v0 = key < lim0 ? v0 : -INFINITY;
                v1 = key < lim1 ? v1 : -INFINITY;
            }
            s[j][e] = v0;
            s[j][2 + e] = v1;
            mx0 = fmaxf(mx0, v0);
            mx1 = fmaxf(mx1, v1);
        }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    // A row with nothing visible yet keeps -inf; its exponentials use base 0 (all zero).
    const float base0 = mx0 == -INFINITY ? 0.0f : mx0, base1 = mx1 == -INFINITY ? 0.0f : mx1;
    const float corr0 = exp2f(m0 - base0), corr1 = exp2f(m1 - base1);
    m0 = mx0;
    m1 = mx1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        s[j][0] = exp2f(s[j][0] - base0);
        s[j][1] = exp2f(s[j][1] - base0);
        s[j][2] = exp2f(s[j][2] - base1);
        s[j][3] = exp2f(s[j][3] - base1);
        sum0 += s[j][0] + s[j][1];
        sum1 += s[j][2] + s[j][3];
    }
    l0 = l0 * corr0 + sum0;  // the quad is summed at the end
    l1 = l1 * corr1 + sum1;
    // The accumulator layout of 16 keys is the A layout of P for P V.
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        pa[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    return make_float2(corr0, corr1);
}

template <typename T, int HD, int MT>
__device__ void flash_attention(const float* q, const T* k_cache, const T* v_cache, const unsigned* positions,
                                PAGE_PARAMS, float* out, float* part_m, float* part_l, float* part_acc,
                                unsigned tokens, unsigned heads, unsigned kv_heads, unsigned rows, float scale,
                                unsigned chunk, unsigned out_bf16, unsigned ranked) {
    using S = FaShape<HD, MT>;
    constexpr int ROWS = S::ROWS, BN = S::BN, STRIDE = S::STRIDE, KSTEPS = HD / 16, NT = BN / 8, DT = HD / 8;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    T* qs = reinterpret_cast<T*>(fa_smem);  // [ROWS][STRIDE]
    T* ks = qs + ROWS * STRIDE;              // [2][BN][STRIDE]
    T* vs = ks + 2 * BN * STRIDE;            // [2][BN][STRIDE]
    unsigned* lim = reinterpret_cast<unsigned*>(vs + 2 * BN * STRIDE);  // [ROWS] keys each row sees
    __shared__ unsigned block_end;

    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned group = heads / kv_heads, pairs = tokens * group;
    // Block x takes KV head x % kv_heads and the row block ranked x / kv_heads by its causal
    // range, longest first, so the blocks start in that order with every KV head's together (a
    // KV head's blocks all before the next's left a tail where one head's longest blocks ran
    // alone). One sequence's rows: the ranks are the row blocks counted from the last. With
    // `ranked` (several runs' rows), each block ranks every row block by the position of its last
    // token (ties by index, so the ranks are a permutation), in shared memory past `lim`.
    const unsigned kvh = blockIdx.x % kv_heads, split = blockIdx.z, splits = gridDim.z;
    const unsigned row_blocks = gridDim.x / kv_heads, rank = blockIdx.x / kv_heads;
    unsigned row_block = row_blocks - 1 - rank;
    if (ranked) {
        unsigned* reach = lim + ROWS;  // [row_blocks]
        __shared__ unsigned picked;
        for (unsigned i = tid; i < row_blocks; i += blockDim.x)
            reach[i] = positions[(min((i + 1) * ROWS, pairs) - 1) / group];
        __syncthreads();
        for (unsigned i = tid; i < row_blocks; i += blockDim.x) {
            const unsigned mine = reach[i];
            unsigned before = 0;
            for (unsigned j = 0; j < row_blocks; j++) {
                const unsigned other = reach[j];
                before += other > mine || (other == mine && j < i);
            }
            if (before == rank) picked = i;
        }
        __syncthreads();
        row_block = picked;
    }
    const unsigned row0 = row_block * ROWS;
    // The sequence of the block's first token: every token's (seq_step 0), or, for the runs of
    // several prompts' chunks, the run's (the host makes a block's rows whole tokens of a run).
    const Pages pg = pages_of(PAGE_ARGS, row0 / group);
    if (tid == 0) block_end = 0;
    __syncthreads();
    for (unsigned r = tid; r < ROWS; r += blockDim.x) {
        const unsigned p = row0 + r;
        const unsigned n = p < pairs ? min(positions[p / group] + 1, pg.max_ctx) : 0;
        lim[r] = n;
        atomicMax(&block_end, n);
    }
    __syncthreads();
    const unsigned start = split * chunk, end = min(start + chunk, block_end);

    const T* kb = k_cache + (size_t)kvh * rows * HD;
    const T* vb = v_cache + (size_t)kvh * rows * HD;
    // One commit group per tile (empty past the range), so waiting for "all but the newest
    // group" always means "the current tile".
    auto load_tile = [&](unsigned key0, int buf) {
        if (key0 < end) {
            copy_kv_rows<T, HD, STRIDE, BN, 32 * FA_WARPS>(ks + buf * BN * STRIDE, vs + buf * BN * STRIDE, kb, vb, pg,
                                                           key0, 0, end, end, tid);
        }
        cp_async_commit();
    };
    load_tile(start, 0);
    load_tile(start + BN, 1);

    // Q rows rounded to T, 8 values per step, while the first tiles are in flight.
    for (unsigned i = tid; i < ROWS * DT; i += blockDim.x) {
        const unsigned r = i / DT, d = (i % DT) * 8, p = row0 + r;
        uint4 packed = make_uint4(0, 0, 0, 0);
        if (p < pairs) {
            const unsigned t = p / group, h = kvh * group + p % group;
            float v[8];
            load8(q + ((size_t)t * heads + h) * HD + d, v);
            packed = make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
        }
        *reinterpret_cast<uint4*>(qs + r * STRIDE + d) = packed;
    }

    // This thread's rows: g and g + 8 of each of the warp's row tiles; and the warp's furthest
    // and nearest limits.
    const unsigned g = lane / 4, c = 2 * (lane % 4);
    unsigned lims[MT][2];
    unsigned warp_end = 0, warp_min = 0xffffffffu;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            lims[mt][hf] = min(lim[(warp * MT + mt) * 16 + g + 8 * hf], end);
            warp_end = max(warp_end, lims[mt][hf]);
            warp_min = min(warp_min, lims[mt][hf]);
        }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        warp_end = max(warp_end, __shfl_xor_sync(0xffffffffu, warp_end, o));
        warp_min = min(warp_min, __shfl_xor_sync(0xffffffffu, warp_min, o));
    }

    float acc[MT][DT][4];
    float m[MT][2], l[MT][2];  // running max (log2 units) and this thread's share of the sum
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
        for (int j = 0; j < DT; j++) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
    }
    const float sl2 = scale * 1.4426950408889634f;

    int buf = 0;
    for (unsigned key0 = start; key0 < end; key0 += BN, buf ^= 1) {
        cp_async_wait<1>();
        __syncthreads();  // the tile (and, the first time, Q) is visible to every warp
        if (key0 < warp_end) {
            const T* kt = ks + buf * BN * STRIDE;
            const T* vt = vs + buf * BN * STRIDE;
            float s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < NT; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk++) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
                    ldmatrix_x4(a[mt], qs + ((warp * MT + mt) * 16 + lane % 16) * STRIDE + kk * 16 + (lane / 16) * 8);
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    unsigned b[4];
                    ldmatrix_x4(b, kt + (j * 8 + lane % 8 + (lane / 16) * 8) * STRIDE + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_16816<T>(s[mt][j], a[mt], b[0], b[1]);
                        mma_16816<T>(s[mt][j + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            const bool full = key0 + BN <= warp_min;  // no row of the warp ends inside this tile
            unsigned pa[MT][BN / 16][4];             // P as A fragments
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const float2 corr = softmax_step<T, NT>(s[mt], pa[mt], key0, c, full, lims[mt][0], lims[mt][1], sl2,
                                                        m[mt][0], m[mt][1], l[mt][0], l[mt][1]);
#pragma unroll
                for (int j = 0; j < DT; j++) {
                    acc[mt][j][0] *= corr.x;
                    acc[mt][j][1] *= corr.x;
                    acc[mt][j][2] *= corr.y;
                    acc[mt][j][3] *= corr.y;
                }
            }
            // O += P V.
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
                for (int j = 0; j < DT; j += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, vt + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * STRIDE + j * 8 + (lane / 16) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_16816<T>(acc[mt][j], pa[mt][kk], b[0], b[1]);
                        mma_16816<T>(acc[mt][j + 1], pa[mt][kk], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer pair before it is refilled
        load_tile(key0 + 2 * BN, buf);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float lsum = l[mt][hf];
            lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
            lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
            const unsigned p = row0 + (warp * MT + mt) * 16 + g + 8 * hf;
            if (p >= pairs) continue;
            const unsigned t = p / group, h = kvh * group + p % group;
            const size_t row = (size_t)t * heads + h;
            if (splits == 1) {
                // Normalised, in f32 or (out_bf16) rounded to bf16, as store_out4 writes.
                const float inv = 1.0f / lsum;
#pragma unroll
                for (int j = 0; j < DT; j++) {
                    const float y0 = acc[mt][j][2 * hf] * inv, y1 = acc[mt][j][2 * hf + 1] * inv;
                    if (out_bf16)
                        *reinterpret_cast<unsigned*>(reinterpret_cast<bf16*>(out) + row * HD + j * 8 + c) =
                            pack2<bf16>(y0, y1);
                    else
                        *reinterpret_cast<float2*>(out + row * HD + j * 8 + c) = make_float2(y0, y1);
                }
            } else {
                // Partial results for the combine, whose max is in natural-log units.
                const size_t prow = row * splits + split;
                float* o = part_acc + prow * HD;
#pragma unroll
                for (int j = 0; j < DT; j++)
                    *reinterpret_cast<float2*>(o + j * 8 + c) = make_float2(acc[mt][j][2 * hf], acc[mt][j][2 * hf + 1]);
                if (c == 0) {
                    part_m[prow] = m[mt][hf] == -INFINITY ? -INFINITY : m[mt][hf] * 0.6931471805599453f;
                    part_l[prow] = lsum;
                }
            }
        }
}

#define FLASH(T, NAME, HD, MT)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS) flash_attention_##NAME##_##HD##_##MT(       \
        const float* q, const T* k_cache, const T* v_cache, const unsigned* positions, PAGE_PARAMS,         \
        float* out, float* part_m, float* part_l, float* part_acc, unsigned tokens, unsigned heads,         \
        unsigned kv_heads, unsigned rows, float scale, unsigned chunk, unsigned out_bf16, unsigned ranked) { \
        pdl_begin();                                                                                        \
        flash_attention<T, HD, MT>(q, k_cache, v_cache, positions, PAGE_ARGS, out, part_m, part_l, part_acc, \
                                   tokens, heads, kv_heads, rows, scale, chunk, out_bf16, ranked);          \
    }
// MT = 2 where the registers allow it (many rows); MT = 1 for decode and head dim 256.
#define FLASHES(T, NAME)                                                                                    \
    FLASH(T, NAME, 64, 1) FLASH(T, NAME, 64, 2) FLASH(T, NAME, 96, 1) FLASH(T, NAME, 96, 2)                \
    FLASH(T, NAME, 128, 1) FLASH(T, NAME, 128, 2) FLASH(T, NAME, 256, 1)

FLASHES(bf16, bf16)
FLASHES(f16, f16)

// ---- decode attention on bf16/f16 caches (sm_90) ----
// Up to DA_ROWS rows, a row being a (token, query head) pair of one KV head's group, numbered
// token-major as in flash_attention (one decode token's whole group). Grid (splits, kv_heads, z),
// one wave when there are several splits; z is 1 for the tokens of one sequence, else one per
// token (a batched decode step: each token's group alone, over its own sequence's pages). Split
// s covers keys [s * chunk, (s + 1) * chunk) of the rows' range, and a split whose first key is
// past every row's range returns at once.
//
// Each of the block's W warps (DaShape::NWARPS) streams its own batches of DA_KEYS keys (batch i
// of warp w starts at s * chunk + (i * W + w) * DA_KEYS) through a ring of its own, STAGES
// batches deep, with cp.async, rows past the range zero-filled and never read, so no warp waits
// for another while the cache streams in. The first STAGES batches are asked for before the
// programmatic wait: rows before the step's first position of the block's sequence were written
// by earlier runs, never by a kernel this one can overlap, so the cache streams in while the
// kernel before this one finishes. In a batched step a sequence may have several tokens (a
// prompt's chunk in runs, or its last token among the outputs while the rest of its chunk runs
// in another launch), so that first position is found among all the step's tokens (step_pos,
// step_seq: step_tokens of them; none for one sequence's tokens, all of which the launch
// holds). The rows from there on, which the kernel before this one writes, and q are read after
// the wait. Per batch: S = Q K^T and O += P V with m16n8k16 mma, the online softmax in
// the exp2 domain, as in flash_attention. Then two merges of (max, sum, acc):
//   1. the block's warps, through shared memory, into the block's record in `part` (with one
//      split in the range, into the output);
//   2. across splits: every block of a (z, KV head) counts its record in counters[2 * head]
//      (a release) and waits for the others' (acquire reads; all are resident: the grid is one
//      wave), then merges its share of the output's pieces, a lane per split (a warp per piece
//      with 32 splits, 16 pieces a warp with 2), each lane loading its split's piece, max and
//      sum, two pieces' loads at once; the last block past its wait (counted in
//      counters[2 * head + 1], asked for before the merge) sets both back to zero at its end.
// Spread so, the merge costs each block one round of loads (up to 32 splits, two pieces a
// lane) instead of one block's many rounds.
// head_dim a multiple of 16; `counters` zero at launch (it is again at exit).

template <int HD>
struct DaShape {
    static constexpr int NWARPS = HD > WIDE_HEAD_DIM ? DA_WARPS_WIDE : DA_WARPS;  // warps per block
    static constexpr int STAGES = DA_STAGES;                    // batches in flight per warp
    static constexpr int STRIDE = HD + 8;                       // shared row, in 16-bit values
    static constexpr int RING = STAGES * 2 * DA_KEYS * STRIDE;  // a warp's ring, in 16-bit values
    static constexpr int VECS = HD / 4;                         // float4s of a row
    static constexpr int REC = HD + 4;                          // a part record: acc, max, sum, 2 unused
};

// What decode_attention_inputs_* computes itself for its one token, the work attention_inputs
// does (see there) and with its arithmetic: the fused projection's row (qkv), the outputs q and
// gate (written by each KV head's first split), the norms, the rotation, and the caches the
// token's key and value go into (by the block whose keys hold its position).
template <typename T, typename W>
struct DaInputs {
    const float* qkv;
    float* q;
    float* gate;
    const W* q_norm;
    const W* k_norm;
    float eps;
    int zero_centered;
    const float* inv_freq;
    T* k_cache;
    T* v_cache;
    unsigned q_stride, rot_dim;
    float scaling;
};

// Keys a token at `position` sees in a sequence of at most max_ctx positions.
__device__ __forceinline__ unsigned keys_seen(unsigned position, unsigned max_ctx) {
    return min(position, max_ctx - 1) + 1;
}

#if __CUDA_ARCH__ >= 900
template <typename T, int HD, typename W, bool FUSED>
__device__ void decode_attention(const float* q, const T* k_cache, const T* v_cache, const unsigned* positions,
                                 PAGE_PARAMS, const unsigned* step_pos, const unsigned* step_seq,
                                 unsigned step_tokens, float* out, float* part, unsigned* counters, unsigned tokens,
                                 unsigned heads, unsigned kv_heads, unsigned rows, float scale, unsigned chunk,
                                 const DaInputs<T, W> in, unsigned out_bf16) {
    using S = DaShape<HD>;
    constexpr int NWARPS = S::NWARPS, STAGES = S::STAGES, STRIDE = S::STRIDE, VECS = S::VECS, REC = S::REC;
    constexpr int KSTEPS = HD / 16, DT = HD / 8;
    extern __shared__ __align__(16) unsigned char da_smem[];
    T* qs = reinterpret_cast<T*>(da_smem);  // [DA_ROWS][STRIDE]
    T* rings = qs + DA_ROWS * STRIDE;        // [NWARPS][RING]

    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // One sequence: its tokens' rows together (z is 0). A sequence per token (seq_step 1): token
    // z's rows alone.
    const unsigned z = blockIdx.z, t0 = seq_step ? z : 0, ntok = seq_step ? 1 : tokens;
    const unsigned group = heads / kv_heads, pairs = ntok * group;
    const unsigned split = blockIdx.x, kvh = blockIdx.y;
    const Pages pg = pages_of(PAGE_ARGS, t0);
    const unsigned max_ctx = pg.max_ctx;

    // Keys a token sees, the furthest of them (the splits that hold any), and the rows no kernel
    // of this run writes: those before the step's first token of the block's sequence. The
    // positions and sequences are inputs of the run, uploaded before it.
    unsigned block_end = 0, old = max_ctx;
    for (unsigned t = t0; t < t0 + ntok; t++) {
        block_end = max(block_end, keys_seen(positions[t], max_ctx));
        old = min(old, positions[t]);
    }
    const unsigned used = (block_end + chunk - 1) / chunk;
    // No key for this block: it leaves at once, not holding its multiprocessor (and its shared
    // memory) through the kernel before, which a programmatic launch overlaps. Split 0 always
    // has keys, so it always waits.
    if (split >= used) PDL_LEAVE_IDLE;
    if (step_tokens > 1) {
        __shared__ unsigned first;
        if (tid == 0) first = old;
        __syncthreads();
        const unsigned s = seq[t0 * seq_step];
        unsigned m = old;
        for (unsigned j = tid; j < step_tokens; j += blockDim.x) {
            const unsigned sj = step_seq[j], pj = step_pos[j];
            if (sj == s) m = min(m, pj);
        }
        if (m < old) atomicMin(&first, m);
        __syncthreads();
        old = first;
    }
    const unsigned start = split * chunk, end = min(start + chunk, block_end);

    const T* kb = k_cache + (size_t)kvh * rows * HD;
    const T* vb = v_cache + (size_t)kvh * rows * HD;
    T* ring = rings + warp * S::RING;
    const unsigned warp_key = start + warp * DA_KEYS;  // batch i starts at warp_key + i * NWARPS * DA_KEYS
    // Keys [lo, hi) of batch i, and the zeros past the range. One commit group per batch (empty
    // past the range), so waiting for all but the newest STAGES - 1 groups always means "batch i".
    auto copy = [&](unsigned i, unsigned lo, unsigned hi, unsigned zero_from) {
        const unsigned key0 = warp_key + i * NWARPS * DA_KEYS;
        if (key0 < end) {
            T* kd = ring + (i % STAGES) * 2 * DA_KEYS * STRIDE;
            copy_kv_rows<T, HD, STRIDE, DA_KEYS, 32>(kd, kd + DA_KEYS * STRIDE, kb, vb, pg, key0, lo, hi, zero_from,
                                                     lane);
        }
    };
    const unsigned old_end = min(old, end);
#pragma unroll
    for (int i = 0; i < STAGES; i++) {
        copy(i, 0, old_end, end);
        cp_async_commit();
    }
    // With FUSED, what the token's inputs need that no kernel of the run writes, before the wait:
    // lane l's norm factors and rotation factors (cos and sin times the scaling, the sin signed
    // by its half) for the values l, l + 32, ...; the cache row this block writes the token's key
    // and value to (rows when none: its position lies in another split's keys); the query rows
    // past the group, zero.
    constexpr int PER = HD / 32;
    float nq[PER], nk[PER], rc[PER], rs[PER];
    unsigned new_row = rows;
    if constexpr (FUSED) {
        const unsigned p = positions[t0], half = in.rot_dim / 2;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const unsigned i = lane + 32 * j;
            nq[j] = in.q_norm != nullptr ? norm_factor(in.q_norm, i, in.zero_centered) : 1.0f;
            nk[j] = in.k_norm != nullptr ? norm_factor(in.k_norm, i, in.zero_centered) : 1.0f;
            rc[j] = 1.0f;
            rs[j] = 0.0f;
            if (i < 2 * half) {
                float sn, c;
                sincosf((float)p * in.inv_freq[i < half ? i : i - half], &sn, &c);
                rc[j] = c * in.scaling;
                rs[j] = i < half ? -(sn * in.scaling) : sn * in.scaling;
            }
        }
        if (start <= p && p < end && p < max_ctx) new_row = pg.row(p);
        for (unsigned i = tid; i < (DA_ROWS - pairs) * HD; i += blockDim.x)
            qs[(pairs + i / HD) * STRIDE + i % HD] = from_f32<T>(0.0f);
    }
    pdl_wait();
    pdl_trigger();

    // This thread's pieces of q (8 values each), then the rows the kernels before wrote, which
    // the first batches wait for as well.
    constexpr int QPIECES = (DA_ROWS * DT + 32 * NWARPS - 1) / (32 * NWARPS);
    float qv[QPIECES][8];
    // With FUSED, where the token's key lands in its warp's ring when its batch is among the
    // first STAGES (written there directly, not read back from the cache).
    T* ring_row = nullptr;
    if constexpr (FUSED) {
        // One token (t0 is 0). Items, a warp each in turn: the token's key and value when this
        // block writes them (first: the copies wait on them), then its group's queries. Each
        // warp asks for its next item's values before it computes the current one's. A query or
        // key is normed, staged in the warp's row past the rings and rotated: queries into qs
        // (and, by each KV head's first split, q and the gate), the key and value into the
        // caches and the ring.
        float* row = reinterpret_cast<float*>(rings + NWARPS * S::RING) + warp * HD;
        const unsigned p = positions[t0], half = in.rot_dim / 2;
        const float* x = in.qkv + t0 * qkv_cols(heads, kv_heads, HD, in.q_stride);
        const unsigned kv_items = new_row < rows ? 2 : 0, items = kv_items + pairs;
        const size_t at = ((size_t)kvh * rows + new_row) * HD;
        if (kv_items != 0) {
            const unsigned o = p - start, b = o / DA_KEYS;
            if (b / NWARPS < STAGES)
                ring_row = rings + (b % NWARPS) * S::RING + (b / NWARPS) * 2 * DA_KEYS * STRIDE + (o % DA_KEYS) * STRIDE;
        }
        // Item it: the key (0) and value (1) when this block writes them, then the group's queries.
        auto src_of = [&](unsigned it) {
            const bool is_q = it >= kv_items;
            return head_source(x, is_q ? kvh * group + it - kv_items : kvh, is_q, it == 0, heads, kv_heads, HD,
                               in.q_stride);
        };
        float cur[PER], nxt[PER];
        if (warp < items) {
            const float* src = src_of(warp);
#pragma unroll
            for (int j = 0; j < PER; j++) cur[j] = src[lane + 32 * j];
        }
        for (unsigned it = warp; it < items; it += NWARPS) {
            if (it + NWARPS < items) {
                const float* src = src_of(it + NWARPS);
#pragma unroll
                for (int j = 0; j < PER; j++) nxt[j] = src[lane + 32 * j];
            }
            const bool is_k = kv_items != 0 && it == 0, is_v = kv_items != 0 && it == 1;
            if (is_v) {
#pragma unroll
                for (int j = 0; j < PER; j++) {
                    const unsigned i = lane + 32 * j;
                    const T v = from_f32<T>(cur[j]);
                    in.v_cache[at + i] = v;
                    if (ring_row != nullptr) ring_row[DA_KEYS * STRIDE + i] = v;
                }
            } else {
                if ((is_k ? in.k_norm : in.q_norm) != nullptr) {
                    const float inv = warp_rms_inverse(cur, HD, in.eps);
#pragma unroll
                    for (int j = 0; j < PER; j++) cur[j] = cur[j] * inv * (is_k ? nk[j] : nq[j]);
                }
#pragma unroll
                for (int j = 0; j < PER; j++) row[lane + 32 * j] = cur[j];
                __syncwarp();
                const unsigned r = it - kv_items;
                const size_t h = (size_t)t0 * heads + kvh * group + r;
#pragma unroll
                for (int j = 0; j < PER; j++) {
                    const unsigned i = lane + 32 * j;
                    const float o = i < 2 * half ? row[i] * rc[j] + row[i < half ? i + half : i - half] * rs[j] : row[i];
                    if (is_k) {
                        const T v = from_f32<T>(o);
                        in.k_cache[at + i] = v;
                        if (ring_row != nullptr) ring_row[i] = v;
                    } else {
                        qs[r * STRIDE + i] = from_f32<T>(o);
                        if (split == 0) in.q[h * HD + i] = o;
                    }
                }
                if (!is_k && split == 0 && in.gate != nullptr) {
                    const float* g = src_of(it) + HD;
                    for (unsigned i = lane; i < HD; i += 32) in.gate[h * HD + i] = g[i];
                }
                __syncwarp();  // row takes the warp's next item
            }
#pragma unroll
            for (int j = 0; j < PER; j++) cur[j] = nxt[j];
        }
        // A key and value past the first batches are read back from the cache by the copies.
        if (kv_items != 0 && ring_row == nullptr) __threadfence();
        __syncthreads();
    } else {
#pragma unroll
        for (int j = 0; j < QPIECES; j++) {
            const unsigned i = tid + j * 32 * NWARPS, r = i / DT, d = (i % DT) * 8;
            if (r < pairs) load8(q + ((size_t)(t0 + r / group) * heads + kvh * group + r % group) * HD + d, qv[j]);
        }
    }
    // Only a warp whose first STAGES batches reach past old_end has such rows, and waits for them
    // (with FUSED, unless the block wrote its token's key and value into the ring itself).
    if ((!FUSED || ring_row == nullptr) && old_end < end &&
        warp_key + ((STAGES - 1) * NWARPS + 1) * DA_KEYS > old_end) {
#pragma unroll
        for (int i = 0; i < STAGES; i++) copy(i, old_end, end, ~0u);
        cp_async_commit();
        cp_async_wait<0>();
    }

    // Q rows rounded to T.
    if constexpr (!FUSED) {
#pragma unroll
        for (int j = 0; j < QPIECES; j++) {
            const unsigned i = tid + j * 32 * NWARPS, r = i / DT, d = (i % DT) * 8;
            if (i >= DA_ROWS * DT) break;
            const float* v = qv[j];
            const uint4 packed = r < pairs ? make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]),
                                                        pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]))
                                           : make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(qs + r * STRIDE + d) = packed;
        }
    }
    __syncthreads();

    // This thread's rows g and g + 8, the keys each sees in this split (rows past the pairs see
    // everything: they are never written), and the fewest any row of the warp sees.
    const unsigned g = lane / 4, c = 2 * (lane % 4);
    auto row_end = [&](unsigned p) {
        return p < pairs ? min(keys_seen(positions[t0 + p / group], max_ctx), end) : end;
    };
    const unsigned lim0 = row_end(g), lim1 = row_end(g + 8);
    unsigned warp_min = min(lim0, lim1);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) warp_min = min(warp_min, __shfl_xor_sync(0xffffffffu, warp_min, o));

    float acc[DT][4];
#pragma unroll
    for (int j = 0; j < DT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const float sl2 = scale * 1.4426950408889634f;
    for (unsigned i = 0; warp_key + i * NWARPS * DA_KEYS < end; i++) {
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const T* kt = ring + (i % STAGES) * 2 * DA_KEYS * STRIDE;
        const T* vt = kt + DA_KEYS * STRIDE;
        const unsigned key0 = warp_key + i * NWARPS * DA_KEYS;
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            unsigned a[4], b[4];
            ldmatrix_x4(a, qs + (lane % 16) * STRIDE + kk * 16 + (lane / 16) * 8);
            ldmatrix_x4(b, kt + (lane % 8 + (lane / 16) * 8) * STRIDE + kk * 16 + ((lane / 8) % 2) * 8);
            mma_16816<T>(s[0], a, b[0], b[1]);
            mma_16816<T>(s[1], a, b[2], b[3]);
        }
        unsigned pa[1][4];
        const float2 corr =
            softmax_step<T, 2>(s, pa, key0, c, key0 + DA_KEYS <= warp_min, lim0, lim1, sl2, m0, m1, l0, l1);
#pragma unroll
        for (int j = 0; j < DT; j += 2) {
            acc[j][0] *= corr.x;
            acc[j][1] *= corr.x;
            acc[j][2] *= corr.y;
            acc[j][3] *= corr.y;
            acc[j + 1][0] *= corr.x;
            acc[j + 1][1] *= corr.x;
            acc[j + 1][2] *= corr.y;
            acc[j + 1][3] *= corr.y;
            unsigned b[4];
            ldmatrix_x4_trans(b, vt + (lane % 8 + ((lane / 8) % 2) * 8) * STRIDE + j * 8 + (lane / 16) * 8);
            mma_16816<T>(acc[j], pa[0], b[0], b[1]);
            mma_16816<T>(acc[j + 1], pa[0], b[2], b[3]);
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
        copy(i + STAGES, 0, end, end);
        cp_async_commit();
    }
    cp_async_wait<0>();
    __syncwarp();

    // 1. The warps' results, each written over its own ring, merged into the block's record (or,
    //    with one split, the output).
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    {
        float* wacc = reinterpret_cast<float*>(ring);  // [DA_ROWS][HD], then max and sum per row
#pragma unroll
        for (int j = 0; j < DT; j++) {
            *reinterpret_cast<float2*>(wacc + g * HD + j * 8 + c) = make_float2(acc[j][0], acc[j][1]);
            *reinterpret_cast<float2*>(wacc + (g + 8) * HD + j * 8 + c) = make_float2(acc[j][2], acc[j][3]);
        }
        if (c == 0) {
            float* wml = wacc + DA_ROWS * HD;
            wml[g] = m0;
            wml[g + 8] = m1;
            wml[DA_ROWS + g] = l0;
            wml[DA_ROWS + g + 8] = l1;
        }
    }
    __syncthreads();
    // Records and counters per (z, KV head).
    const unsigned head = z * gridDim.y + kvh;
    float* rec = part + ((size_t)head * gridDim.x + split) * DA_ROWS * REC;
    for (unsigned i = tid; i < pairs * VECS; i += blockDim.x) {
        const unsigned r = i / VECS, v = i % VECS;
        const float* w0 = reinterpret_cast<const float*>(rings);
        constexpr int WSTRIDE = S::RING / 2;  // a warp's ring, in floats
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < NWARPS; w++) mx = fmaxf(mx, w0[w * WSTRIDE + DA_ROWS * HD + r]);
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; w++) {
            const float* wacc = w0 + w * WSTRIDE;
            const float mw = wacc[DA_ROWS * HD + r];
            if (mw == -INFINITY) continue;  // this warp saw no key of the row
            const float f = exp2f(mw - mx);
            const float4 y = reinterpret_cast<const float4*>(wacc + r * HD)[v];
            a.x += f * y.x;
            a.y += f * y.y;
            a.z += f * y.z;
            a.w += f * y.w;
            sum += f * wacc[DA_ROWS * HD + DA_ROWS + r];
        }
        if (used == 1) {
            const unsigned t = t0 + r / group, h = kvh * group + r % group;
            const float inv = 1.0f / sum;
            store_out4(out, ((size_t)t * heads + h) * HD, v, make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv),
                       out_bf16);
        } else {
            reinterpret_cast<float4*>(rec + r * REC)[v] = a;
            if (v == 0) {
                rec[r * REC + HD] = mx;
                rec[r * REC + HD + 1] = sum;
            }
        }
    }
    if (used == 1) return;

    // 2. Across splits: once every block of this KV head has written its record (counted in
    //    counters[2 * head]), each merges its share of the output's pieces.
    __syncthreads();
    unsigned* arrived = counters + 2 * head;
    unsigned* left = arrived + 1;
    // Blocks past their wait before this one's (counted in counters[2 * head + 1]); the last
    // one past sets both counters back to zero at its end (none reads `arrived` after its wait).
    // Asked for here, so the round trip overlaps the merge.
    unsigned before = 0;
    if (tid == 0) {
        red_add_release(arrived, 1u);  // the block's records, ordered by the barrier, before the count
        while (load_acquire(arrived) < used) {
        }
        before = atomicAdd(left, 1u);
    }
    __syncthreads();
    const float* recs = part + (size_t)head * gridDim.x * DA_ROWS * REC;
    constexpr size_t SSTRIDE = (size_t)DA_ROWS * REC;  // floats from one split's records to the next
    // A group of `lanes` lanes per piece (the power of two at or above the splits, up to 32), a
    // lane per split, so a warp merges 32 / lanes pieces at once.
    const unsigned items = pairs * VECS, share = (items + used - 1) / used;
    const unsigned lanes = min(32u, 1u << (32 - __clz(used - 1))), per_warp = 32 / lanes;
    const unsigned first = split * share, last = min(first + share, items), step = NWARPS * per_warp;
    // Piece i's record of split k (this lane's first: lane % lanes), or none: zero, max -inf.
    auto load = [&](unsigned i, unsigned k, float4& y, float& mk, float& lk) {
        y = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        mk = -INFINITY;
        lk = 0.0f;
        if (i < last && k < used) {
            const float* rk = recs + k * SSTRIDE + (i / VECS) * REC;
            y = __ldcg(reinterpret_cast<const float4*>(rk) + i % VECS);
            mk = __ldcg(rk + HD);
            lk = __ldcg(rk + HD + 1);
        }
    };
    // Piece i from this lane's first record (as loaded; a split that saw no key of the row has a
    // zero accumulator and max -inf), its further splits (past 32) and the group's other lanes.
    auto merge = [&](unsigned i, float4 a, float mx, float sum) {
        if (mx == -INFINITY) {
            a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            sum = 0.0f;
        }
        for (unsigned k = lane % lanes + lanes; i < last && k < used; k += lanes) {
            float4 y;
            float mk, lk;
            load(i, k, y, mk, lk);
            if (mk == -INFINITY) continue;
            const float m = fmaxf(mx, mk), c = exp2f(mx - m), f = exp2f(mk - m);
            a = make_float4(a.x * c + f * y.x, a.y * c + f * y.y, a.z * c + f * y.z, a.w * c + f * y.w);
            sum = sum * c + f * lk;
            mx = m;
        }
        float m = mx;
        for (unsigned o = lanes / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float c = mx == -INFINITY ? 0.0f : exp2f(mx - m);
        float4 y = make_float4(a.x * c, a.y * c, a.z * c, a.w * c);
        sum *= c;
        for (unsigned o = lanes / 2; o > 0; o /= 2) {
            y.x += __shfl_xor_sync(0xffffffffu, y.x, o);
            y.y += __shfl_xor_sync(0xffffffffu, y.y, o);
            y.z += __shfl_xor_sync(0xffffffffu, y.z, o);
            y.w += __shfl_xor_sync(0xffffffffu, y.w, o);
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        if (i < last && lane % lanes == 0) {
            const unsigned r = i / VECS, t = t0 + r / group, h = kvh * group + r % group;
            const float inv = 1.0f / sum;
            store_out4(out, ((size_t)t * heads + h) * HD, i % VECS,
                       make_float4(y.x * inv, y.y * inv, y.z * inv, y.w * inv), out_bf16);
        }
    };
    // Two pieces a lane a round, both loaded before either is merged: one round trip for both.
    for (unsigned i0 = first + warp * per_warp; i0 < last; i0 += 2 * step) {
        const unsigned i = i0 + lane / lanes, j = i + step;
        float4 yi, yj;
        float mi, li, mj, lj;
        load(i, lane % lanes, yi, mi, li);
        load(j, lane % lanes, yj, mj, lj);
        merge(i, yi, mi, li);
        merge(j, yj, mj, lj);
    }
    if (tid == 0 && before == used - 1) {
        *arrived = 0;
        *left = 0;
    }
}

#define DECODE(T, NAME, HD)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * DaShape<HD>::NWARPS) decode_attention_##NAME##_##HD(  \
        const float* q, const T* k_cache, const T* v_cache, const unsigned* positions, PAGE_PARAMS,         \
        const unsigned* step_pos, const unsigned* step_seq, unsigned step_tokens, float* out, float* part,  \
        unsigned* counters, unsigned tokens, unsigned heads, unsigned kv_heads, unsigned rows, float scale, \
        unsigned chunk, unsigned out_bf16) {                                                                \
        decode_attention<T, HD, float, false>(q, k_cache, v_cache, positions, PAGE_ARGS, step_pos, step_seq,      \
                                             step_tokens, out, part, counters, tokens, heads, kv_heads, rows,  \
                                             scale, chunk, DaInputs<T, float>{}, out_bf16);                     \
    }
#define DECODES(T, NAME) DECODE(T, NAME, 64) DECODE(T, NAME, 96) DECODE(T, NAME, 128) DECODE(T, NAME, 256)
DECODES(bf16, bf16)
DECODES(f16, f16)

// decode_attention_inputs_{cache}_{norm weights}_{head dim}: one token's attention_inputs and
// decode_attention in one kernel (DaInputs; the same arguments as those two, less what one token
// fixes); without norms (or gates) the pointers are null.
#define DECODE_INPUTS(T, NAME, W, WNAME, HD)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * DaShape<HD>::NWARPS)                                  \
        decode_attention_inputs_##NAME##_##WNAME##_##HD(                                                    \
            const float* qkv, float* q, float* gate, const W* q_norm, const W* k_norm, float eps,           \
            int zero_centered, const unsigned* positions, const float* inv_freq, T* k_cache, T* v_cache,    \
            PAGE_PARAMS, float* out, float* part, unsigned* counters, unsigned heads, unsigned kv_heads,    \
            unsigned rows, float scale, unsigned chunk, unsigned q_stride, unsigned rot_dim, float scaling) { \
        const DaInputs<T, W> in{qkv,      q,        gate,    q_norm,   k_norm,  eps,    zero_centered,      \
                                inv_freq, k_cache,  v_cache, q_stride, rot_dim, scaling};                   \
        decode_attention<T, HD, W, true>(q, k_cache, v_cache, positions, PAGE_ARGS, positions, seq, 0, out, \
                                         part, counters, 1, heads, kv_heads, rows, scale, chunk, in, 0);    \
    }
#define DECODE_INPUTS_DIMS(T, NAME, W, WNAME)                                                               \
    DECODE_INPUTS(T, NAME, W, WNAME, 64) DECODE_INPUTS(T, NAME, W, WNAME, 128) DECODE_INPUTS(T, NAME, W, WNAME, 256)
DECODE_INPUTS_DIMS(bf16, bf16, float, f32)
DECODE_INPUTS_DIMS(bf16, bf16, bf16, bf16)
DECODE_INPUTS_DIMS(f16, f16, float, f32)
DECODE_INPUTS_DIMS(f16, f16, bf16, bf16)
#endif
