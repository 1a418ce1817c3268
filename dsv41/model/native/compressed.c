/* A fast decode step's compressed branch in fewer calls (docs/NUMERICS.md N34), as sublayers.c does for
 * the projections: a kv source's new compressed rows written into its cache rows in one call, and an
 * index source's choice of compressed positions in another.
 *
 * Publication (attention.py `Attention._publish`, compressor.py `Compressor.project` for r = 1): from
 * the new latents L [G, Dh] pre-RoPE (or, for r = 1, from the tokens x [G, D]: L = norm(x · wkvᵀ)), the
 * index key RoPE(k_norm(L · wkᵀ)) [Di] and the compressed row RoPE(L) [Dh], each written to its
 * destination row in the cache (addresses given per row: the rows of several slots are not one
 * stride apart).
 *
 * Choice (attention.py `Attention.select`, indexer.py `Indexer.select` and `candidate_blocks`), per
 * token r against its row's index keys [C, Di] (an address per token):
 *   q = RoPE(qr · wq_bᵀ) [Hi, Di], w = bf16(bf16(x · weights_projᵀ) · scale) [Hi]
 *   s = the indexer's scores (`dsv41_index_scores`), −∞ from position visible[r] on
 *   a candidate source: its kept-block mask from s (blocks of Bs by their max, the newest visible block
 *       pinned with +∞, the best Nb kept unless −∞), written to keep [N, C]
 *   a candidate user: s = −∞ where its source's mask restrict [N, C] is 0
 *   the k = min(K, C) best of s (`dsv41_topk`, ties to the lower position) ascending, −1 from visible on.
 *
 * Every part is the kernel the layer calls on its own with the same arguments, or (the masks, the
 * block maxima, the ascending order) a step with no rounding, so the results have the bits of the calls
 * one by one. Shapes: N tokens (one per row), D dim, Qr query rank, Dh latent width, Hi indexer heads,
 * Di their width, R rope dim; activations, weights and cache rows bf16; norm weights bf16 or fp32;
 * phases fp32 (re, im) [N or G, R/2]. Returns 0, or -1 (no memory, a product refused its shapes;
 * nothing is to be used, and a publication wrote no row).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define BF16_NEG_INF 0xFF80u
/* Products (C · Hi · Di) from which a token's scores take the threads (native/__init__.py GEMV_THREAD_FROM). */
#define SCORE_THREADS_FROM (1 << 15)

int dsv41_publish(int64_t G, int64_t D, int64_t Dh, int64_t Di, int64_t R, int threads, const uint16_t *x,
                  const uint16_t *wkv, const void *norm, int norm_bf16, float eps, const uint16_t *latent,
                  const uint16_t *wk, const void *k_norm, int k_norm_bf16, float k_eps, const float *phases,
                  const int64_t *kv_rows, const int64_t *key_rows) {
    uint16_t *scratch = malloc((size_t)(G * (3 * Dh + 2 * Di)) * sizeof(uint16_t));
    if (scratch == NULL) return -1;
    uint16_t *own = scratch, *rotated = own + G * Dh, *keys = rotated + G * Dh, *rotated_keys = keys + G * Di;
    int status = 0;
    if (x != NULL) {                                    /* r = 1: the compressor's projection and norm */
        status = bf16_product(G, Dh, D, threads, x, wkv, own);
        if (status == 0) dsv41_rms_norm(G, Dh, eps, own, 1, norm, norm_bf16, own);
        latent = own;
    }
    if (status == 0) status = bf16_product(G, Di, Dh, threads, latent, wk, keys);
    if (status == 0) {
        dsv41_rms_norm(G, Di, k_eps, keys, 1, k_norm, k_norm_bf16, keys);
        dsv41_rope(1, G, 1, Di, R, 1, 1, 0, keys, phases, rotated_keys);
        dsv41_rope(1, G, 1, Dh, R, 1, 1, 0, latent, phases, rotated);
        for (int64_t g = 0; g < G; g++) {
            memcpy((void *)(intptr_t)kv_rows[g], rotated + g * Dh, (size_t)Dh * sizeof(uint16_t));
            memcpy((void *)(intptr_t)key_rows[g], rotated_keys + g * Di, (size_t)Di * sizeof(uint16_t));
        }
    }
    free(scratch);
    return status;
}

static int ascending(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* A candidate source's kept blocks of one token's scores s [C] → keep [C] (0 or 1). `block_score`
 * holds ⌈C / Bs⌉ floats, `heap` as many int64, `chosen` and `values` Nb of each. */
static void keep_blocks(int64_t C, int64_t Nb, int64_t Bs, int64_t visible, const uint16_t *s, float *block_score,
                        int64_t *heap, int64_t *chosen, float *values, uint8_t *keep) {
    const int64_t n_blocks = (C + Bs - 1) / Bs, top = Nb < n_blocks ? Nb : n_blocks;
    const int64_t newest = visible > 0 ? (visible - 1) / Bs : -1;
    for (int64_t b = 0; b < n_blocks; b++) {
        float best = -INFINITY;                          /* a short last block is padded with −∞ */
        for (int64_t j = b * Bs; j < (b + 1) * Bs && j < C; j++) {
            const float v = bf16_to_float(s[j]);
            if (isnan(v) || isnan(best)) best = NAN;     /* amax propagates a NaN */
            else if (v > best) best = v;
        }
        block_score[b] = b == newest ? INFINITY : best;
    }
    memset(keep, 0, (size_t)C);
    if (top < 1) return;
    dsv41_topk(1, n_blocks, top, 0, 1, block_score, 0, heap, chosen, values);
    for (int64_t i = 0; i < top; i++) {
        if (!(values[i] > -INFINITY)) continue;
        for (int64_t j = chosen[i] * Bs; j < (chosen[i] + 1) * Bs && j < C; j++) keep[j] = 1;
    }
}

int dsv41_index_select(int64_t N, int64_t D, int64_t Qr, int64_t Hi, int64_t Di, int64_t R, int64_t C, int64_t K,
                       int64_t Nb, int64_t Bs, int threads, const uint16_t *x, const uint16_t *qr,
                       const uint16_t *wq_b, const uint16_t *weights_proj, float scale, const float *phases,
                       const int64_t *key_rows, const int64_t *visible, const uint8_t *restrict_mask, uint8_t *keep,
                       int64_t *chosen) {
    const int64_t k = K < C ? K : C, n_blocks = Bs > 0 ? (C + Bs - 1) / Bs : 0;
    const int64_t longest = C > n_blocks ? C : n_blocks, picks = k > Nb ? k : Nb;
    uint16_t *q = malloc((size_t)(N * Hi * (2 * Di + 1) + C) * sizeof(uint16_t));
    int64_t *heap = malloc((size_t)(longest + 2 * picks) * sizeof(int64_t));
    float *block_score = malloc((size_t)(n_blocks + picks + 1) * sizeof(float));
    if (q == NULL || heap == NULL || block_score == NULL) {
        free(q); free(heap); free(block_score);
        return -1;
    }
    uint16_t *q_raw = q + N * Hi * Di, *w = q_raw + N * Hi * Di, *s = w + N * Hi;
    int64_t *picked = heap + longest, *values = picked + picks;
    int status = bf16_product(N, Hi * Di, Qr, threads, qr, wq_b, q_raw);
    if (status == 0) {
        dsv41_rope(1, N, Hi, Di, R, 1, 1, 0, q_raw, phases, q);
        status = bf16_product(N, Hi, D, threads, x, weights_proj, w);
    }
    for (int64_t i = 0; status == 0 && i < N * Hi; i++) w[i] = float_to_bf16(bf16_to_float(w[i]) * scale);
    const int score_threads = C * Hi * Di >= SCORE_THREADS_FROM ? threads : 1;
    for (int64_t r = 0; status == 0 && r < N; r++) {
        status = dsv41_index_scores(1, 1, Hi, Di, C, 1, score_threads, q + r * Hi * Di, w + r * Hi,
                                    (const void *)(intptr_t)key_rows[r], 0, s);
        if (status != 0) break;
        for (int64_t j = visible[r] > 0 ? visible[r] : 0; j < C; j++) s[j] = BF16_NEG_INF;
        if (keep != NULL)
            keep_blocks(C, Nb, Bs, visible[r], s, block_score, heap, picked, block_score + n_blocks, keep + r * C);
        if (restrict_mask != NULL)
            for (int64_t j = 0; j < C; j++)
                if (!restrict_mask[r * C + j]) s[j] = BF16_NEG_INF;
        dsv41_topk(1, C, k, 0, 1, s, 1, heap, picked, values);
        qsort(picked, (size_t)k, sizeof(int64_t), ascending);
        for (int64_t i = 0; i < k; i++) chosen[r * k + i] = picked[i] < visible[r] ? picked[i] : -1;
    }
    free(q); free(heap); free(block_score);
    return status;
}
