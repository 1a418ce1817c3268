/* The QDQ points of docs/ARCHITECTURE.md §6.3–§6.4 for a few rows, with formats.py's bytes and values
 * (dsv41/model/native/__init__.py calls them; docs/NUMERICS.md N11, N13): the fp8 activation
 * quantisation before a quantised GEMM, the window KV's fp8 QDQ and the indexer's fp4 QDQ. As torch
 * ops each is a dozen passes over a few KB (abs, amax, clamp, the scale's bits, a division, a cast or
 * seven threshold comparisons, a multiply, a cast back); here one.
 * Built with -ffp-contract=off: every fp32 step rounds as torch's does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define BLOCK 32

/* §6.3 point #1, formats.fp8_act_quant for rows of fp32 x [rows, K]: per 32-wide block the scale
 * pow2_ceil(max(amax, floor) · inv_max) (the caller's 1e-4 and fp32(1/448)), then each x / scale clamped to ±448 and rounded to the
 * nearest e4m3 byte, ties to the even code. NaN propagates as torch's ops do: into the block's amax
 * (so its scale is the ue8m0 NaN) and into its bytes (0x7F with the sign). */
static uint8_t e4m3_byte(float v) {
    union { float value; uint32_t bits; } in = {v};
    const uint8_t sign = (uint8_t)((in.bits >> 24) & 0x80u);
    if (isnan(v)) return 0x7Fu | sign;
    const float a = fabsf(v);
    if (a < 0x1p-6f) return (uint8_t)rintf(a * 512.0f) | sign;    /* subnormal steps of 2^-9 (8 = 2^-6) */
    union { float value; uint32_t bits; } mag = {a};
    const uint32_t rounded = mag.bits + 0x7FFFFu + ((mag.bits >> 20) & 1u);
    return (uint8_t)((rounded >> 20) - (120u << 3)) | sign;
}

static float pow2_ceil(float x) {
    union { float value; uint32_t bits; } in = {x}, out;
    uint32_t exponent = (in.bits & 0x7FFFFFFFu) >> 23;
    exponent += (in.bits & 0x7FFFFFu) != 0;
    if (exponent >= 255u) { out.bits = 0x7FC00000u; return out.value; }
    out.bits = exponent ? exponent << 23 : 0x00400000u;       /* 2^-127 is a subnormal */
    return out.value;
}

void dsv41_fp8_act_quant(int64_t rows, int64_t K, const float *x, float floor, float inv_max, uint8_t *q,
                         float *scale) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < K / BLOCK; k++) {
            const float *block = x + r * K + k * BLOCK;
            float amax = 0.0f;
            int nan = 0;
            for (int j = 0; j < BLOCK; j++) {
                const float a = fabsf(block[j]);
                nan |= isnan(a);
                amax = a > amax ? a : amax;
            }
            if (nan) amax = NAN;
            else if (amax < floor) amax = floor;
            const float s = pow2_ceil(amax * inv_max);
            scale[r * (K / BLOCK) + k] = s;
            for (int j = 0; j < BLOCK; j++) {
                float v = block[j] / s;
                if (v > 448.0f) v = 448.0f;
                if (v < -448.0f) v = -448.0f;
                q[r * K + k * BLOCK + j] = e4m3_byte(v);
            }
        }
    }
}


/* formats.fp8_qdq(x, 32) of x [rows, K] (bf16 or fp32): the activation quantisation's bytes, each
 * decoded (e4m3[256], torch's values) and times its block's scale, in x's dtype. Returns 0 or -1. */
int dsv41_fp8_qdq(int64_t rows, int64_t K, int bf16, const void *x, float floor, float inv_max,
                  const float *e4m3, void *out) {
    float *xf = malloc(sizeof(float) * (size_t)(K + K / BLOCK));
    uint8_t *q = malloc((size_t)K);
    if (xf == NULL || q == NULL) {
        free(xf);
        free(q);
        return -1;
    }
    float *scale = xf + K;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < K; k++) xf[k] = value_at(x, bf16, r * K + k);
        dsv41_fp8_act_quant(1, K, xf, floor, inv_max, q, scale);
        for (int64_t k = 0; k < K; k++) store_value(out, bf16, r * K + k, e4m3[q[k]] * scale[k / BLOCK]);
    }
    free(xf);
    free(q);
    return 0;
}

/* The e2m1 value nearest v (|v| ≤ 6 or NaN), ties to the even code, the sign kept (NaN: ±0), as
 * formats.fp4_encode then fp4_decode: one threshold per code boundary, ≥ where the upper code is even. */
static float e2m1_round(float v) {
    static const float midpoint[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    static const float value[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float mag = fabsf(v);
    int code = 0;
    for (int i = 0; i < 7; i++) code += (i % 2) ? mag >= midpoint[i] : mag > midpoint[i];
    return signbit(v) ? -value[code] : value[code];
}

/* formats.fp4_qdq_e8m0(x, 32) of x [rows, K] (bf16 or fp32), §6.4 point #4: per block the scale
 * pow2_ceil(max(amax, floor) · inv_max) (fp32(1/6)), each x / scale clamped to ±6 and rounded to
 * e2m1, times the scale, in x's dtype. NaN propagates into the block's amax and so its scale. */
void dsv41_fp4_qdq_e8m0(int64_t rows, int64_t K, int bf16, const void *x, float floor, float inv_max, void *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < K / BLOCK; b++) {
            const int64_t at = r * K + b * BLOCK;
            float amax = 0.0f;
            int nan = 0;
            for (int j = 0; j < BLOCK; j++) {
                const float a = fabsf(value_at(x, bf16, at + j));
                nan |= isnan(a);
                amax = a > amax ? a : amax;
            }
            if (nan) amax = NAN;
            else if (amax < floor) amax = floor;
            const float s = pow2_ceil(amax * inv_max);
            for (int j = 0; j < BLOCK; j++) {
                float v = value_at(x, bf16, at + j) / s;
                if (v > 6.0f) v = 6.0f;
                if (v < -6.0f) v = -6.0f;
                store_value(out, bf16, at + j, e2m1_round(v) * s);
            }
        }
}
