/* RMSNorm of a few rows for fast numerics (layers.py `RMSNorm`, docs/NUMERICS.md N18):
 * out[r] = (w · (x[r] / sqrt(mean(x[r]²) + eps))) in x's dtype, the statistic and the scaling in fp32,
 * the sum of squares in this kernel's order (torch's vectorised cascade is not reproduced: reference
 * numerics keep torch's). x and out bf16 or fp32, w bf16 or fp32 [D], contiguous rows.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

void dsv41_rms_norm(int64_t rows, int64_t D, float eps, const void *x, int x_bf16, const void *w, int w_bf16,
                    void *out) {
    float h[D > 0 ? D : 1];
    for (int64_t r = 0; r < rows; r++) {
        float squares = 0.0f;
        for (int64_t d = 0; d < D; d++) h[d] = value_at(x, x_bf16, r * D + d);
        #pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < D; d++) squares += h[d] * h[d];
        const float scale = 1.0f / sqrtf(squares / (float)D + eps);
        for (int64_t d = 0; d < D; d++) {
            const float v = value_at(w, w_bf16, d) * (h[d] * scale);
            store_value(out, x_bf16, r * D + d, v);
        }
    }
}
