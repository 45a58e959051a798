// Gated DeltaNet. causal_conv1d: one thread per channel, walking the tokens in order from the
// channel's saved inputs (kernel - 1 of them, KERNEL_MAX at most) and saving the last ones back.
// delta_gates: element-wise decay and beta. delta_rule_f32: the recurrence, one block per value
// head with the state [k_dim, v_dim] in shared memory; each thread owns state columns, so the
// per-token update needs no synchronisation beyond loading the token's normalised q and k.
// delta_rule_regs_*: the same with the state in registers (below). delta_chunked_*: the chunked
// form of the CPU reference, at the end.
#include "kestrel.cuh"

// States hold a row per sequence when the op has rows (`StateRows`): every kernel takes (seq,
// seq_step) after the state. seq null: one row, every token from it; seq_step 0: every token
// from row seq[0] (a chunk of one sequence); seq_step 1: token t alone from row seq[t] (a batched
// decode step), a run per token along the grid's last dimension. The kernels' bodies see one
// run: the entry points move the pointers to its row and first token.
struct Run {
    size_t row;
    unsigned t0, tokens;
};

__device__ __forceinline__ Run run_of(const unsigned* seq, unsigned seq_step, unsigned tokens, unsigned z) {
    const unsigned t0 = seq_step ? z : 0;
    return Run{seq ? (size_t)seq[t0 * seq_step] : 0, t0, seq_step ? 1u : tokens};
}

// KERNEL_MAX (the longest convolution window), DC (tokens per chunk of delta_chunked_*), CP
// (its threads to a state column), DELTA_REGS_THREADS (a delta_rule_regs_* block) and the
// chunked kernels' shared-memory sizes (DELTA_CHUNK_SMEM_<DK>) come from the host
// (`ops/deltanet.rs`) as -D definitions.
#if !defined(KERNEL_MAX) || !defined(DC) || !defined(CP) || !defined(DELTA_REGS_THREADS)
#error "deltanet.cu is compiled with KERNEL_MAX, DC, CP and DELTA_REGS_THREADS from ops/deltanet.rs"
#endif

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
    extern "C" __global__ void causal_conv1d_##NAME(const float* x, const W* w, float* state,               \
                                                    const unsigned* seq, unsigned seq_step, float* out,      \
                                                    unsigned tokens, unsigned channels, unsigned kernel) {   \
        pdl_begin();                                                                                        \
        const Run r = run_of(seq, seq_step, tokens, blockIdx.y);                                            \
        const size_t at = (size_t)r.t0 * channels;                                                          \
        conv1d(x + at, w, state + r.row * channels * (kernel - 1), out + at, r.tokens, channels, kernel);   \
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
        pdl_begin();                                                                                        \
        gates(a, b, a_log, dt_bias, g, beta, n, heads);                                                     \
    }
#define GATES_FOR(A, AN) GATES(A, AN, float, f32) GATES(A, AN, bf16, bf16) GATES(A, AN, f16, f16)

GATES_FOR(float, f32)
GATES_FOR(bf16, bf16)
GATES_FOR(f16, f16)

// q, k: [tokens, k_heads, dk]; v, out: [tokens, v_heads, dv]; g, beta: [tokens, v_heads];
// state: [v_heads, dk, dv] (a run's row). Dynamic shared memory: (dk * dv + 2 * dk) floats.
__device__ void delta_rule_smem(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                float* state, float* out, unsigned tokens, unsigned k_heads, unsigned v_heads,
                                unsigned dk, unsigned dv) {
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

// Moves the delta rule's pointers to run `r` (see `Run`): its state row and first token.
#define DELTA_RUN(r, dk)                                                                                    \
    q += (size_t)(r).t0 * k_heads * (dk);                                                                   \
    k += (size_t)(r).t0 * k_heads * (dk);                                                                   \
    v += (size_t)(r).t0 * v_heads * dv;                                                                     \
    out += (size_t)(r).t0 * v_heads * dv;                                                                   \
    g += (size_t)(r).t0 * v_heads;                                                                          \
    beta += (size_t)(r).t0 * v_heads;                                                                       \
    state += (r).row * v_heads * (dk) * dv

// Grid (v_heads, runs).
extern "C" __global__ void delta_rule_f32(const float* q, const float* k, const float* v, const float* g,
                                          const float* beta, float* state, const unsigned* seq,
                                          unsigned seq_step, float* out, unsigned tokens, unsigned k_heads,
                                          unsigned v_heads, unsigned dk, unsigned dv) {
    pdl_begin();
    const Run r = run_of(seq, seq_step, tokens, blockIdx.y);
    DELTA_RUN(r, dk);
    delta_rule_smem(q, k, v, g, beta, state, out, r.tokens, k_heads, v_heads, dk, dv);
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

static_assert(DELTA_REGS_THREADS == 128, "delta_rule_regs: four threads to each of a block's 32 state columns");
#define DELTA_REGS(R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(DELTA_REGS_THREADS) delta_rule_regs_##R(                 \
        const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,  \
        const unsigned* seq, unsigned seq_step, float* out, unsigned tokens, unsigned k_heads,             \
        unsigned v_heads, unsigned dv) {                                                                   \
        pdl_begin();                                                                                       \
        const Run r = run_of(seq, seq_step, tokens, blockIdx.z);                                           \
        DELTA_RUN(r, 4 * R);                                                                               \
        delta_rule_regs<R>(q, k, v, g, beta, state, out, r.tokens, k_heads, v_heads, dv);                  \
    }
DELTA_REGS(16)
DELTA_REGS(32)
DELTA_REGS(64)


// ---- the chunked form (prefill) ----
// The same recurrence over chunks of DC = 64 tokens, as the CPU's chunked form: within a chunk,
// with c the cumulative decay and a_ij = beta_i (k_i . k_j) e^(c_i - c_j) for j < i,
//   W = (I + A)^-1 (K beta e^c),  U = (I + A)^-1 (V beta),  V' = U - W S,
//   out_i = e^(c_i) q_i S + sum_{j <= i} (q_i . k_j) e^(c_i - c_j) V'_j,
//   S <- e^(c_last) S + sum_i e^(c_last - c_i) k_i (x) V'_i.
// One block per (value head, 32 state columns), 256 threads; thread (column j, part p) keeps
// rows p, p + CP, ... of its column of S in registers (CP = 8 parts to a column). The chunk's
// normalised q and k, W, the two triangular matrices and the block's 32 columns of V live in
// shared memory (rows padded by 4 floats, so 16-byte row reads of different rows do not collide).
// Every step is parallel across threads; only the triangular solves walk the chunk's rows.
// CP, threads to a state column, comes from the host (`ops/deltanet.rs`) with DC.

template <int DK>
struct ChunkSmem {
    static constexpr unsigned P = DK + 4;  // padded row of q, k, W
    float q[DC][P], k[DC][P], w[DC][P];
    float a[DC][DC], m[DC][DC];  // a_ij (j < i) and (q_i . k_j) e^(c_i - c_j) (j <= i)
    float v[DC][33];             // V, then U, then V' (the block's columns; padded against conflicts)
    float c[DC], beta[DC], ec[DC], f[DC];
};

template <int DK>
__device__ void delta_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                              float* state, float* out, unsigned tokens, unsigned k_heads, unsigned v_heads,
                              unsigned dv) {
    constexpr unsigned R = DK / CP;
    extern __shared__ __align__(16) unsigned char chunk_smem[];
    ChunkSmem<DK>& sm = *reinterpret_cast<ChunkSmem<DK>*>(chunk_smem);
    const unsigned h = blockIdx.x, kh = h / (v_heads / k_heads), j0 = blockIdx.y * 32;
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32, p = tid % CP, jj = tid / CP;
    const unsigned j = j0 + jj;
    const bool col = j < dv;
    float* st = state + (size_t)h * DK * dv;
    float S[R];
#pragma unroll
    for (int r = 0; r < R; r++) S[r] = col ? st[(size_t)(p + CP * r) * dv + j] : 0.0f;
    const float qscale = rsqrtf((float)DK);
    for (unsigned t0 = 0; t0 < tokens; t0 += DC) {
        const unsigned l = min(DC, tokens - t0);
        // 1. This chunk's q, k (rows past the chunk are zero) and V, every thread's loads issued
        // before its stores; then q and k normalised in place, a row per warp at a time.
        constexpr unsigned V4 = DK / 4;  // float4s per row
        for (unsigned e0 = tid; e0 < DC * V4; e0 += 4 * blockDim.x) {
            float4 xq[4], xk[4];
#pragma unroll
            for (unsigned u = 0; u < 4; u++) {
                const unsigned e = e0 + u * blockDim.x, i = e / V4;
                const size_t at = ((size_t)(t0 + i) * k_heads + kh) * V4 + e % V4;
                const bool ok = e < DC * V4 && i < l;
                xq[u] = ok ? reinterpret_cast<const float4*>(q)[at] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                xk[u] = ok ? reinterpret_cast<const float4*>(k)[at] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (unsigned u = 0; u < 4; u++) {
                const unsigned e = e0 + u * blockDim.x, i = e / V4;
                if (e >= DC * V4) continue;
                *reinterpret_cast<float4*>(&sm.q[i][4 * (e % V4)]) = xq[u];
                *reinterpret_cast<float4*>(&sm.k[i][4 * (e % V4)]) = xk[u];
            }
        }
        for (unsigned e0 = tid; e0 < DC * 32; e0 += 8 * blockDim.x) {
            float xv[8];
#pragma unroll
            for (unsigned u = 0; u < 8; u++) {
                const unsigned e = e0 + u * blockDim.x, i = e / 32, c = e % 32;
                xv[u] = e < DC * 32 && i < l && j0 + c < dv ? v[((size_t)(t0 + i) * v_heads + h) * dv + j0 + c] : 0.0f;
            }
#pragma unroll
            for (unsigned u = 0; u < 8; u++) {
                const unsigned e = e0 + u * blockDim.x;
                if (e < DC * 32) sm.v[e / 32][e % 32] = xv[u];
            }
        }
        if (tid < DC) {
            sm.beta[tid] = tid < l ? beta[(size_t)(t0 + tid) * v_heads + h] : 0.0f;
            sm.c[tid] = tid < l ? g[(size_t)(t0 + tid) * v_heads + h] : 0.0f;
        }
        __syncthreads();
        for (unsigned i = warp; i < l; i += blockDim.x / 32) {
            float qq = 0.0f, kk = 0.0f;
#pragma unroll
            for (unsigned e = 0; e < DK / 32; e++) {
                qq += sm.q[i][lane + 32 * e] * sm.q[i][lane + 32 * e];
                kk += sm.k[i][lane + 32 * e] * sm.k[i][lane + 32 * e];
            }
            qq = warp_sum(qq);
            kk = warp_sum(kk);
            const float qn = qscale / sqrtf(qq + 1e-6f), kn = 1.0f / sqrtf(kk + 1e-6f);
#pragma unroll
            for (unsigned e = 0; e < DK / 32; e++) {
                sm.q[i][lane + 32 * e] *= qn;
                sm.k[i][lane + 32 * e] *= kn;
            }
        }
        if (tid == 0) {
            // The cumulative decay, summed in order as the CPU does.
            float acc = 0.0f;
            for (unsigned i = 0; i < DC; i++) sm.c[i] = acc += sm.c[i];
        }
        __syncthreads();
        if (tid < DC) {
            sm.ec[tid] = expf(sm.c[tid]);
            sm.f[tid] = tid < l ? expf(sm.c[l - 1] - sm.c[tid]) : 0.0f;
        }
        // 2. k_i . k_j (j < i) and q_i . k_j (j <= i), 4 x 4 tiles of the lower triangle.
        constexpr unsigned TILES = (DC / 4) * (DC / 4 + 1) / 2;
        for (unsigned T = tid; T < 2 * TILES; T += blockDim.x) {
            const bool qk = T >= TILES;
            unsigned idx = T % TILES, ti = 0;
            while (idx > ti) idx -= ++ti;  // row ti of tiles holds ti + 1 of them
            const unsigned tj = idx, i0 = 4 * ti, jb = 4 * tj;
            float acc[4][4] = {};
            for (unsigned a = 0; a < DK; a += 4) {
                float4 x[4], y[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    x[u] = *reinterpret_cast<const float4*>(qk ? &sm.q[i0 + u][a] : &sm.k[i0 + u][a]);
                    y[u] = *reinterpret_cast<const float4*>(&sm.k[jb + u][a]);
                }
#pragma unroll
                for (int u = 0; u < 4; u++)
#pragma unroll
                    for (int w = 0; w < 4; w++)
                        acc[u][w] += x[u].x * y[w].x + x[u].y * y[w].y + x[u].z * y[w].z + x[u].w * y[w].w;
            }
#pragma unroll
            for (int u = 0; u < 4; u++)
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    const unsigned i = i0 + u, jx = jb + w;
                    // exp of a difference, not a ratio of exps, as the CPU computes it
                    const float decay = expf(sm.c[i] - sm.c[jx]);
                    if (qk) sm.m[i][jx] = jx <= i ? acc[u][w] * decay : 0.0f;
                    else sm.a[i][jx] = jx < i ? sm.beta[i] * acc[u][w] * decay : 0.0f;
                }
        }
        __syncthreads();
        // 3. Forward substitution, one column per thread: W's DK columns, then U's 32.
        for (unsigned cc = tid; cc < DK + 32; cc += blockDim.x) {
            if (cc < DK) {
                for (unsigned i = 0; i < DC; i++) {
                    float x = sm.k[i][cc] * sm.beta[i] * sm.ec[i];
                    for (unsigned jx = 0; jx < i; jx++) x -= sm.a[i][jx] * sm.w[jx][cc];
                    sm.w[i][cc] = x;
                }
            } else {
                const unsigned u = cc - DK;
                for (unsigned i = 0; i < DC; i++) {
                    float x = sm.v[i][u] * sm.beta[i];
                    for (unsigned jx = 0; jx < i; jx++) x -= sm.a[i][jx] * sm.v[jx][u];
                    sm.v[i][u] = x;
                }
            }
        }
        __syncthreads();
        // 4. V' = U - W S (this thread's rows of S, summed over the column's parts).
        for (unsigned i = 0; i < DC; i++) {
            float part = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) part += sm.w[i][p + CP * r] * S[r];
            for (unsigned o = 1; o < CP; o <<= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (p == 0) sm.v[i][jj] -= part;
        }
        __syncthreads();
        // 5. out_i = e^(c_i) q_i S + sum_{j <= i} m_ij V'_j (the j's split over the parts).
        for (unsigned i = 0; i < l; i++) {
            float part = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) part += sm.q[i][p + CP * r] * S[r];
            part *= sm.ec[i];
            for (unsigned jx = p; jx <= i; jx += CP) part += sm.m[i][jx] * sm.v[jx][jj];
            for (unsigned o = 1; o < CP; o <<= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (p == 0 && col) out[((size_t)(t0 + i) * v_heads + h) * dv + j] = part;
        }
        // 6. S <- e^(c_last) S + sum_i e^(c_last - c_i) k_i (x) V'_i.
        const float el = expf(sm.c[l - 1]);
#pragma unroll
        for (int r = 0; r < R; r++) S[r] *= el;
        for (unsigned i = 0; i < l; i++) {
            const float x = sm.v[i][jj] * sm.f[i];
#pragma unroll
            for (int r = 0; r < R; r++) S[r] += sm.k[i][p + CP * r] * x;
        }
        __syncthreads();  // the next chunk overwrites shared memory
    }
    if (col) {
#pragma unroll
        for (int r = 0; r < R; r++) st[(size_t)(p + CP * r) * dv + j] = S[r];
    }
}

#define DELTA_CHUNKED(DKV)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * CP) delta_chunked_##DKV(                                \
        const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,  \
        const unsigned* seq, unsigned seq_step, float* out, unsigned tokens, unsigned k_heads,             \
        unsigned v_heads, unsigned dv) {                                                                   \
        pdl_begin();                                                                                       \
        const Run r = run_of(seq, seq_step, tokens, blockIdx.z);                                           \
        DELTA_RUN(r, DKV);                                                                                 \
        delta_chunked<DKV>(q, k, v, g, beta, state, out, r.tokens, k_heads, v_heads, dv);                  \
    }
DELTA_CHUNKED(64)
DELTA_CHUNKED(128)
static_assert(sizeof(ChunkSmem<64>) == DELTA_CHUNK_SMEM_64, "ops/deltanet.rs chunk_smem disagrees");
static_assert(sizeof(ChunkSmem<128>) == DELTA_CHUNK_SMEM_128, "ops/deltanet.rs chunk_smem disagrees");
