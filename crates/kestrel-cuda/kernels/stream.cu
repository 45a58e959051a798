// Streamed experts inside the forward pass. A one-token decode step of a layer resolves the
// router's choice into the layer's cache of slots inside the router's own kernel
// (route_*_slots in moe.cu, with slots_resolve_token of slots.cuh: the books are read before
// that kernel's wait, so resolving costs the chain no round trip and no launch), and the
// experts' kernels read its misses from host memory (the *_streamed kernels there). A step of
// a few tokens, or one on a device without the fused router, is one kernel, expert_fetch: the
// choice resolved on the GPU (one warp on the books in shared memory, following
// kestrel_core::expert_slots::resolve step for step: the same books, the same victims) and the
// misses copied from the layer's packed experts in mapped page-locked host memory by blocks of
// the SMs; expert_commit then makes the next books the books, off the experts' path. Either way
// a step that misses is still one graph replay: the router's choice never goes back to the
// host. A longer chunk's experts are listed for staging (expert_stage_plan) and copied
// (expert_copy) from the slots or host memory.
//
// A copy list is `[count, (dst, src) * count]`: `dst` a span index of the destination, `src` a
// span index of the host's packed experts, or STREAM_FROM_CACHE | a slot of the cache.
//
// Tuning: reads of host memory cross the link, so a block keeps four 16-byte loads in flight per
// thread; host-paths.cu (shared/peer) measured 51 GB/s for such kernels from any grid of
// 132 x 256 threads up, and about the copy engine's speed for expert-sized gathers.
#include "slots.cuh"

#if !defined(STREAM_MAX_IDS) || !defined(STREAM_MAX_SLOTS) || !defined(STREAM_MAX_EXPERTS)
#error "stream.cu needs STREAM_MAX_IDS, STREAM_MAX_SLOTS and STREAM_MAX_EXPERTS (ops/stream.rs)"
#endif

#define STREAM_FROM_CACHE 0x80000000u

// Copies `span16` 16-byte words from `s` to `o`, the caller's threads taking words first,
// first + stride, ...: four loads in flight a thread (reads of host memory cross the link).
__device__ __forceinline__ void copy_words(const int4* s, int4* o, unsigned long long span16, size_t first,
                                           size_t stride) {
    size_t i = first;
    for (; i + 3 * stride < span16; i += 4 * stride) {
        const int4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], d = s[i + 3 * stride];
        o[i] = a;
        o[i + stride] = b;
        o[i + 2 * stride] = c;
        o[i + 3 * stride] = d;
    }
    for (; i < span16; i += stride) o[i] = s[i];
}

// copy_words spread over the blocks of x.
__device__ __forceinline__ void copy_span(const int4* s, int4* o, unsigned long long span16) {
    copy_words(s, o, span16, (size_t)blockIdx.x * blockDim.x + threadIdx.x, (size_t)gridDim.x * blockDim.x);
}

// One decode step of a layer, in one kernel: every block loads the ids and the books into
// shared memory and resolves them there with one warp (the same result in every block, as the
// books it reads are not written in this kernel), block (0, 0) writes the slots and the next
// books into the table's second copy (expert_commit makes them the books), and the blocks of
// row y copy the y-th miss from host memory into its slot. Every block triggers the next
// kernels right after its wait, so the experts kernel launches while the books resolve.
extern "C" __global__ void expert_fetch(const unsigned* ids, unsigned n, const unsigned* books, unsigned* next,
                                        unsigned slots, unsigned experts, unsigned half_life, unsigned* out,
                                        const int4* host, int4* cache, unsigned long long span16) {
    __shared__ unsigned t[SLOTS_HEADER + 2 * STREAM_MAX_SLOTS + 2 * STREAM_MAX_EXPERTS];
    __shared__ unsigned id[STREAM_MAX_IDS], dist[STREAM_MAX_IDS], dslot[STREAM_MAX_IDS];
    __shared__ unsigned fill_slot[STREAM_MAX_IDS], fill_expert[STREAM_MAX_IDS], nfill;
    pdl_begin();
    const unsigned words = SLOTS_HEADER + 2 * slots + 2 * experts;
    for (unsigned i = threadIdx.x; i < words; i += blockDim.x) t[i] = books[i];
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) id[i] = ids[i];
    __syncthreads();
    const bool first = blockIdx.x == 0 && blockIdx.y == 0;
    if (threadIdx.x < 32) {
        const unsigned lane = threadIdx.x;
        const Books b = books_of(t, slots, experts);
        const unsigned clock = t[T_CLOCK] + 1;
        // The distinct ids in order of first appearance.
        unsigned nd = 0;
        for (unsigned j = 0; j < n; j++) {
            const unsigned e = id[j];
            bool seen = false;
            for (unsigned d0 = 0; d0 < nd; d0 += 32) {
                const unsigned d = d0 + lane;
                seen |= __any_sync(0xffffffffu, d < nd && dist[d] == e);
            }
            if (!seen) {
                if (lane == 0) dist[nd] = e;
                nd++;
            }
            __syncwarp();
        }
        // Hits keep their slots (and are pinned by the stamp); uses are counted first.
        for (unsigned d = 0; d < nd; d++) {
            const unsigned e = dist[d];
            if (half_life > 0 && lane == 0) count_use(b, e, clock, half_life);
            unsigned found = SLOT_NONE;
            for (unsigned s0 = 0; s0 < slots; s0 += 32) {
                const unsigned s = s0 + lane;
                const unsigned hit = __ballot_sync(0xffffffffu, s < slots && b.owner[s] == e + 1);
                if (hit) {
                    found = s0 + __ffs(hit) - 1;
                    break;
                }
            }
            if (lane == 0) {
                dslot[d] = found;
                if (found != SLOT_NONE) b.stamp[found] = clock;
            }
            __syncwarp();
        }
        // Misses take the best victim, one at a time, in order.
        unsigned fills = 0;
        for (unsigned d = 0; d < nd; d++) {
            if (dslot[d] != SLOT_NONE) continue;
            unsigned bc, bs, ba, bi;
            victim_candidate(b, slots, clock, half_life, lane, 32, bc, bs, ba, bi);
            warp_best(bc, bs, ba, bi);
            if (lane == 0) {
                hold(b, bi, dist[d], clock);
                dslot[d] = bi;
                fill_slot[fills] = bi;
                fill_expert[fills] = dist[d];
            }
            fills++;
            __syncwarp();
        }
        if (lane == 0) {
            nfill = fills;
            close_step(t, clock, nd, fills);
        }
        if (first) {
            for (unsigned j = lane; j < n; j += 32) {
                const unsigned e = id[j];
                unsigned d = 0;
                while (dist[d] != e) d++;
                out[j] = dslot[d];
            }
        }
    }
    __syncthreads();
    if (first)
        for (unsigned i = threadIdx.x; i < words; i += blockDim.x) next[i] = t[i];
    const unsigned y = blockIdx.y;
    if (y < nfill) copy_span(host + (size_t)fill_expert[y] * span16, cache + (size_t)fill_slot[y] * span16, span16);
}

// Makes the next books a fetch wrote (the table's second copy) the books.
extern "C" __global__ void expert_commit(unsigned* table, unsigned words) {
    pdl_begin();
    for (unsigned i = threadIdx.x; i < words; i += blockDim.x) table[i] = table[words + i];
}

// The distinct experts of a longer chunk in increasing order, each from its cache slot if the
// layer holds it, else from host memory (counted in the table's staged words).
extern "C" __global__ void expert_stage_plan(const unsigned* ids, unsigned n, unsigned* table, unsigned slots,
                                             unsigned experts, unsigned* list) {
    // 0: unused, 1: from host, 2 + s: from slot s.
    __shared__ unsigned used[STREAM_MAX_EXPERTS];
    pdl_begin();
    const unsigned* owner = table + SLOTS_HEADER;
    for (unsigned e = threadIdx.x; e < experts; e += blockDim.x) used[e] = 0;
    __syncthreads();
    for (unsigned j = threadIdx.x; j < n; j += blockDim.x) used[ids[j]] = 1;
    __syncthreads();
    for (unsigned s = threadIdx.x; s < slots; s += blockDim.x) {
        const unsigned o = owner[s];
        if (o != 0 && used[o - 1] != 0) used[o - 1] = 2 + s;
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    const unsigned lane = threadIdx.x;
    unsigned listed = 0, from_host = 0;
    for (unsigned e0 = 0; e0 < experts; e0 += 32) {
        const unsigned e = e0 + lane;
        const unsigned u = e < experts ? used[e] : 0;
        const unsigned any = __ballot_sync(0xffffffffu, u != 0);
        if (u != 0) {
            const unsigned at = listed + __popc(any & ((1u << lane) - 1));
            list[1 + 2 * at] = e;
            list[2 + 2 * at] = u >= 2 ? (STREAM_FROM_CACHE | (u - 2)) : e;
        }
        listed += __popc(any);
        from_host += __popc(__ballot_sync(0xffffffffu, u == 1));
    }
    if (lane == 0) {
        list[0] = listed;
        add_wide(table, T_STAGED, from_host);
    }
}

// Copies entry blockIdx.y of the list: span16 16-byte words, spread over the blocks of x.
extern "C" __global__ void expert_copy(const unsigned* list, const int4* host, const int4* cache, int4* dst,
                                       unsigned long long span16) {
    pdl_wait();
    const unsigned y = blockIdx.y;
    if (y >= list[0]) {
        pdl_trigger();
        return;
    }
    const unsigned to = list[1 + 2 * y], from = list[2 + 2 * y];
    pdl_trigger();
    const int4* s = (from & STREAM_FROM_CACHE) ? cache + (size_t)(from & ~STREAM_FROM_CACHE) * span16
                                               : host + (size_t)from * span16;
    copy_span(s, dst + (size_t)to * span16, span16);
}

// Every expert of a layer to its index of the staging buffer, from the cache slot the books
// give it, else from host memory (counted in the books' staged words, as expert_stage_plan counts
// them): a few blocks, each copying whole experts in turn, as this runs beside the kernels of the
// layers before the one it stages, which keep the other SMs.
extern "C" __global__ void expert_stage_all(unsigned* table, unsigned slots, unsigned experts, const int4* host,
                                            const int4* cache, int4* dst, unsigned long long span16) {
    __shared__ unsigned slot_of[STREAM_MAX_EXPERTS];
    __shared__ unsigned from_host;
    pdl_wait();
    pdl_trigger();
    const unsigned* owner = table + SLOTS_HEADER;
    for (unsigned e = threadIdx.x; e < experts; e += blockDim.x) slot_of[e] = 0xffffffffu;
    if (threadIdx.x == 0) from_host = 0;
    __syncthreads();
    for (unsigned s = threadIdx.x; s < slots; s += blockDim.x) {
        const unsigned o = owner[s];
        if (o != 0 && o <= experts) slot_of[o - 1] = s;
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        unsigned mine = 0;
        for (unsigned e = threadIdx.x; e < experts; e += blockDim.x) mine += slot_of[e] == 0xffffffffu;
        atomicAdd(&from_host, mine);
        __syncthreads();
        if (threadIdx.x == 0) add_wide(table, T_STAGED, from_host);
    }
    for (unsigned e = blockIdx.x; e < experts; e += gridDim.x) {
        const unsigned s = slot_of[e];
        const int4* src = s != 0xffffffffu ? cache + (size_t)s * span16 : host + (size_t)e * span16;
        copy_words(src, dst + (size_t)e * span16, span16, threadIdx.x, blockDim.x);
    }
}
