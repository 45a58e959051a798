// Mixture of experts.
// router: one warp per token holds up to ROUTER_MAX experts in registers: softmax, then k rounds
// of warp argmax (the lower index wins ties), optional renormalisation.
// Experts, with 16-byte weight loads (see rows_dot in kestrel.cuh): gate_up computes
// act[t * k + j] = silu(gate_e x_t) * (up_e x_t) for every (token, slot); down_combine computes
// out[t] = sum_j weights[t, j] * down_e act[t * k + j], slots summed in order, so results do not
// depend on scheduling. Each expert is one contiguous span of `span` bytes; each matrix sits at
// the given byte offsets (weight, scales, biases; bf16 experts use only the weight offset).
// BITS is 4 or 8 for MLX-quantised experts and 16 for bf16.
#include "kestrel.cuh"

#define ROUTER_PER_LANE 16  // up to 512 experts

extern "C" __global__ void router_f32(const float* logits, unsigned* ids, float* weights, unsigned experts,
                                      unsigned k, int normalize) {
    const unsigned lane = threadIdx.x;
    const size_t t = blockIdx.x;
    const float* l = logits + t * experts;
    float p[ROUTER_PER_LANE];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        const unsigned e = lane + 32 * i;
        p[i] = e < experts ? l[e] : -INFINITY;
        m = fmaxf(m, p[i]);
    }
    m = warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++) {
        p[i] = lane + 32 * i < experts ? expf(p[i] - m) : -1.0f;
        s += fmaxf(p[i], 0.0f);
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; i++)
        if (p[i] >= 0.0f) p[i] /= s;
    float total = 0.0f, chosen = 0.0f;
    for (unsigned j = 0; j < k; j++) {
        float best = -2.0f;
        unsigned bi = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; i++)
            if (p[i] > best) { best = p[i]; bi = lane + 32 * i; }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
        }
        if (bi % 32 == lane) {
#pragma unroll
            for (int i = 0; i < ROUTER_PER_LANE; i++)
                if (lane + 32 * i == bi) p[i] = -1.0f;  // taken
        }
        if (lane == j) chosen = best;  // slot j's weight lives in lane j until written
        if (lane == 0) ids[t * k + j] = bi;
        total += best;
    }
    if (lane < k) weights[t * k + lane] = normalize ? chosen / total : chosen;
}

#define GU_WARPS 4
#define GU_ROWS 2
#define DOWN_WARPS 4
#define DOWN_ROWS 2

template <int BITS>
__device__ void gate_up(const float* x, const unsigned* ids, const unsigned char* experts, float* act,
                        unsigned hidden, unsigned inter, unsigned k, unsigned long long span,
                        unsigned long long gw, unsigned long long gs, unsigned long long gb, unsigned long long uw,
                        unsigned long long us, unsigned long long ub, unsigned group) {
    extern __shared__ float xs[];  // x pre-scaled for BITS, then (quantised only) x plain
    float* xs_plain = xs + padded_len(hidden);
    const size_t tk = blockIdx.y;
    const float* xt = x + (tk / k) * hidden;
    if constexpr (BITS != 16)
        for (unsigned i = threadIdx.x; i < hidden; i += blockDim.x) xs_plain[padded(i)] = xt[i];
    stage_x<BITS>(xt, xs, hidden);
    const unsigned lane = threadIdx.x % 32;
    const unsigned row0 = (blockIdx.x * GU_WARPS + threadIdx.x / 32) * GU_ROWS;
    if (row0 >= inter) return;
    const unsigned char* sp = experts + (size_t)ids[tk] * span;
    float g[GU_ROWS], u[GU_ROWS];
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) g[r] = u[r] = 0.0f;
    rows_dot<BITS, GU_ROWS>(sp + gw, reinterpret_cast<const bf16*>(sp + gs), reinterpret_cast<const bf16*>(sp + gb),
                            row0, inter, xs, xs_plain, hidden, group, g);
    rows_dot<BITS, GU_ROWS>(sp + uw, reinterpret_cast<const bf16*>(sp + us), reinterpret_cast<const bf16*>(sp + ub),
                            row0, inter, xs, xs_plain, hidden, group, u);
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
        const float gv = warp_sum(g[r]), uv = warp_sum(u[r]);
        if (lane == 0 && row0 + r < inter) act[tk * inter + row0 + r] = silu(gv) * uv;
    }
}

template <int BITS>
__device__ void down_combine(const float* act, const unsigned* ids, const float* weights,
                             const unsigned char* experts, float* out, unsigned hidden, unsigned inter, unsigned k,
                             unsigned long long span, unsigned long long dw, unsigned long long ds,
                             unsigned long long db, unsigned group) {
    // The k activations staged pre-scaled for BITS, then (quantised only) plain.
    extern __shared__ float xs[];
    const size_t t = blockIdx.y;
    const unsigned plen = padded_len(inter);
    float* xs_plain = xs + k * plen;
    for (unsigned j = 0; j < k; j++)
        for (unsigned i = threadIdx.x; i < inter; i += blockDim.x) {
            const float a = act[(t * k + j) * inter + i];
            xs[j * plen + padded(i)] = a * VecFormat<BITS>::x_scale(i);
            if constexpr (BITS != 16) xs_plain[j * plen + padded(i)] = a;
        }
    __syncthreads();
    const unsigned lane = threadIdx.x % 32;
    const unsigned row0 = (blockIdx.x * DOWN_WARPS + threadIdx.x / 32) * DOWN_ROWS;
    if (row0 >= hidden) return;
    float total[DOWN_ROWS];
#pragma unroll
    for (int r = 0; r < DOWN_ROWS; r++) total[r] = 0.0f;
    for (unsigned j = 0; j < k; j++) {
        const unsigned char* sp = experts + (size_t)ids[t * k + j] * span;
        float a[DOWN_ROWS];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; r++) a[r] = 0.0f;
        rows_dot<BITS, DOWN_ROWS>(sp + dw, reinterpret_cast<const bf16*>(sp + ds),
                                  reinterpret_cast<const bf16*>(sp + db), row0, hidden, xs + j * plen,
                                  xs_plain + j * plen, inter, group, a);
        const float wj = weights[t * k + j];
#pragma unroll
        for (int r = 0; r < DOWN_ROWS; r++) total[r] += wj * warp_sum(a[r]);
    }
#pragma unroll
    for (int r = 0; r < DOWN_ROWS; r++)
        if (lane == 0 && row0 + r < hidden) out[t * hidden + row0 + r] = total[r];
}

#define EXPERTS(BITS, NAME)                                                                                 \
    extern "C" __global__ void moe_gate_up_##NAME(const float* x, const unsigned* ids,                      \
                                                  const unsigned char* experts, float* act, unsigned hidden, \
                                                  unsigned inter, unsigned k, unsigned long long span,       \
                                                  unsigned long long gw, unsigned long long gs,              \
                                                  unsigned long long gb, unsigned long long uw,              \
                                                  unsigned long long us, unsigned long long ub,              \
                                                  unsigned group) {                                          \
        gate_up<BITS>(x, ids, experts, act, hidden, inter, k, span, gw, gs, gb, uw, us, ub, group);         \
    }                                                                                                       \
    extern "C" __global__ void moe_down_##NAME(const float* act, const unsigned* ids, const float* weights,  \
                                               const unsigned char* experts, float* out, unsigned hidden,    \
                                               unsigned inter, unsigned k, unsigned long long span,          \
                                               unsigned long long dw, unsigned long long ds,                \
                                               unsigned long long db, unsigned group) {                     \
        down_combine<BITS>(act, ids, weights, experts, out, hidden, inter, k, span, dw, ds, db, group);     \
    }

EXPERTS(16, bf16)
EXPERTS(4, q4)
EXPERTS(8, q8)
