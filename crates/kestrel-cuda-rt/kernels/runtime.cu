// Runtime kernels: small element-wise kernels used by `kestrel doctor`, the runtime tests and the
// runtime benchmark. Every kernel takes its element count last and guards its tail, so sizes
// need not be multiples of the block.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "pdl.cuh"

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

// Lets the next kernel launch at once (programmatic launch), then thread 0 of each block spins
// for `ns` nanoseconds before the block writes out[i] = value: a slow producer.
extern "C" __global__ void trigger_spin_fill_f32(float* out, float value, unsigned long long ns, unsigned int n) {
    pdl_trigger();
    if (threadIdx.x == 0) {
        unsigned long long start = global_ns();
        while (global_ns() - start < ns) {
        }
    }
    __syncthreads();
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}

// out[i] = x[i] + 1 after the programmatic wait: a consumer that keeps the contract.
extern "C" __global__ void pdl_add_one_f32(const float* x, float* out, unsigned int n) {
    pdl_wait();
    pdl_trigger();
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + 1.0f;
}

// The same without the wait: breaks the contract on purpose, so a test can see that a
// programmatic edge really lets a kernel start before its predecessor has finished.
extern "C" __global__ void early_add_one_f32(const float* x, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + 1.0f;
}

// Reads n 16-byte vectors and writes nothing (unless their XOR is an unlikely value, which keeps
// the loads): fills L2 with clean lines, so benchmarks can start from a cold cache without the
// write-backs a memset would leave behind.
// Four loads of a thread are in flight at once.
extern "C" __global__ void read_all_u32(const uint4* x, unsigned* sink, unsigned long long n) {
    unsigned acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = x[i], b = x[i + stride], c = x[i + 2 * stride], d = x[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 v = x[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Writes through an arbitrary address: with an unmapped address this raises an illegal-address
// fault, which the runtime tests use to check how sticky device errors are reported.
extern "C" __global__ void poke_u32(unsigned long long address, unsigned int value) {
    *reinterpret_cast<volatile unsigned int*>(address) = value;
}
