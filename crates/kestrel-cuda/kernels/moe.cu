// Mixture of experts.
// router: one warp per token holds up to ROUTER_MAX experts in registers: softmax, then k rounds
// of warp argmax (the lower index wins ties), optional renormalisation.
// Experts, with 16-byte weight loads: gate_up computes act[t * k + j] = silu(gate_e x_t) * (up_e x_t)
// for every (token, slot); down_combine computes out[t] = sum_j weights[t, j] * down_e act[t * k + j],
// slots summed in order, so results do not depend on scheduling. Each expert is one contiguous span of `span` bytes; each matrix sits at
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

// Decode-sized expert kernels read x (or the activations) straight from global memory (it is
// small and stays in L1), so no block-wide staging or barrier delays the weight loads: every warp
// issues its weight loads at once. A quantised value is turned into a float without an
// int-to-float conversion: ((word >> shift) & mask) OR-ed into the mantissa of 2^23, minus 2^23.

// This lane's share of rows row0 .. row0 + R of one matrix (`cols` values per row) times x:
// vectors lane, lane + 32, ... with every load of an iteration issued before the arithmetic.
template <int BITS, int R>
__device__ __forceinline__ void rows_dot_direct(const unsigned char* w, const bf16* scales, const bf16* biases,
                                                unsigned row0, unsigned rows, const float* x, unsigned cols,
                                                unsigned group, float acc[R]) {
    constexpr unsigned VALS = VecFormat<BITS>::VALS;
    const unsigned lane = threadIdx.x % 32;
    const unsigned nvec = cols / VALS, groups = BITS == 16 ? 0 : cols / group;
    const uint4* W = reinterpret_cast<const uint4*>(w);
    for (unsigned u = lane; u < nvec; u += 32) {
        uint4 v[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            if (row0 + r < rows) v[r] = __ldcs(W + (size_t)(row0 + r) * nvec + u);
        const float4* xp = reinterpret_cast<const float4*>(x + u * VALS);
        if constexpr (BITS == 16) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const float4 xq = xp[q / 2];
                const float x0 = q % 2 ? xq.z : xq.x, x1 = q % 2 ? xq.w : xq.y;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (row0 + r >= rows) continue;
                    const unsigned word = q == 0 ? v[r].x : q == 1 ? v[r].y : q == 2 ? v[r].z : v[r].w;
                    acc[r] += __uint_as_float(word << 16) * x0 + __uint_as_float(word & 0xffff0000u) * x1;
                }
            }
        } else {
            constexpr unsigned PER_WORD = 32 / BITS, MASK = (1u << BITS) - 1u;
            float sx = 0.0f, qx[R];
#pragma unroll
            for (int r = 0; r < R; r++) qx[r] = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                float xq[PER_WORD];
#pragma unroll
                for (unsigned j = 0; j < PER_WORD / 4; j++) {
                    const float4 f = xp[q * PER_WORD / 4 + j];
                    xq[4 * j] = f.x;
                    xq[4 * j + 1] = f.y;
                    xq[4 * j + 2] = f.z;
                    xq[4 * j + 3] = f.w;
                }
#pragma unroll
                for (unsigned j = 0; j < PER_WORD; j++) sx += xq[j];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (row0 + r >= rows) continue;
                    const unsigned word = q == 0 ? v[r].x : q == 1 ? v[r].y : q == 2 ? v[r].z : v[r].w;
#pragma unroll
                    for (unsigned j = 0; j < PER_WORD; j++)
                        qx[r] += (__uint_as_float(((word >> (BITS * j)) & MASK) | 0x4B000000u) - 8388608.0f) * xq[j];
                }
            }
            const unsigned g = (u * VALS) / group;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (row0 + r >= rows) continue;
                const size_t gi = (size_t)(row0 + r) * groups + g;
                acc[r] += to_f32(scales[gi]) * qx[r] + to_f32(biases[gi]) * sx;
            }
        }
    }
}

#define GU_ROWS 2   // rows of gate and of up per warp
#define GU_WARPS 4
#define DOWN_WARPS 4
#define DOWN_CHUNK 4  // experts whose loads a warp issues together

// act[tk, r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t), tk = t * k + slot, e = ids[tk].
// Grid (inter / (GU_WARPS * GU_ROWS), tokens * k).
template <int BITS>
__device__ void gate_up(const float* x, const unsigned* ids, const unsigned char* experts, float* act,
                        unsigned hidden, unsigned inter, unsigned k, unsigned long long span,
                        unsigned long long gw, unsigned long long gs, unsigned long long gb, unsigned long long uw,
                        unsigned long long us, unsigned long long ub, unsigned group) {
    const size_t tk = blockIdx.y;
    const unsigned lane = threadIdx.x % 32;
    const unsigned row0 = (blockIdx.x * GU_WARPS + threadIdx.x / 32) * GU_ROWS;
    if (row0 >= inter) return;
    const float* xt = x + (tk / k) * hidden;
    const unsigned char* sp = experts + (size_t)ids[tk] * span;
    float g[GU_ROWS], u[GU_ROWS];
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) g[r] = u[r] = 0.0f;
    rows_dot_direct<BITS, GU_ROWS>(sp + gw, reinterpret_cast<const bf16*>(sp + gs),
                                   reinterpret_cast<const bf16*>(sp + gb), row0, inter, xt, hidden, group, g);
    rows_dot_direct<BITS, GU_ROWS>(sp + uw, reinterpret_cast<const bf16*>(sp + us),
                                   reinterpret_cast<const bf16*>(sp + ub), row0, inter, xt, hidden, group, u);
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
        const float gv = warp_sum(g[r]), uv = warp_sum(u[r]);
        if (lane == 0 && row0 + r < inter) act[tk * inter + row0 + r] = silu(gv) * uv;
    }
}

// out[t, r] = sum_j weights[t, j] * (down_{e_j}[r] . act[t * k + j]), slots summed in order.
// One warp per output row; grid (hidden / DOWN_WARPS, tokens).
template <int BITS>
__device__ void down_combine(const float* act, const unsigned* ids, const float* weights,
                             const unsigned char* experts, float* out, unsigned hidden, unsigned inter, unsigned k,
                             unsigned long long span, unsigned long long dw, unsigned long long ds,
                             unsigned long long db, unsigned group) {
    const size_t t = blockIdx.y;
    const unsigned lane = threadIdx.x % 32;
    const unsigned row = blockIdx.x * DOWN_WARPS + threadIdx.x / 32;
    if (row >= hidden) return;
    float total = 0.0f;
    for (unsigned j0 = 0; j0 < k; j0 += DOWN_CHUNK) {
        float a[DOWN_CHUNK];
#pragma unroll
        for (unsigned c = 0; c < DOWN_CHUNK; c++) {
            a[c] = 0.0f;
            if (j0 + c < k) {
                const unsigned char* sp = experts + (size_t)ids[t * k + j0 + c] * span;
                float one[1] = {0.0f};
                rows_dot_direct<BITS, 1>(sp + dw, reinterpret_cast<const bf16*>(sp + ds),
                                         reinterpret_cast<const bf16*>(sp + db), row, hidden,
                                         act + (t * k + j0 + c) * inter, inter, group, one);
                a[c] = one[0];
            }
        }
#pragma unroll
        for (unsigned c = 0; c < DOWN_CHUNK; c++)
            if (j0 + c < k) total += weights[t * k + j0 + c] * warp_sum(a[c]);
    }
    if (lane == 0) out[t * hidden + row] = total;
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
