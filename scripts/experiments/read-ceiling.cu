// read-ceiling.cu: how fast one kernel can read a decode step's bytes (the 16.8 MB of an 8k KV
// cache, the 21.2 MB of eight experts) on this GPU, by four ways of loading them, timed alone and
// four to a graph with programmatic launches, each launch over its own copy of the bytes.
//
// Measured on one NVIDIA H200 on 2026-11-21 at commit 92687df, re-run on 2026-11-22 at 7d21c14
// (which moved its timing into cuda-bench.cuh) with the same figures. Results: docs/perf-log.md,
// "Decode attention: the cache streams before the wait, the merge spread over the blocks" (the
// table "What one kernel can reach at these sizes"), and the re-run in "What the decode ops'
// dependencies cost before any arithmetic".
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o read-ceiling scripts/experiments/read-ceiling.cu
//   ./read-ceiling [MB ...]          (default 16.8 21.2)
//
// Ways (the grid is one wave; every block reads a contiguous share, half from the "K" half of the
// bytes, half from the "V" half, as decode attention splits a cache):
//   plain     4 blocks of 512 threads per SM, four 16-byte loads in flight per thread;
//   cp.async  one block of 256 threads per SM, each warp's share copied with 16-byte cp.async;
//   bulk      one block per SM whose first thread asks for its whole share with 8 bulk copies
//             (the TMA unit) on 4 mbarriers; the 4 warps each wait for one and read it;
//   bulk rows the same with one bulk copy per 256-byte row into rows padded to 272 bytes (what
//             conflict-free tensor-core reads of a cache need), issued by every lane.
// Each kernel sums what it read and stores one float per block, so nothing is optimised away.
// "early" variants issue the reads before griddepcontrol.wait (as a kernel may for bytes no
// earlier kernel of the graph writes); the others wait first. Timing: CUDA events around a graph
// replay after 256 MB of other memory was read (L2 flushed), median of 50 replays.
#include "cuda-bench.cuh"

__device__ __forceinline__ unsigned saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// bytes: total; a block reads [b * share, (b + 1) * share) of each half.
__global__ void __launch_bounds__(512) plain(const uint4* src, size_t n16, float* out, int early) {
    if (!early) wait_prev();
    let_next();
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    float s = 0.0f;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
              d = __ldcs(src + i + 3 * stride);
        s += sum4(a) + sum4(b) + sum4(c) + sum4(d);
    }
    for (; i < n16; i += stride) s += sum4(__ldcs(src + i));
    if (early) wait_prev();
    if (s == 1.2345f) out[blockIdx.x] = s;
}

__global__ void __launch_bounds__(256) cpasync(const uint4* src, size_t half16, unsigned share16, float* out,
                                               int early) {
    extern __shared__ uint4 sm[];
    if (!early) wait_prev();
    let_next();
    const uint4* k = src + (size_t)blockIdx.x * share16;
    const uint4* v = src + half16 + (size_t)blockIdx.x * share16;
    for (unsigned i = threadIdx.x; i < share16; i += blockDim.x) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr(sm + i)), "l"(k + i) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr(sm + share16 + i)), "l"(v + i)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    if (early) wait_prev();
    float s = 0.0f;
    for (unsigned i = threadIdx.x; i < 2 * share16; i += blockDim.x) s += sum4(sm[i]);
    if (s == 1.2345f) out[blockIdx.x] = s;
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     saddr(dst)),
                 "l"(src), "r"(bytes), "r"(saddr(bar))
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "W_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n\t"
        "@!done bra W_%=;\n}" ::"r"(saddr(bar))
        : "memory");
}

// 128 threads; share16 a multiple of 4 * 16 (each of the 4 pieces of K and of V whole 256-byte rows).
__global__ void __launch_bounds__(128) bulk_chunk(const uint4* src, size_t half16, unsigned share16, float* out,
                                                  int early) {
    extern __shared__ uint4 sm[];
    __shared__ __align__(8) unsigned long long bars[4];
    const unsigned piece = share16 / 4, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (!early) wait_prev();
    let_next();
    if (threadIdx.x == 0) {
        for (int p = 0; p < 4; p++) mbar_init(&bars[p]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        const uint4* k = src + (size_t)blockIdx.x * share16;
        const uint4* v = src + half16 + (size_t)blockIdx.x * share16;
        for (int p = 0; p < 4; p++) {
            mbar_expect(&bars[p], 2 * piece * 16);
            bulk(sm + 2 * p * piece, k + p * piece, piece * 16, &bars[p]);
            bulk(sm + (2 * p + 1) * piece, v + p * piece, piece * 16, &bars[p]);
        }
    }
    __syncthreads();
    mbar_wait(&bars[warp]);
    if (early) wait_prev();
    float s = 0.0f;
    for (unsigned i = lane; i < 2 * piece; i += 32) s += sum4(sm[2 * warp * piece + i]);
    if (s == 1.2345f) out[blockIdx.x] = s;
}

// 128 threads; rows of 256 bytes (16 uint4) land 17 uint4 apart.
__global__ void __launch_bounds__(128) bulk_rows(const uint4* src, size_t half16, unsigned share16, float* out,
                                                 int early) {
    extern __shared__ uint4 sm[];
    __shared__ __align__(8) unsigned long long bars[4];
    const unsigned rows = share16 / 16, prow = rows / 4, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (!early) wait_prev();
    let_next();
    if (threadIdx.x < 4) mbar_init(&bars[threadIdx.x]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    // Warp w asks for rows [w * prow, (w + 1) * prow) of K and of V, on its own barrier.
    if (lane == 0) mbar_expect(&bars[warp], 2 * prow * 256);
    __syncwarp();
    const uint4* k = src + (size_t)blockIdx.x * share16;
    const uint4* v = src + half16 + (size_t)blockIdx.x * share16;
    for (unsigned r = warp * prow + lane; r < (warp + 1) * prow; r += 32) {
        bulk(sm + r * 17, k + r * 16, 256, &bars[warp]);
        bulk(sm + (rows + r) * 17, v + r * 16, 256, &bars[warp]);
    }
    mbar_wait(&bars[warp]);
    if (early) wait_prev();
    float s = 0.0f;
    for (unsigned i = lane; i < prow * 16; i += 32) {
        const unsigned r = warp * prow + i / 16, c = i % 16;
        s += sum4(sm[r * 17 + c]) + sum4(sm[(rows + r) * 17 + c]);
    }
    if (s == 1.2345f) out[blockIdx.x] = s;
}

int main(int argc, char** argv) {
    std::vector<double> sizes;
    for (int i = 1; i < argc; i++) sizes.push_back(atof(argv[i]));
    if (sizes.empty()) sizes = {16.8, 21.2};
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    ColdTimer t;
    const int sms = t.sms;
    printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    uint4* bufs[4];
    float* out;
    CK(cudaMalloc(&out, 1 << 20));
    CK(cudaFuncSetAttribute(cpasync, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
    CK(cudaFuncSetAttribute(bulk_chunk, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
    CK(cudaFuncSetAttribute(bulk_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));

    for (double mb : sizes) {
        // Blocks: one per SM for the shared-memory ways, rounded down to a multiple of 4 (as
        // decode attention splits 4 KV heads); shares whole 16-row multiples.
        const int blocks = sms / 4 * 4;
        const size_t want = (size_t)(mb * 1e6);
        const unsigned share16 = (unsigned)((want / 2 / 16 / blocks + 63) / 64 * 64);
        const size_t half16 = (size_t)share16 * blocks, n16 = 2 * half16, bytes = n16 * 16;
        for (auto& b : bufs) {
            CK(cudaMalloc(&b, bytes));
            CK(cudaMemset(b, 2, bytes));
        }
        printf("\n%.1f MB requested: %zu bytes, %d blocks, %u bytes per block (floor %.2f us at 4.26 TB/s)\n", mb,
               bytes, blocks, share16 * 32, bytes / 4.26e6);
        const unsigned smem = share16 * 32, smem_rows = (share16 / 16) * 2 * 17 * 16;
        const char* names[] = {"plain", "cp.async", "bulk", "bulk rows"};
        for (int way = 0; way < 4; way++) {
            if ((way == 1 || way == 2) && smem > (200u << 10)) continue;
            if (way == 3 && smem_rows > (200u << 10)) continue;
            for (int early = 0; early < 2; early++) {
                for (int chain : {1, 4}) {
                    const double us = t.graph_median_us(
                        [&] {
                            for (int c = 0; c < chain; c++) {
                                const uint4* src = bufs[c];
                                if (way == 0)
                                    launch_pdl(t.st, c > 0, dim3(4 * sms), dim3(512), 0, plain, src, n16, out, early);
                                else if (way == 1)
                                    launch_pdl(t.st, c > 0, dim3(blocks), dim3(256), smem, cpasync, src, half16,
                                               share16, out, early);
                                else if (way == 2)
                                    launch_pdl(t.st, c > 0, dim3(blocks), dim3(128), smem, bulk_chunk, src, half16,
                                               share16, out, early);
                                else
                                    launch_pdl(t.st, c > 0, dim3(blocks), dim3(128), smem_rows, bulk_rows, src,
                                               half16, share16, out, early);
                            }
                        },
                        chain);
                    printf("%-10s %-5s %s: %7.2f us per read, %5.0f GB/s, %4.1f%% of 4.26 TB/s\n", names[way],
                           early ? "early" : "wait", chain == 1 ? "alone  " : "4 chain", us, bytes / us / 1e3,
                           bytes / us / 1e3 / 4260 * 100);
                }
            }
        }
        for (auto& b : bufs) CK(cudaFree(b));
    }
    return 0;
}
