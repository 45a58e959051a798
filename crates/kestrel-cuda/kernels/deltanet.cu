// Gated DeltaNet. causal_conv1d: one thread per channel, walking the tokens in order from the
// channel's saved inputs (kernel - 1 of them, KERNEL_MAX at most) and saving the last ones back.
// delta_gates: element-wise decay and beta. delta_rule: the recurrence, one block per value head
// with the state [k_dim, v_dim] in shared memory; each thread owns state columns, so the per-token
// update needs no synchronisation beyond loading the token's normalised q and k.
#include "kestrel.cuh"

#define KERNEL_MAX 8

template <typename W>
__device__ void conv1d(const float* x, const W* w, float* state, float* out, unsigned tokens, unsigned channels,
                       unsigned kernel) {
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels || kernel > KERNEL_MAX) return;
    const unsigned hist = kernel - 1;
    float win[KERNEL_MAX];  // win[0 .. hist) = previous inputs, oldest first
    float wc[KERNEL_MAX];
#pragma unroll
    for (unsigned j = 0; j < KERNEL_MAX; j++) {
        win[j] = j < hist ? state[(size_t)c * hist + j] : 0.0f;
        wc[j] = j < kernel ? to_f32(w[(size_t)c * kernel + j]) : 0.0f;
    }
    for (unsigned t = 0; t < tokens; t++) {
        const float xt = x[(size_t)t * channels + c];
        float acc = 0.0f;
#pragma unroll
        for (unsigned j = 0; j < KERNEL_MAX; j++)
            if (j < hist) acc += wc[j] * win[j];
        acc += wc[hist] * xt;
        out[(size_t)t * channels + c] = silu(acc);
#pragma unroll
        for (unsigned j = 0; j + 1 < KERNEL_MAX; j++)
            if (j + 1 < hist) win[j] = win[j + 1];
        if (hist > 0) win[hist - 1] = xt;
    }
#pragma unroll
    for (unsigned j = 0; j < KERNEL_MAX; j++)
        if (j < hist) state[(size_t)c * hist + j] = win[j];
}

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

template <typename A, typename D>
__device__ void gates(const float* a, const float* b, const A* a_log, const D* dt_bias, float* g, float* beta,
                      unsigned n, unsigned heads) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned h = i % heads;
    g[i] = -expf(to_f32(a_log[h])) * softplus(a[i] + to_f32(dt_bias[h]));
    beta[i] = sigmoid(b[i]);
}

#define CONV(W, NAME)                                                                                       \
    extern "C" __global__ void causal_conv1d_##NAME(const float* x, const W* w, float* state, float* out,   \
                                                    unsigned tokens, unsigned channels, unsigned kernel) {   \
        conv1d(x, w, state, out, tokens, channels, kernel);                                                 \
    }

CONV(float, f32)
CONV(bf16, bf16)
CONV(f16, f16)

// Checkpoints keep A_log in f32 and dt_bias in bf16, among other mixes: one kernel per pair,
// named delta_gates_{A_log dtype}_{dt_bias dtype}.
#define GATES(A, AN, D, DN)                                                                                 \
    extern "C" __global__ void delta_gates_##AN##_##DN(const float* a, const float* b, const A* a_log,      \
                                                       const D* dt_bias, float* g, float* beta, unsigned n, \
                                                       unsigned heads) {                                     \
        gates(a, b, a_log, dt_bias, g, beta, n, heads);                                                     \
    }
#define GATES_FOR(A, AN) GATES(A, AN, float, f32) GATES(A, AN, bf16, bf16) GATES(A, AN, f16, f16)

GATES_FOR(float, f32)
GATES_FOR(bf16, bf16)
GATES_FOR(f16, f16)

// q, k: [tokens, k_heads, dk]; v, out: [tokens, v_heads, dv]; g, beta: [tokens, v_heads];
// state: [v_heads, dk, dv]. Dynamic shared memory: (dk * dv + 2 * dk) floats.
extern "C" __global__ void delta_rule_f32(const float* q, const float* k, const float* v, const float* g,
                                          const float* beta, float* state, float* out, unsigned tokens,
                                          unsigned k_heads, unsigned v_heads, unsigned dk, unsigned dv) {
    extern __shared__ float smem[];
    __shared__ float scratch[32];
    float* S = smem;          // [dk, dv]
    float* qs = S + dk * dv;  // [dk]
    float* ks = qs + dk;      // [dk]
    const unsigned h = blockIdx.x, kh = h / (v_heads / k_heads);
    float* st = state + (size_t)h * dk * dv;
    for (unsigned i = threadIdx.x; i < dk * dv; i += blockDim.x) S[i] = st[i];
    const float qscale = rsqrtf((float)dk);
    for (unsigned t = 0; t < tokens; t++) {
        const float* qt = q + ((size_t)t * k_heads + kh) * dk;
        const float* kt = k + ((size_t)t * k_heads + kh) * dk;
        float qq = 0.0f, kk = 0.0f;
        for (unsigned i = threadIdx.x; i < dk; i += blockDim.x) {
            qq += qt[i] * qt[i];
            kk += kt[i] * kt[i];
        }
        qq = block_sum(qq, scratch);
        kk = block_sum(kk, scratch);
        const float qn = qscale / sqrtf(qq + 1e-6f), kn = 1.0f / sqrtf(kk + 1e-6f);
        for (unsigned i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = qt[i] * qn;
            ks[i] = kt[i] * kn;
        }
        __syncthreads();
        const float decay = expf(g[(size_t)t * v_heads + h]), b = beta[(size_t)t * v_heads + h];
        const float* vt = v + ((size_t)t * v_heads + h) * dv;
        float* ot = out + ((size_t)t * v_heads + h) * dv;
        for (unsigned j = threadIdx.x; j < dv; j += blockDim.x) {
            float mem = 0.0f;
            for (unsigned i = 0; i < dk; i++) {
                const float s = S[i * dv + j] * decay;
                S[i * dv + j] = s;
                mem += s * ks[i];
            }
            const float delta = (vt[j] - mem) * b;
            float o = 0.0f;
            for (unsigned i = 0; i < dk; i++) {
                const float s = S[i * dv + j] + ks[i] * delta;
                S[i * dv + j] = s;
                o += s * qs[i];
            }
            ot[j] = o;
        }
        __syncthreads();  // qs and ks are reloaded for the next token
    }
    for (unsigned i = threadIdx.x; i < dk * dv; i += blockDim.x) st[i] = S[i];
}
