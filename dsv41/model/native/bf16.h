/* bf16 ⇄ fp32 as torch's casts give them, for every kernel of this folder (native/__init__.py compiles
 * the sources with it; a change to it rebuilds the library). */
#ifndef DSV41_BF16_H
#define DSV41_BF16_H

#include <stdint.h>
#include <string.h>

/* A bf16 value widens exactly: the upper half of a float. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 → bf16 to nearest even; a NaN stays a quiet NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u | 0x00400000u) >> 16);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of an fp32 or bf16 array as a float, and a float stored into one. */
static inline float value_at(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_value(void *p, int bf16, int64_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* v as the dtype holds it: rounded to bf16 (to nearest even), or kept as fp32. */
static inline float round_to(float v, int bf16) {
    return bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

/* n values of an fp32 or bf16 row as floats, and back: one loop per dtype, so each vectorises. */
static inline void widen_row(const void *src, int bf16, int64_t n, float *dst) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    for (int64_t d = 0; d < n; d++) dst[d] = bf16_to_float(((const uint16_t *)src)[d]);
}

static inline void narrow_row(const float *src, int64_t n, int bf16, void *dst) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    for (int64_t d = 0; d < n; d++) ((uint16_t *)dst)[d] = float_to_bf16(src[d]);
}

#endif
