// Output-head selections on the GPU, so decode reads back a few bytes: argmax and top-k per row
// (one block per row, or for argmax of long rows many blocks and a second pass; the lower index
// wins ties). Top-k takes k rounds, each selecting the
// largest element ordered after the previous pick in (value descending, index ascending).
#include "kestrel.cuh"

// Is (v, i) before (bv, bi) in (value descending, index ascending) order?
__device__ __forceinline__ bool before(float v, unsigned i, float bv, unsigned bi) {
    return v > bv || (v == bv && i < bi);
}

// Block-wide best (value, index) of the per-thread candidates; every thread gets it.
__device__ void block_best(float& v, unsigned& i) {
    __shared__ float sv[32];
    __shared__ unsigned si[32];
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const unsigned oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) { sv[threadIdx.x / 32] = v; si[threadIdx.x / 32] = i; }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (unsigned w = 1; w < blockDim.x / 32; w++)
        if (before(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
}

extern "C" __global__ void argmax_f32(const float* logits, unsigned* out, unsigned cols) {
    pdl_begin();
    const float* row = logits + (size_t)blockIdx.x * cols;
    float bv = -INFINITY;
    unsigned bi = 0xffffffffu;
    for (unsigned c = threadIdx.x; c < cols; c += blockDim.x)
        if (before(row[c], c, bv, bi)) { bv = row[c]; bi = c; }
    block_best(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

// Argmax of long rows in two launches: argmax_partial_f32 (grid (parts, rows)) leaves the best
// (value, index) of each `chunk` columns of a row; argmax_final_f32 (one block per row) picks the
// best of a row's parts. The order is the same total order, so the result is argmax_f32's.
extern "C" __global__ void argmax_partial_f32(const float* logits, float* part_v, unsigned* part_i, unsigned cols,
                                              unsigned chunk) {
    pdl_begin();
    const float* row = logits + (size_t)blockIdx.y * cols;
    const unsigned c0 = blockIdx.x * chunk, c1 = min(cols, c0 + chunk);
    float bv = -INFINITY;
    unsigned bi = 0xffffffffu;
    for (unsigned c = c0 + threadIdx.x; c < c1; c += blockDim.x)
        if (before(row[c], c, bv, bi)) { bv = row[c]; bi = c; }
    block_best(bv, bi);
    if (threadIdx.x == 0) {
        part_v[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = bv;
        part_i[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = bi;
    }
}

extern "C" __global__ void argmax_final_f32(const float* part_v, const unsigned* part_i, unsigned* out,
                                            unsigned parts) {
    pdl_begin();
    const size_t base = (size_t)blockIdx.x * parts;
    float bv = -INFINITY;
    unsigned bi = 0xffffffffu;
    for (unsigned p = threadIdx.x; p < parts; p += blockDim.x)
        if (before(part_v[base + p], part_i[base + p], bv, bi)) { bv = part_v[base + p]; bi = part_i[base + p]; }
    block_best(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

extern "C" __global__ void top_k_f32(const float* logits, unsigned* ids, float* values, unsigned cols, unsigned k) {
    pdl_begin();
    const float* row = logits + (size_t)blockIdx.x * cols;
    float lv = INFINITY;  // the previous pick; unused before the first round
    unsigned li = 0;
    bool first = true;
    for (unsigned j = 0; j < k; j++) {
        float bv = -INFINITY;
        unsigned bi = 0xffffffffu;
        for (unsigned c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = row[c];
            const bool after_last = first || before(lv, li, v, c);
            if (after_last && before(v, c, bv, bi)) { bv = v; bi = c; }
        }
        block_best(bv, bi);
        if (threadIdx.x == 0) {
            ids[(size_t)blockIdx.x * k + j] = bi;
            values[(size_t)blockIdx.x * k + j] = bv;
        }
        lv = bv;
        li = bi;
        first = false;
    }
}

// ---- sampling (see kestrel_core::sample; the same arithmetic, so the same token) ----
// SAMPLE_CHUNK, the logits a block of sample_rows_partial_f32 takes, comes from the host
// (`ops/head.rs`) as a -D definition.
// SAMPLE_MAX_K, the most candidates a draw keeps, is kestrel_core::sample::BACKEND_MAX_TOP_K.
#if !defined(SAMPLE_CHUNK) || !defined(SAMPLE_MAX_K)
#error "head.cu is compiled with SAMPLE_CHUNK and SAMPLE_MAX_K from ops/head.rs"
#endif

__device__ __forceinline__ float penalised(float l, unsigned n, float rep, float presence, float frequency) {
    if (n == 0) return l;
    if (rep != 1.0f) l = l > 0.0f ? l / rep : l * rep;
    return l - (presence + frequency * (float)n);
}

// k rounds of block_best over vals[0..n) (index base + i), each pick marked NaN so it is not
// picked again; the picks go to out_v / out_i (stride 1) from thread 0.
__device__ void pick_best(float* vals, const unsigned* idx, unsigned base, unsigned n, unsigned k, float* out_v,
                          unsigned* out_i) {
    for (unsigned j = 0; j < k; j++) {
        float bv = -INFINITY;
        unsigned bi = 0xffffffffu, bp = 0xffffffffu;
        for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned id = idx ? idx[i] : base + i;
            if (before(vals[i], id, bv, bi)) { bv = vals[i]; bi = id; bp = i; }
        }
        const unsigned pos = bp;
        float v = bv;
        unsigned id = bi;
        block_best(v, id);
        // The thread that held the winner marks it (NaN is never picked).
        if (id != 0xffffffffu && bi == id) vals[pos] = __int_as_float(0x7fc00000);
        if (threadIdx.x == 0) { out_v[j] = v; out_i[j] = id; }
        __syncthreads();
    }
}

__device__ __forceinline__ unsigned long long rotl64(unsigned long long x, int r) { return (x << r) | (x >> (64 - r)); }

// The token drawn from the m best candidates (top_v / top_i, most likely first): f64 weights,
// top-p and min-p in the host's order, a draw with the xoshiro state rng_in (u32 [8]), the state
// after it to rng_out (the same or another place; copied when no draw was needed). One thread.
__device__ unsigned draw_from_head(const float* top_v, unsigned* top_i, unsigned m, float temperature, float top_p,
                                   float min_p, const unsigned* rng_in, unsigned* rng_out) {
    unsigned long long s[4];
    for (int i = 0; i < 4; i++) s[i] = (unsigned long long)rng_in[2 * i] | ((unsigned long long)rng_in[2 * i + 1] << 32);
    unsigned token = top_i[0];
    if (temperature != 0.0f && m > 1) {
        double w[SAMPLE_MAX_K];
        const double t = (double)temperature, max = (double)top_v[0];
        double total = 0.0;
        for (unsigned j = 0; j < m; j++) { w[j] = exp(((double)top_v[j] - max) / t); total += w[j]; }
        unsigned keep = m;
        if (top_p < 1.0f) {
            double acc = 0.0;
            for (unsigned j = 0; j < m; j++) {
                acc += w[j] / total;
                if (acc >= (double)top_p) { keep = j + 1; break; }
            }
        }
        if (min_p > 0.0f) {
            const double floor = w[0] * (double)min_p;
            unsigned kept = 0;
            for (unsigned j = 0; j < keep; j++)
                if (w[j] >= floor) { w[kept] = w[j]; top_i[kept] = top_i[j]; kept++; }
            keep = kept;
        }
        double sum = 0.0;
        for (unsigned j = 0; j < keep; j++) sum += w[j];
        // Ascending token order, as the host draws.
        for (unsigned a = 1; a < keep; a++)
            for (unsigned b = a; b > 0 && top_i[b - 1] > top_i[b]; b--) {
                const unsigned ti = top_i[b]; top_i[b] = top_i[b - 1]; top_i[b - 1] = ti;
                const double tw = w[b]; w[b] = w[b - 1]; w[b - 1] = tw;
            }
        token = top_i[0];
        if (keep > 1) {
            const unsigned long long r = rotl64(s[1] * 5, 7) * 9, sh = s[1] << 17;
            s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= sh; s[3] = rotl64(s[3], 45);
            const double u = (double)((float)(r >> 40) * (1.0f / 16777216.0f));
            double acc = 0.0;
            token = top_i[keep - 1];
            for (unsigned j = 0; j < keep; j++) {
                acc += w[j] / sum;
                if (u < acc) { token = top_i[j]; break; }
            }
        }
    }
    for (int i = 0; i < 4; i++) { rng_out[2 * i] = (unsigned)s[i]; rng_out[2 * i + 1] = (unsigned)(s[i] >> 32); }
    return token;
}

// ---- sampling each row with its own settings (Op::SampleRows) ----
// draws: u32 [rows, DRAW_WORDS] (temperature, top-k, top-p, min-p, repetition, presence and
// frequency penalty as bits, the row's counts row or NO_COUNTS, then the generator); counts:
// u32 [seqs, cols]; out: u32 [rows, DRAWN_WORDS] (the token, then the generator after the draw).
// A row keeps k = 1 at temperature 0, else its top-k (clamped to 1..SAMPLE_MAX_K: the host
// sends only rows the op takes); a counts row past `seqs` is read as none.
// sample_rows_partial_f32: grid (parts, rows), each block penalises SAMPLE_CHUNK logits by the
// row's counts (f32, as the host does) and leaves its k best to part_v / part_i [rows, parts,
// SAMPLE_MAX_K]; sample_rows_final_f32: grid (rows), the k best of the row's parts, then
// draw_from_head, and the drawn token counted in the row's counts.
// DRAW_WORDS and DRAWN_WORDS come from kestrel_core::sample through ops/head.rs.
#if !defined(DRAW_WORDS) || !defined(DRAWN_WORDS) || !defined(NO_COUNTS)
#error "head.cu is compiled with DRAW_WORDS, DRAWN_WORDS and NO_COUNTS from ops/head.rs"
#endif

__device__ __forceinline__ unsigned row_candidates(const unsigned* d) {
    if (__uint_as_float(d[0]) == 0.0f) return 1;
    return min(max(d[1], 1u), (unsigned)SAMPLE_MAX_K);
}

// The row of `counts` a draw names, or null.
__device__ __forceinline__ unsigned* counts_row(unsigned* counts, const unsigned* d, unsigned seqs, unsigned cols) {
    return d[7] != NO_COUNTS && d[7] < seqs ? counts + (size_t)d[7] * cols : nullptr;
}

extern "C" __global__ void sample_rows_partial_f32(const float* logits, const unsigned* draws, unsigned* counts,
                                                   float* part_v, unsigned* part_i, unsigned cols, unsigned seqs) {
    pdl_begin();
    __shared__ float vals[SAMPLE_CHUNK];
    const unsigned row = blockIdx.y;
    const unsigned* d = draws + (size_t)row * DRAW_WORDS;
    const unsigned k = row_candidates(d);
    const unsigned c0 = blockIdx.x * SAMPLE_CHUNK, n = min(cols - c0, (unsigned)SAMPLE_CHUNK);
    const float* l = logits + (size_t)row * cols + c0;
    const unsigned* c = counts_row(counts, d, seqs, cols);
    const float rep = __uint_as_float(d[4]), presence = __uint_as_float(d[5]), frequency = __uint_as_float(d[6]);
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x)
        vals[i] = c ? penalised(l[i], c[c0 + i], rep, presence, frequency) : l[i];
    __syncthreads();
    const size_t at = ((size_t)row * gridDim.x + blockIdx.x) * SAMPLE_MAX_K;
    pick_best(vals, nullptr, c0, n, k, part_v + at, part_i + at);
}

extern "C" __global__ void sample_rows_final_f32(const float* part_v, const unsigned* part_i, const unsigned* draws,
                                                 unsigned* counts, unsigned* out, unsigned parts, unsigned cols,
                                                 unsigned seqs) {
    pdl_begin();
    extern __shared__ float cand[];  // parts * k values, then as many indices
    __shared__ float top_v[SAMPLE_MAX_K];
    __shared__ unsigned top_i[SAMPLE_MAX_K];
    const unsigned row = blockIdx.x;
    const unsigned* d = draws + (size_t)row * DRAW_WORDS;
    const unsigned k = row_candidates(d), n = parts * k;
    unsigned* cand_i = reinterpret_cast<unsigned*>(cand + n);
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
        const size_t at = ((size_t)row * parts + i / k) * SAMPLE_MAX_K + i % k;
        cand[i] = part_v[at];
        cand_i[i] = part_i[at];
    }
    __syncthreads();
    pick_best(cand, cand_i, 0, n, k, top_v, top_i);
    if (threadIdx.x != 0) return;
    unsigned m = 0;
    while (m < k && top_i[m] != 0xffffffffu) m++;
    unsigned* o = out + (size_t)row * DRAWN_WORDS;
    const unsigned token = draw_from_head(top_v, top_i, m, __uint_as_float(d[0]), __uint_as_float(d[2]),
                                          __uint_as_float(d[3]), d + 8, o + 1);
    o[0] = token;
    unsigned* c = counts_row(counts, d, seqs, cols);
    if (c) c[token] += 1;
}
