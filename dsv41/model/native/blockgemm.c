/* The quantised blockwise GEMM of docs/ARCHITECTURE.md §6.3 for a few activation rows, read straight
 * from the stored weight bytes (dsv41/model/native/__init__.py builds and calls it; docs/NUMERICS.md N11),
 * whole with its activation quantisation (quantize.c) and stored ue8m0 scales in `dsv41_quantized_linear`.
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
    const float *ws;         /* [P, N, K/32] fp32 scales, or NULL: */
    const uint8_t *ws8;      /* the stored ue8m0 scales [P, ⌈N/rg⌉, ⌈K/cg⌉], one per rg × cg tile */
    int64_t rg, cg;          /* 32 × 32 (fp8) or 1 × 32 (fp4) */
    const float *act;        /* [P, M, K] activation values (fp8 weights), decoded once */
    const int32_t *act_int;  /* [P, M, K] 2^9 · activation values (fp4 weights), decoded once */
    const float *e4m3;
    const int8_t *e2m1_int;
    float *out;              /* [P, M, N] fp32, or NULL: */
    uint16_t *out_bf16;      /* [P, M, N] bf16, rounded to nearest even */
} Job;

/* A ue8m0 byte's value 2^(byte − 127), as torch's widening cast gives it (255: NaN; 0: 2^-127). */
static float e8m0_value(uint8_t byte) {
    union { uint32_t bits; float value; } v = {byte == 255 ? 0x7FC00000u : (byte ? (uint32_t)byte << 23 : 0x00400000u)};
    return v.value;
}

static uint16_t to_bf16(float f) {
    union { float value; uint32_t bits; } u = {f};
    if ((u.bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u.bits >> 16) | 0x0040u);
    return (uint16_t)((u.bits + 0x7fffu + ((u.bits >> 16) & 1u)) >> 16);
}

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
        const float *wsrow = job->ws ? job->ws + row * nb : NULL;
        const int64_t ld = (K + job->cg - 1) / job->cg;
        const uint8_t *ws8row = job->ws8 ? job->ws8 + (p * ((N + job->rg - 1) / job->rg) + n / job->rg) * ld : NULL;
        const float *qs = job->qs + p * M * nb;
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
                    partial = partial * (wsrow ? wsrow[k] : e8m0_value(ws8row[k * BLOCK / job->cg]));
                    acc[r] = acc[r] + partial;
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t at = (p * M + m0 + r) * N + n;
                if (job->out) job->out[at] = acc[r];
                else job->out_bf16[at] = to_bf16(acc[r]);
            }
        }
    }
}

/* The products of every pair's rows, split over `threads` OpenMP threads (torch's pool:
 * native/__init__.py): job's P·N output rows, activation bytes q decoded once. Returns 0, or -1 if
 * memory could not be had (nothing is then written; the caller takes the torch path). */
static int run(Job job, int64_t P, int threads, const uint8_t *q, const int32_t *e4m3_int) {
    const int64_t M = job.M, N = job.N, K = job.K;
    float *act = NULL;
    int32_t *act_int = NULL;
    if (job.fp4) act_int = malloc(sizeof(int32_t) * P * M * K);
    else act = malloc(sizeof(float) * P * M * K);
    if (act == NULL && act_int == NULL) return -1;
    for (int64_t i = 0; i < P * M * K; i++) {
        if (job.fp4) act_int[i] = e4m3_int[q[i]];
        else act[i] = job.e4m3[q[i]];
    }
    job.act = act;
    job.act_int = act_int;
    if (threads < 1) threads = 1;
    if (threads > P * N) threads = (int)(P * N);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t = 0, nt = 1;
#if defined(_OPENMP)
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        Job mine = job;
        mine.begin = P * N * t / nt;
        mine.end = P * N * (t + 1) / nt;
        run_rows(&mine);
    }
    free(act);
    free(act_int);
    return 0;
}

/* P pairs, each [M, K] activations (q, e4m3 bytes, qs scales) through its own [N, K] weight with fp32
 * scales ws [P, N, K/32], into fp32 out [P, M, N]. */
int dsv41_block_gemm(int64_t P, int64_t M, int64_t N, int64_t K, int fp4, int threads,
                     const uint8_t *q, const float *qs, const uint8_t *w, const float *ws,
                     const float *e4m3, const int32_t *e4m3_int, const int8_t *e2m1_int, float *out) {
    const Job job = {M, N, K, 0, 0, fp4, qs, w, ws, NULL, 1, 1, NULL, NULL, e4m3, e2m1_int, out, NULL};
    return run(job, P, threads, q, e4m3_int);
}

void dsv41_fp8_act_quant(int64_t rows, int64_t K, const float *x, float floor, float inv_max, uint8_t *q,
                         float *scale);

/* layers.py `quantized_linear` / `quantized_pairs` whole: x [P, M, K] (bf16 or fp32) quantised per 32
 * (`dsv41_fp8_act_quant`), the blockwise GEMM against the stored weight and its stored ue8m0 scales
 * (tiles of rg × cg), bf16 out [P, M, N]: one call instead of the scales widened and repeated, the
 * activations quantised and the product run as separate torch steps. Returns 0 or -1 (no memory). */
int dsv41_quantized_linear(int64_t P, int64_t M, int64_t N, int64_t K, int fp4, int threads, const void *x,
                           int x_bf16, float floor, float inv_max, const uint8_t *w, const uint8_t *ws8,
                           int64_t rg, int64_t cg, const float *e4m3, const int32_t *e4m3_int,
                           const int8_t *e2m1_int, uint16_t *out) {
    const int64_t n = P * M * K;
    float *xf = malloc(sizeof(float) * n + sizeof(float) * (n / BLOCK));
    uint8_t *q = malloc((size_t)n);
    if (xf == NULL || q == NULL) {
        free(xf);
        free(q);
        return -1;
    }
    float *qs = xf + n;
    for (int64_t i = 0; i < n; i++) {
        if (x_bf16) {
            union { uint32_t bits; float value; } v = {(uint32_t)((const uint16_t *)x)[i] << 16};
            xf[i] = v.value;
        } else {
            xf[i] = ((const float *)x)[i];
        }
    }
    dsv41_fp8_act_quant(P * M, K, xf, floor, inv_max, q, qs);
    const Job job = {M, N, K, 0, 0, fp4, qs, w, NULL, ws8, rg, cg, NULL, NULL, e4m3, e2m1_int, NULL, out};
    const int status = run(job, P, threads, q, e4m3_int);
    free(xf);
    free(q);
    return status;
}
