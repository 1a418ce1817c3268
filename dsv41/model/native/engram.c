/* Engram table rows (engram/table.py `EngramTable.lookup`, docs/ARCHITECTURE.md §9 step 1) gathered and
 * dequantised in one pass: out[q, j] = bf16(e4m3(weight[id, j]) · 2^(scale[id, j/32] − 127)), the fp32
 * product rounded once, as the torch path's decode, scale and cast do. Both factors are exact in fp32 and
 * their product has at most 4 significant bits, so the result is the torch path's value for every byte
 * pair (a NaN stays a NaN, its payload aside). torch gathers the bytes, widens them through a table,
 * scales and casts in five passes over fp32 copies; here each row is read once and written once. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "span.h"

#define ENGRAM_BLOCK 32   /* values sharing one ue8m0 scale along a row (docs/CHECKPOINT.md §2) */

static float e4m3_value(int byte) {
    const int exponent = (byte >> 3) & 15, mantissa = byte & 7;
    float v;
    if (exponent == 15 && mantissa == 7) v = NAN;                        /* e4m3fn has no infinity */
    else if (exponent == 0) v = ldexpf((float)mantissa, -9);            /* subnormal: m/8 · 2⁻⁶ */
    else v = ldexpf(8.0f + (float)mantissa, exponent - 10);             /* (1 + m/8) · 2^(e − 7) */
    return (byte & 0x80) ? -v : v;
}

static float e8m0_value(int byte) {
    return byte == 255 ? NAN : ldexpf(1.0f, byte - 127);
}

/* ids [n] index a table part of `rows` rows that starts at row `first` of the whole table; an id outside
 * the part gives a row of zeros (tensor parallelism: another rank holds it). De % 32 == 0. */
void dsv41_engram_rows(int64_t n, int64_t rows, int64_t De, int64_t first, const uint8_t *weight,
                       const uint8_t *scale, const int64_t *ids, int threads, uint16_t *out) {
    float values[256], scales[256];
    for (int b = 0; b < 256; b++) {
        values[b] = e4m3_value(b);
        scales[b] = e8m0_value(b);
    }
    const int64_t blocks = De / ENGRAM_BLOCK;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const Span span = thread_span(n);
        for (int64_t q = span.begin; q < span.end; q++) {
            const int64_t row = ids[q] - first;
            uint16_t *o = out + q * De;
            if (row < 0 || row >= rows) {
                memset(o, 0, (size_t)De * sizeof *o);
                continue;
            }
            const uint8_t *w = weight + row * De, *s = scale + row * blocks;
            for (int64_t k = 0; k < blocks; k++) {
                const float f = scales[s[k]];
                for (int j = 0; j < ENGRAM_BLOCK; j++)
                    o[k * ENGRAM_BLOCK + j] = float_to_bf16(values[w[k * ENGRAM_BLOCK + j]] * f);
            }
        }
    }
}
