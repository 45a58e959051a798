// Timeline of one-token MoE decode at Qwen3-30B-A3B's shapes (route_q8_4 -> moe_gate_up_q4 ->
// moe_down_q4, four layers, each with its own weights) as one graph with programmatic launches,
// L2 flushed before each replay: %globaltimer stamps of thread 0 of every block, placed in the
// real kernels by stamp.py. Build and run with run.sh beside it (nvcc on the GPU machine).
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <string>
__device__ unsigned long long* g_rec[3];
__device__ unsigned g_count[3];
#define TL_BEGIN(kind) unsigned long long* tl_rec = nullptr; if (threadIdx.x == 0) { \
    unsigned s_ = atomicAdd(&g_count[kind], 1u); tl_rec = g_rec[kind] + (size_t)s_ * 8; unsigned sm_; \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_)); tl_rec[7] = sm_; } STAMP(0)
#define STAMP(k) do { if (threadIdx.x == 0) { unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_) :: "memory"); \
    tl_rec[k] = t_; } } while (0)
#include "moe_stamped.cu"
__global__ void flush(const uint4* p, size_t n, float* o) { float s = 0; for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) s += __uint_as_float(p[i].x & 0x3fffffff); if (s == 1.5f) o[0] = s; }
__global__ void fill(unsigned* p, size_t n, unsigned seed) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { unsigned x = (unsigned)i * 2654435761u ^ seed; x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; p[i] = x & 0x3C3F3C3Fu; } }
__global__ void fillf(float* p, size_t n, unsigned seed) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { unsigned x = (unsigned)i * 2654435761u ^ seed; x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; p[i] = (x % 2001) / 1000.0f - 1.0f; } }
__global__ void probe(unsigned long long* o) { unsigned long long prev, t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(prev)); unsigned n = 0;
    for (int i = 0; i < 200000 && n < 16; i++) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); if (t != prev) { o[n++] = t - prev; prev = t; } } }
#define CK(x) do { cudaError_t e = (x); if (e) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
template <typename... A, typename... B>
cudaError_t launch(void (*f)(A...), dim3 g, dim3 b, unsigned smem, cudaStream_t s, B... args) {
    cudaLaunchConfig_t c = {}; c.gridDim = g; c.blockDim = b; c.dynamicSmemBytes = smem; c.stream = s;
    cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
    c.attrs = at; c.numAttrs = 1; return cudaLaunchKernelEx(&c, f, args...);
}
int main(int argc, char** argv) {
    const unsigned H = 2048, I = 768, E = 128, K = 8, G = 64, L = 4;
    const unsigned long long gw = 0, gs = 786432, gb = 835584, uw = 884736, us = gs + uw, ub = gb + uw;
    const unsigned long long dw = 1769472, ds = 2555904, db = 2605056, span = 2654208;
    unsigned char* ex[L]; unsigned *rw[L]; bf16 *rs[L], *rb[L]; float *x[L], *logits, *wts, *out[L], *ad, *as16; unsigned* ids[L]; int* aq;
    for (unsigned l = 0; l < L; l++) {
        CK(cudaMalloc(&ex[l], span * E)); fill<<<1024, 256>>>((unsigned*)ex[l], span * E / 4, 17 + l);
        CK(cudaMalloc(&rw[l], H * E)); fill<<<64, 256>>>(rw[l], H * E / 4, 99 + l);
        CK(cudaMalloc(&rs[l], E * H / G * 2)); fill<<<64, 256>>>((unsigned*)rs[l], E * H / G / 2, 5 + l);
        CK(cudaMalloc(&rb[l], E * H / G * 2)); fill<<<64, 256>>>((unsigned*)rb[l], E * H / G / 2, 7 + l);
        CK(cudaMalloc(&x[l], H * 4)); fillf<<<8, 256>>>(x[l], H, 3 + l);
        CK(cudaMalloc(&out[l], H * 4)); CK(cudaMalloc(&ids[l], K * 4));
    }
    CK(cudaMalloc(&logits, E * 4)); CK(cudaMalloc(&wts, K * 4));
    CK(cudaMalloc(&aq, K * I)); CK(cudaMalloc(&ad, K * I / 32 * 4)); CK(cudaMalloc(&as16, K * I / 16 * 4));
    const unsigned nb[3] = {8, (I / 32) * K, H / 4};
    unsigned long long* rec[3];
    for (int k = 0; k < 3; k++) { CK(cudaMalloc(&rec[k], (size_t)nb[k] * L * 64)); CK(cudaMemcpyToSymbol(g_rec, &rec[k], 8, k * 8)); }
    void* fl; CK(cudaMalloc(&fl, 256 << 20)); CK(cudaMemset(fl, 1, 256 << 20));
    // "norm" as the first argument: route_norm_q8_4, the residual add and norm folded in (each
    // layer's x is then the added row, and a residual and bf16 norm weights come with it).
    const bool norm = argc > 1 && std::string(argv[1]) == "norm";
    float* res[L]; bf16* nw[L]; float* hn[L];
    for (unsigned l = 0; l < L; l++) {
        CK(cudaMalloc(&res[l], H * 4)); fillf<<<8, 256>>>(res[l], H, 11 + l);
        CK(cudaMalloc(&nw[l], H * 2)); fill<<<8, 256>>>((unsigned*)nw[l], H / 2, 13 + l);
        CK(cudaMalloc(&hn[l], H * 4));
    }
    const unsigned rsm = (2 * padded_len(H) + 2 * H) * 4, gsm = 32 * 4 + 16 * 4 * 2 * 2 * (H / G) + (H + (H / 32 + H / 16) * 4), dsm = K * (I + (I / 32 + I / 16) * 4);
    CK(cudaFuncSetAttribute(route_q8_4, cudaFuncAttributeMaxDynamicSharedMemorySize, rsm));
    CK(cudaFuncSetAttribute(route_norm_q8_4, cudaFuncAttributeMaxDynamicSharedMemorySize, rsm));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph; cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (unsigned l = 0; l < L; l++) {
        if (norm)
            CK(launch(route_norm_q8_4, dim3(8), dim3(512), rsm, s, res[l], (const float*)x[l], (const void*)nw[l], hn[l], (const unsigned*)rw[l], (const bf16*)rs[l], (const bf16*)rb[l], logits, ids[l], wts, H, E, G, K, 1, 1e-6f, 1, 1));
        else
            CK(launch(route_q8_4, dim3(8), dim3(512), rsm, s, (const float*)x[l], (const unsigned*)rw[l], (const bf16*)rs[l], (const bf16*)rb[l], logits, ids[l], wts, H, E, G, K, 1));
        CK(launch(moe_gate_up_q4, dim3(I / 32, K), dim3(512), gsm, s, (const float*)x[l], (const unsigned*)ids[l], (const unsigned char*)ex[l], aq, ad, as16, H, I, K, span, gw, gs, gb, uw, us, ub, G));
        CK(launch(moe_down_q4, dim3(H / 4, 1), dim3(128), dsm, s, (const int*)aq, (const float*)ad, (const float*)as16, (const unsigned*)ids[l], (const float*)wts, (const unsigned char*)ex[l], out[l], H, I, K, span, dw, ds, db, G));
    }
    CK(cudaStreamEndCapture(s, &graph)); CK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    { unsigned long long* pr; CK(cudaMalloc(&pr, 128)); CK(cudaMemset(pr, 0, 128)); probe<<<1, 1>>>(pr); unsigned long long hp[16]; CK(cudaMemcpy(hp, pr, 128, cudaMemcpyDeviceToHost));
      printf("globaltimer steps (ns):"); for (int i = 0; i < 16; i++) printf(" %llu", hp[i]); printf("\n"); }
    const int R = 40, W = 10; std::vector<float> ev;
    // stats[kind][layer][stamp] -> per-run (median, min, max) over blocks
    std::vector<double> st[3][L][7][3]; std::vector<double> early[L];
    for (int run = 0; run < R; run++) {
        unsigned z[3] = {0, 0, 0}; CK(cudaMemcpyToSymbol(g_count, z, 12));
        for (int k = 0; k < 3; k++) CK(cudaMemset(rec[k], 0, (size_t)nb[k] * L * 64));
        flush<<<528, 512, 0, s>>>((const uint4*)fl, (256 << 20) / 16, out[0]);
        cudaEventRecord(e0, s); CK(cudaGraphLaunch(exec, s)); cudaEventRecord(e1, s); CK(cudaStreamSynchronize(s));
        float ms; cudaEventElapsedTime(&ms, e0, e1); if (run >= W) ev.push_back(ms * 1000);
        std::vector<unsigned long long> h[3];
        for (int k = 0; k < 3; k++) { h[k].resize((size_t)nb[k] * L * 8); CK(cudaMemcpy(h[k].data(), rec[k], h[k].size() * 8, cudaMemcpyDeviceToHost)); }
        unsigned long long t0 = ~0ull; for (unsigned b = 0; b < nb[0]; b++) t0 = std::min(t0, h[0][b * 8]);
        if (run < W) continue;
        for (int k = 0; k < 3; k++) for (unsigned l = 0; l < L; l++) for (int j = 0; j < 7; j++) {
            std::vector<double> v; for (unsigned b = 0; b < nb[k]; b++) { unsigned long long t = h[k][((size_t)l * nb[k] + b) * 8 + j]; if (t) v.push_back((t - t0) / 1000.0); }
            if (v.empty()) continue; std::sort(v.begin(), v.end());
            st[k][l][j][0].push_back(v[v.size() / 2]); st[k][l][j][1].push_back(v.front()); st[k][l][j][2].push_back(v.back());
        }
        for (unsigned l = 0; l < L; l++) { // down blocks started before the first gate_up block of the layer ended
            unsigned long long gend = ~0ull; for (unsigned b = 0; b < nb[1]; b++) gend = std::min(gend, h[1][((size_t)l * nb[1] + b) * 8 + 5] ? h[1][((size_t)l * nb[1] + b) * 8 + 5] : ~0ull);
            unsigned n = 0; for (unsigned b = 0; b < nb[2]; b++) if (h[2][((size_t)l * nb[2] + b) * 8] < gend) n++;
            early[l].push_back(n);
        }
    }
    auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? -1.0 : v[v.size() / 2]; };
    std::sort(ev.begin(), ev.end()); printf("graph of %u layers: event time median %.2f us (%.2f per layer)\n", L, ev[ev.size() / 2], ev[ev.size() / 2] / L);
    const char* names[3][7] = {{"start", "after wait", "x staged+cluster", "dots done", "cluster sync", "choose done", "dot computed"},
                               {"start", "after wait", "weights issued (ids)", "x int8 + scales", "loop done", "act written", ""},
                               {"start", "weights issued (ids)", "after wait", "act staged", "loop done", "end", ""}};
    const char* kn[3] = {"route_q8_4", "gate_up_q4", "down_q4"};
    for (unsigned l = 0; l < L; l++) for (int k = 0; k < 3; k++) {
        printf("layer %u %s (%u blocks)%s\n", l, kn[k], nb[k], k == 2 ? (" early down blocks: " + std::to_string(med(early[l]))).c_str() : "");
        for (int j = 0; j < 7; j++) if (!st[k][l][j][0].empty())
            printf("   %-22s med %7.2f  min %7.2f  max %7.2f\n", names[k][j], med(st[k][l][j][0]), med(st[k][l][j][1]), med(st[k][l][j][2]));
    }
    return 0;
}
