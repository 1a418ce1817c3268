/* The quantised blockwise GEMM of docs/ARCHITECTURE.md §6.3 for a few activation rows, read straight
 * from the stored weight bytes (dsv41/model/native.py builds and calls it; docs/NUMERICS.md N11).
 *
 * out[p, m, n] = Σ_k in K order, in fp32:  fp32(S) · qs[p, m, k] · ws[p, n, k],
 *                S = Σ_{j < 32} a[p, m, 32k + j] · w[p, n, 32k + j]   (exact, in double)
 *
 * a: e4m3 activation bytes, w: e4m3 bytes ("fp8") or packed e2m1 bytes, low nibble first ("fp4").
 * S is computed exactly and rounded once to fp32, then scaled and accumulated as the torch path does
 * (built with -ffp-contract=off: a fused multiply-add in the fp32 part would round differently):
 * - fp8: every product has at most 8 significant bits, so it is exact in fp32 (the smallest is
 *   2^-18, a normal number), and a block's products span fewer than 2^41 units of the smallest one,
 *   so their sum is exact in a double in any order;
 * - fp4: in integers. 2^9 · a is an integer below 2^18 (e4m3's smallest step is 2^-9) and 2 · w one
 *   of 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12, so 2^10 · S is an int32 sum below 2^27; converting it to
 *   fp32 rounds once, and the power-of-two 2^-10 is exact. Integer lanes vectorise, and the 16
 *   nibble values are looked up 16 at a time by a byte shuffle where the CPU has one.
 *
 * Activation and fp4 values come from the caller's tables (torch's exact widening casts): e4m3[256]
 * as floats, e4m3_int[256] = 2^9 · e4m3 as int32, e2m1_int[16] = 2 · e2m1 as int8.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__SSSE3__)
#include <immintrin.h>
#endif

#define BLOCK 32

typedef struct {
    int64_t M, N, K, begin, end;  /* rows begin..end of the P·N output rows (pair-major) */
    int fp4;
    const float *qs;         /* [P, M, K/32] */
    const uint8_t *w;        /* [P, N, K] or [P, N, K/2] weight bytes */
    const float *ws;         /* [P, N, K/32] */
    const float *act;        /* [P, M, K] activation values (fp8 weights), decoded once */
    const int32_t *act_int;  /* [P, M, K] 2^9 · activation values (fp4 weights), decoded once */
    const float *e4m3;
    const int8_t *e2m1_int;
    float *out;              /* [P, M, N] */
} Job;

/* Σ a[j] · v[j] over one fp8 block: fp32 products (exact), summed in four double lanes. */
static double block_dot(const float *a, const float *v) {
    float prod[BLOCK];
    for (int j = 0; j < BLOCK; j++) prod[j] = a[j] * v[j];
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    for (int j = 0; j < BLOCK; j += 4) {
        s0 += (double)prod[j];
        s1 += (double)prod[j + 1];
        s2 += (double)prod[j + 2];
        s3 += (double)prod[j + 3];
    }
    return (s0 + s1) + (s2 + s3);
}

/* 2 · the 32 e2m1 values of one block's 16 packed bytes, in element order (low nibble first). */
static void decode_fp4_block(const uint8_t *bytes, const int8_t *table, int8_t *v) {
#if defined(__SSSE3__)
    const __m128i lut = _mm_loadu_si128((const __m128i *)table);
    const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_shuffle_epi8(lut, _mm_and_si128(packed, nibble));
    const __m128i odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    _mm_storeu_si128((__m128i *)v, _mm_unpacklo_epi8(even, odd));
    _mm_storeu_si128((__m128i *)(v + 16), _mm_unpackhi_epi8(even, odd));
#else
    for (int i = 0; i < BLOCK / 2; i++) {
        v[2 * i] = table[bytes[i] & 0x0F];
        v[2 * i + 1] = table[bytes[i] >> 4];
    }
#endif
}

static int32_t block_dot_int(const int32_t *a, const int8_t *v) {
    int32_t s = 0;
    for (int j = 0; j < BLOCK; j++) s += a[j] * (int32_t)v[j];
    return s;
}

#define ROWS_AT_ONCE 16

static void run_rows(const Job *job) {
    const int64_t M = job->M, N = job->N, K = job->K, nb = K / BLOCK;
    const int64_t row_bytes = job->fp4 ? K / 2 : K, block_bytes = job->fp4 ? BLOCK / 2 : BLOCK;
    float acc[ROWS_AT_ONCE], v[BLOCK];
    int8_t v_int[BLOCK];
    for (int64_t row = job->begin; row < job->end; row++) {
        const int64_t p = row / N, n = row % N;
        const uint8_t *wrow = job->w + row * row_bytes;
        const float *wsrow = job->ws + row * nb;
        const float *qs = job->qs + p * M * nb;
        float *out = job->out + p * M * N + n;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
            const int64_t rows = M - m0 < ROWS_AT_ONCE ? M - m0 : ROWS_AT_ONCE;
            for (int64_t r = 0; r < rows; r++) acc[r] = 0.0f;
            for (int64_t k = 0; k < nb; k++) {
                const uint8_t *bytes = wrow + k * block_bytes;
                if (job->fp4) decode_fp4_block(bytes, job->e2m1_int, v_int);
                else for (int j = 0; j < BLOCK; j++) v[j] = job->e4m3[bytes[j]];
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t m = m0 + r, at = (p * M + m) * K + k * BLOCK;
                    float partial = job->fp4 ? (float)block_dot_int(job->act_int + at, v_int) * 0x1p-10f
                                             : (float)block_dot(job->act + at, v);
                    partial = partial * qs[m * nb + k];
                    partial = partial * wsrow[k];
                    acc[r] = acc[r] + partial;
                }
            }
            for (int64_t r = 0; r < rows; r++) out[(m0 + r) * N] = acc[r];
        }
    }
}

/* P pairs, each [M, K] activations (q, e4m3 bytes) through its own [N, K] weight, into out [P, M, N];
 * the P·N output rows are split over `threads` OpenMP threads (torch's pool: native/__init__.py).
 * Returns 0, or -1 if memory could not be had (nothing is then written; the caller takes the torch path). */
int dsv41_block_gemm(int64_t P, int64_t M, int64_t N, int64_t K, int fp4, int threads,
                     const uint8_t *q, const float *qs, const uint8_t *w, const float *ws,
                     const float *e4m3, const int32_t *e4m3_int, const int8_t *e2m1_int, float *out) {
    float *act = NULL;
    int32_t *act_int = NULL;
    if (fp4) act_int = malloc(sizeof(int32_t) * P * M * K);
    else act = malloc(sizeof(float) * P * M * K);
    if (act == NULL && act_int == NULL) return -1;
    for (int64_t i = 0; i < P * M * K; i++) {
        if (fp4) act_int[i] = e4m3_int[q[i]];
        else act[i] = e4m3[q[i]];
    }
    if (threads < 1) threads = 1;
    if (threads > P * N) threads = (int)(P * N);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t = 0, nt = 1;
#if defined(_OPENMP)
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const Job job = {M, N, K, P * N * t / nt, P * N * (t + 1) / nt, fp4, qs, w, ws, act, act_int,
                         e4m3, e2m1_int, out};
        run_rows(&job);
    }
    free(act);
    free(act_int);
    return 0;
}

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
