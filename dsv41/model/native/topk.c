/* Top-k with exact ties to the lower index, as dsv41/model/topk.py defines it (docs/NUMERICS.md N4,
 * N15): each score becomes one int64 key, its order-preserving integer image in the high 32 bits
 * (−0 read as +0; a negative float's magnitude bits flipped) and the complement of its index in the
 * low 32, so no two keys are equal and the k largest keys are one set, whoever selects them.
 *
 * A row keeps its k best keys in a min-heap, or for a k near n selects them by quickselect, then
 * sorts them in descending order: the order `torch.topk(sorted=True)` gives distinct keys. No
 * arithmetic on the scores beyond the −0 fold, so every numerics policy may take it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "span.h"

/* The low 32 bits of a key, from an index and back (the complement is its own inverse). */
#define LOW_BITS(index) (0xFFFFFFFFu - (uint32_t)(index))

static inline int64_t score_key(float score, int64_t index) {
    const float folded = score + 0.0f;                    /* −0 → +0 */
    int32_t bits;
    memcpy(&bits, &folded, sizeof bits);
    const int32_t monotone = bits < 0 ? bits ^ 0x7FFFFFFF : bits;
    return (int64_t)((uint64_t)(int64_t)monotone << 32) | (int64_t)LOW_BITS(index);
}

static void sift_down(int64_t *heap, int64_t size, int64_t at) {
    for (;;) {
        int64_t smallest = at;
        const int64_t left = 2 * at + 1, right = left + 1;
        if (left < size && heap[left] < heap[smallest]) smallest = left;
        if (right < size && heap[right] < heap[smallest]) smallest = right;
        if (smallest == at) return;
        const int64_t t = heap[at];
        heap[at] = heap[smallest];
        heap[smallest] = t;
        at = smallest;
    }
}

/* Moves the k largest of keys[0 … n) (all distinct) to the front, in no order: quickselect with a
 * median-of-three pivot. */
static void select_largest(int64_t *keys, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t a = keys[lo], b = keys[lo + (hi - lo) / 2], c = keys[hi];
        const int64_t pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {                                  /* larger keys to the left */
            while (keys[i] > pivot) i++;
            while (keys[j] < pivot) j--;
            if (i <= j) {
                const int64_t t = keys[i];
                keys[i++] = keys[j];
                keys[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

/* One row: the k best keys of scores[0 … n), written as indices (in descending key order with
 * `sorted`, else in no order) and the scores at them, in the scores' dtype. `heap` holds n keys of
 * scratch. A small k keeps a min-heap of the best k (one comparison per score once it is full); a
 * large one selects them first. */
static void row_topk(const void *scores, int bf16, int64_t n, int64_t k, int sorted, int64_t *heap,
                     int64_t *indices, void *values) {
    if (n >= 16 * k) {
        for (int64_t i = 0; i < k; i++) heap[i] = score_key(value_at(scores, bf16, i), i);
        for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
        for (int64_t i = k; i < n; i++) {
            const int64_t key = score_key(value_at(scores, bf16, i), i);
            if (key > heap[0]) {
                heap[0] = key;
                sift_down(heap, k, 0);
            }
        }
    } else {
        for (int64_t i = 0; i < n; i++) heap[i] = score_key(value_at(scores, bf16, i), i);
        select_largest(heap, n, k);
        if (sorted)
            for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    }
    for (int64_t size = sorted ? k : 0; size > 1; size--) {     /* heap sort: the smallest key goes last */
        const int64_t t = heap[0];
        heap[0] = heap[size - 1];
        heap[size - 1] = t;
        sift_down(heap, size - 1, 0);
    }
    for (int64_t i = 0; i < k; i++) {
        const int64_t index = (int64_t)LOW_BITS(heap[i] & 0xFFFFFFFF);
        indices[i] = index;
        if (bf16) ((uint16_t *)values)[i] = ((const uint16_t *)scores)[index];
        else ((float *)values)[i] = ((const float *)scores)[index];
    }
}

/* rows × n scores (contiguous fp32, or bf16 with `bf16`) → indices [rows, k] int64 and values
 * [rows, k] of the same dtype; `heap` is threads × n int64 of scratch. 0 < k ≤ n < 2^32 (the caller
 * checks). */
void dsv41_topk(int64_t rows, int64_t n, int64_t k, int sorted, int threads, const void *scores, int bf16,
                int64_t *heap, int64_t *indices, void *values) {
    const size_t width = bf16 ? 2 : 4;
    if (threads < 1) threads = 1;
    if (threads > rows) threads = (int)rows;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const Span span = thread_span(rows);
        for (int64_t r = span.begin; r < span.end; r++)
            row_topk((const char *)scores + r * n * width, bf16, n, k, sorted, heap + span.index * n, indices + r * k,
                     (char *)values + r * k * width);
    }
}

/* The router of fast numerics (moe.py `route`, docs/ARCHITECTURE.md §13) in one call instead of ~10
 * torch operations: per token, score = √softplus(logit) with softplus(x) = x above 20 (torch's
 * threshold) and log1p(exp(x)) below; the k experts of the best score + bias (ties to the lower
 * expert: the keys above); their scores as weights, divided by their sum + eps when k > 1 (summed in
 * the chosen order), times `scale`. The bias only selects (trap 16); a token with image[t] set selects
 * with bias_vl.
 *
 * logits [n, E] fp32, bias and bias_vl [E] fp32 (bias_vl and image may be NULL); ids [n, k] int64 and
 * weights [n, k] fp32 out. 0 < k ≤ E < 2^32 (the caller checks). Returns 0, or -1 (no scratch). */
int dsv41_route(int64_t n, int64_t E, int64_t k, float scale, float eps, int threads, const float *logits,
                const float *bias, const float *bias_vl, const uint8_t *image, int64_t *ids, float *weights) {
    if (threads < 1) threads = 1;
    if (threads > n) threads = (int)n;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1) reduction(|: failed)
    {
        const Span span = thread_span(n);
        float *score = malloc(sizeof(float) * (size_t)(2 * E));
        int64_t *heap = malloc(sizeof(int64_t) * (size_t)E);
        if (score == NULL || heap == NULL) failed = 1;
        for (int64_t t = span.begin; !failed && t < span.end; t++) {
            float *select = score + E;
            const float *b = (image != NULL && bias_vl != NULL && image[t]) ? bias_vl : bias;
            for (int64_t e = 0; e < E; e++) {
                const float x = logits[t * E + e];
                score[e] = sqrtf(x > 20.0f ? x : log1pf(expf(x)));
                select[e] = score[e] + b[e];
            }
            row_topk(select, 0, E, k, 1, heap, ids + t * k, weights + t * k);
            float sum = 0.0f;
            for (int64_t a = 0; a < k; a++) {
                weights[t * k + a] = score[ids[t * k + a]];
                sum += weights[t * k + a];
            }
            for (int64_t a = 0; a < k; a++) {
                const float w = k > 1 ? weights[t * k + a] / (sum + eps) : weights[t * k + a];
                weights[t * k + a] = w * scale;
            }
        }
        free(score);
        free(heap);
    }
    return failed ? -1 : 0;
}
