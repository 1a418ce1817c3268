/* The hyper-connection mixes of a few rows (dsv41/model/hyper.py `split_mixes`, docs/ARCHITECTURE.md §7;
 * docs/NUMERICS.md N13): the pre and post gates and Sinkhorn's doubly stochastic comb, from the mix
 * projection m [rows, (2 + S) · S].
 *
 *   pre  = σ(m[:S] · scale0 + base[:S]) + eps
 *   post = 2 · σ(m[S:2S] · scale1 + base[S:2S])
 *   comb = Sinkhorn(m[2S:] · scale2 + base[2S:]), S × S: a row softmax (exp / Σ) + eps, then a column
 *          step, then iters − 1 row and column steps, each x / (Σ + eps)
 *
 * with the torch path's bits under invariant kernels: every fp32 step rounds as torch's op does
 * (built with -ffp-contract=off), σ and exp are evaluated in double and rounded once to fp32
 * (numerics.py `_elementwise`), and a sum over S ≤ 4 values runs in index order, as torch's reduction
 * does at that width (tests/test_native.py compares both on every row of wide-ranged logits).
 * A decode step's mixes are a few 4 × 4 matrices: as torch ops, Sinkhorn's ~80 steps each cost a
 * fixed few µs of dispatch; here the whole mix costs about as much as one of them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_STREAMS 4

static float sigmoid(float z) {
    return (float)(1.0 / (1.0 + exp(-(double)z)));
}

/* Σ_j c[j · stride] for j < S, in index order. */
static float sum_in_order(const float *c, int64_t S, int64_t stride) {
    float s = c[0];
    for (int64_t j = 1; j < S; j++) s = s + c[j * stride];
    return s;
}

/* Returns 0, or -1 for more streams than the summation order is known for (the caller keeps torch). */
int dsv41_split_mixes(int64_t rows, int64_t S, int64_t iters, const float *m, const float *scale,
                      const float *base, float eps, float *pre, float *post, float *comb) {
    if (S < 1 || S > MAX_STREAMS || iters < 1) return -1;
    const int64_t width = (2 + S) * S;
    for (int64_t r = 0; r < rows; r++) {
        const float *mr = m + r * width;
        for (int64_t i = 0; i < S; i++) {
            pre[r * S + i] = sigmoid(mr[i] * scale[0] + base[i]) + eps;
            post[r * S + i] = 2.0f * sigmoid(mr[S + i] * scale[1] + base[S + i]);
        }
        float *c = comb + r * S * S;
        for (int64_t i = 0; i < S * S; i++) c[i] = mr[2 * S + i] * scale[2] + base[2 * S + i];
        for (int64_t i = 0; i < S; i++) {                       /* row softmax, + eps */
            float *row = c + i * S, top = row[0];
            for (int64_t j = 1; j < S; j++) top = row[j] > top ? row[j] : top;
            for (int64_t j = 0; j < S; j++) row[j] = (float)exp((double)(row[j] - top));
            const float total = sum_in_order(row, S, 1);
            for (int64_t j = 0; j < S; j++) row[j] = row[j] / total + eps;
        }
        for (int64_t step = 0; step < 2 * iters - 1; step++) {
            const int columns = step % 2 == 0;                  /* column, row, column, …, column */
            float total[MAX_STREAMS];
            for (int64_t i = 0; i < S; i++)
                total[i] = (columns ? sum_in_order(c + i, S, S) : sum_in_order(c + i * S, S, 1)) + eps;
            for (int64_t i = 0; i < S; i++)
                for (int64_t j = 0; j < S; j++) c[i * S + j] = c[i * S + j] / total[columns ? j : i];
        }
    }
    return 0;
}

#define CHUNK 256
#define MAX_STREAMS 4

/* hc_pre (hyper.py `collapse`): out[r, d] = Σ_i pre[r, i] · x[r, i, d] in fp32, i in order from 0 (the
 * order and the zero start of torch's reduction over the stream dim), rounded to x's dtype. Each
 * element's steps are its own, so the loop over d runs in vector lanes, CHUNK values at a time. */
void dsv41_hc_collapse(int64_t rows, int64_t S, int64_t D, int bf16, const void *x, const float *pre, void *out) {
    const size_t width = bf16 ? 2 : 4;
    float acc[CHUNK], v[CHUNK];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d0 = 0; d0 < D; d0 += CHUNK) {
            const int64_t n = D - d0 < CHUNK ? D - d0 : CHUNK;
            for (int64_t d = 0; d < n; d++) acc[d] = 0.0f;
            for (int64_t i = 0; i < S; i++) {
                const float w = pre[r * S + i];
                widen_row((const char *)x + ((r * S + i) * D + d0) * width, bf16, n, v);
                for (int64_t d = 0; d < n; d++) acc[d] = acc[d] + w * v[d];
            }
            narrow_row(acc, n, bf16, (char *)out + (r * D + d0) * width);
        }
}

/* hc_post (hyper.py `expand`): stream j of row r = post[r, j] · o[r] + Σ_i comb[r, i, j] · R[r, i] in
 * fp32 (the sum as `collapse`'s), rounded to o's dtype; R and the result [rows, S, D], S ≤ 4. */
void dsv41_hc_expand(int64_t rows, int64_t S, int64_t D, int bf16, const void *o, const void *residual,
                     const float *post, const float *comb, void *out) {
    const size_t width = bf16 ? 2 : 4;
    float streams[MAX_STREAMS][CHUNK], ov[CHUNK], mixed[CHUNK];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d0 = 0; d0 < D; d0 += CHUNK) {
            const int64_t n = D - d0 < CHUNK ? D - d0 : CHUNK;
            for (int64_t i = 0; i < S; i++)
                widen_row((const char *)residual + ((r * S + i) * D + d0) * width, bf16, n, streams[i]);
            widen_row((const char *)o + (r * D + d0) * width, bf16, n, ov);
            for (int64_t j = 0; j < S; j++) {
                for (int64_t d = 0; d < n; d++) mixed[d] = 0.0f;
                for (int64_t i = 0; i < S; i++) {
                    const float c = comb[(r * S + i) * S + j];
                    for (int64_t d = 0; d < n; d++) mixed[d] = mixed[d] + c * streams[i][d];
                }
                const float p = post[r * S + j];
                for (int64_t d = 0; d < n; d++) mixed[d] = p * ov[d] + mixed[d];
                narrow_row(mixed, n, bf16, (char *)out + ((r * S + j) * D + d0) * width);
            }
        }
}

/* `dsv41_hc_expand` of many rows split between the threads by rows: each row's steps are its own, so
 * the same bits (a 16-row step's last expansion ran on one thread while the other waited; N39). */
void dsv41_hc_expand_rows(int64_t rows, int64_t S, int64_t D, int bf16, const void *o, const void *residual,
                          const float *post, const float *comb, void *out, int threads) {
    const size_t width = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        dsv41_hc_expand(1, S, D, bf16, (const char *)o + r * D * width, (const char *)residual + r * S * D * width,
                        post + r * S, comb + r * S * S, (char *)out + r * S * D * width);
}

/* out[r][j] = Σ_k x[r][k] · f[j][k] in fp32 for R ≤ 2 rows of x and J ≤ 4 rows of f (K values each,
 * contiguous): per pair two sixteen-lane sums over alternate halves of each 32 values, their lanes'
 * sum, then the tail in order (fast numerics' order, its licence). Each pair's steps are the same
 * whatever R and J, so its bits are; the R · J pairs side by side keep 2 · R · J multiply-add chains in
 * flight, where one pair's two chains waited on each other's latency (N39). */
static inline __attribute__((always_inline)) void dots(int R, int J, const float *x, const float *f, int64_t K,
                                                       float out[2][4]) {
    int64_t k = 0;
    float total[2][4] = {{0.0f}};
#if defined(__AVX512F__)
    __m512 s0[2][4], s1[2][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) s0[r][j] = s1[r][j] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m512 a0[2], a1[2];
        for (int r = 0; r < R; r++) {
            a0[r] = _mm512_loadu_ps(x + r * K + k);
            a1[r] = _mm512_loadu_ps(x + r * K + k + 16);
        }
        for (int j = 0; j < J; j++) {
            const __m512 b0 = _mm512_loadu_ps(f + j * K + k), b1 = _mm512_loadu_ps(f + j * K + k + 16);
            for (int r = 0; r < R; r++) {
                s0[r][j] = _mm512_fmadd_ps(a0[r], b0, s0[r][j]);
                s1[r][j] = _mm512_fmadd_ps(a1[r], b1, s1[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) total[r][j] = _mm512_reduce_add_ps(_mm512_add_ps(s0[r][j], s1[r][j]));
#endif
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) {
            float t = total[r][j];
            for (int64_t q = k; q < K; q++) t += x[r * K + q] * f[j * K + q];
            out[r][j] = t;
        }
}

/* `dots` for the R × J block at runtime sizes (R ≤ 2, J ≤ 4), each size inlined. */
static void dots_block(int R, int J, const float *x, const float *f, int64_t K, float out[2][4]) {
    switch (R * 8 + J) {
        case 9: dots(1, 1, x, f, K, out); break;
        case 10: dots(1, 2, x, f, K, out); break;
        case 11: dots(1, 3, x, f, K, out); break;
        case 12: dots(1, 4, x, f, K, out); break;
        case 17: dots(2, 1, x, f, K, out); break;
        case 18: dots(2, 2, x, f, K, out); break;
        case 19: dots(2, 3, x, f, K, out); break;
        default: dots(2, 4, x, f, K, out); break;
    }
}

/* Fast numerics' whole hc mix of a few rows (hyper.py `mixes`) in one call: for the flat stream
 * x[r] (S · D values, bf16 or fp32), m = (fn · x[r]) / sqrt(mean(x[r]²) + norm_eps) with fn [M, S · D]
 * fp32, M = (2 + S) · S, then `dsv41_split_mixes` of m. Every row's sums are its own, in one order
 * whatever the row count. As torch operations the projection and its RMS statistic are ~12 calls of
 * a few µs for a product of ~10 µs. Returns 0, or -1 (more than MAX_STREAMS streams, no memory). */
int dsv41_hc_mixes(int64_t rows, int64_t S, int64_t D, int bf16, const void *x, const float *fn,
                   const float *scale, const float *base, int64_t iters, float norm_eps, float hc_eps, int threads,
                   float *pre, float *post, float *comb) {
    if (S < 1 || S > MAX_STREAMS || iters < 1) return -1;
    const int64_t K = S * D, M = (2 + S) * S;
    float *flat = malloc((size_t)(rows * K) * sizeof(float)), *m = malloc((size_t)(rows * M) * sizeof(float));
    float *inv = malloc((size_t)rows * sizeof(float));
    if (flat == NULL || m == NULL || inv == NULL) {
        free(flat); free(m); free(inv);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *xr = flat + r * K, square[2][4];
        widen_row((const char *)x + r * K * (bf16 ? 2 : 4), bf16, K, xr);
        dots(1, 1, xr, xr, K, square);
        inv[r] = 1.0f / sqrtf(square[0][0] / (float)K + norm_eps);
    }
    /* blocks of 2 rows × 4 of fn's: a decode row's 24 projections split between the threads */
    const int64_t row_blocks = (rows + 1) / 2, fn_blocks = (M + 3) / 4;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t q = 0; q < row_blocks * fn_blocks; q++) {
        const int64_t r0 = q / fn_blocks * 2, j0 = q % fn_blocks * 4;
        const int R = rows - r0 < 2 ? (int)(rows - r0) : 2, J = M - j0 < 4 ? (int)(M - j0) : 4;
        float block[2][4];
        dots_block(R, J, flat + r0 * K, fn + j0 * K, K, block);
        for (int r = 0; r < R; r++)
            for (int j = 0; j < J; j++) m[(r0 + r) * M + j0 + j] = block[r][j] * inv[r0 + r];
    }
    const int status = dsv41_split_mixes(rows, S, iters, m, scale, base, hc_eps, pre, post, comb);
    free(flat); free(m); free(inv);
    return status;
}

void dsv41_rms_norm(int64_t rows, int64_t D, float eps, const void *x, int x_bf16, const void *w, int w_bf16,
                    void *out);

/* A sublayer's entry for a decode step's rows (block.py `Block._enter`): with `o` (not NULL) the previous
 * sublayer's output first expands into the streams (`dsv41_hc_expand` of o and `residual` with post and
 * comb, into `streams`), else `residual` is the streams; then their mixes for this sublayer
 * (`dsv41_hc_mixes` → pre_out, post_out, comb_out) and its normed input h = RMSNorm(collapse(streams,
 * pre)) (`dsv41_hc_collapse`, then `dsv41_rms_norm` in place): the four calls the layers make one by
 * one, in their order, so the same bits, for one call's fixed cost instead of four. Returns 0, or -1
 * (the mixes could not run; h and the mixes' outputs untouched). */
static int enter_rows(int64_t rows, int64_t S, int64_t D, int bf16, const void *o, const void *residual,
                      const float *post, const float *comb, void *streams, const float *fn, const float *scale,
                      const float *base, int64_t iters, float norm_eps, float hc_eps, int threads, const float *pre,
                      const void *norm_weight, int norm_bf16, float eps, float *pre_out, float *post_out,
                      float *comb_out, void *h) {
    const void *x = residual;
    if (o != NULL) {
        dsv41_hc_expand(rows, S, D, bf16, o, residual, post, comb, streams);
        x = streams;
    }
    if (dsv41_hc_mixes(rows, S, D, bf16, x, fn, scale, base, iters, norm_eps, hc_eps, threads, pre_out, post_out,
                       comb_out) != 0)
        return -1;
    dsv41_hc_collapse(rows, S, D, bf16, x, pre, h);
    dsv41_rms_norm(rows, D, eps, h, bf16, norm_weight, norm_bf16, h);
    return 0;
}

int dsv41_hc_enter(int64_t rows, int64_t S, int64_t D, int bf16, const void *o, const void *residual,
                   const float *post, const float *comb, void *streams, const float *fn, const float *scale,
                   const float *base, int64_t iters, float norm_eps, float hc_eps, int threads, const float *pre,
                   const void *norm_weight, int norm_bf16, float eps, float *pre_out, float *post_out,
                   float *comb_out, void *h) {
    if (threads < 2 || rows < 2)
        return enter_rows(rows, S, D, bf16, o, residual, post, comb, streams, fn, scale, base, iters, norm_eps, hc_eps,
                          threads, pre, norm_weight, norm_bf16, eps, pre_out, post_out, comb_out, h);
    /* several rows: each thread takes whole pairs of rows through all four steps (every step is each
     * row's own, so the same bits), instead of the threads sharing only the projections and taking turns
     * at the rest: 16 rows' expansions, statistics, collapses and norms were ~55% of the call (N39) */
    const size_t width = bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (int64_t r = 0; r < rows; r += 2) {
        const int64_t n = rows - r < 2 ? rows - r : 2;
        failed |= enter_rows(n, S, D, bf16, o != NULL ? (const char *)o + r * D * width : NULL,
                             (const char *)residual + r * S * D * width, post != NULL ? post + r * S : NULL,
                             comb != NULL ? comb + r * S * S : NULL,
                             streams != NULL ? (char *)streams + r * S * D * width : NULL, fn, scale, base, iters,
                             norm_eps, hc_eps, 1, pre + r * S, norm_weight, norm_bf16, eps, pre_out + r * S,
                             post_out + r * S, comb_out + r * S * S, (char *)h + r * D * width) != 0;
    }
    return failed ? -1 : 0;
}
