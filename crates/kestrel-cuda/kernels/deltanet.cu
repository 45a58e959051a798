// Gated DeltaNet. causal_conv1d: one thread per channel, walking the tokens in order from the
// channel's saved inputs (kernel - 1 of them, KERNEL_MAX at most) and saving the last ones back.
// delta_gates: element-wise decay and beta. delta_rule_f32: the recurrence, one block per value
// head with the state [k_dim, v_dim] in shared memory; each thread owns state columns, so the
// per-token update needs no synchronisation beyond loading the token's normalised q and k.
// delta_rule_regs_*: the same with the state in registers (below).
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

// The same recurrence with the state in registers and each value head spread over blocks of
// 32 state columns: thread (column j, part p) holds rows p, p + 4, ... of column j (R = dk / 4
// of them), so a token costs each thread 4R multiply-adds and two 2-step shuffles, and a head
// runs on dv / 32 multiprocessors. Everything a token needs is loaded one token ahead: warp 0
// normalises the next q and k into a double-buffered shared copy, each thread holds the next v,
// g and beta, so one barrier per token remains. Grid (v_heads, dv / 32), 128 threads.
template <int R>
__device__ void delta_rule_regs(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                float* state, float* out, unsigned tokens, unsigned k_heads, unsigned v_heads,
                                unsigned dv) {
    constexpr unsigned DK = 4 * R;
    __shared__ float qs[2][DK], ks[2][DK];
    const unsigned h = blockIdx.x, kh = h / (v_heads / k_heads);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, p = threadIdx.x % 4;
    const unsigned j = blockIdx.y * 32 + threadIdx.x / 4;
    const bool col = j < dv;
    float* st = state + (size_t)h * DK * dv;
    float S[R];
#pragma unroll
    for (int r = 0; r < R; r++) S[r] = col ? st[(size_t)(p + 4 * r) * dv + j] : 0.0f;
    const float qscale = rsqrtf((float)DK);
    // Warp 0's next q and k (DK / 32 values each per lane); every thread's next v, g, beta.
    constexpr unsigned PER_LANE = DK / 32;
    float nq[PER_LANE], nk[PER_LANE], nv = 0.0f, ng = 0.0f, nb = 0.0f;
    const auto load = [&](unsigned t) {
        if (t >= tokens) return;
        if (warp == 0) {
#pragma unroll
            for (unsigned e = 0; e < PER_LANE; e++) {
                nq[e] = q[((size_t)t * k_heads + kh) * DK + lane + 32 * e];
                nk[e] = k[((size_t)t * k_heads + kh) * DK + lane + 32 * e];
            }
        }
        nv = col ? v[((size_t)t * v_heads + h) * dv + j] : 0.0f;
        ng = g[(size_t)t * v_heads + h];
        nb = beta[(size_t)t * v_heads + h];
    };
    load(0);
    for (unsigned t = 0; t < tokens; t++) {
        const unsigned buf = t & 1;
        if (warp == 0) {
            float qq = 0.0f, kk = 0.0f;
#pragma unroll
            for (unsigned e = 0; e < PER_LANE; e++) {
                qq += nq[e] * nq[e];
                kk += nk[e] * nk[e];
            }
            qq = warp_sum(qq);
            kk = warp_sum(kk);
            const float qn = qscale / sqrtf(qq + 1e-6f), kn = 1.0f / sqrtf(kk + 1e-6f);
#pragma unroll
            for (unsigned e = 0; e < PER_LANE; e++) {
                qs[buf][lane + 32 * e] = nq[e] * qn;
                ks[buf][lane + 32 * e] = nk[e] * kn;
            }
        }
        const float vj = nv, decay = expf(ng), b = nb;
        __syncthreads();  // qs[buf], ks[buf] are ready; everyone is past token t - 1
        load(t + 1);
        float mem = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++) {
            S[r] *= decay;
            mem += S[r] * ks[buf][p + 4 * r];
        }
        mem += __shfl_xor_sync(0xffffffffu, mem, 1);
        mem += __shfl_xor_sync(0xffffffffu, mem, 2);
        const float delta = (vj - mem) * b;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++) {
            S[r] += ks[buf][p + 4 * r] * delta;
            o += S[r] * qs[buf][p + 4 * r];
        }
        o += __shfl_xor_sync(0xffffffffu, o, 1);
        o += __shfl_xor_sync(0xffffffffu, o, 2);
        if (p == 0 && col) out[((size_t)t * v_heads + h) * dv + j] = o;
    }
    if (col) {
#pragma unroll
        for (int r = 0; r < R; r++) st[(size_t)(p + 4 * r) * dv + j] = S[r];
    }
}

#define DELTA_REGS(R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) delta_rule_regs_##R(                                \
        const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,  \
        float* out, unsigned tokens, unsigned k_heads, unsigned v_heads, unsigned dv) {                    \
        delta_rule_regs<R>(q, k, v, g, beta, state, out, tokens, k_heads, v_heads, dv);                    \
    }
DELTA_REGS(16)
DELTA_REGS(32)
DELTA_REGS(64)

