/* Dense products at decode sizes: a few activation rows against a weight held in bf16 or fp32
 * (dsv41/model/native/__init__.py builds and calls it; docs/NUMERICS.md N12, N13).
 *
 * out[p, m, n] = Σ_k x[p, m, k] · w[p, n, k]
 *   fast:  fp32 fused multiply-adds, summed in this kernel's own order (fast numerics' licence);
 *   exact: every product in double, where it is exact (24 + 24 significant bits < 53), summed in
 *          double and rounded once to fp32: the invariant kernels' float64 product (numerics.py
 *          `linear`), which gives the same fp32 result in any summation order (NUMERICS.md N1).
 *
 * A decode step's GEMMs have one row (a few at small batches), so their cost is reading the weight
 * once: this loop streams each weight row through multiply-adds against every activation row, where
 * torch's bf16 path (oneDNN) spends ~40 µs of fixed cost per call beyond the read and the float64
 * path first writes a float64 copy of the weight.
 * Every operand is addressed by strides in elements (the innermost stride is 1): a row slice of a
 * result, one expert of a stacked bank or a grouped einsum's operand is read and written in place.
 * bf16 inputs widen exactly (the upper half of a float); a bf16 output rounds once from the fp32
 * result, to nearest even, as torch's cast does (NaN stays NaN).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "fp4.h"
#include "kernels.h"
#include "span.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8
/* Most activation rows of a bf16 product that take the dot products where AMX tiles are there (N37):
 * past them the tiles, whose cost barely grows with the rows (the dot products' grows with each). */
#define AMX_FROM_ROWS 4
/* The same for a routed expert's group of rows from a stored fp4 bank: its tile decodes each block once
 * for all the group's rows beside the tiles (N38), where the dot products decode it once and then pay a
 * vdpbf16ps per row, so the tiles win from 2 rows (N40). */
#define AMX_STORED_FROM_ROWS 1
/* Columns of the routed experts' sum a thread adds at a time: two threads share a dim-1024 row. */
#define SUM_SPAN 128
/* A held expert's tile of rows costs a thread about this many of a stored one's (4× the bytes, no
 * decoding): the threads split the experts' tiles by this cost. Measured per thread on a 16-token stored
 * step (N40): at 1 (a split by count) the last thread, which holds the shared expert, took ~12% longer
 * than the first over the gate and up tiles, at 4 the first ~11% longer, at 2–2.7 within ~4%. */
#define HELD_TILE_COST 2.3

typedef struct {
    int64_t P, M, N, K;
    int w_bf16, out_bf16, exact;
    const void *x;           /* [P, M, K] activations, contiguous: fp32, or double when exact */
    const void *w;
    int64_t w_sp, w_sn;
    void *out;
    int64_t o_sp, o_sm;
} Gemv;

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* Eight weight values from k on, widened to fp32 (bf16: the upper half of a float). */
static inline __m256 weight_lanes8(const void *w, int w_bf16, int64_t k) {
    if (!w_bf16) return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The sum of a + b's eight lanes, in one fixed order: halves, then pairs, then the last two. */
static inline float lane_sum8(__m256 a, __m256 b) {
    const __m256 t = _mm256_add_ps(a, b);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* The sum of a + b's four double lanes: halves, then the last two. */
static inline double lane_sum4d(__m256d a, __m256d b) {
    const __m256d t = _mm256_add_pd(a, b);
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

/* `row_dot`'s vector loop on AVX2 → the k it stopped at. Inlined where M is a constant (1 … 4: a
 * decode step, an expert's few tokens) the compiler keeps the 2·M sums in registers; for a runtime
 * count it keeps them on the stack, a load and a store per multiply-add (N23). The weight is read 2 KB
 * ahead of the loads (its rows follow each other, so that runs into the next row). Every count sums
 * the same lanes in the same K order and reduces them alike, so a row's result is the same in any. */
static inline __attribute__((always_inline)) int64_t row_dot8(const float *x, int64_t M, int64_t K, const void *w,
                                                              int w_bf16, float *acc) {
    __m256 s[MAX_ROWS][2];
    const int64_t ww = w_bf16 ? 2 : 4;
    int64_t k = 0;
    for (int64_t m = 0; m < M; m++) s[m][0] = s[m][1] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        if ((k * ww) % 64 == 0) _mm_prefetch((const char *)w + k * ww + 2048, _MM_HINT_T0);
        const __m256 v0 = weight_lanes8(w, w_bf16, k), v1 = weight_lanes8(w, w_bf16, k + 8);
        for (int64_t m = 0; m < M; m++) {
            s[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), v0, s[m][0]);
            s[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), v1, s[m][1]);
        }
    }
    for (int64_t m = 0; m < M; m++) acc[m] = lane_sum8(s[m][0], s[m][1]);
    return k;
}
#endif

#if defined(__AVX512F__)
/* `row_dot`'s vector loop with AVX-512 → the k it stopped at; `row_dot8`'s scheme in 16 lanes: inlined
 * per constant row count (1 … 4) the 2·M sums stay in registers, and the weight is asked for 2 KB ahead
 * of its loads. Before, the sums of a runtime count lived on the stack and the weight came by the
 * hardware prefetcher alone: the bf16 head widened into fp32 rows (8192 × 1024) streamed at ~18 GB/s on
 * two threads (N31). Every count sums the same lanes in the same K order and reduces them alike. */
static inline __attribute__((always_inline)) int64_t row_dot16(const float *x, int64_t M, int64_t K, const void *w,
                                                               int w_bf16, float *acc) {
    __m512 s[MAX_ROWS][2];
    const int64_t ww = w_bf16 ? 2 : 4;
    int64_t k = 0;
    for (int64_t m = 0; m < M; m++) s[m][0] = s[m][1] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m512 v0, v1;
        _mm_prefetch((const char *)w + k * ww + 2048, _MM_HINT_T0);
        if (w_bf16) {
            const uint16_t *wb = (const uint16_t *)w + k;
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)wb)), 16));
            v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wb + 16))), 16));
        } else {
            _mm_prefetch((const char *)w + k * ww + 2048 + 64, _MM_HINT_T0);
            v0 = _mm512_loadu_ps((const float *)w + k);
            v1 = _mm512_loadu_ps((const float *)w + k + 16);
        }
        for (int64_t m = 0; m < M; m++) {
            s[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), v0, s[m][0]);
            s[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), v1, s[m][1]);
        }
    }
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_reduce_add_ps(_mm512_add_ps(s[m][0], s[m][1]));
    return k;
}
#endif

/* The vector loop this build has: 16 lanes with AVX-512, else 8 with AVX2 and FMA (none: scalar). */
#if defined(__AVX512F__)
#define ROW_DOT_LOOP row_dot16
#elif defined(__AVX2__) && defined(__FMA__)
#define ROW_DOT_LOOP row_dot8
#endif

/* One weight row (K values from `w`, bf16 or fp32) against M fp32 activation rows x[m * K …]: acc[m]. */
static void row_dot(const float *x, int64_t M, int64_t K, const void *w, int w_bf16, float *acc) {
    int64_t k = 0;
#if defined(ROW_DOT_LOOP)
    switch (M) {                                /* a constant count per call site: sums in registers */
    case 1: k = ROW_DOT_LOOP(x, 1, K, w, w_bf16, acc); break;
    case 2: k = ROW_DOT_LOOP(x, 2, K, w, w_bf16, acc); break;
    case 3: k = ROW_DOT_LOOP(x, 3, K, w, w_bf16, acc); break;
    case 4: k = ROW_DOT_LOOP(x, 4, K, w, w_bf16, acc); break;
    default: k = ROW_DOT_LOOP(x, M, K, w, w_bf16, acc);
    }
#else
    for (int64_t m = 0; m < M; m++) acc[m] = 0.0f;
#endif
    for (; k < K; k++) {
        float v = w_bf16 ? bf16_to_float(((const uint16_t *)w)[k]) : ((const float *)w)[k];
        for (int64_t m = 0; m < M; m++) acc[m] += x[m * K + k] * v;
    }
}

/* Weight rows per register tile (and activation rows per pass of one). */
#define TILE 4

#if defined(__AVX512F__)

static inline __m512 weight_lanes(const void *w, int w_bf16, int64_t k) {
    if (!w_bf16) return _mm512_loadu_ps((const float *)w + k);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* TILE weight rows w[i] against TILE activation rows x[r] (fast mode): acc[r][i], every weight and
 * activation vector loaded once for TILE × TILE multiply-adds held in registers, where `row_dot`
 * reloads each activation row per weight row. */
static void tile_dot(const float *const x[TILE], int64_t K, const void *const w[TILE], int w_bf16,
                     float acc[TILE][TILE]) {
    __m512 s[TILE][TILE];
    for (int r = 0; r < TILE; r++)
        for (int i = 0; i < TILE; i++) s[r][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 v[TILE], a[TILE];
        for (int i = 0; i < TILE; i++) v[i] = weight_lanes(w[i], w_bf16, k);
        for (int r = 0; r < TILE; r++) a[r] = _mm512_loadu_ps(x[r] + k);
        for (int r = 0; r < TILE; r++)
            for (int i = 0; i < TILE; i++) s[r][i] = _mm512_fmadd_ps(a[r], v[i], s[r][i]);
    }
    for (int r = 0; r < TILE; r++)
        for (int i = 0; i < TILE; i++) acc[r][i] = _mm512_reduce_add_ps(s[r][i]);
    for (; k < K; k++)
        for (int i = 0; i < TILE; i++) {
            const float v = w_bf16 ? bf16_to_float(((const uint16_t *)w[i])[k]) : ((const float *)w[i])[k];
            for (int r = 0; r < TILE; r++) acc[r][i] += x[r][k] * v;
        }
}
#endif

static inline void put(const Gemv *g, int64_t p, int64_t m, int64_t n, float v);

#if defined(__AVX512BF16__)
/* Four vectors' lane sums: [Σ a, Σ b, Σ c, Σ d] in 9 shuffles and adds, where four
 * _mm512_reduce_add_ps take ~30. */
static inline __m128 lane_sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 q = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(q), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#define PREFETCH_ROWS 16
/* How far ahead of its reads (bf16 values: 2 KB) a tile streaming one row at a time asks for lines. */
#define PREFETCH_AHEAD 1024

/* TILE bf16 weight rows against R ≤ TILE bf16 activation rows (fast mode, both operands bf16):
 * vdpbf16ps multiplies 32 pairs of bf16 values exactly and adds them into 16 fp32 lanes, twice the
 * multiply-adds per instruction of widening the weight to fp32, with no widening at all. The K tail
 * loads masked (zeros add nothing). R is a constant at each call site, so the loops unroll.
 *
 * Two orders, the same bits (every lane sums in K order either way). `streaming` (the tile is the one
 * pass over these weight rows, a decode step of at most TILE rows, or a routed expert's first pass over
 * its group's rows: the group's later passes find the rows in L1) reads each weight row to its end
 * before the next, one sequential stream with the activations in L1: four rows read side by side are
 * four short streams inside a page, which the hardware prefetcher barely follows (one row through
 * 2048 × 512: 137 µs side by side, 93 µs row by row; docs/NUMERICS.md N20). Otherwise the rows go
 * side by side, each loaded vector used R × TILE times: the later passes over a tile hit the cache,
 * and there the loads, not the stream, bound the loop. */
static inline __attribute__((always_inline)) void tile_dot_bf16(int R, int streaming, const uint16_t *const x[TILE],
                                                                int64_t K, const uint16_t *const w[TILE],
                                                                float acc[TILE][TILE]) {
    if (streaming) {
        __m512 s[TILE][TILE];                   /* its own: indexed by the row loop, it may live in memory */
        for (int i = 0; i < TILE; i++) {
            __m512 t[TILE];                     /* row i's sums, in registers while the row streams */
            for (int r = 0; r < R; r++) t[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 32) {
                const __mmask32 live = K - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
                const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(live, w[i] + k);
                _mm_prefetch((const char *)(w[i] + k + PREFETCH_AHEAD), _MM_HINT_T0);  /* past a row: the next */
                for (int r = 0; r < R; r++)
                    t[r] = _mm512_dpbf16_ps(t[r], (__m512bh)_mm512_maskz_loadu_epi16(live, x[r] + k), v);
            }
            for (int r = 0; r < R; r++) s[r][i] = t[r];
        }
        for (int r = 0; r < R; r++) _mm_storeu_ps(acc[r], lane_sums4(s[r][0], s[r][1], s[r][2], s[r][3]));
        return;
    }
    __m512 s[TILE][TILE];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < TILE; i++) s[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 live = K - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh v[TILE], a[TILE];
        for (int i = 0; i < TILE; i++) {
            v[i] = (__m512bh)_mm512_maskz_loadu_epi16(live, w[i] + k);
            /* the rows PREFETCH_ROWS on, where the next tiles read: the hardware's prefetcher alone
             * leaves a thread at half the read bandwidth (routed experts: 1.3 ms against 1.7) */
            _mm_prefetch((const char *)(w[i] + PREFETCH_ROWS * K + k), _MM_HINT_T0);
        }
        for (int r = 0; r < R; r++) a[r] = (__m512bh)_mm512_maskz_loadu_epi16(live, x[r] + k);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < TILE; i++) s[r][i] = _mm512_dpbf16_ps(s[r][i], a[r], v[i]);
    }
    for (int r = 0; r < R; r++) _mm_storeu_ps(acc[r], lane_sums4(s[r][0], s[r][1], s[r][2], s[r][3]));
}

/* `tile_dot_bf16` with R (1 … TILE) known only at run time: one unrolled copy per row count, inlined
 * into the caller (called through a function, the many-row passes ran at half speed). */
static inline __attribute__((always_inline)) void tile_dot_bf16_rows(int64_t R, int streaming,
                                                                     const uint16_t *const x[TILE], int64_t K,
                                                                     const uint16_t *const w[TILE],
                                                                     float acc[TILE][TILE]) {
    switch (R) {
        case 1: tile_dot_bf16(1, streaming, x, K, w, acc); break;
        case 2: tile_dot_bf16(2, streaming, x, K, w, acc); break;
        case 3: tile_dot_bf16(3, streaming, x, K, w, acc); break;
        default: tile_dot_bf16(4, streaming, x, K, w, acc); break;
    }
}

/* Output rows n0 … n1 of pair p from bf16 activations xs [M, K] (contiguous): weight tiles of TILE
 * rows (a tile past n1 repeats the last row, its results unused), activation rows TILE at a time. */
static void run_rows_bf16(const Gemv *g, const uint16_t *xs, int64_t p, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += TILE) {
        const uint16_t *w[TILE];
        for (int i = 0; i < TILE; i++)
            w[i] = (const uint16_t *)g->w + p * g->w_sp + (n + i < n1 ? n + i : n1 - 1) * g->w_sn;
        for (int64_t m0 = 0; m0 < g->M; m0 += TILE) {
            const int64_t R = g->M - m0 < TILE ? g->M - m0 : TILE;
            const uint16_t *x[TILE];
            float acc[TILE][TILE];
            for (int r = 0; r < TILE; r++) x[r] = xs + (m0 + (r < R ? r : 0)) * g->K;
            tile_dot_bf16_rows(R, g->M <= TILE, x, g->K, w, acc);
            for (int64_t r = 0; r < R; r++)
                for (int i = 0; i < TILE && n + i < n1; i++) put(g, p, m0 + r, n + i, acc[r][i]);
        }
    }
}
#endif

/* 1 where this build multiplies in wide register tiles (N12): bf16 activations by bf16 weights with
 * AVX512-BF16 dot products, fp32 ones (`bf16` 0) with AVX-512 multiply-adds; then the product keeps
 * pace with torch's to 32 rows, without them to 4. */
int dsv41_gemv_wide(int bf16) {
#if defined(__AVX512BF16__)
    if (bf16) return 1;
#endif
#if defined(__AVX512F__)
    if (!bf16) return 1;
#endif
    return 0;
}

/* `row_dot` with every product exact in double and the sum in double (one rounding to fp32 after). */
static void row_dot_exact(const double *x, int64_t M, int64_t K, const void *w, int w_bf16, float *acc) {
    double sum[MAX_ROWS];
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512d s[MAX_ROWS][2];
    for (int64_t m = 0; m < M; m++) s[m][0] = s[m][1] = _mm512_setzero_pd();
    for (; k + 16 <= K; k += 16) {
        __m512 v;
        if (w_bf16)
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k))), 16));
        else
            v = _mm512_loadu_ps((const float *)w + k);
        const __m512d v0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        const __m512d v1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        for (int64_t m = 0; m < M; m++) {
            s[m][0] = _mm512_fmadd_pd(_mm512_loadu_pd(x + m * K + k), v0, s[m][0]);
            s[m][1] = _mm512_fmadd_pd(_mm512_loadu_pd(x + m * K + k + 8), v1, s[m][1]);
        }
    }
    for (int64_t m = 0; m < M; m++) sum[m] = _mm512_reduce_add_pd(_mm512_add_pd(s[m][0], s[m][1]));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256d s[MAX_ROWS][2];
    for (int64_t m = 0; m < M; m++) s[m][0] = s[m][1] = _mm256_setzero_pd();
    for (; k + 8 <= K; k += 8) {
        const __m256 v = weight_lanes8(w, w_bf16, k);
        const __m256d v0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), v1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        for (int64_t m = 0; m < M; m++) {
            s[m][0] = _mm256_fmadd_pd(_mm256_loadu_pd(x + m * K + k), v0, s[m][0]);
            s[m][1] = _mm256_fmadd_pd(_mm256_loadu_pd(x + m * K + k + 4), v1, s[m][1]);
        }
    }
    for (int64_t m = 0; m < M; m++) sum[m] = lane_sum4d(s[m][0], s[m][1]);
#else
    for (int64_t m = 0; m < M; m++) sum[m] = 0.0;
#endif
    for (; k < K; k++) {
        const double v = w_bf16 ? bf16_to_float(((const uint16_t *)w)[k]) : ((const float *)w)[k];
        for (int64_t m = 0; m < M; m++) sum[m] += x[m * K + k] * v;
    }
    for (int64_t m = 0; m < M; m++) acc[m] = (float)sum[m];
}

static inline void put(const Gemv *g, int64_t p, int64_t m, int64_t n, float v) {
    char *dst = (char *)g->out + (p * g->o_sp + m * g->o_sm + n) * (g->out_bf16 ? 2 : 4);
    if (g->out_bf16) *(uint16_t *)dst = float_to_bf16(v);
    else *(float *)dst = v;
}

/* Output rows n0 … n1 of pair p. */
static void run_rows(const Gemv *g, int64_t p, int64_t n0, int64_t n1) {
    const size_t ww = g->w_bf16 ? 2 : 4, ow = g->out_bf16 ? 2 : 4;
#if defined(__AVX512F__)
    if (!g->exact && g->M > 1) {
        /* tiles of TILE × TILE; a tile past the last row or output repeats it, its results unused */
        const float *xs = (const float *)g->x + p * g->M * g->K;
        for (int64_t n = n0; n < n1; n += TILE) {
            const void *w[TILE];
            for (int i = 0; i < TILE; i++)
                w[i] = (const char *)g->w + (p * g->w_sp + (n + i < n1 ? n + i : n1 - 1) * g->w_sn) * ww;
            for (int64_t m0 = 0; m0 < g->M; m0 += TILE) {
                const float *x[TILE];
                float acc[TILE][TILE];
                for (int r = 0; r < TILE; r++) x[r] = xs + (m0 + r < g->M ? m0 + r : g->M - 1) * g->K;
                tile_dot(x, g->K, w, g->w_bf16, acc);
                for (int r = 0; r < TILE && m0 + r < g->M; r++)
                    for (int i = 0; i < TILE && n + i < n1; i++) put(g, p, m0 + r, n + i, acc[r][i]);
            }
        }
        return;
    }
#endif
    float acc[MAX_ROWS];
    for (int64_t n = n0; n < n1; n++) {
        const void *row = (const char *)g->w + (p * g->w_sp + n * g->w_sn) * ww;
        for (int64_t m0 = 0; m0 < g->M; m0 += MAX_ROWS) {          /* rows MAX_ROWS at a time */
            const int64_t rows = g->M - m0 < MAX_ROWS ? g->M - m0 : MAX_ROWS, at = (p * g->M + m0) * g->K;
            if (g->exact) row_dot_exact((const double *)g->x + at, rows, g->K, row, g->w_bf16, acc);
            else row_dot((const float *)g->x + at, rows, g->K, row, g->w_bf16, acc);
            for (int64_t m = 0; m < rows; m++) {
                char *dst = (char *)g->out + (p * g->o_sp + (m0 + m) * g->o_sm + n) * ow;
                if (g->out_bf16) *(uint16_t *)dst = float_to_bf16(acc[m]);
                else *(float *)dst = acc[m];
            }
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* bf16 operands of more than AMX_FROM_ROWS rows on AMX tiles (amx.c, N37): each pair's activations packed
 * once, then tiles of AMX_ROWS output rows split over the threads. A tile's weight rows are read in place
 * where they are whole (AMX_ROWS rows, K a multiple of 32), else copied first into a zero-padded
 * scratch. Returns 0, or -1 (an allocation failed; `out` untouched). */
static int run_amx(const Gemv *g, const uint16_t *x, int64_t x_sp, int64_t x_sm, int threads) {
    const int64_t Kp = AMX_PADDED(g->K), blocks = AMX_BLOCKS(g->M, AMX_ROWS), tiles = AMX_BLOCKS(g->N, AMX_ROWS);
    const int64_t packed = blocks * Kp * AMX_ROWS;                     /* uint16 values per pair */
    uint16_t *b = malloc((size_t)(g->P * packed) * sizeof(uint16_t));
    uint16_t *scratch = calloc((size_t)(threads * AMX_ROWS * Kp), sizeof(uint16_t));
    const int64_t per_thread = blocks > 1 ? blocks : 2;               /* sums a thread holds: a pair of tiles */
    float *c = malloc((size_t)(threads * per_thread * AMX_ROWS * AMX_ROWS) * sizeof(float));
    if (b == NULL || scratch == NULL || c == NULL) {
        free(b); free(scratch); free(c);
        return -1;
    }
    for (int64_t p = 0; p < g->P; p++) dsv41_amx_pack(g->M, g->K, x + p * x_sp, x_sm, AMX_ROWS, b + p * packed);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const Span span = thread_span(g->P * tiles);
        uint16_t *mine = scratch + span.index * AMX_ROWS * Kp;
        float *sums = c + span.index * per_thread * AMX_ROWS * AMX_ROWS;
        dsv41_amx_begin(AMX_ROWS);
        for (int64_t r = span.begin; r < span.end; r++) {
            const int64_t p = r / tiles, n0 = (r % tiles) * AMX_ROWS;
            const int64_t rows = g->N - n0 < AMX_ROWS ? g->N - n0 : AMX_ROWS;
            if (blocks == 1 && r + 1 < span.end && (r + 1) / tiles == p && n0 + 2 * AMX_ROWS <= g->N && g->K % 32 == 0) {
                /* the second tile's sums right after the first's: weight row i's at sums + i · AMX_ROWS */
                dsv41_amx_tile_pair((const uint16_t *)g->w + p * g->w_sp + n0 * g->w_sn, g->w_sn, Kp, b + p * packed, AMX_ROWS,
                                    sums, sums + AMX_ROWS * AMX_ROWS);
                for (int64_t m = 0; m < g->M; m++)
                    for (int64_t i = 0; i < 2 * AMX_ROWS; i++) put(g, p, m, n0 + i, sums[i * AMX_ROWS + m]);
                r++;
                continue;
            }
            int64_t stride;
            const uint16_t *w = dsv41_amx_rows((const uint16_t *)g->w + p * g->w_sp + n0 * g->w_sn, g->w_sn, rows,
                                               g->K, mine, &stride);
            dsv41_amx_tile(w, stride, Kp, b + p * packed, blocks, AMX_ROWS, sums);
            for (int64_t m = 0; m < g->M; m++)
                for (int64_t i = 0; i < rows; i++)
                    put(g, p, m, n0 + i, sums[((m / AMX_ROWS) * AMX_ROWS + i) * AMX_ROWS + m % AMX_ROWS]);
        }
        dsv41_amx_end();
    }
    free(b); free(scratch); free(c);
    return 0;
}
#endif

/* Rows of every pair split into `threads` equal spans of the P·N output rows. Returns 0, or -1 when
 * the shape is outside what this kernel takes (the caller then uses torch). */
int dsv41_gemv(int64_t P, int64_t M, int64_t N, int64_t K, int x_bf16, int w_bf16, int out_bf16, int exact,
               int threads, const void *x, int64_t x_sp, int64_t x_sm, const void *w, int64_t w_sp, int64_t w_sn,
               void *out, int64_t o_sp, int64_t o_sm) {
    if (M < 1 || K < 1 || P < 1 || N < 1 || threads < 1) return -1;
#if defined(__AVX512BF16__)
    const int dot = x_bf16 && w_bf16 && !exact;
#else
    const int dot = 0;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (dot && M > AMX_FROM_ROWS && dsv41_amx_ready()) {
        Gemv g = {P, M, N, K, w_bf16, out_bf16, exact, NULL, w, w_sp, w_sn, out, o_sp, o_sm};
        return run_amx(&g, (const uint16_t *)x, x_sp, x_sm, threads);
    }
#endif
    /* the activations gathered once into one contiguous copy (P·M·K values: a few KB): bf16 as they are
     * for the dot products, else widened to fp32 or double */
    const size_t width = dot ? sizeof(uint16_t) : exact ? sizeof(double) : sizeof(float);
    void *xf = malloc((size_t)(P * M * K) * width);
    if (xf == NULL) return -1;
    for (int64_t p = 0; p < P; p++)
        for (int64_t m = 0; m < M; m++) {
            const int64_t at = p * x_sp + m * x_sm, to = (p * M + m) * K;
            if (dot) {
                memcpy((uint16_t *)xf + to, (const uint16_t *)x + at, (size_t)K * sizeof(uint16_t));
                continue;
            }
            for (int64_t k = 0; k < K; k++) {
                const float v = x_bf16 ? bf16_to_float(((const uint16_t *)x)[at + k]) : ((const float *)x)[at + k];
                if (exact) ((double *)xf)[to + k] = v;
                else ((float *)xf)[to + k] = v;
            }
        }
    Gemv g = {P, M, N, K, w_bf16, out_bf16, exact, xf, w, w_sp, w_sn, out, o_sp, o_sm};
    const int64_t total = P * N;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const Span span = thread_span(total);
        const int64_t begin = span.begin, end = span.end;
        for (int64_t r = begin; r < end;) {
            const int64_t p = r / N, n0 = r % N;
            const int64_t n1 = (end - p * N) < N ? end - p * N : N;
#if defined(__AVX512BF16__)
            if (dot) run_rows_bf16(&g, (const uint16_t *)xf + p * M * K, p, n0, n1);
            else
#endif
            run_rows(&g, p, n0, n1);
            r = p * N + n1;
        }
    }
    free(xf);
    return 0;
}

/* out[p, m, n] = Σ_k x[p, m, k] · w[p, k, n], the weight K-major (a block's P·V against its values as
 * the cache holds them, without a transposed copy): `exact` mode's products in double, summed in
 * double and rounded once to fp32, the loop over n in vector lanes. fp32 operands, contiguous.
 * Returns 0, or -1 (an allocation failed; `out` untouched). */
int dsv41_gemv_exact_kn(int64_t P, int64_t M, int64_t N, int64_t K, int threads, const float *x, const float *w,
                        float *out) {
    if (threads < 1) threads = 1;
    if (threads > P) threads = (int)P;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: failed)
    {
        const Span span = thread_span(P);
        double *acc = malloc(sizeof(double) * (size_t)(M * N));
        if (acc == NULL) failed = 1;
        for (int64_t p = span.begin; acc != NULL && p < span.end; p++) {
            for (int64_t i = 0; i < M * N; i++) acc[i] = 0.0;
            for (int64_t m = 0; m < M; m++)
                for (int64_t k = 0; k < K; k++) {
                    const double a = x[(p * M + m) * K + k];
                    const float *row = w + (p * K + k) * N;
                    double *dst = acc + m * N;
                    for (int64_t n = 0; n < N; n++) dst[n] += a * (double)row[n];
                }
            for (int64_t i = 0; i < M * N; i++) out[p * M * N + i] = (float)acc[i];
        }
        free(acc);
    }
    return failed ? -1 : 0;
}

/* Packed e2m1 rows (two values a byte, low nibble first) with one ue8m0 scale per 32 values, decoded into
 * the banks' compute dtype: code value · 2^(s − 127) in fp32 (s = 255: NaN), formats.dequantize_fp4_weight's
 * product, which the loader then casts. A 2-bit significand times a power of two within fp32's range is
 * exact in bf16, normal or not, so the cast is the float's upper half (rounding would change nothing). */
/* How far ahead (bytes of codes) a stored row's lines are asked for: a decode step's tile reads its four
 * rows side by side (N31), 2 KB a tile at dim 1024; 1 KB ahead measured best (12 layers' stored experts
 * of a dim-1024 step 6.6-6.8 ms against 7.3-7.5 at 2 KB, 7.2-7.5 at 512 or 768 bytes). */
#define FP4_PREFETCH 1024

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0_value(uint8_t s) {
    const uint32_t u = s == 255 ? 0x7fc00000u : s == 0 ? 0x00400000u : (uint32_t)s << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One block of 32 values by the float product, for any scale. */
static inline void fp4_block(const uint8_t *src, uint8_t scale, int bf16, void *out) {
    const float s = e8m0_value(scale);
    for (int j = 0; j < 32; j++) {
        const float v = E2M1[(src[j / 2] >> (4 * (j & 1))) & 15] * s;
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        if (bf16) ((uint16_t *)out)[j] = (uint16_t)(u >> 16);
        else ((float *)out)[j] = v;
    }
}

#if !defined(__AVX512BW__) && defined(__AVX2__)
/* Eight values from four code bytes (nibble k of the little-endian word is value k), as `fp4_block`
 * computes them: the code's magnitude from a table, its sign bit, and the same fp32 product by the
 * scale, so the same bits for every scale. */
static inline __m256 fp4_lanes8(uint32_t four_bytes, __m256 scale) {
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)four_bytes),
                                                             _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                           _mm256_set1_epi32(15));
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), codes);
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(codes, 3), 31));
    return _mm256_mul_ps(_mm256_or_ps(magnitude, sign), scale);
}
#endif

/* rows × K values from packed [rows, K/2] and scale [rows, K/32] (K a multiple of 32) into out [rows, K]. */
static void fp4_rows(int64_t rows, int64_t K, int bf16, const uint8_t *packed, const uint8_t *scale, void *out) {
    const size_t width = bf16 ? 2 : 4;
#if defined(__AVX512BW__)
    const __m512i table = _mm512_loadu_si512(E2M1_BF16);
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = packed + r * (K / 2), *sc = scale + r * (K / 32);
        for (int64_t b = 0; b < K / 32; b++) {
            char *dst = (char *)out + (size_t)(r * K + b * 32) * width;
            /* a tile's rows follow each other in the bank, and the next tile's after them: the stream's
             * lines are asked for FP4_PREFETCH bytes ahead, since decoding keeps fewer loads in flight */
            if (b % 4 == 0) __builtin_prefetch((const char *)(src + b * 16) + FP4_PREFETCH);
#if defined(__AVX512BW__)
            if (FP4_WIDE_SCALE(sc[b])) {
                const __m512i v = fp4_values(src + b * 16, sc[b], table);
                if (bf16) {
                    _mm512_storeu_si512(dst, v);
                } else {
                    _mm512_storeu_si512(dst, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
                    _mm512_storeu_si512(dst + 64, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
                }
                continue;
            }
#elif defined(__AVX2__)
            const __m256 scale8 = _mm256_set1_ps(e8m0_value(sc[b]));
            for (int q = 0; q < 4; q += 2) {              /* 16 values a pass: 8 code bytes */
                uint32_t words[2];
                memcpy(words, src + b * 16 + 4 * q, sizeof words);
                const __m256 v0 = fp4_lanes8(words[0], scale8), v1 = fp4_lanes8(words[1], scale8);
                if (bf16) {
                    /* the upper halves, packed per 128-bit lane, then the lanes put back in order */
                    const __m256i packed16 = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(v0), 16),
                                                                 _mm256_srli_epi32(_mm256_castps_si256(v1), 16));
                    _mm256_storeu_si256((__m256i *)(dst + q * 16), _mm256_permute4x64_epi64(packed16, 0xd8));
                } else {
                    _mm256_storeu_ps((float *)dst + q * 8, v0);
                    _mm256_storeu_ps((float *)dst + q * 8 + 8, v1);
                }
            }
            continue;
#endif
            fp4_block(src + b * 16, sc[b], bf16, dst);
        }
    }
}

/* `fp4_rows` of a whole stored matrix, split over threads by rows (the torch path's dequantised expert). */
void dsv41_fp4_rows(int64_t rows, int64_t K, int bf16, int threads, const uint8_t *packed, const uint8_t *scale,
                    void *out) {
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const Span span = thread_span(rows);
        const size_t width = bf16 ? 2 : 4;
        fp4_rows(span.end - span.begin, K, bf16, packed + span.begin * (K / 2), scale + span.begin * (K / 32),
                 (char *)out + (size_t)(span.begin * K) * width);
    }
}

/* The routed experts of a few tokens (moe.py `RoutedExperts`), fast numerics: every (token, expert)
 * pair's SwiGLU, its routing weight and its down projection, summed per token in ascending expert
 * order, in one call instead of a sort, a gather and three products per expert as torch ops.
 *
 * ids [n, A] local expert ids (negative: another rank's, skipped), weights [n, A] fp32 (both NULL: every
 * token on expert 0 at weight 1, A = 1: the shared expert); x [n, D];
 * w1, w3 [E, I, D] and w2 [E, D, I] one dtype (bf16 or fp32); out [n, D] fp32. As the torch path does:
 * the hidden h = silu(min(g, limit)) · clamp(u, ±limit) · weight (limit ≤ 0: no clamp) and each pair's
 * output round to the banks' dtype; the products sum in this kernel's own order. With `accumulate` the
 * pairs' outputs add to what `out` holds (the shared expert onto the routed sum, the order the layer
 * adds them in) instead of to zero. c1, c3, c2 (NULL: banks held in the compute dtype): the banks are the
 * stored fp4 bytes, w1, w3 [E, I, D/2] and w2 [E, D, I/2], with their ue8m0 scales c1, c3 [E, I, D/32] and
 * c2 [E, D, I/32]; each tile's rows are decoded to the values a held bank has just before the tile reads
 * them (in registers or into a scratch, `stored_tile`), so the sums, and the bits, are the held bank's
 * (N30). s1, s3 [I, D] and s2 [D, I] (NULL: none): the shared expert, in the
 * banks' dtype, as one more expert after the last: every token through it at weight 1, its output added
 * after the token's routed ones (moe.py's `y + shared`, the same bits as a second call accumulating).
 * Pairs of one expert run together, up to MAX_ROWS at a time, so each chosen expert's weights are read once;
 * with bf16 operands and AMX tiles (N37), a group of more than AMX_FROM_ROWS rows (AMX_STORED_FROM_ROWS
 * for a stored bank's expert; up to 4 · AMX_ROWS) multiplies on the tiles, a smaller one by the dot
 * products: a pair's bits then depend on how many rows its expert has in the call, whether past that
 * cut-off or not, and on nothing else.
 * Returns 0, or -1 (an id of E or more, or an allocation failed; `out` untouched).
 */
/* Rows j0 … j0 + TILE − 1 (those below `rows`) of one expert's weight `w` [rows, K] against the m ≤ MAX_ROWS
 * activation rows xs [m, K] of its group: acc[k][j] for pair k and row j0 + j. With `dot` (bf16 operands
 * and AVX512-BF16) xs is bf16 and the tiles take dot products; else xs is fp32 and `row_dot` runs. */
static void expert_tile(int dot, const void *xs, int64_t m, int64_t K, const void *w, int64_t j0, int64_t rows,
                        int w_bf16, float acc[MAX_ROWS][TILE]) {
    const size_t ww = w_bf16 ? 2 : 4;
#if defined(__AVX512BF16__)
    if (dot) {
        const uint16_t *wr[TILE], *x[TILE];
        for (int j = 0; j < TILE; j++)
            wr[j] = (const uint16_t *)((const char *)w + (size_t)((j0 + j < rows ? j0 + j : rows - 1) * K) * ww);
        for (int64_t k0 = 0; k0 < m; k0 += TILE) {
            const int64_t R = m - k0 < TILE ? m - k0 : TILE;
            float part[TILE][TILE];
            for (int r = 0; r < TILE; r++) x[r] = (const uint16_t *)xs + (k0 + (r < R ? r : 0)) * K;
            tile_dot_bf16_rows(R, k0 == 0, x, K, wr, part);
            for (int64_t r = 0; r < R; r++) memcpy(acc[k0 + r], part[r], sizeof part[r]);
        }
        return;
    }
#endif
    (void)dot;
    float col[MAX_ROWS];
    for (int64_t j = 0; j < TILE && j0 + j < rows; j++) {
        row_dot((const float *)xs, m, K, (const char *)w + (size_t)((j0 + j) * K) * ww, w_bf16, col);
        for (int64_t k = 0; k < m; k++) acc[k][j] = col[k];
    }
}

/* One pair's hidden row (I values): h = silu(min(g, limit)) · clamp(u, ±limit) · weight (limit ≤ 0: no
 * clamp), computed in place over `gate`, then rounded to the banks' dtype into h (bf16 for the dot
 * products, else fp32). With AVX-512, 16 values at a time and exp by `exp_lanes` (exp.h): a 16-token
 * layer's 49k scalar expf calls took 0.17 of its ~2.9 ms (N39). Each value's steps are its own, so a
 * value's bits do not depend on its lane. */
static void swiglu_row(float *gate, const float *up, int64_t I, float limit, float weight, int w_bf16, int dot,
                       void *h) {
#if defined(EXP_LANES)
    const __m512 one = _mm512_set1_ps(1.0f), top = _mm512_set1_ps(limit), bottom = _mm512_set1_ps(-limit);
    for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 lanes = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1u);
        __m512 g = _mm512_maskz_loadu_ps(lanes, gate + i), u = _mm512_maskz_loadu_ps(lanes, up + i);
        if (limit > 0.0f) {
            g = _mm512_min_ps(g, top);
            u = _mm512_min_ps(_mm512_max_ps(u, bottom), top);
        }
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(gate + i, lanes, _mm512_mul_ps(_mm512_mul_ps(silu, u), _mm512_set1_ps(weight)));
    }
#else
    for (int64_t i = 0; i < I; i++) {
        float g = gate[i], u = up[i];
        if (limit > 0.0f) {
            g = g < limit ? g : limit;
            u = u < -limit ? -limit : (u > limit ? limit : u);
        }
        gate[i] = g / (1.0f + expf(-g)) * u * weight;
    }
#endif
    if (dot) narrow_row(gate, I, 1, h);
    else
        for (int64_t i = 0; i < I; i++) ((float *)h)[i] = round_to(gate[i], w_bf16);
}

/* The first of `units` tiles per group that this thread takes among G groups whose tiles cost cost[g]
 * each (prefix[g]: the cost of a tile of each group before g), so that the threads' shares cost alike:
 * for thread t of nt, the tile where the fraction t/nt of the total cost falls. A stored step's shared
 * expert (held, last) gave the last thread 7–12% more time than the first under a split by count (N40). */
static int64_t tile_at(int64_t G, int64_t units, const double *prefix, const double *cost, int t, int nt) {
    if (t >= nt || G == 0) return G * units;
    const double at = prefix[G] * t / nt;
    int64_t g = 0;
    while (g + 1 < G && prefix[g + 1] <= at) g++;
    const int64_t u = (int64_t)((at - prefix[g]) / cost[g] * (double)units + 0.5);
    return g * units + (u < units ? u : units);
}

/* A pair's token: routed pairs hold t · A + a (their routing weight's index), the shared expert's −1 − t. */
static inline int64_t pair_token(int64_t at, int64_t A) {
    return at >= 0 ? at / A : -1 - at;
}

/* Expert e's matrix (`size` values) in bank w [E, …], or the shared expert's s for e = E. */
static inline const void *expert_weight(const void *w, const void *s, int64_t e, int64_t E, int64_t size, size_t ww) {
    return e == E ? s : (const void *)((const char *)w + (size_t)(e * size) * ww);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* TILE stored fp4 rows (w[i]: K/2 bytes, c[i]: K/32 scale bytes, every scale FP4_WIDE_SCALE, K a multiple
 * of 32) against R activation rows, each 32 values decoded in registers just before their dot products.
 * Every (activation row, weight row) pair keeps one accumulator whose lanes add their blocks in K order,
 * as `tile_dot_bf16` does: the same bits as the rows held in bf16. The weight rows run side by side, not
 * one after another: a row's dot products are one dependency chain (each vdpbf16ps waits for the last),
 * which alone held a decode step's row (R = 1) to about a third of the decoder's rate; TILE · R chains
 * in flight keep the decoding units busy. The tile's rows are adjacent in the bank (K/2 bytes each), so
 * side by side they still read one stream (N31). */
static inline __attribute__((always_inline)) void tile_dot_fp4(int R, const uint16_t *const x[TILE], int64_t K,
                                                               const uint8_t *const w[TILE], const uint32_t *const add[TILE],
                                                               float acc[TILE][TILE]) {
    const __m512i table = _mm512_loadu_si512(E2M1_BF16);
    __m512 s[TILE][TILE];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < TILE; i++) s[r][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        if (k % 128 == 0)
            for (int i = 0; i < TILE; i++) _mm_prefetch((const char *)(w[i] + k / 2) + FP4_PREFETCH, _MM_HINT_T0);
        __m512bh a[TILE];
        for (int r = 0; r < R; r++) a[r] = (__m512bh)_mm512_loadu_si512(x[r] + k);
        for (int i = 0; i < TILE; i++) {
            const __m512bh v = (__m512bh)fp4_scaled_values(w[i] + k / 2, _mm512_set1_epi32((int)add[i][k / 32]), table);
            for (int r = 0; r < R; r++) s[r][i] = _mm512_dpbf16_ps(s[r][i], a[r], v);
        }
    }
    for (int r = 0; r < R; r++) _mm_storeu_ps(acc[r], lane_sums4(s[r][0], s[r][1], s[r][2], s[r][3]));
}
#endif

/* `expert_tile` of a stored bank (w [E, rows, K/2] bytes, c [E, rows, K/32] scales), expert e's rows j0 …
 * j0 + TILE − 1: a few activation rows (a decode step) with bf16 dot products decode in registers
 * (`tile_dot_fp4`); otherwise the tile's rows are decoded into `scratch` once and `expert_tile` reads them
 * there, pass after pass. Either way the held bank's bits. */
static void stored_tile(int dot, const void *xs, int64_t m, int64_t K, const uint8_t *w, const uint8_t *c, int64_t e,
                        int64_t rows, int64_t j0, int w_bf16, void *scratch, float acc[MAX_ROWS][TILE]) {
    const int64_t n = rows - j0 < TILE ? rows - j0 : TILE, at = e * rows + j0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    /* the blocks' exponent adds, worked out once a tile (a vector op per 16 blocks), so that each block
     * takes its own by a broadcast load: a broadcast from a register takes the shuffle port, which the
     * decode's widen and table lookup already keep busy (N31) */
    uint32_t adds[TILE][FP4_TILE_BLOCKS];
    if (dot && m <= TILE && K / 32 <= FP4_TILE_BLOCKS && fp4_wide_scales(c + at * (K / 32), n * (K / 32))) {
        const uint8_t *wr[TILE];
        const uint32_t *ar[TILE];
        const uint16_t *x[TILE];
        for (int i = 0; i < TILE; i++) {
            const int64_t row = i < n ? i : n - 1;
            if (i < n) fp4_exponent_adds(c + (at + i) * (K / 32), K / 32, adds[i]);
            wr[i] = w + (at + row) * (K / 2);
            ar[i] = adds[row];
        }
        for (int r = 0; r < TILE; r++) x[r] = (const uint16_t *)xs + (r < m ? r : 0) * K;
        float part[TILE][TILE];
        switch (m) {
            case 1: tile_dot_fp4(1, x, K, wr, ar, part); break;
            case 2: tile_dot_fp4(2, x, K, wr, ar, part); break;
            case 3: tile_dot_fp4(3, x, K, wr, ar, part); break;
            default: tile_dot_fp4(4, x, K, wr, ar, part); break;
        }
        for (int64_t r = 0; r < m; r++) memcpy(acc[r], part[r], sizeof part[r]);
        return;
    }
#endif
    /* the dot products read bf16 rows; the multiply-adds widen every weight to fp32 first, so they read
     * the rows decoded to fp32 (the same values: every decoded value is exact in bf16) */
    const int as_bf16 = dot && w_bf16;
    fp4_rows(n, K, as_bf16, w + at * (K / 2), c + at * (K / 32), scratch);
    expert_tile(dot, xs, m, K, scratch, 0, n, as_bf16, acc);
}

/* A tile of expert e's matrix (`rows` × K, from row j0) against the group's activation rows: the held
 * bank in place (the shared expert, e = E, always is), or a stored one. */
static inline void bank_tile(int dot, const void *xs, int64_t m, int64_t K, const void *w, const void *s,
                             const uint8_t *c, int64_t e, int64_t E, int64_t rows, int64_t j0, int w_bf16,
                             void *scratch, float acc[MAX_ROWS][TILE]) {
    if (c == NULL || e == E)
        expert_tile(dot, xs, m, K, expert_weight(w, s, e, E, rows * K, w_bf16 ? 2 : 4), j0, rows, w_bf16, acc);
    else
        stored_tile(dot, xs, m, K, (const uint8_t *)w, c, e, rows, j0, w_bf16, scratch, acc);
}

/* Whether an expert's group of m rows multiplies on AMX tiles (`amx`: the call's operands are bf16 and
 * the tiles are there; N37): past AMX_FROM_ROWS rows of a held bank, where the dot products' cost grows
 * with the rows, or AMX_STORED_FROM_ROWS of a stored one (`stored`). */
static inline int amx_group(int amx, int64_t m, int stored) {
    return amx && m > (stored ? AMX_STORED_FROM_ROWS : AMX_FROM_ROWS);
}

/* The activation rows a packed block of an m-row group holds (N42). */
static inline int64_t amx_columns(int64_t m) {
    return m <= AMX_NARROW ? AMX_NARROW : AMX_ROWS;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* `bank_tile` on AMX tiles (N37): AMX_ROWS rows of expert e's bf16 matrix (`rows` × K, from row j0) against
 * its group's packed activation blocks bx of `columns` rows → sums [blocks, AMX_ROWS, columns]. A held
 * matrix's whole tile is read in place; a stored one's rows are decoded to the held bank's values (so the
 * held bank's bits) block by block as the tiles take them, or into `scratch` first where a scale is
 * outside FP4_WIDE_SCALE; a held partial tile or a K that is not a multiple of 32 is copied there
 * (zero-padded). */
static void amx_bank_tile(const uint16_t *bx, int64_t blocks, int64_t columns, int64_t K, const void *w, const void *s,
                          const uint8_t *c, int64_t e, int64_t E, int64_t rows, int64_t j0, uint16_t *scratch,
                          float *sums) {
    const int64_t n = rows - j0 < AMX_ROWS ? rows - j0 : AMX_ROWS;
    const uint16_t *a = scratch;
    int64_t stride = K;                                     /* a stored bank's K is a multiple of 32 */
    if (c != NULL && e != E) {
        const uint8_t *codes = (const uint8_t *)w + (e * rows + j0) * (K / 2), *scales = c + (e * rows + j0) * (K / 32);
        if (dsv41_amx_tile_fp4(codes, scales, n, K, bx, blocks, columns, sums) == 0) return;
        fp4_rows(n, K, 1, codes, scales, scratch);
    } else
        a = dsv41_amx_rows((const uint16_t *)expert_weight(w, s, e, E, rows * K, 2) + j0 * K, K, n, K, scratch, &stride);
    dsv41_amx_tile(a, stride, AMX_PADDED(K), bx, blocks, columns, sums);
}

/* sums [blocks, AMX_ROWS, columns] of an `amx_bank_tile` → rows j0 … of the m pairs' outputs at p0
 * (row width `width`), rounded as the bank's products are. */
static void amx_put(const float *sums, int64_t columns, int64_t m, int64_t p0, int64_t j0, int64_t width, int w_bf16,
                    float *out) {
    for (int64_t k = 0; k < m; k++)
        for (int64_t j = 0; j < AMX_ROWS && j0 + j < width; j++)
            out[(p0 + k) * width + j0 + j] = round_to(sums[((k / columns) * AMX_ROWS + j) * columns + k % columns], w_bf16);
}
#endif

int dsv41_routed_experts(int64_t n, int64_t A, int64_t E, int64_t D, int64_t I, int w_bf16, int x_bf16, float limit, int threads,
                         const void *x, const int64_t *ids, const float *weights,
                         const void *w1, const void *w3, const void *w2, const void *s1, const void *s3,
                         const void *s2, const uint8_t *c1, const uint8_t *c3, const uint8_t *c2, int accumulate,
                         float *out) {
    const int shared = s1 != NULL;
    const int64_t pairs_max = n * A + (shared ? n : 0);
    for (int64_t q = 0; q < n * A; q++)
        if (ids != NULL && ids[q] >= E) return -1;
#if defined(__AVX512BF16__)
    const int dot = w_bf16 && x_bf16;      /* h rounds to bf16 anyway, so the down projection's operand is exact */
#else
    const int dot = 0;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int amx = dot && dsv41_amx_ready();
#else
    const int amx = 0;
#endif
    /* rows a group takes at most: on the tiles 4 blocks of AMX_ROWS (amx.c's C tiles) */
    const int64_t cap = amx ? 4 * AMX_ROWS : MAX_ROWS, unit = amx ? AMX_ROWS : TILE;
    const size_t xw = dot ? 2 : 4;
    int64_t *pair = malloc((size_t)pairs_max * 2 * sizeof(int64_t));     /* sorted (expert, token) */
    int64_t *group = malloc((size_t)(pairs_max + 1) * sizeof(int64_t));  /* first pair of each group */
    float *gate = malloc((size_t)(pairs_max * (2 * I + D) + 1) * sizeof(float));
    void *xg = malloc((size_t)(pairs_max * (D + I) + 1) * xw);          /* the pairs' x rows, then their h rows */
    /* a stored bank's decoded tile (bf16 or fp32 values), one per thread */
    const int64_t widest = D > I ? D : I;
    char *scratch = c1 != NULL ? malloc((size_t)(threads * TILE * widest) * sizeof(float)) : NULL;
    if (pair == NULL || group == NULL || gate == NULL || xg == NULL || (c1 != NULL && scratch == NULL)) {
        free(pair); free(group); free(gate); free(xg); free(scratch);
        return -1;
    }
    int64_t P = 0;
    for (int64_t t = 0; t < n; t++)
        for (int64_t a = 0; a < A; a++) {
            const int64_t e = ids != NULL ? ids[t * A + a] : 0;
            if (e < 0) continue;
            int64_t j = P++;                              /* insertion: pairs stay sorted by (expert, token) */
            while (j > 0 && pair[2 * (j - 1)] > e) {
                pair[2 * j] = pair[2 * (j - 1)];
                pair[2 * j + 1] = pair[2 * (j - 1) + 1];
                j--;
            }
            pair[2 * j] = e;
            pair[2 * j + 1] = t * A + a;
        }
    for (int64_t t = 0; shared && t < n; t++) {         /* expert E sorts last: the shared one */
        pair[2 * P] = E;
        pair[2 * P + 1] = -1 - t;
        P++;
    }
    int64_t G = 0;
    for (int64_t p = 0; p < P; p++)
        if (p == 0 || pair[2 * p] != pair[2 * (p - 1)] || p - group[G - 1] == cap) group[G++] = p;
    group[G] = P;
    /* the AMX groups' packed activation blocks (x for gate and up, then h for down), each group's from
     * column `first[g]` on (its blocks of `amx_columns` rows each: Kp · columns values a block), and one
     * scratch tile per thread */
    int64_t *first = malloc((size_t)(G + 1) * sizeof(int64_t));
    double *prefix = malloc((size_t)(2 * G + 1) * sizeof(double)), *cost = prefix + G + 1;
    if (first == NULL || prefix == NULL) {
        free(pair); free(group); free(gate); free(xg); free(scratch); free(first); free(prefix);
        return -1;
    }
    /* per group: its tiles' cost to a thread, and whether it multiplies on the tiles (from column first[g]) */
    prefix[0] = 0.0;
    first[0] = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t m = group[g + 1] - group[g];
        const int stored = c1 != NULL && pair[2 * group[g]] != E;
        cost[g] = stored ? 1.0 : HELD_TILE_COST;
        prefix[g + 1] = prefix[g] + cost[g];
        first[g + 1] = first[g] + (amx_group(amx, m, stored) ? AMX_BLOCKS(m, amx_columns(m)) * amx_columns(m) : 0);
    }
    const int64_t Dp = AMX_PADDED(D), Ip = AMX_PADDED(I), Wp = Dp > Ip ? Dp : Ip;
    uint16_t *bx = NULL, *bh = NULL, *tiles = NULL;
    float *sums = NULL;
    if (first[G] > 0) {
        bx = malloc((size_t)(first[G] * Dp) * sizeof(uint16_t));
        bh = malloc((size_t)(first[G] * Ip) * sizeof(uint16_t));
        tiles = calloc((size_t)(threads * AMX_ROWS * Wp), sizeof(uint16_t));
        sums = malloc((size_t)(threads * 4 * AMX_ROWS * AMX_ROWS) * sizeof(float));
        if (bx == NULL || bh == NULL || tiles == NULL || sums == NULL) {
            free(pair); free(group); free(gate); free(xg); free(scratch); free(first); free(prefix); free(bx); free(bh);
            free(tiles); free(sums);
            return -1;
        }
    }
    float *up = gate + P * I, *y = up + P * I;
    char *hg = (char *)xg + (size_t)(P * D) * xw;
    for (int64_t p = 0; p < P; p++) {
        const int64_t t = pair_token(pair[2 * p + 1], A);
        if (dot) memcpy((uint16_t *)xg + p * D, (const uint16_t *)x + t * D, (size_t)D * 2);
        else for (int64_t d = 0; d < D; d++) ((float *)xg)[p * D + d] = value_at(x, x_bf16, t * D + d);
    }
    const int64_t I_units = (I + unit - 1) / unit, D_units = (D + unit - 1) / unit;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float acc[MAX_ROWS][TILE];
        const int index = thread_span(0).index;
        int nt = 1;
#if defined(_OPENMP)
        nt = omp_get_num_threads();
#endif
        void *tile = scratch != NULL ? scratch + (size_t)(index * TILE * widest) * sizeof(float) : NULL;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        uint16_t *mine = tiles != NULL ? tiles + index * AMX_ROWS * Wp : NULL;
        float *own = sums != NULL ? sums + index * 4 * AMX_ROWS * AMX_ROWS : NULL;
        /* the tiles configured for the block width of the group at hand, again when it changes (a 16-token
         * step's groups are mostly narrow, the shared expert's wide) */
        int64_t columns = AMX_ROWS;
        if (amx) dsv41_amx_begin(columns);
        /* the tile groups' activations packed by the threads (a block mostly zeros to write; one thread
         * alone took ~0.1 of a 16-token layer's ~2.7 ms) */
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < G; g++)
            if (first[g + 1] > first[g])
                dsv41_amx_pack(group[g + 1] - group[g], D, (const uint16_t *)xg + group[g] * D, D,
                               amx_columns(group[g + 1] - group[g]), bx + first[g] * Dp);
#endif
        /* gate and up: `unit` rows of w1 and w3, each thread a run of tiles of one share of the cost */
        const int64_t gu_end = tile_at(G, I_units, prefix, cost, index + 1, nt);
        for (int64_t r = tile_at(G, I_units, prefix, cost, index, nt); r < gu_end; r++) {
            const int64_t g = r / I_units, i1 = (r % I_units) * unit, p0 = group[g], m = group[g + 1] - p0, e = pair[2 * p0];
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (first[g + 1] > first[g]) {
                /* the run's tiles of this group: all of w1's, then all of w3's */
                const int64_t last = (g + 1) * I_units < gu_end ? (g + 1) * I_units : gu_end;
                const uint16_t *b = bx + first[g] * Dp;
                const int64_t blocks = (first[g + 1] - first[g]) / amx_columns(m);
                if (amx_columns(m) != columns) dsv41_amx_begin(columns = amx_columns(m));
                for (int64_t i = i1; i < (last - g * I_units) * unit; i += unit) {
                    amx_bank_tile(b, blocks, columns, D, w1, s1, c1, e, E, I, i, mine, own);
                    amx_put(own, columns, m, p0, i, I, w_bf16, gate);
                }
                for (int64_t i = i1; i < (last - g * I_units) * unit; i += unit) {
                    amx_bank_tile(b, blocks, columns, D, w3, s3, c3, e, E, I, i, mine, own);
                    amx_put(own, columns, m, p0, i, I, w_bf16, up);
                }
                r = last - 1;
                continue;
            }
#endif
            const void *xs = (const char *)xg + (size_t)(p0 * D) * xw;
            for (int64_t i0 = i1; i0 < i1 + unit && i0 < I; i0 += TILE) {
                bank_tile(dot, xs, m, D, w1, s1, c1, e, E, I, i0, w_bf16, tile, acc);
                for (int64_t k = 0; k < m; k++)
                    for (int64_t j = 0; j < TILE && i0 + j < I; j++) gate[(p0 + k) * I + i0 + j] = round_to(acc[k][j], w_bf16);
                bank_tile(dot, xs, m, D, w3, s3, c3, e, E, I, i0, w_bf16, tile, acc);
                for (int64_t k = 0; k < m; k++)
                    for (int64_t j = 0; j < TILE && i0 + j < I; j++) up[(p0 + k) * I + i0 + j] = round_to(acc[k][j], w_bf16);
            }
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {                    /* h = SwiGLU · routing weight, rounded */
            const int64_t at = pair[2 * p + 1];
            swiglu_row(gate + p * I, up + p * I, I, limit, weights != NULL && at >= 0 ? weights[at] : 1.0f, w_bf16,
                       dot, hg + (size_t)(p * I) * xw);
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < G; g++)
            if (first[g + 1] > first[g])
                dsv41_amx_pack(group[g + 1] - group[g], I, (const uint16_t *)hg + group[g] * I, I,
                               amx_columns(group[g + 1] - group[g]), bh + first[g] * Ip);
#endif
        const int64_t down_end = tile_at(G, D_units, prefix, cost, index + 1, nt);
        for (int64_t r = tile_at(G, D_units, prefix, cost, index, nt); r < down_end; r++) {    /* down: `unit` rows of w2 */
            const int64_t g = r / D_units, d1 = (r % D_units) * unit, p0 = group[g], m = group[g + 1] - p0, e = pair[2 * p0];
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (first[g + 1] > first[g]) {
                if (amx_columns(m) != columns) dsv41_amx_begin(columns = amx_columns(m));
                amx_bank_tile(bh + first[g] * Ip, (first[g + 1] - first[g]) / columns, columns, I, w2, s2, c2, e, E, D, d1,
                              mine, own);
                amx_put(own, columns, m, p0, d1, D, w_bf16, y);
                continue;
            }
#endif
            for (int64_t d0 = d1; d0 < d1 + unit && d0 < D; d0 += TILE) {
                bank_tile(dot, hg + (size_t)(p0 * I) * xw, m, I, w2, s2, c2, e, E, D, d0, w_bf16, tile, acc);
                for (int64_t k = 0; k < m; k++)
                    for (int64_t j = 0; j < TILE && d0 + j < D; j++) y[(p0 + k) * D + d0 + j] = round_to(acc[k][j], w_bf16);
            }
        }
        #pragma omp barrier
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx) dsv41_amx_end();
#endif
        /* Σ per token, experts ascending: pair after pair onto its token's row, a span of SUM_SPAN columns
         * at a time (whole rows vectorise; one column at a time read y at a D-float stride and added
         * through memory, a fifth of a 16-token layer's time outside the products) */
        #pragma omp for schedule(static)
        for (int64_t d0 = 0; d0 < D; d0 += SUM_SPAN) {
            const int64_t d1 = d0 + SUM_SPAN < D ? d0 + SUM_SPAN : D;
            if (!accumulate)
                for (int64_t t = 0; t < n; t++) memset(out + t * D + d0, 0, (size_t)(d1 - d0) * sizeof(float));
            for (int64_t p = 0; p < P; p++) {
                float *o = out + pair_token(pair[2 * p + 1], A) * D;
                const float *yp = y + p * D;
                for (int64_t d = d0; d < d1; d++) o[d] += yp[d];
            }
        }
    }
    free(pair); free(group); free(gate); free(xg); free(scratch); free(first); free(prefix); free(bx); free(bh); free(tiles);
    free(sums);
    return 0;
}
