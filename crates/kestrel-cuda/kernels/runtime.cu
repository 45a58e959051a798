// Runtime kernels: small element-wise kernels used by `kestrel doctor`, the runtime tests and the
// runtime benchmark. Every kernel takes its element count last and guards its tail, so sizes
// need not be multiples of the block.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void fill_f32(float* out, float value, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}

// y[i] = a * x[i] + y[i]
extern "C" __global__ void axpy_f32(const float* x, float* y, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaf(a, x[i], y[i]);
}

// out[i] = a[i] + b[i]
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// out[i] = s * x[i]
extern "C" __global__ void scale_f32(const float* x, float* out, float s, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = s * x[i];
}

// x[i] += 1; a chain of these measures launch cost, each depending on the last.
extern "C" __global__ void increment_u32(unsigned int* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1u;
}

// Rounds through bf16 and back: out[i] = float(bf16(x[i])). Exercises the bf16 header.
extern "C" __global__ void round_bf16_f32(const float* x, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __bfloat162float(__float2bfloat16(x[i]));
}

// Rounds through f16 and back. Exercises the fp16 header.
extern "C" __global__ void round_f16_f32(const float* x, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __half2float(__float2half(x[i]));
}

static __device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One thread busy-waits for `ns` nanoseconds of wall time, then writes out[0] = value.
// Launched with one block, it occupies one multiprocessor and leaves the rest free, which makes
// concurrency between independent graph branches visible in wall time.
extern "C" __global__ void spin_f32(float* out, float value, unsigned long long ns) {
    if (threadIdx.x != 0) return;
    unsigned long long start = global_ns();
    while (global_ns() - start < ns) {
    }
    out[0] = value;
}

// Writes through an arbitrary address: with an unmapped address this raises an illegal-address
// fault, which the runtime tests use to check how sticky device errors are reported.
extern "C" __global__ void poke_u32(unsigned long long address, unsigned int value) {
    *reinterpret_cast<volatile unsigned int*>(address) = value;
}
