// Element-wise ops: a column part of a split or of a concatenation, the residual add, SwiGLU, the
// sigmoid gate, row copies, conversions between f32 and bf16. One thread per output element
// (convert_f32_bf16: eight). Every kernel starts with pdl_begin() (see pdl.cuh).
#include "kestrel.cuh"

// out[rg, c] = x[rg, offset + c] for rg < rows_groups, c < width; x rows hold `total` columns.
extern "C" __global__ void split_f32(const float* x, float* out, unsigned rows_groups, unsigned total,
                                     unsigned offset, unsigned width) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows_groups * width) return;
    const size_t rg = i / width, c = i % width;
    out[i] = x[rg * total + offset + c];
}

// dst[r, offset + c] = src[r, c] for r < rows, c < width; dst rows hold `total` columns.
extern "C" __global__ void place_f32(const float* src, float* dst, unsigned rows, unsigned total, unsigned offset,
                                     unsigned width) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * width) return;
    const size_t r = i / width, c = i % width;
    dst[r * total + offset + c] = src[i];
}

// out[i] = a[i] + b[i]: the residual add.
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, unsigned n) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* out, unsigned n) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(gate[i]) * up[i];
}

// out[r, c] = x[r, c] * sigmoid(gate[r, c]) (gate_cols == cols) or sigmoid(gate[r]) (gate_cols == 1).
extern "C" __global__ void sigmoid_gate_f32(const float* x, const float* gate, float* out, unsigned rows,
                                            unsigned cols, unsigned gate_cols) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * cols) return;
    const float g = gate_cols == 1 ? gate[i / cols] : gate[i];
    out[i] = x[i] * sigmoid(g);
}

extern "C" __global__ void copy_f32(const float* src, float* dst, unsigned n) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// out[i] = float(x[i]) (exact): bf16 activations for a product that reads f32.
extern "C" __global__ void convert_bf16_f32(const bf16* x, float* out, unsigned n) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __bfloat162float(x[i]);
}

// out[i] = bf16(x[i]), round to nearest even: activations for a bf16 tensor-core product.
// Eight values per thread (two 16-byte loads, one 16-byte store); n is a multiple of 8.
extern "C" __global__ void convert_f32_bf16(const float* x, bf16* out, unsigned n) {
    pdl_begin();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i * 8 >= n) return;
    const float4 a = reinterpret_cast<const float4*>(x)[2 * i], b = reinterpret_cast<const float4*>(x)[2 * i + 1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint4 packed;
    unsigned* words = reinterpret_cast<unsigned*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const bf16 lo = from_f32<bf16>(v[2 * j]), hi = from_f32<bf16>(v[2 * j + 1]);
        words[j] = (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
    }
    reinterpret_cast<uint4*>(out)[i] = packed;
}
