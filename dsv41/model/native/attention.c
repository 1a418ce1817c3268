/* Sparse attention of a few query positions without attention blocks (fast numerics; attention.py
 * `sparse_attention`, docs/NUMERICS.md N17), in one call instead of ~20 torch operations a layer.
 *
 * For query row r = (b, t) and head h, over its listed pool rows j (−1: not listed; a row listed twice
 * counts twice), K = V one latent:
 *   z_j = scale · q[r, h] · pool[b, j],   m = max(max_j z_j, floor),
 *   out[r, h] = Σ_j exp(z_j − m) · pool[b, j] / (Σ_j exp(z_j − m) + exp(sink[h] − m)),
 * in fp32, summed in this kernel's order (fast numerics' licence); a query with no listed row gets 0.
 * q, pool and out are bf16 or fp32 (each its own flag), rows int64 [B, T, n], sink fp32 [H].
 * The pool of a call with one batch row may come in parts read where they lie (a decode step's window
 * rings, its own rows and the compressed rows: no copy of them into one tensor first, N40); its last
 * part may be rows picked from a cache: token t's entry j is row pick_row[t · k + j] of slot
 * pick_slot[t] (−1: none, never listed).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "span.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(EXP_LANES)
/* The vector path (AVX-512, Dh a multiple of 32) takes a row's heads G at a time (G a constant: 8, 4, 2 or
 * 1, the largest that divides H), so each listed row's widened values are read once for the group's
 * scores and once for its weighted sums, from L1, where one head at a time read a 16-row layer's rows
 * (~80 KB a query row) twice a head from L2 and summed each score in one chain of dependent adds (N39).
 * Each (head, row) score is one sixteen-lane multiply-add chain over Dh in order, then its lanes' sum;
 * each output element one chain over the listed rows in order: the same steps whatever G and whatever
 * rows sit beside it in a block, so the same bits. */

/* z [G, n] = scale · (qv [G, Dh] · kvs[j]), two rows side by side. */
static inline __attribute__((always_inline)) void group_scores(int G, int64_t n, int64_t Dh, const float *qv,
                                                               const float *kvs, float scale, float *z) {
    int64_t j = 0;
    for (; j < n; j += 2) {
        const int two = j + 1 < n;
        __m512 s[2][8];
        for (int h = 0; h < G; h++) s[0][h] = s[1][h] = _mm512_setzero_ps();
        for (int64_t d = 0; d < Dh; d += 16) {
            const __m512 k0 = _mm512_loadu_ps(kvs + j * Dh + d), k1 = _mm512_loadu_ps(kvs + (j + two) * Dh + d);
            for (int h = 0; h < G; h++) {
                const __m512 qd = _mm512_loadu_ps(qv + h * Dh + d);
                s[0][h] = _mm512_fmadd_ps(qd, k0, s[0][h]);
                s[1][h] = _mm512_fmadd_ps(qd, k1, s[1][h]);
            }
        }
        for (int h = 0; h < G; h++) {
            z[h * n + j] = _mm512_reduce_add_ps(s[0][h]) * scale;
            if (two) z[h * n + j + 1] = _mm512_reduce_add_ps(s[1][h]) * scale;
        }
    }
}

/* acc [G, Dh] = Σ_j p[h, j] · kvs[j] over the listed rows j, 32 elements of every head at a time. */
static inline __attribute__((always_inline)) void group_sums(int G, int64_t n, int64_t Dh, const int64_t *rows,
                                                             const float *p, const float *kvs, float *acc) {
    for (int64_t d0 = 0; d0 < Dh; d0 += 32) {
        __m512 a[8][2];
        for (int h = 0; h < G; h++) a[h][0] = a[h][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            if (rows[j] < 0) continue;
            const __m512 k0 = _mm512_loadu_ps(kvs + j * Dh + d0), k1 = _mm512_loadu_ps(kvs + j * Dh + d0 + 16);
            for (int h = 0; h < G; h++) {
                const __m512 w = _mm512_set1_ps(p[h * n + j]);
                a[h][0] = _mm512_fmadd_ps(w, k0, a[h][0]);
                a[h][1] = _mm512_fmadd_ps(w, k1, a[h][1]);
            }
        }
        for (int h = 0; h < G; h++) {
            _mm512_storeu_ps(acc + h * Dh + d0, a[h][0]);
            _mm512_storeu_ps(acc + h * Dh + d0 + 16, a[h][1]);
        }
    }
}

/* Heads h0 … h0 + G − 1 of a row whose listed rows are widened in kvs: qv and acc [G, Dh], z [G, n]. */
static inline __attribute__((always_inline)) void attend_group(int G, int64_t h0, int64_t Dh, int64_t n,
                                                               const void *q, int q_bf16, size_t q_width, int64_t q_at,
                                                               const int64_t *rows, const float *sink, float scale,
                                                               float floor, void *out, int out_bf16, size_t out_width,
                                                               const float *kvs, float *z, float *qv, float *acc) {
    widen_row((const char *)q + (q_at + h0 * Dh) * q_width, q_bf16, G * Dh, qv);
    group_scores(G, n, Dh, qv, kvs, scale, z);
    float denom[8];
    for (int h = 0; h < G; h++) {
        float *zh = z + h * n, m = floor;
        for (int64_t j = 0; j < n; j++)
            if (rows[j] >= 0 && zh[j] > m) m = zh[j];
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 lanes = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
            _mm512_mask_storeu_ps(zh + j, lanes, exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, zh + j),
                                                                         _mm512_set1_ps(m))));
        }
        denom[h] = 0.0f;
        for (int64_t j = 0; j < n; j++)
            if (rows[j] >= 0) denom[h] += zh[j];
        denom[h] += expf(sink[h0 + h] - m);
    }
    group_sums(G, n, Dh, rows, z, kvs, acc);
    for (int h = 0; h < G; h++) {
        for (int64_t d = 0; d < Dh; d++) acc[h * Dh + d] = acc[h * Dh + d] / denom[h];
        narrow_row(acc + h * Dh, Dh, out_bf16, (char *)out + (q_at + (h0 + h) * Dh) * out_width);
    }
}
#endif

/* A pool of rows [Σ parts, Dh] held in `parts` pieces: piece i's rows (end[i − 1] … end[i] − 1 of the
 * pool) start at at[i]; rows of `width` bytes a value. With pick_k > 0 the last piece is a cache [S, L,
 * Dh] whose row e is row pick_row[e] of slot pick_slot[e / pick_k]. */
typedef struct {
    int64_t parts;
    const int64_t *at, *end;
    int64_t Dh;
    size_t width;
    int64_t pick_k, pick_L;
    const int64_t *pick_slot, *pick_row;
} Pool;

static inline const char *pool_row(const Pool *pool, int64_t row) {
    int64_t i = 0;
    while (i + 1 < pool->parts && row >= pool->end[i]) i++;
    const int64_t first = i == 0 ? 0 : pool->end[i - 1];
    int64_t at = row - first;
    if (pool->pick_k > 0 && i == pool->parts - 1) at = pool->pick_slot[at / pool->pick_k] * pool->pick_L + pool->pick_row[at];
    return (const char *)(intptr_t)pool->at[i] + (size_t)(at * pool->Dh) * pool->width;
}

/* One query row's H heads. kvs [n, Dh] receives its listed pool rows widened (once for every head),
 * z [H, n] the scores, qv and acc [H, Dh]. */
static void attend_row(int64_t H, int64_t Dh, int64_t n, const void *q, int q_bf16, size_t q_width, int64_t q_at,
                       const Pool *pool, int pool_bf16, int64_t pool_at, const int64_t *rows,
                       const float *sink, float scale, float floor, void *out, int out_bf16, size_t out_width,
                       float *kvs, float *z, float *qv, float *acc) {
    for (int64_t j = 0; j < n; j++) {
        if (rows[j] >= 0) widen_row(pool_row(pool, pool_at + rows[j]), pool_bf16, Dh, kvs + j * Dh);
        else memset(kvs + j * Dh, 0, (size_t)Dh * sizeof(float));     /* scored with the rest, never read */
    }
#if defined(EXP_LANES)
    if (Dh % 32 == 0) {
        const int G = H % 8 == 0 ? 8 : H % 4 == 0 ? 4 : H % 2 == 0 ? 2 : 1;
        for (int64_t h0 = 0; h0 < H; h0 += G)
            switch (G) {
                case 8: attend_group(8, h0, Dh, n, q, q_bf16, q_width, q_at, rows, sink, scale, floor, out, out_bf16,
                                     out_width, kvs, z, qv, acc); break;
                case 4: attend_group(4, h0, Dh, n, q, q_bf16, q_width, q_at, rows, sink, scale, floor, out, out_bf16,
                                     out_width, kvs, z, qv, acc); break;
                case 2: attend_group(2, h0, Dh, n, q, q_bf16, q_width, q_at, rows, sink, scale, floor, out, out_bf16,
                                     out_width, kvs, z, qv, acc); break;
                default: attend_group(1, h0, Dh, n, q, q_bf16, q_width, q_at, rows, sink, scale, floor, out, out_bf16,
                                      out_width, kvs, z, qv, acc); break;
            }
        return;
    }
#endif
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
        float denom = 0.0f;
        for (int64_t d = 0; d < Dh; d++) acc[d] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            if (rows[j] < 0) continue;
            const float p = expf(z[j] - m), *kv = kvs + j * Dh;
            denom += p;
            for (int64_t d = 0; d < Dh; d++) acc[d] += p * kv[d];
        }
        denom += expf(sink[h] - m);
        for (int64_t d = 0; d < Dh; d++) acc[d] = acc[d] / denom;
        narrow_row(acc, Dh, out_bf16, (char *)out + (q_at + h * Dh) * out_width);
    }
}

/* q [B, T, H, Dh], pool [B, N, Dh] in `parts` pieces (part_at: their addresses, part_end: the row after
 * each, the last B · N; pick_k > 0: the last piece picked from a cache of S slots of L rows, as `Pool`
 * says), rows [B, T, n] (entries in −1 … N−1: the caller checks), out like q.
 * Returns 0, or -1 (a picked row outside its cache, or scratch could not be had; out untouched). */
int dsv41_sparse_attention(int64_t B, int64_t T, int64_t H, int64_t Dh, int64_t N, int64_t n, int threads,
                           const void *q, int q_bf16, int64_t parts, const int64_t *part_at, const int64_t *part_end,
                           int64_t pick_k, int64_t pick_S, int64_t pick_L, const int64_t *pick_slot,
                           const int64_t *pick_row, int pool_bf16, const int64_t *rows, const float *sink, float scale,
                           float floor, void *out, int out_bf16) {
    const int64_t R = B * T;
    const Pool pool = {parts, part_at, part_end, Dh, pool_bf16 ? 2 : 4, pick_k, pick_L, pick_slot, pick_row};
    if (pick_k > 0) {
        const int64_t picked = part_end[parts - 1] - (parts > 1 ? part_end[parts - 2] : 0);
        for (int64_t e = 0; e < picked; e++)
            if (pick_row[e] < -1 || pick_row[e] >= pick_L || pick_slot[e / pick_k] < 0 || pick_slot[e / pick_k] >= pick_S)
                return -1;
    }
    if (threads < 1) threads = 1;
    if (threads > R) threads = (int)R;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: failed)
    {
        const Span span = thread_span(R);
        float *scratch = malloc(sizeof(float) * (size_t)(n * Dh + H * n + 2 * H * Dh));
        if (scratch == NULL) failed = 1;
        for (int64_t r = span.begin; scratch != NULL && r < span.end; r++)
            attend_row(H, Dh, n, q, q_bf16, q_bf16 ? 2 : 4, r * H * Dh, &pool, pool_bf16, (r / T) * N, rows + r * n,
                       sink, scale, floor, out, out_bf16, out_bf16 ? 2 : 4, scratch, scratch + n * Dh,
                       scratch + n * Dh + H * n, scratch + n * Dh + H * n + H * Dh);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* A call's compressed entries copied out of their cache (attention.py `Picked.rows`, N·k of them), for
 * an attention that cannot read them there: token i's entry j is row selected[i, j] of slot
 * token_slot[i] in kv [S, L, Dh] (rows of row_bytes bytes, contiguous), copied to picked[i · k + j]; an
 * entry of −1 (nothing selected) copies row 0. The torch path's index in one call.
 * Returns 0, or -1 (a selected row of L or more; nothing written). */
int dsv41_gather_compressed(int64_t N, int64_t k, int64_t L, int64_t row_bytes, const void *kv,
                            const int64_t *token_slot, const int64_t *selected, void *picked) {
    for (int64_t q = 0; q < N * k; q++)
        if (selected[q] >= L) return -1;
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t q = i * k + j, row = selected[q] < 0 ? 0 : selected[q];
            memcpy((char *)picked + q * row_bytes, (const char *)kv + (token_slot[i] * L + row) * row_bytes,
                   (size_t)row_bytes);
        }
    return 0;
}
