// RMS norms: standard (w), zero-centred (1 + w), fused residual add, gated (silu(z)).
// One block per row; kernels are named by the weight dtype.
#include "kestrel.cuh"

template <typename W>
__device__ void norm_row(const float* x, const W* w, float* out, unsigned dim, float eps, int zero_centered,
                         float* scratch) {
    float ss = 0.0f;
    for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) {
        const float s = zero_centered ? 1.0f + to_f32(w[i]) : to_f32(w[i]);
        out[i] = x[i] * inv * s;
    }
}

#define NORMS(W, NAME)                                                                                       \
    extern "C" __global__ void rms_norm_##NAME(const float* x, const W* w, float* out, unsigned dim, float eps, \
                                               int zero_centered) {                                        \
        pdl_begin();                                                                                         \
        __shared__ float scratch[32];                                                                        \
        const size_t r = blockIdx.x;                                                                         \
        norm_row(x + r * dim, w, out + r * dim, dim, eps, zero_centered, scratch);                           \
    }                                                                                                        \
    extern "C" __global__ void add_rms_norm_##NAME(float* residual, const float* x, const W* w, float* out,   \
                                                   unsigned dim, float eps, int zero_centered) {             \
        pdl_begin();                                                                                         \
        __shared__ float scratch[32];                                                                        \
        const size_t r = blockIdx.x;                                                                         \
        float* res = residual + r * dim;                                                                     \
        for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) res[i] += x[r * dim + i];                   \
        /* each thread reads back only the elements it wrote before the reduction */                        \
        norm_row(res, w, out + r * dim, dim, eps, zero_centered, scratch);                                   \
    }                                                                                                        \
    extern "C" __global__ void gated_rms_norm_##NAME(const float* x, const float* z, const W* w, float* out,  \
                                                     unsigned dim, float eps) {                              \
        pdl_begin();                                                                                         \
        __shared__ float scratch[32];                                                                        \
        const size_t r = blockIdx.x;                                                                         \
        norm_row(x + r * dim, w, out + r * dim, dim, eps, 0, scratch);                                       \
        for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) out[r * dim + i] *= silu(z[r * dim + i]);   \
    }

NORMS(float, f32)
NORMS(bf16, bf16)
NORMS(f16, f16)
