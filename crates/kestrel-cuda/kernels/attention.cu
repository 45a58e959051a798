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
