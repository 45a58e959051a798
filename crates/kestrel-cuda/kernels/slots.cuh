// The books of a streamed layer's cache of expert slots on the GPU, given to the moe and stream
// modules as the in-memory header "slots.cuh": the table's layout (kestrel_core::expert_slots,
// whose HEADER and USE come as SLOTS_HEADER and SLOTS_USE), the order victims are chosen in, and
// the resolution of one token's experts by a whole block, which the one-token router runs after
// its choice (route_* in moe.cu). Every function here follows expert_slots step for step, so the
// GPU's books are the CPU's bit for bit.
#pragma once
#include "kestrel.cuh"

#if !defined(SLOTS_HEADER) || !defined(SLOTS_USE)
#error "slots.cuh needs SLOTS_HEADER and SLOTS_USE (kestrel_core::expert_slots)"
#endif

// Word offsets of the table's header.
#define T_CLOCK 0
#define T_LOOKUPS 1
#define T_MISSES 3
#define T_STAGED 5
#define SLOT_NONE 0xffffffffu

__device__ __forceinline__ void add_wide(unsigned* t, unsigned at, unsigned n) {
    const unsigned long long v = ((unsigned long long)t[at + 1] << 32 | t[at]) + n;
    t[at] = (unsigned)v;
    t[at + 1] = (unsigned)(v >> 32);
}

// Is candidate a (class, score, age, slot) better than b? Class 0 is a free slot, 1 an occupied
// slot this step has not used, 2 none. Lower score leaves first, then the older, then the
// lower slot.
__device__ __forceinline__ bool better(unsigned ac, unsigned as, unsigned aa, unsigned ai, unsigned bc, unsigned bs,
                                       unsigned ba, unsigned bi) {
    if (ac != bc) return ac < bc;
    if (ac == 0) return ai < bi;
    if (as != bs) return as < bs;
    if (aa != ba) return aa > ba;
    return ai < bi;
}

// A use count `age` steps after its last use (expert_slots::faded).
__device__ __forceinline__ unsigned faded(unsigned count, unsigned age, unsigned half_life) {
    const unsigned shift = age / half_life;
    return shift >= 32 ? 0u : count >> shift;
}

// The books' arrays for `slots` slots and `experts` experts, after the header of `t`.
struct Books {
    unsigned* owner;    // the held expert plus one, 0: free
    unsigned* stamp;    // the clock of the slot's last use
    unsigned* count;    // each expert's faded use count
    unsigned* used_at;  // the clock of each expert's last use
};

__device__ __forceinline__ Books books_of(unsigned* t, unsigned slots, unsigned experts) {
    unsigned* owner = t + SLOTS_HEADER;
    return Books{owner, owner + slots, owner + 2 * slots, owner + 2 * slots + experts};
}

// Counts a use of expert e at `clock` (expert_slots::count_use).
__device__ __forceinline__ void count_use(Books b, unsigned e, unsigned clock, unsigned half_life) {
    b.count[e] = min(faded(b.count[e], clock - b.used_at[e], half_life), 0xffffffffu - SLOTS_USE) + SLOTS_USE;
    b.used_at[e] = clock;
}

// Slot s holds expert e from `clock` on (expert_slots' hold).
__device__ __forceinline__ void hold(Books b, unsigned s, unsigned e, unsigned clock) {
    b.owner[s] = e + 1;
    b.stamp[s] = clock;
}

// The header after a step at `clock` that looked up `lookups` experts and missed `misses`.
__device__ __forceinline__ void close_step(unsigned* t, unsigned clock, unsigned lookups, unsigned misses) {
    t[T_CLOCK] = clock;
    add_wide(t, T_LOOKUPS, lookups);
    add_wide(t, T_MISSES, misses);
}

// This thread's best victim among slots s0, s0 + step, ... at `clock`, in better()'s order:
// (class, score, age, slot) into c, sc, a, i (class 2 and SLOT_NONE when it has none).
__device__ __forceinline__ void victim_candidate(Books b, unsigned slots, unsigned clock, unsigned half_life,
                                                 unsigned s0, unsigned step, unsigned& bc, unsigned& bs,
                                                 unsigned& ba, unsigned& bi) {
    bc = 2, bs = 0, ba = 0, bi = SLOT_NONE;
    for (unsigned s = s0; s < slots; s += step) {
        const unsigned o = b.owner[s];
        const unsigned age = clock - b.stamp[s];
        const unsigned c = o == 0 ? 0 : (age == 0 ? 2 : 1);
        const unsigned sc = c == 1 && half_life > 0 ? faded(b.count[o - 1], clock - b.used_at[o - 1], half_life) : 0;
        if (better(c, sc, age, s, bc, bs, ba, bi)) { bc = c; bs = sc; ba = age; bi = s; }
    }
}

// The best candidate of the warp in every lane.
__device__ __forceinline__ void warp_best(unsigned& c, unsigned& sc, unsigned& a, unsigned& i) {
    for (int off = 16; off > 0; off >>= 1) {
        const unsigned oc = __shfl_xor_sync(0xffffffffu, c, off);
        const unsigned os = __shfl_xor_sync(0xffffffffu, sc, off);
        const unsigned oa = __shfl_xor_sync(0xffffffffu, a, off);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (better(oc, os, oa, oi, c, sc, a, i)) { c = oc; sc = os; a = oa; i = oi; }
    }
}

// One token's experts `id[0..k)` (distinct, as a router chooses them; shared memory) resolved
// in the books `t` (shared memory, updated in place) by the whole block, as
// expert_slots::resolve does: uses counted, hits keeping (and stamping) their slots, then each
// miss in order taking the best victim. Writes slot[j] (shared) for every id and the misses to
// fill (fill_slot, fill_expert; *nfill of them, shared). blockDim.x is a multiple of 32, at most
// 1024; k <= blockDim.x. Synchronises the block before and after.
__device__ void slots_resolve_token(unsigned* t, const unsigned* id, unsigned k, unsigned slots, unsigned experts,
                                    unsigned half_life, unsigned* slot, unsigned* fill_slot, unsigned* fill_expert,
                                    unsigned* nfill) {
    __shared__ unsigned best[4][32];
    const Books b = books_of(t, slots, experts);
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
    __syncthreads();
    const unsigned clock = t[T_CLOCK] + 1;
    // The ids are distinct: each thread counts its own id's use.
    if (tid < k) {
        slot[tid] = SLOT_NONE;
        if (half_life > 0) count_use(b, id[tid], clock, half_life);
    }
    __syncthreads();
    // An expert is held by at most one slot: each thread looks for the ids in its slots.
    for (unsigned s = tid; s < slots; s += blockDim.x) {
        const unsigned o = b.owner[s];
        if (o == 0) continue;
        for (unsigned j = 0; j < k; j++)
            if (id[j] + 1 == o) {
                slot[j] = s;
                b.stamp[s] = clock;
            }
    }
    __syncthreads();
    unsigned fills = 0;
    for (unsigned j = 0; j < k; j++) {
        if (slot[j] != SLOT_NONE) continue;
        unsigned bc, bs, ba, bi;
        victim_candidate(b, slots, clock, half_life, tid, blockDim.x, bc, bs, ba, bi);
        warp_best(bc, bs, ba, bi);
        if (lane == 0) {
            best[0][warp] = bc;
            best[1][warp] = bs;
            best[2][warp] = ba;
            best[3][warp] = bi;
        }
        __syncthreads();
        if (warp == 0) {
            bc = 2, bs = 0, ba = 0, bi = SLOT_NONE;
            if (lane < warps) { bc = best[0][lane]; bs = best[1][lane]; ba = best[2][lane]; bi = best[3][lane]; }
            warp_best(bc, bs, ba, bi);
            if (lane == 0) {
                hold(b, bi, id[j], clock);
                slot[j] = bi;
                fill_slot[fills] = bi;
                fill_expert[fills] = id[j];
            }
        }
        fills++;
        __syncthreads();
    }
    if (tid == 0) {
        *nfill = fills;
        close_step(t, clock, k, fills);
    }
    __syncthreads();
}
