/* RMSNorm of a few rows for fast numerics (layers.py `RMSNorm`, docs/NUMERICS.md N18):
 * out[r] = (w · (x[r] / sqrt(mean(x[r]²) + eps))) in x's dtype, the statistic and the scaling in fp32,
 * the sum of squares in this kernel's order (torch's vectorised cascade is not reproduced: reference
 * numerics keep torch's). x and out bf16 or fp32, w bf16 or fp32 [D], contiguous rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float widened(const void *p, int bf16, int64_t i) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void dsv41_rms_norm(int64_t rows, int64_t D, float eps, const void *x, int x_bf16, const void *w, int w_bf16,
                    void *out) {
    float h[D > 0 ? D : 1];
    for (int64_t r = 0; r < rows; r++) {
        float squares = 0.0f;
        for (int64_t d = 0; d < D; d++) h[d] = widened(x, x_bf16, r * D + d);
        #pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < D; d++) squares += h[d] * h[d];
        const float scale = 1.0f / sqrtf(squares / (float)D + eps);
        for (int64_t d = 0; d < D; d++) {
            const float v = widened(w, w_bf16, d) * (h[d] * scale);
            if (x_bf16) ((uint16_t *)out)[r * D + d] = to_bf16(v);
            else ((float *)out)[r * D + d] = v;
        }
    }
}
