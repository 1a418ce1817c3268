/* The lightning indexer's scores of a few query positions (fast numerics; indexer.py `_tile`,
 * docs/NUMERICS.md N19), in one call instead of a product, a ReLU, a weighting and a head sum as torch
 * operations, once per batch row.
 *
 * For query row r = (b, t) and key c of batch row b:
 *   l_h = q[r, h] · k[b, c]                      an fp32 sum in this kernel's order, rounded to the dtype
 *   s   = Σ_h round(relu(l_h) · w[r, h])         summed in fp32, heads ascending, rounded once at the end
 * where `round` is bf16's (to nearest even) for bf16 operands and none for fp32 ones: the roundings of
 * the torch path (its logits, its weighted logits and its fp32-accumulated head sum in the dtype).
 * A NaN logit stays NaN through the ReLU, as torch's does.
 * q [B, T, H, D], w [B, T, H] and out [B, T, C] contiguous; keys [B, C, D] with rows D apart and
 * batch rows `key_stride` elements apart (a column tile of the pool); all one dtype.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "span.h"

/* Keys scored per work item: each item widens its query row once for this many keys. */
#define KEYS_PER_ITEM 256

/* Keys c0 … c1 of query row r; qv [H·D] and kv [D] are scratch. */
static void score_keys(int64_t T, int64_t H, int64_t D, int64_t C, int bf16, int64_t r, int64_t c0, int64_t c1,
                       const void *q, const void *w, const void *keys, int64_t key_stride, void *out,
                       float *qv, float *kv) {
    const size_t width = bf16 ? 2 : 4;
    widen_row((const char *)q + r * H * D * width, bf16, H * D, qv);
    const char *key_rows = (const char *)keys + (r / T) * key_stride * width;
    for (int64_t c = c0; c < c1; c++) {
        widen_row(key_rows + c * D * width, bf16, D, kv);
        float sum = 0.0f;
        for (int64_t h = 0; h < H; h++) {
            const float *qh = qv + h * D;
            float dot = 0.0f;
            #pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qh[d] * kv[d];
            float l = round_to(dot, bf16);
            l = l < 0.0f ? 0.0f : l;
            sum += round_to(l * value_at(w, bf16, r * H + h), bf16);
        }
        store_value(out, bf16, r * C + c, sum);
    }
}

/* Returns 0, or -1 if scratch could not be had (out untouched where a thread failed). */
int dsv41_index_scores(int64_t B, int64_t T, int64_t H, int64_t D, int64_t C, int bf16, int threads, const void *q,
                       const void *w, const void *keys, int64_t key_stride, void *out) {
    const int64_t per_row = (C + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM, items = B * T * per_row;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int)(items > 0 ? items : 1);
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: failed)
    {
        const Span span = thread_span(items);
        float *scratch = malloc(sizeof(float) * (size_t)(H * D + D));
        if (scratch == NULL) failed = 1;
        for (int64_t i = span.begin; scratch != NULL && i < span.end; i++) {
            const int64_t r = i / per_row, c0 = (i % per_row) * KEYS_PER_ITEM;
            const int64_t c1 = c0 + KEYS_PER_ITEM < C ? c0 + KEYS_PER_ITEM : C;
            score_keys(T, H, D, C, bf16, r, c0, c1, q, w, keys, key_stride, out, scratch, scratch + H * D);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
