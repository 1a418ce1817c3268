/* Sparse attention of a few query positions without attention blocks (fast numerics; attention.py
 * `sparse_attention`, docs/NUMERICS.md N17), in one call instead of ~20 torch operations a layer.
 *
 * For query row r = (b, t) and head h, over its listed pool rows j (−1: not listed; a row listed twice
 * counts twice), K = V one latent:
 *   z_j = scale · q[r, h] · pool[b, j],   m = max(max_j z_j, floor),
 *   out[r, h] = Σ_j exp(z_j − m) · pool[b, j] / (Σ_j exp(z_j − m) + exp(sink[h] − m)),
 * in fp32, summed in this kernel's order (fast numerics' licence); a query with no listed row gets 0.
 * q, pool and out are bf16 or fp32 (each its own flag), rows int64 [B, T, n], sink fp32 [H].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "span.h"

/* One query row's H heads. kvs [n, Dh] receives its listed pool rows widened (once for every head),
 * z [n] the scores, qv and acc [Dh]. */
static void attend_row(int64_t H, int64_t Dh, int64_t n, const void *q, int q_bf16, size_t q_width, int64_t q_at,
                       const void *pool, int pool_bf16, size_t pool_width, int64_t pool_at, const int64_t *rows,
                       const float *sink, float scale, float floor, void *out, int out_bf16, size_t out_width,
                       float *kvs, float *z, float *qv, float *acc) {
    for (int64_t j = 0; j < n; j++)
        if (rows[j] >= 0) widen_row((const char *)pool + (pool_at + rows[j] * Dh) * pool_width, pool_bf16, Dh, kvs + j * Dh);
    for (int64_t h = 0; h < H; h++) {
        widen_row((const char *)q + (q_at + h * Dh) * q_width, q_bf16, Dh, qv);
        float m = floor;
        for (int64_t j = 0; j < n; j++) {
            z[j] = 0.0f;                                /* an unlisted row's weight is never read */
            if (rows[j] < 0) continue;
            const float *kv = kvs + j * Dh;
            float dot = 0.0f;
            #pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < Dh; d++) dot += qv[d] * kv[d];
            z[j] = dot * scale;
            if (z[j] > m) m = z[j];
        }
        /* the weights e^(z − m) 16 at a time (exp.h: a call of libm's expf per listed row and head was
         * about half of a 16-row layer's attention; N39), then summed and applied in row order */
#if defined(EXP_LANES)
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 lanes = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
            _mm512_mask_storeu_ps(z + j, lanes, exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, z + j),
                                                                        _mm512_set1_ps(m))));
        }
#else
        for (int64_t j = 0; j < n; j++) z[j] = expf(z[j] - m);
#endif
        float denom = 0.0f;
        for (int64_t d = 0; d < Dh; d++) acc[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            if (rows[j] < 0) continue;
            const float p = z[j], *kv = kvs + j * Dh;
            denom += p;
            for (int64_t d = 0; d < Dh; d++) acc[d] += p * kv[d];
        }
        denom += expf(sink[h] - m);
        for (int64_t d = 0; d < Dh; d++) acc[d] = acc[d] / denom;
        narrow_row(acc, Dh, out_bf16, (char *)out + (q_at + h * Dh) * out_width);
    }
}

/* q [B, T, H, Dh], pool [B, N, Dh], rows [B, T, n] (entries in −1 … N−1: the caller checks), out like q.
 * Returns 0, or -1 if scratch could not be had (out untouched). */
int dsv41_sparse_attention(int64_t B, int64_t T, int64_t H, int64_t Dh, int64_t N, int64_t n, int threads,
                           const void *q, int q_bf16, const void *pool, int pool_bf16, const int64_t *rows,
                           const float *sink, float scale, float floor, void *out, int out_bf16) {
    const int64_t R = B * T;
    if (threads < 1) threads = 1;
    if (threads > R) threads = (int)R;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: failed)
    {
        const Span span = thread_span(R);
        float *scratch = malloc(sizeof(float) * (size_t)(n * Dh + n + 2 * Dh));
        if (scratch == NULL) failed = 1;
        for (int64_t r = span.begin; scratch != NULL && r < span.end; r++)
            attend_row(H, Dh, n, q, q_bf16, q_bf16 ? 2 : 4, r * H * Dh, pool, pool_bf16, pool_bf16 ? 2 : 4,
                       (r / T) * N * Dh, rows + r * n, sink, scale, floor, out, out_bf16, out_bf16 ? 2 : 4, scratch,
                       scratch + n * Dh, scratch + n * Dh + n, scratch + n * Dh + n + Dh);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* A call's compressed entries in the pool (attention.py `_compressed`, N·k of them): token i's entry j
 * is row selected[i, j] of slot token_slot[i] in kv [S, L, Dh] (rows of row_bytes bytes, contiguous),
 * copied to picked[i · k + j], listed there as listed[i, j] = base + i · k + j; an entry of −1 (nothing
 * selected) copies row 0 and is listed as −1. The torch path's index, arange and where, in one call.
 * Returns 0, or -1 (a selected row of L or more; nothing written). */
int dsv41_gather_compressed(int64_t N, int64_t k, int64_t L, int64_t row_bytes, const void *kv,
                            const int64_t *token_slot, const int64_t *selected, int64_t base, void *picked,
                            int64_t *listed) {
    for (int64_t q = 0; q < N * k; q++)
        if (selected[q] >= L) return -1;
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t q = i * k + j, row = selected[q] < 0 ? 0 : selected[q];
            memcpy((char *)picked + q * row_bytes, (const char *)kv + (token_slot[i] * L + row) * row_bytes,
                   (size_t)row_bytes);
            listed[q] = selected[q] < 0 ? -1 : base + q;
        }
    return 0;
}
