/* Rotary position embedding of a few rows (dsv41/model/rope.py `Rotary.rotate`, docs/ARCHITECTURE.md §10;
 * docs/NUMERICS.md N13): the last R features of every head, adjacent pairs as complex numbers, times the
 * position's phase (its conjugate for the inverse: `conj` negates the imaginary part as it is read, an
 * exact step, so the bits are those of torch's product with the conjugated table), in fp32, rounded to
 * x's dtype; the first F − R features copied.
 *
 * (a + bi)(c + di) = (ac − bd) + (ad + bc)i, each product rounded, then one subtraction or addition:
 * torch's complex64 multiply on the CPU (built with -ffp-contract=off, so no step is fused), which
 * tests/test_native.py compares bit for bit. As torch ops a rotation is ~16 operations (a complex
 * view, a copy, the product, a real view, a cast and a concatenation); here it is one call.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"


/* x, out [B, T, H, F] (H = 1 without heads), contiguous; phases [PB, T, R/2, 2] fp32 (re, im) with
 * PB = B or 1 (one table for every row). */
void dsv41_rope(int64_t B, int64_t T, int64_t H, int64_t F, int64_t R, int64_t PB, int bf16, int conj,
                const void *x, const float *phases, void *out) {
    const size_t width = bf16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const float *ph = phases + ((PB > 1 ? b : 0) * T + t) * R;
            for (int64_t h = 0; h < H; h++) {
                const int64_t row = ((b * T + t) * H + h) * F;
                memcpy((char *)out + row * width, (const char *)x + row * width, (size_t)(F - R) * width);
                for (int64_t k = 0; k < R / 2; k++) {
                    const int64_t at = row + F - R + 2 * k;
                    const float a = value_at(x, bf16, at), bi = value_at(x, bf16, at + 1);
                    const float c = ph[2 * k], d = conj ? -ph[2 * k + 1] : ph[2 * k + 1];
                    store_value(out, bf16, at, a * c - bi * d);
                    store_value(out, bf16, at + 1, a * d + bi * c);
                }
            }
        }
}
