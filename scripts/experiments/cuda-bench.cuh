// cuda-bench.cuh: what the standalone measurement scripts (read-ceiling.cu, bulk-sweep.cu,
// decode-ceiling.cu) share: error checks, and timing as `kestrel bench ops` times an op (CUDA
// events around the work on a stream after 256 MB of other memory was read, so L2 holds none of
// the work's bytes; the median of the runs after a warm-up). The host half is left out under
// NVRTC, so `scripts/gpu/nvrtc-check.py --include scripts/experiments` can check a script's
// kernels without a GPU.
//
// Written on 2026-11-22 at commit 7d21c14, when the three scripts were re-run on one NVIDIA H200
// with it. It measures nothing itself; the scripts' results are in docs/perf-log.md ("What the
// decode ops' dependencies cost before any arithmetic" and the sections each script names).
#pragma once

// Programmatic dependent launch: wait for the kernel before (its writes visible), let the next
// one start.
__device__ __forceinline__ void wait_prev() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void let_next() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// The four words of a vector as small positive floats, summed (what a skeleton does with bytes).
__device__ __forceinline__ float sum4(uint4 v) {
    return __uint_as_float(v.x & 0x3fffffffu) + __uint_as_float(v.y & 0x3fffffffu) +
           __uint_as_float(v.z & 0x3fffffffu) + __uint_as_float(v.w & 0x3fffffffu);
}

// Reads n16 16-byte vectors (one word of each kept, so the reads are not optimised away).
__global__ void flush_l2(const uint4* p, size_t n16, float* out) {
    unsigned s = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x)
        s += p[i].x;
    if (s == 12345u) out[0] = (float)s;
}

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e = (x);                                                                    \
        if (e != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

struct ColdTimer {
    static constexpr size_t FLUSH = 256 << 20;
    cudaStream_t st;
    cudaEvent_t e0, e1;
    uint4* fl;
    float* sink;
    int sms;

    ColdTimer() {
        cudaDeviceProp prop;
        CK(cudaGetDeviceProperties(&prop, 0));
        sms = prop.multiProcessorCount;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaMalloc(&fl, FLUSH));
        CK(cudaMemset(fl, 1, FLUSH));
        CK(cudaMalloc(&sink, 1 << 16));
    }

    // Median µs of what `enqueue` puts on `st`, divided by `per`: `warm` runs, then `runs` timed.
    // Work queued before on other streams (the scripts fill their buffers on the default one)
    // finishes first: `st` does not wait for it by itself.
    template <typename F>
    double median_us(F enqueue, int per = 1, int warm = 10, int runs = 50) {
        CK(cudaDeviceSynchronize());
        std::vector<float> ts;
        for (int r = 0; r < warm + runs; r++) {
            flush_l2<<<4 * sms, 512, 0, st>>>(fl, FLUSH / 16, sink);
            CK(cudaEventRecord(e0, st));
            enqueue();
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= warm) ts.push_back(ms * 1000.0f / per);
        }
        CK(cudaGetLastError());
        std::sort(ts.begin(), ts.end());
        return ts[ts.size() / 2];
    }

    // The same for a graph of what `capture` puts on `st`, replayed.
    template <typename F>
    double graph_median_us(F capture, int per = 1, int warm = 10, int runs = 50) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        capture();
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        const double us = median_us([&] { CK(cudaGraphLaunch(ge, st)); }, per, warm, runs);
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
        return us;
    }
};

// Launches `kernel` on `st`, with programmatic stream serialisation when `pdl` (the kernel may
// start while the one before it finishes, and waits for it with griddepcontrol.wait).
template <typename K, typename... A>
void launch_pdl(cudaStream_t st, bool pdl, dim3 grid, dim3 block, unsigned smem, K kernel, A... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
#endif
