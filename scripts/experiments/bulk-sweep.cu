// bulk-sweep.cu: how fast the bulk copy engine (cp.async.bulk, the TMA unit) moves a decode
// step's bytes into shared memory, by copy size, copies per block and mbarriers: one block per
// SM, each block's share copied as copies of S bytes, all issued at once by the lanes of one
// warp (copy i completing on barrier i % n), then waited for by every thread. "spread": a
// block's copies come from 8 regions 64 MB apart (as one-token MoE down reads 16 rows of each
// of 8 experts); "contiguous": from one range. "plain": the same bytes by 16-byte loads.
// Timing: CUDA events around one launch after 256 MB of other memory was read (L2 flushed),
// median of 30 launches.
//
// Measured on one NVIDIA H200 and recorded at commit 404de41 (2026-11-22; the section is dated
// 2026-11-21), re-run on 2026-11-22 at 7d21c14 with the same figures. Results:
// docs/perf-log.md, "Tried and not kept: MoE decode's experts copied into shared memory by the
// bulk copy engine" (and the re-run in "What the decode ops' dependencies cost before any
// arithmetic").
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o bulk-sweep scripts/experiments/bulk-sweep.cu
//   ./bulk-sweep
#include "cuda-bench.cuh"

__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Block b copies `copies` pieces of `piece` bytes; piece i of block b starts at
// base(b, i) = spread ? (i % 8) * region + (b * copies / 8 + i / 8) * piece : (b * copies + i) * piece.
__global__ void __launch_bounds__(128) sweep(const unsigned char* src, unsigned piece, unsigned copies, int spread,
                                             size_t region, unsigned nbar, float* out) {
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) unsigned long long bars[32];
    if (threadIdx.x == 0) {
        for (unsigned b = 0; b < nbar; b++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&bars[b])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        // Copy i completes on barrier i % nbar.
        if (threadIdx.x < nbar)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&bars[threadIdx.x])),
                         "r"(piece * ((copies - threadIdx.x + nbar - 1) / nbar))
                         : "memory");
        for (unsigned i = threadIdx.x; i < copies; i += 32) {
            const size_t off = spread ? (i % 8) * region + ((size_t)blockIdx.x * (copies / 8) + i / 8) * piece
                                      : ((size_t)blockIdx.x * copies + i) * piece;
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    saddr(sm + (size_t)i * piece)),
                "l"(src + off), "r"(piece), "r"(saddr(&bars[i % nbar]))
                : "memory");
        }
    }
    for (unsigned b = 0; b < nbar; b++) {
        unsigned done = 0;
        while (!done)
            asm volatile(
                "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                : "=r"(done)
                : "r"(saddr(&bars[b]))
                : "memory");
    }
    // Nothing more after the wait, so the time is the copies' (one word kept, so the launch does
    // something observable).
    if (threadIdx.x == 0 && reinterpret_cast<const unsigned*>(sm)[0] == 12345u) out[blockIdx.x] = 1.0f;
}

// The reference: the same bytes by plain 16-byte loads, 4 blocks of 512 threads per SM, four
// loads in flight per thread.
__global__ void __launch_bounds__(512) plain(const uint4* src, size_t n16, float* out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned s = 0;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
                    d = __ldcs(src + i + 3 * stride);
        s += a.x + b.y + c.z + d.w;
    }
    for (; i < n16; i += stride) s += __ldcs(src + i).x;
    if (s == 12345u) out[blockIdx.x] = s;
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    ColdTimer t;
    const int sms = t.sms;
    printf("%s, %d SMs\n", prop.name, sms);
    const size_t src_bytes = 512 << 20;
    unsigned char* src;
    float* out;
    CK(cudaMalloc(&src, src_bytes));
    CK(cudaMemset(src, 2, src_bytes));
    CK(cudaMalloc(&out, 1 << 16));
    CK(cudaFuncSetAttribute(sweep, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
    printf("%-11s %8s %7s %5s %10s %9s %8s %7s\n", "layout", "piece B", "copies", "bars", "per block", "total MB", "us", "TB/s");
    for (unsigned per_block : {48u << 10, 96u << 10, 160u << 10}) {
        {
            const size_t total = (size_t)per_block * sms;
            const double us = t.median_us(
                [&] { plain<<<4 * sms, 512, 0, t.st>>>(reinterpret_cast<const uint4*>(src), total / 16, out); }, 1, 5,
                30);
            printf("%-11s %8s %7s %5s %10u %9.2f %8.2f %7.2f\n", "plain", "-", "-", "-", per_block, total / 1e6, us,
                   total / us / 1e6);
        }
        for (unsigned piece : {2048u, 6144u, 16384u, 163840u}) {
            if (piece > per_block || per_block % piece) continue;
            const unsigned copies = per_block / piece;
            for (unsigned nbar : {1u, 2u, 4u, 8u, 16u, 32u})
            for (int spread = 0; spread < 2; spread++) {
                if ((spread && copies % 8) || nbar > copies || (spread && nbar != 8)) continue;
                const size_t total = (size_t)per_block * sms, region = 64ull << 20;
                const double us = t.median_us(
                    [&] { sweep<<<sms, 128, per_block, t.st>>>(src, piece, copies, spread, region, nbar, out); }, 1,
                    5, 30);
                printf("%-11s %8u %7u %5u %10u %9.2f %8.2f %7.2f\n", spread ? "spread" : "contiguous", piece, copies,
                       nbar, per_block, total / 1e6, us, total / us / 1e6);
            }
        }
    }
    return 0;
}
