// Mixture of experts. router: softmax over experts, top-k (lower index wins ties), optional
// renormalisation; one block per token. Experts: gate/up (one warp per row of the intermediate
// activation, per (token, slot)), down (one warp per output row, per (token, slot)), and a
// combine that sums the slots in order, so results do not depend on scheduling.
// Each expert is one contiguous span of `span` bytes; each matrix sits at the given byte offsets
// (weight, scales, biases; bf16 experts use only the weight offset). BITS is 16 for bf16.
#include "kestrel.cuh"

extern "C" __global__ void router_f32(const float* logits, unsigned* ids, float* weights, unsigned experts,
                                      unsigned k, int normalize) {
    extern __shared__ float probs[];  // [experts]
    __shared__ float scratch[32];
    __shared__ unsigned s_idx[32];
    const size_t t = blockIdx.x;
    const float* l = logits + t * experts;
    float m = -INFINITY;
    for (unsigned e = threadIdx.x; e < experts; e += blockDim.x) m = fmaxf(m, l[e]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (unsigned e = threadIdx.x; e < experts; e += blockDim.x) {
        probs[e] = expf(l[e] - m);
        s += probs[e];
    }
    s = block_sum(s, scratch);
    for (unsigned e = threadIdx.x; e < experts; e += blockDim.x) probs[e] /= s;
    __syncthreads();
    float total = 0.0f;
    for (unsigned j = 0; j < k; j++) {
        // Block argmax over probs, ties to the lower index; taken experts are marked -1.
        float best = -2.0f;
        unsigned bi = 0xffffffffu;
        for (unsigned e = threadIdx.x; e < experts; e += blockDim.x)
            if (probs[e] > best) { best = probs[e]; bi = e; }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
        }
        __syncthreads();
        if (threadIdx.x % 32 == 0) { scratch[threadIdx.x / 32] = best; s_idx[threadIdx.x / 32] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (unsigned w = 1; w < blockDim.x / 32; w++)
                if (scratch[w] > best || (scratch[w] == best && s_idx[w] < bi)) { best = scratch[w]; bi = s_idx[w]; }
            ids[t * k + j] = bi;
            weights[t * k + j] = best;
            total += best;
            probs[bi] = -1.0f;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && normalize)
        for (unsigned j = 0; j < k; j++) weights[t * k + j] /= total;
}

template <int BITS>
__device__ __forceinline__ float lane_dot(const unsigned char* span, unsigned long long w, unsigned long long s,
                                          unsigned long long b, unsigned row, const float* x, unsigned cols,
                                          unsigned group, unsigned lane) {
    if constexpr (BITS == 16) {
        const bf16* m = reinterpret_cast<const bf16*>(span + w) + (size_t)row * cols;
        return lane_dot_dense(m, x, cols, lane);
    } else {
        constexpr unsigned VPW = 32 / BITS;
        const unsigned* words = reinterpret_cast<const unsigned*>(span + w) + (size_t)row * (cols / VPW);
        const bf16* sc = reinterpret_cast<const bf16*>(span + s) + (size_t)row * (cols / group);
        const bf16* bi = reinterpret_cast<const bf16*>(span + b) + (size_t)row * (cols / group);
        return lane_dot_quant<BITS>(words, sc, bi, x, cols, group, lane);
    }
}

// act[tk, r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t]), tk = t * k + slot, e = ids[tk].
template <int BITS>
__device__ void gate_up(const float* x, const unsigned* ids, const unsigned char* experts, float* act,
                        unsigned hidden, unsigned inter, unsigned k, unsigned long long span, unsigned long long gw,
                        unsigned long long gs, unsigned long long gb, unsigned long long uw, unsigned long long us,
                        unsigned long long ub, unsigned group) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const size_t tk = blockIdx.y;
    if (r >= inter) return;
    const unsigned char* sp = experts + ids[tk] * span;
    const float* xt = x + (tk / k) * hidden;
    const float g = warp_sum(lane_dot<BITS>(sp, gw, gs, gb, r, xt, hidden, group, lane));
    const float u = warp_sum(lane_dot<BITS>(sp, uw, us, ub, r, xt, hidden, group, lane));
    if (lane == 0) act[tk * inter + r] = silu(g) * u;
}

// y[tk, r] = down_e[r] . act[tk]
template <int BITS>
__device__ void down(const float* act, const unsigned* ids, const unsigned char* experts, float* y,
                     unsigned hidden, unsigned inter, unsigned long long span, unsigned long long dw,
                     unsigned long long ds, unsigned long long db, unsigned group) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const size_t tk = blockIdx.y;
    if (r >= hidden) return;
    const unsigned char* sp = experts + ids[tk] * span;
    const float d = warp_sum(lane_dot<BITS>(sp, dw, ds, db, r, act + tk * inter, inter, group, lane));
    if (lane == 0) y[tk * hidden + r] = d;
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
    extern "C" __global__ void moe_down_##NAME(const float* act, const unsigned* ids,                       \
                                               const unsigned char* experts, float* y, unsigned hidden,      \
                                               unsigned inter, unsigned long long span,                     \
                                               unsigned long long dw, unsigned long long ds,                \
                                               unsigned long long db, unsigned group) {                     \
        down<BITS>(act, ids, experts, y, hidden, inter, span, dw, ds, db, group);                           \
    }

EXPERTS(16, bf16)
EXPERTS(4, q4)
EXPERTS(8, q8)

// out[t, i] = sum_j weights[t, j] * y[t * k + j, i], slots summed in order.
extern "C" __global__ void moe_combine_f32(const float* y, const float* weights, float* out, unsigned hidden,
                                           unsigned k) {
    const size_t t = blockIdx.y;
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hidden) return;
    float acc = 0.0f;
    for (unsigned j = 0; j < k; j++) acc += weights[t * k + j] * y[(t * k + j) * hidden + i];
    out[t * hidden + i] = acc;
}
