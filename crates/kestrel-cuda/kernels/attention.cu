// Full attention with a KV cache. kv_append writes new keys/values at their positions; attention
// is causal with grouped-query heads: one block per (token, head), four warps splitting the cache
// rows, each with an online softmax; the warps' partial results are merged at the end. A lane
// holds dims lane, lane + 32, ... of the head (head_dim <= 256).
#include "kestrel.cuh"

#define WARPS 4
#define MAX_PER_LANE 8

template <typename T>
__device__ void kv_append(const float* k, const float* v, const unsigned* positions, T* k_cache, T* v_cache,
                          unsigned tokens, unsigned kv_heads, unsigned head_dim, unsigned max_ctx) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * kv_heads * head_dim) return;
    const size_t t = i / ((size_t)kv_heads * head_dim), h = (i / head_dim) % kv_heads, d = i % head_dim;
    const unsigned p = positions[t];
    if (p >= max_ctx) return;  // the host checks lengths before any work; never write outside the cache
    const size_t dst = (h * max_ctx + p) * head_dim + d;
    k_cache[dst] = from_f32<T>(k[i]);
    v_cache[dst] = from_f32<T>(v[i]);
}

template <typename T>
__device__ void attention(const float* q, const T* k_cache, const T* v_cache, const unsigned* positions,
                          float* out, unsigned heads, unsigned kv_heads, unsigned head_dim, unsigned max_ctx,
                          float scale) {
    __shared__ float s_m[WARPS], s_l[WARPS];
    __shared__ float s_acc[WARPS][MAX_PER_LANE * 32];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const size_t row = blockIdx.x;  // token * heads + head
    const unsigned t = row / heads, h = row % heads;
    const unsigned kvh = h / (heads / kv_heads);
    const unsigned n = min(positions[t] + 1, max_ctx);
    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
#pragma unroll
    for (int r = 0; r < MAX_PER_LANE; r++) {
        const unsigned d = lane + 32 * r;
        qv[r] = d < head_dim ? q[row * head_dim + d] : 0.0f;
        acc[r] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const T* kb = k_cache + (size_t)kvh * max_ctx * head_dim;
    const T* vb = v_cache + (size_t)kvh * max_ctx * head_dim;
    for (unsigned j = warp; j < n; j += WARPS) {
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) {
            const unsigned d = lane + 32 * r;
            if (d < head_dim) s += qv[r] * to_f32(kb[(size_t)j * head_dim + d]);
        }
        s = warp_sum(s) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int r = 0; r < MAX_PER_LANE; r++) {
            const unsigned d = lane + 32 * r;
            if (d < head_dim) acc[r] = acc[r] * corr + p * to_f32(vb[(size_t)j * head_dim + d]);
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
                                                T* k_cache, T* v_cache, unsigned tokens, unsigned kv_heads,  \
                                                unsigned head_dim, unsigned max_ctx) {                      \
        kv_append(k, v, positions, k_cache, v_cache, tokens, kv_heads, head_dim, max_ctx);                  \
    }                                                                                                       \
    extern "C" __global__ void attention_##NAME(const float* q, const T* k_cache, const T* v_cache,          \
                                                const unsigned* positions, float* out, unsigned heads,       \
                                                unsigned kv_heads, unsigned head_dim, unsigned max_ctx,      \
                                                float scale) {                                               \
        attention(q, k_cache, v_cache, positions, out, heads, kv_heads, head_dim, max_ctx, scale);          \
    }

ATTN(float, f32)
ATTN(bf16, bf16)
ATTN(f16, f16)

// ---- decode: split over the cache length ----
// Grid (kv_heads * subgroups, splits, tokens): a block takes one KV head, up to GROUP query heads
// of its group and one chunk of the cache rows `0 ..= positions[t]`, so each K/V row is read
// once per GROUP query heads. A warp takes batches of 32 keys: lane j copies K and V rows j into
// the warp's shared rows with asynchronous 16-byte copies (all in flight at once, no registers),
// scores key j against the block's queries, the online softmax runs per query head across lanes,
// and P.V accumulates with lane d owning dims d, d + 32, ... (PL of them). The warps' partial
// results are merged and written as (max, sum, acc) per (token, head, split) for
// attention_combine. head_dim is a multiple of 8.
#define GROUP 8
#define DEC_WARPS 4

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
                                float* part_m, float* part_l, float* part_acc, unsigned heads, unsigned kv_heads,
                                unsigned head_dim, unsigned max_ctx, float scale, unsigned chunk) {
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
    const unsigned n = min(positions[t] + 1, max_ctx);
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
    const T* kb = k_cache + (size_t)kvh * max_ctx * head_dim;
    const T* vb = v_cache + (size_t)kvh * max_ctx * head_dim;
    const unsigned row_chunks = head_dim * sizeof(T) / 16;
    for (unsigned base = start + warp * 32; base < end; base += DEC_WARPS * 32) {
        const unsigned key = base + lane;
        const bool valid = key < end;
        if (valid) {
            const char* kr = reinterpret_cast<const char*>(kb + (size_t)key * head_dim);
            const char* vr = reinterpret_cast<const char*>(vb + (size_t)key * head_dim);
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

// out[t, h] = merge of the splits' partial results. One block per (token, head); the splits'
// weights exp(m_s - max) are computed once into shared memory (at most MAX_SPLITS splits).
#define MAX_SPLITS 1024
extern "C" __global__ void attention_combine_f32(const float* part_m, const float* part_l, const float* part_acc,
                                                 float* out, unsigned head_dim, unsigned splits) {
    __shared__ float f[MAX_SPLITS];
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const float* pm = part_m + row * splits;
    const float* pl = part_l + row * splits;
    float mm = -INFINITY;
    for (unsigned s = threadIdx.x; s < splits; s += blockDim.x) mm = fmaxf(mm, pm[s]);
    mm = block_max(mm, scratch);
    float ll = 0.0f;
    for (unsigned s = threadIdx.x; s < splits; s += blockDim.x) {
        f[s] = pm[s] == -INFINITY ? 0.0f : expf(pm[s] - mm);
        ll += pl[s] * f[s];
    }
    ll = block_sum(ll, scratch);  // also orders the writes of f before the reads below
    const float* pa = part_acc + row * splits * head_dim;
    for (unsigned d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        unsigned s = 0;
        for (; s + 4 <= splits; s += 4) {
            a0 += f[s] * pa[(size_t)s * head_dim + d];
            a1 += f[s + 1] * pa[(size_t)(s + 1) * head_dim + d];
            a2 += f[s + 2] * pa[(size_t)(s + 2) * head_dim + d];
            a3 += f[s + 3] * pa[(size_t)(s + 3) * head_dim + d];
        }
        for (; s < splits; s++) a0 += f[s] * pa[(size_t)s * head_dim + d];
        out[row * head_dim + d] = ((a0 + a1) + (a2 + a3)) / ll;
    }
}

#define SPLIT(T, NAME, PL)                                                                                  \
    extern "C" __global__ void attention_split_##NAME##_##PL(                                               \
        const float* q, const T* k_cache, const T* v_cache, const unsigned* positions, float* part_m,       \
        float* part_l, float* part_acc, unsigned heads, unsigned kv_heads, unsigned head_dim,               \
        unsigned max_ctx, float scale, unsigned chunk) {                                                    \
        attention_split<T, PL>(q, k_cache, v_cache, positions, part_m, part_l, part_acc, heads, kv_heads,  \
                               head_dim, max_ctx, scale, chunk);                                            \
    }
#define SPLITS(T, NAME) SPLIT(T, NAME, 2) SPLIT(T, NAME, 3) SPLIT(T, NAME, 4) SPLIT(T, NAME, 8)

SPLITS(float, f32)
SPLITS(bf16, bf16)
SPLITS(f16, f16)
