// RMS norms: standard (w), zero-centred (1 + w), fused residual add, gated (silu(z)).
// One block per row; kernels are named by the weight dtype, and `_to_bf16` for outputs stored as
// bf16 (rounded to nearest even) for projections that read bf16. `*_vec_*`: rows of a multiple
// of 4 values that fit in a block's registers, in one pass: the weights are loaded before the
// programmatic wait, and the row (with the residual) in one round trip to memory.
#include "kestrel.cuh"

template <typename W, typename O>
__device__ void norm_row(const float* x, const W* w, O* out, unsigned dim, float eps, int zero_centered,
                         float* scratch) {
    float ss = 0.0f;
    for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) {
        const float s = zero_centered ? 1.0f + to_f32(w[i]) : to_f32(w[i]);
        out[i] = from_f32<O>(x[i] * inv * s);
    }
}

// The one-pass forms for rows of dim = 4 * n, n <= VEC_NORM_MAX * blockDim.x: each thread holds
// its float4s in registers, loaded together (the weights before the programmatic-launch wait),
// so a row costs one round trip to memory instead of one per loop step. With `residual`, the
// row is residual + x, written back to `residual` first. VEC_NORM_MAX comes from the host
// (`ops/norm.rs`) as a -D definition.
#ifndef VEC_NORM_MAX
#error "norm.cu is compiled with VEC_NORM_MAX from ops/norm.rs"
#endif
template <typename W, typename O>
__device__ void norm_row_vec(float* residual, const float* x, const W* w, O* out, unsigned dim, float eps,
                             int zero_centered, float* scratch) {
    const unsigned n = dim / 4, t = threadIdx.x;
    float s[VEC_NORM_MAX][4];
#pragma unroll
    for (int j = 0; j < VEC_NORM_MAX; j++) {
        const unsigned i = t + j * blockDim.x;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const float v = i < n ? to_f32(w[4 * i + c]) : 0.0f;
            s[j][c] = zero_centered ? 1.0f + v : v;
        }
    }
    pdl_wait();
    pdl_trigger();
    const size_t r = blockIdx.x;
    const float4* xr = reinterpret_cast<const float4*>(x + r * dim);
    float4 a[VEC_NORM_MAX];
#pragma unroll
    for (int j = 0; j < VEC_NORM_MAX; j++) {
        const unsigned i = t + j * blockDim.x;
        a[j] = i < n ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (residual) {
        float4* rr = reinterpret_cast<float4*>(residual + r * dim);
        float4 b[VEC_NORM_MAX];
#pragma unroll
        for (int j = 0; j < VEC_NORM_MAX; j++) {
            const unsigned i = t + j * blockDim.x;
            b[j] = i < n ? rr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < VEC_NORM_MAX; j++) {
            const unsigned i = t + j * blockDim.x;
            a[j] = make_float4(b[j].x + a[j].x, b[j].y + a[j].y, b[j].z + a[j].z, b[j].w + a[j].w);
            if (i < n) rr[i] = a[j];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VEC_NORM_MAX; j++) ss += a[j].x * a[j].x + a[j].y * a[j].y + a[j].z * a[j].z + a[j].w * a[j].w;
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int j = 0; j < VEC_NORM_MAX; j++) {
        const unsigned i = t + j * blockDim.x;
        if (i >= n) continue;
        const float4 v = make_float4(a[j].x * inv * s[j][0], a[j].y * inv * s[j][1], a[j].z * inv * s[j][2],
                                     a[j].w * inv * s[j][3]);
        if constexpr (sizeof(O) == 4)
            reinterpret_cast<float4*>(out + r * dim)[i] = v;
        else
            reinterpret_cast<uint2*>(out + r * dim)[i] = make_uint2(pack2<O>(v.x, v.y), pack2<O>(v.z, v.w));
    }
}

// rms_norm_* and add_rms_norm_* for weights W, output O, names ending in NAME.
#define NORMS(W, O, NAME)                                                                                    \
    extern "C" __global__ void rms_norm_##NAME(const float* x, const W* w, O* out, unsigned dim, float eps,    \
                                               int zero_centered) {                                        \
        pdl_begin();                                                                                         \
        __shared__ float scratch[32];                                                                        \
        const size_t r = blockIdx.x;                                                                         \
        norm_row(x + r * dim, w, out + r * dim, dim, eps, zero_centered, scratch);                           \
    }                                                                                                        \
    extern "C" __global__ void add_rms_norm_##NAME(float* residual, const float* x, const W* w, O* out,       \
                                                   unsigned dim, float eps, int zero_centered) {             \
        pdl_begin();                                                                                         \
        __shared__ float scratch[32];                                                                        \
        const size_t r = blockIdx.x;                                                                         \
        float* res = residual + r * dim;                                                                     \
        for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) res[i] += x[r * dim + i];                   \
        /* each thread reads back only the elements it wrote before the reduction */                        \
        norm_row(res, w, out + r * dim, dim, eps, zero_centered, scratch);                                   \
    }                                                                                                        \
    extern "C" __global__ void rms_norm_vec_##NAME(const float* x, const W* w, O* out, unsigned dim,          \
                                                   float eps, int zero_centered) {                           \
        __shared__ float scratch[32];                                                                        \
        norm_row_vec(nullptr, x, w, out, dim, eps, zero_centered, scratch);                                  \
    }                                                                                                        \
    extern "C" __global__ void add_rms_norm_vec_##NAME(float* residual, const float* x, const W* w, O* out,   \
                                                       unsigned dim, float eps, int zero_centered) {         \
        __shared__ float scratch[32];                                                                        \
        norm_row_vec(residual, x, w, out, dim, eps, zero_centered, scratch);                                 \
    }

#define GATED_NORM(W, NAME)                                                                                  \
    extern "C" __global__ void gated_rms_norm_##NAME(const float* x, const float* z, const W* w, float* out,  \
                                                     unsigned dim, float eps) {                              \
        pdl_begin();                                                                                         \
        __shared__ float scratch[32];                                                                        \
        const size_t r = blockIdx.x;                                                                         \
        norm_row(x + r * dim, w, out + r * dim, dim, eps, 0, scratch);                                       \
        for (unsigned i = threadIdx.x; i < dim; i += blockDim.x) out[r * dim + i] *= silu(z[r * dim + i]);   \
    }

NORMS(float, float, f32)
NORMS(bf16, float, bf16)
NORMS(f16, float, f16)
NORMS(float, bf16, f32_to_bf16)
NORMS(bf16, bf16, bf16_to_bf16)
NORMS(f16, bf16, f16_to_bf16)
GATED_NORM(float, f32)
GATED_NORM(bf16, bf16)
GATED_NORM(f16, f16)
