// Rotary embeddings (neox halves) in place on x [tokens, heads, head_dim]; one block per
// (token, head), the angle position * inv_freq computed in f32 as transformers does.
#include "kestrel.cuh"

extern "C" __global__ void rope_f32(float* x, const unsigned* positions, const float* inv_freq, unsigned heads,
                                    unsigned head_dim, unsigned rot_dim, float scaling) {
    pdl_begin();
    const size_t row = blockIdx.x;
    const unsigned t = row / heads, half = rot_dim / 2;
    float* h = x + row * head_dim;
    const float p = (float)positions[t];
    for (unsigned i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        c *= scaling;
        s *= scaling;
        const float x1 = h[i], x2 = h[i + half];
        h[i] = x1 * c - x2 * s;
        h[i + half] = x2 * c + x1 * s;
    }
}
