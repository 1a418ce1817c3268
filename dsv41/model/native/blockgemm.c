/* The quantised blockwise GEMM of docs/ARCHITECTURE.md §6.3, read straight from the stored weight
 * bytes: a decode step's few rows one at a time, a prefill's in register tiles (dsv41/model/native/
 * __init__.py builds and calls it; docs/NUMERICS.md N11, N14),
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

#include "bf16.h"
#include "span.h"
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

/* With AVX-512 a block's 32 weights decode in vector lanes, straight to floats: e4m3 bytes through
 * the fp16 converter (sign and the 7 low bits moved into a half's layout read 2^8 below the e4m3
 * value, subnormals included, and the power of two restores it exactly; 0x7F / 0xFF are NaN), e2m1
 * nibbles as indices into a 16-entry table. Products with the activations are exact in fp32 (at
 * most 8 significant bits) and are summed in double lanes, exactly, for fp4 as for fp8. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VECTOR_BLOCKS 1

static inline __m512 fp8_lanes(const uint8_t *bytes) {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)bytes));
    const __m256i low = _mm256_and_si256(h, _mm256_set1_epi16(0x7F));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(low, 7));
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    return _mm512_mask_mov_ps(v, _mm256_cmpeq_epi16_mask(low, _mm256_set1_epi16(0x7F)), _mm512_set1_ps(NAN));
}

/* The 32 values of one fp4 block's 16 bytes (low nibble first) as two vectors of 16 floats. */
static inline void fp4_lanes(const uint8_t *bytes, __m512 table, __m512 *v0, __m512 *v1) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i even = _mm_and_si128(packed, nibble), odd = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    *v0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd)), table);
    *v1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(even, odd)), table);
}

/* Σ a[j] · w[j] over a block, exact: fp32 products widened and added in double lanes. */
static inline double block_sum_lanes(const float *a, __m512 w0, __m512 w1) {
    const __m512 p0 = _mm512_mul_ps(_mm512_loadu_ps(a), w0), p1 = _mm512_mul_ps(_mm512_loadu_ps(a + 16), w1);
    const __m512d d0 = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(p0)),
                                     _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p0), 1))));
    const __m512d d1 = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(p1)),
                                     _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p1), 1))));
    return _mm512_reduce_add_pd(_mm512_add_pd(d0, d1));
}
#else
#define VECTOR_BLOCKS 0
#endif

/* Whether this build decodes and sums blocks in AVX-512 lanes (tests pick their mutations by it). */
int dsv41_vector_blocks(void) { return VECTOR_BLOCKS; }

#define ROWS_AT_ONCE 16

static void run_rows(const Job *job) {
    const int64_t M = job->M, N = job->N, K = job->K, nb = K / BLOCK;
    const int64_t row_bytes = job->fp4 ? K / 2 : K, block_bytes = job->fp4 ? BLOCK / 2 : BLOCK;
    float acc[ROWS_AT_ONCE], v[BLOCK];
    int8_t v_int[BLOCK];
#if VECTOR_BLOCKS
    float halves[16];
    for (int i = 0; i < 16; i++) halves[i] = 0.5f * (float)job->e2m1_int[i];
    const __m512 e2m1 = _mm512_loadu_ps(halves);
#endif
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
#if VECTOR_BLOCKS
                __m512 w0, w1;
                if (job->fp4) fp4_lanes(bytes, e2m1, &w0, &w1);
                else {
                    w0 = fp8_lanes(bytes);
                    w1 = fp8_lanes(bytes + 16);
                }
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t m = m0 + r;
                    float partial = (float)block_sum_lanes(job->act + (p * M + m) * K + k * BLOCK, w0, w1);
                    partial = partial * qs[m * nb + k];
                    partial = partial * (wsrow ? wsrow[k] : e8m0_value(ws8row[k * BLOCK / job->cg]));
                    acc[r] = acc[r] + partial;
                }
                continue;
#endif
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
                else job->out_bf16[at] = float_to_bf16(acc[r]);
            }
        }
    }
}

/* Many rows (a prefill's GEMMs) without AVX-512 (with it, `run_columns` below, N25): tiles of TILE_COLS
 * output columns, whose weight block is decoded
 * once into doubles laid out [j][column] and swept down TILE_ROWS activation rows at a time. A block's
 * 32 products are exact in double, and so is their sum (the bounds above, for fp8 and fp4 alike), so
 * fused multiply-adds in this order give the same S as the row kernels; the fp32 steps after it are
 * theirs. Rows are taken CHUNK_ROWS at a time, their activations widened to double once per chunk. */
#define TILE_COLS 16
#define TILE_ROWS 6
#define CHUNK_ROWS 256
#define TILED_FROM 8

static void decode_tile(const Job *job, int64_t p, int64_t n0, int64_t cols, int64_t k, double wt[BLOCK][TILE_COLS],
                        float wsc[TILE_COLS]) {
    const int64_t N = job->N, K = job->K, nb = K / BLOCK;
    const int64_t row_bytes = job->fp4 ? K / 2 : K, ld = (K + job->cg - 1) / job->cg;
    int8_t v_int[BLOCK];
    for (int64_t c = 0; c < TILE_COLS; c++) {
        if (c >= cols) {
            for (int j = 0; j < BLOCK; j++) wt[j][c] = 0.0;
            wsc[c] = 0.0f;
            continue;
        }
        const int64_t n = n0 + c;
        const uint8_t *bytes = job->w + (p * N + n) * row_bytes + k * (job->fp4 ? BLOCK / 2 : BLOCK);
        if (job->fp4) {
            decode_fp4_block(bytes, job->e2m1_int, v_int);
            for (int j = 0; j < BLOCK; j++) wt[j][c] = 0.5 * (double)v_int[j];
        } else {
            for (int j = 0; j < BLOCK; j++) wt[j][c] = (double)job->e4m3[bytes[j]];
        }
        wsc[c] = job->ws ? job->ws[(p * N + n) * nb + k]
                         : e8m0_value(job->ws8[(p * ((N + job->rg - 1) / job->rg) + n / job->rg) * ld + k * BLOCK / job->cg]);
    }
}

typedef double lanes __attribute__((vector_size(8 * sizeof(double))));
#define LANES 8
#define TILE_VECS (TILE_COLS / LANES)

/* S[r][c] = Σ_j a[r][j] · wt[j][c] for TILE_ROWS activation rows (rows past `rows` repeat the last
 * one, their sums unused), in vector lanes of doubles. Contracting x · w + s into a fused multiply-add
 * changes nothing here, the product being exact, so this function alone may. */
__attribute__((optimize("fp-contract=fast")))
static void tile_sums(const double *a, int64_t K, int64_t rows, const double wt[BLOCK][TILE_COLS],
                      double s[TILE_ROWS][TILE_COLS]) {
    const double *row[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) row[r] = a + (r < rows ? r : rows - 1) * K;
    lanes acc[TILE_ROWS][TILE_VECS];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int v = 0; v < TILE_VECS; v++) acc[r][v] = (lanes){0};
    for (int j = 0; j < BLOCK; j++) {
        lanes w[TILE_VECS];
        memcpy(w, wt[j], sizeof w);
        for (int r = 0; r < TILE_ROWS; r++) {
            const double x = row[r][j];
            for (int v = 0; v < TILE_VECS; v++) acc[r][v] += x * w[v];
        }
    }
    memcpy(s, acc, sizeof acc);
}

/* acc[r][c] += the fp32 steps of S[r][c] (rounded once, times the row's and the column's scale). */
static void tile_rows(const double *a, int64_t K, int64_t rows, const double wt[BLOCK][TILE_COLS], const float *qs,
                      int64_t nb, const float wsc[TILE_COLS], float (*acc)[TILE_COLS]) {
    double s[TILE_ROWS][TILE_COLS];
    tile_sums(a, K, rows, wt, s);
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < TILE_COLS; c++) {
            float partial = (float)s[r][c];
            partial = partial * qs[r * nb];
            partial = partial * wsc[c];
            acc[r][c] = acc[r][c] + partial;
        }
}

/* Output tiles begin..end (pair-major, ⌈N / TILE_COLS⌉ per pair) for rows m0 .. m0 + rows of a chunk
 * whose activations a64 [P, rows, K] are doubles. */
static void run_tiles(const Job *job, const double *a64, int64_t m0, int64_t rows, int64_t begin, int64_t end) {
    const int64_t M = job->M, N = job->N, K = job->K, nb = K / BLOCK, tiles = (N + TILE_COLS - 1) / TILE_COLS;
    double wt[BLOCK][TILE_COLS] __attribute__((aligned(64)));
    float wsc[TILE_COLS], acc[CHUNK_ROWS][TILE_COLS];
    for (int64_t t = begin; t < end; t++) {
        const int64_t p = t / tiles, n0 = (t % tiles) * TILE_COLS;
        const int64_t cols = N - n0 < TILE_COLS ? N - n0 : TILE_COLS;
        memset(acc, 0, sizeof(float) * TILE_COLS * rows);
        for (int64_t k = 0; k < nb; k++) {
            decode_tile(job, p, n0, cols, k, wt, wsc);
            for (int64_t r = 0; r < rows; r += TILE_ROWS)
                tile_rows(a64 + (p * rows + r) * K + k * BLOCK, K, rows - r < TILE_ROWS ? rows - r : TILE_ROWS, wt,
                          job->qs + (p * M + m0 + r) * nb + k, nb, wsc, acc + r);
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++) {
                const int64_t at = (p * M + m0 + r) * N + n0 + c;
                if (job->out) job->out[at] = acc[r][c];
                else job->out_bf16[at] = float_to_bf16(acc[r][c]);
            }
    }
}

static int run_tiled(const Job *job, int64_t P, int threads, const uint8_t *q) {
    const int64_t M = job->M, N = job->N, K = job->K, tiles = P * ((N + TILE_COLS - 1) / TILE_COLS);
    const int64_t chunk = M < CHUNK_ROWS ? M : CHUNK_ROWS;
    double *a64 = malloc(sizeof(double) * P * chunk * K);
    if (a64 == NULL) return -1;
    if (threads < 1) threads = 1;
    if (threads > tiles) threads = (int)tiles;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        for (int64_t p = 0; p < P; p++)
            for (int64_t i = 0; i < rows * K; i++) a64[p * rows * K + i] = (double)job->e4m3[q[(p * M + m0) * K + i]];
        #pragma omp parallel num_threads(threads) if (threads > 1)
        {
            const Span span = thread_span(tiles);
            run_tiles(job, a64, m0, rows, span.begin, span.end);
        }
    }
    free(a64);
    return 0;
}

#if VECTOR_BLOCKS
/* Many rows with AVX-512 (N25): the lanes run down the activation rows, not across the columns. A
 * chunk's activations are widened to double once and stored K-major ([K][rows], rows padded with
 * zeros to whole vectors of 8), and so are its block scales; each column's 32-value weight block
 * decodes in vector lanes (`fp8_lanes`, `fp4_lanes`) into 32 doubles, and S for 8 columns × up to 24
 * rows is 32 fused multiply-adds of a row vector by a broadcast weight per column and vector. The
 * products are exact and so is every partial sum (the bounds at the top), so S is the row kernels'
 * in any order; the fp32 steps after it are theirs, vector by vector: S rounded once to fp32, times
 * the rows' scales, times the column's, added. Before, the weights decoded one value at a time into
 * a [j][column] tile and the fp32 steps ran one output at a time, costing more than the sums. */
#define VCOLS 8
#define RV_MAX 3

/* Block k of columns n0 … n0 + VCOLS − 1 (past `cols`: zeros) of pair p as doubles w[c][j], and their scales. */
static void decode_columns(const Job *job, __m512 e2m1, int64_t p, int64_t n0, int64_t cols, int64_t k,
                           double w[VCOLS][BLOCK], float wsc[VCOLS]) {
    const int64_t N = job->N, K = job->K, nb = K / BLOCK;
    const int64_t row_bytes = job->fp4 ? K / 2 : K, ld = (K + job->cg - 1) / job->cg;
    for (int64_t c = 0; c < VCOLS; c++) {
        if (c >= cols) {
            for (int j = 0; j < BLOCK; j += 8) _mm512_storeu_pd(w[c] + j, _mm512_setzero_pd());
            wsc[c] = 0.0f;
            continue;
        }
        const int64_t n = n0 + c;
        const uint8_t *bytes = job->w + (p * N + n) * row_bytes + k * (job->fp4 ? BLOCK / 2 : BLOCK);
        __m512 v0, v1;
        if (job->fp4) fp4_lanes(bytes, e2m1, &v0, &v1);
        else {
            v0 = fp8_lanes(bytes);
            v1 = fp8_lanes(bytes + 16);
        }
        _mm512_storeu_pd(w[c], _mm512_cvtps_pd(_mm512_castps512_ps256(v0)));
        _mm512_storeu_pd(w[c] + 8, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v0), 1))));
        _mm512_storeu_pd(w[c] + 16, _mm512_cvtps_pd(_mm512_castps512_ps256(v1)));
        _mm512_storeu_pd(w[c] + 24, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v1), 1))));
        wsc[c] = job->ws ? job->ws[(p * N + n) * nb + k]
                         : e8m0_value(job->ws8[(p * ((N + job->rg - 1) / job->rg) + n / job->rg) * ld + k * BLOCK / job->cg]);
    }
}

/* acc[c][r] += the fp32 steps of S[c][r] for RV vectors of 8 rows from aT (block k's 32 rows of the
 * K-major activations, `stride` doubles apart) and qsT (block k's row scales). RV is a constant at
 * each call, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void column_rows(int RV, const double *aT, int64_t stride, const float *qsT,
                                                              const double w[VCOLS][BLOCK], const float wsc[VCOLS],
                                                              float *acc, int64_t acc_stride) {
    __m512d s[VCOLS][RV_MAX];
    for (int c = 0; c < VCOLS; c++)
        for (int v = 0; v < RV; v++) s[c][v] = _mm512_setzero_pd();
    for (int j = 0; j < BLOCK; j++) {
        __m512d a[RV_MAX];
        for (int v = 0; v < RV; v++) a[v] = _mm512_loadu_pd(aT + j * stride + 8 * v);
        for (int c = 0; c < VCOLS; c++) {
            const __m512d wc = _mm512_set1_pd(w[c][j]);
            for (int v = 0; v < RV; v++) s[c][v] = _mm512_fmadd_pd(a[v], wc, s[c][v]);
        }
    }
    for (int v = 0; v < RV; v++) {
        const __m256 qs = _mm256_loadu_ps(qsT + 8 * v);
        for (int c = 0; c < VCOLS; c++) {
            float *at = acc + c * acc_stride + 8 * v;
            __m256 partial = _mm512_cvtpd_ps(s[c][v]);
            partial = _mm256_mul_ps(partial, qs);
            partial = _mm256_mul_ps(partial, _mm256_set1_ps(wsc[c]));
            _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), partial));
        }
    }
}

/* Column tiles begin..end (pair-major, ⌈N / VCOLS⌉ per pair) for rows m0 .. m0 + rows of a chunk:
 * aT [P, K, RP] and qsT [P, K/32, RP], RP = rows padded to a multiple of 8. */
static void run_columns(const Job *job, const double *aT, const float *qsT, int64_t m0, int64_t rows, int64_t RP,
                        int64_t begin, int64_t end, float *acc) {
    const int64_t M = job->M, N = job->N, K = job->K, nb = K / BLOCK, tiles = (N + VCOLS - 1) / VCOLS;
    double w[VCOLS][BLOCK] __attribute__((aligned(64)));
    float wsc[VCOLS], halves[16];
    for (int i = 0; i < 16; i++) halves[i] = 0.5f * (float)job->e2m1_int[i];
    const __m512 e2m1 = _mm512_loadu_ps(halves);
    for (int64_t t = begin; t < end; t++) {
        const int64_t p = t / tiles, n0 = (t % tiles) * VCOLS;
        const int64_t cols = N - n0 < VCOLS ? N - n0 : VCOLS;
        memset(acc, 0, sizeof(float) * VCOLS * RP);
        for (int64_t k = 0; k < nb; k++) {
            decode_columns(job, e2m1, p, n0, cols, k, w, wsc);
            const double *a = aT + (p * K + k * BLOCK) * RP;
            const float *qs = qsT + (p * nb + k) * RP;
            int64_t r = 0;
            for (; r + 8 * RV_MAX <= RP; r += 8 * RV_MAX) column_rows(RV_MAX, a + r, RP, qs + r, w, wsc, acc + r, RP);
            if (RP - r == 16) column_rows(2, a + r, RP, qs + r, w, wsc, acc + r, RP);
            else if (RP - r == 8) column_rows(1, a + r, RP, qs + r, w, wsc, acc + r, RP);
        }
        for (int64_t c = 0; c < cols; c++)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t at = (p * M + m0 + r) * N + n0 + c;
                if (job->out) job->out[at] = acc[c * RP + r];
                else job->out_bf16[at] = float_to_bf16(acc[c * RP + r]);
            }
    }
}

static int run_columns_tiled(const Job *job, int64_t P, int threads, const uint8_t *q) {
    const int64_t M = job->M, N = job->N, K = job->K, nb = K / BLOCK, tiles = P * ((N + VCOLS - 1) / VCOLS);
    const int64_t chunk = M < CHUNK_ROWS ? M : CHUNK_ROWS, RPmax = (chunk + 7) / 8 * 8;
    if (threads < 1) threads = 1;
    if (threads > tiles) threads = (int)tiles;
    double *aT = malloc(sizeof(double) * P * K * RPmax);
    float *qsT = malloc(sizeof(float) * P * nb * RPmax), *acc = malloc(sizeof(float) * threads * VCOLS * RPmax);
    if (aT == NULL || qsT == NULL || acc == NULL) {
        free(aT); free(qsT); free(acc);
        return -1;
    }
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk, RP = (rows + 7) / 8 * 8;
        #pragma omp parallel num_threads(threads) if (threads > 1)
        {
            /* block b's 32 activation columns and scales, K-major: each row read in order, the writes
             * within the block's RP × 32 doubles (L1) */
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < P * nb; b++) {
                const int64_t p = b / nb, k = b % nb;
                double *col = aT + (p * K + k * BLOCK) * RP;
                for (int64_t r = 0; r < RP; r++) {
                    if (r >= rows) {
                        for (int j = 0; j < BLOCK; j++) col[j * RP + r] = 0.0;
                        qsT[b * RP + r] = 0.0f;
                        continue;
                    }
                    const uint8_t *src = q + (p * M + m0 + r) * K + k * BLOCK;
                    for (int j = 0; j < BLOCK; j++) col[j * RP + r] = (double)job->e4m3[src[j]];
                    qsT[b * RP + r] = job->qs[(p * M + m0 + r) * nb + k];
                }
            }
            const Span span = thread_span(tiles);
            run_columns(job, aT, qsT, m0, rows, RP, span.begin, span.end, acc + span.index * VCOLS * RPmax);
        }
    }
    free(aT); free(qsT); free(acc);
    return 0;
}
#endif

/* The products of every pair's rows, split over `threads` OpenMP threads (torch's pool:
 * native/__init__.py): job's P·N output rows, activation bytes q decoded once. Returns 0, or -1 if
 * memory could not be had (nothing is then written; the caller takes the torch path). */
static int run(Job job, int64_t P, int threads, const uint8_t *q, const int32_t *e4m3_int) {
    const int64_t M = job.M, N = job.N, K = job.K;
#if VECTOR_BLOCKS
    if (M >= TILED_FROM) return run_columns_tiled(&job, P, threads, q);
#else
    if (M >= TILED_FROM) return run_tiled(&job, P, threads, q);
#endif
    float *act = NULL;
    int32_t *act_int = NULL;
    const int integer = job.fp4 && !VECTOR_BLOCKS;     /* fp4 blocks summed in int32 (no vector lanes) */
    if (integer) act_int = malloc(sizeof(int32_t) * P * M * K);
    else act = malloc(sizeof(float) * P * M * K);
    if (act == NULL && act_int == NULL) return -1;
    for (int64_t i = 0; i < P * M * K; i++) {
        if (integer) act_int[i] = e4m3_int[q[i]];
        else act[i] = job.e4m3[q[i]];
    }
    job.act = act;
    job.act_int = act_int;
    if (threads < 1) threads = 1;
    if (threads > P * N) threads = (int)(P * N);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const Span span = thread_span(P * N);
        Job mine = job;
        mine.begin = span.begin;
        mine.end = span.end;
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
    /* rows quantise on their own (the same bytes split any way): a prefill's rows over the threads */
    #pragma omp parallel num_threads(threads) if (threads > 1 && P * M >= TILED_FROM)
    {
        const Span span = thread_span(P * M);
        for (int64_t i = span.begin * K; i < span.end * K; i++) {
            if (x_bf16) {
                union { uint32_t bits; float value; } v = {(uint32_t)((const uint16_t *)x)[i] << 16};
                xf[i] = v.value;
            } else {
                xf[i] = ((const float *)x)[i];
            }
        }
        dsv41_fp8_act_quant(span.end - span.begin, K, xf + span.begin * K, floor, inv_max, q + span.begin * K,
                            qs + span.begin * (K / BLOCK));
    }
    const Job job = {M, N, K, 0, 0, fp4, qs, w, NULL, ws8, rg, cg, NULL, NULL, e4m3, e2m1_int, NULL, out};
    const int status = run(job, P, threads, q, e4m3_int);
    free(xf);
    free(q);
    return status;
}
