/* A fast decode step's sublayers in fewer calls (docs/NUMERICS.md N33): the attention's projections in
 * two calls instead of eleven (attention.py `Attention.forward`): into the attention, the query path
 * (wq_a, q_norm, wq_b, RoPE) and the key path (wkv, kv_norm, RoPE); out of it, the inverse RoPE, wo_a's
 * groups and wo_b. And the MoE in one call instead of three (moe.py `MoE.routed`): the gate's logits,
 * the router and the routed and shared experts. And (N35) a block's way into its attention (the attention's
 * entry, then the projections) and its feed-forward half (the FFN's entry, the MoE, the expansion).
 *
 * Each part is the kernel the layer would call on its own (`dsv41_gemv`, `dsv41_rms_norm`, `dsv41_rope`,
 * `dsv41_route`, `dsv41_routed_experts`), with the same arguments, in the same order, so the results have
 * the same bits. What the fusion saves is what lies between the kernels: a wrapper, a tensor allocation
 * and a ctypes call each, and the torch and Python steps of the layer, all of which run out of a cache
 * the weight streams have just flushed (a dim-1024 window layer spent ~200 of its ~490 µs between its
 * eleven kernels).
 *
 * Shapes: N packed tokens, D dim, Qr query rank, H heads, Dh head dim, R rope dim, G output groups,
 * Or output rank per group; E experts, A chosen per token, I expert width. Activations and weights bf16;
 * norm weights bf16 or fp32; phases fp32 (re, im) [N, R/2], one per token. All contiguous.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

/* qr = q_norm(x · wq_aᵀ) [N, Qr]; q = RoPE(qr · wq_bᵀ) [N, H, Dh]; kv = RoPE(kv_norm(x · wkvᵀ)) [N, Dh].
 * Returns 0, or -1 (no memory, or a product refused its shapes; then nothing is to be used). */
int dsv41_attention_in(int64_t N, int64_t D, int64_t Qr, int64_t H, int64_t Dh, int64_t R, int threads,
                       const uint16_t *x, const uint16_t *wq_a, const void *q_norm, int q_norm_bf16, float q_eps,
                       const uint16_t *wq_b, const uint16_t *wkv, const void *kv_norm, int kv_norm_bf16,
                       float kv_eps, const float *phases, uint16_t *qr, uint16_t *q, uint16_t *kv) {
    uint16_t *unrotated = malloc((size_t)(N * (H + 1) * Dh) * sizeof(uint16_t));
    if (unrotated == NULL) return -1;
    uint16_t *q_raw = unrotated, *kv_raw = unrotated + N * H * Dh;
    int status = bf16_product(N, Qr, D, threads, x, wq_a, qr);
    if (status == 0) {
        dsv41_rms_norm(N, Qr, q_eps, qr, 1, q_norm, q_norm_bf16, qr);
        status = bf16_product(N, H * Dh, Qr, threads, qr, wq_b, q_raw);
    }
    if (status == 0) {
        dsv41_rope(1, N, H, Dh, R, 1, 1, 0, q_raw, phases, q);
        status = bf16_product(N, Dh, D, threads, x, wkv, kv_raw);
    }
    if (status == 0) {
        dsv41_rms_norm(N, Dh, kv_eps, kv_raw, 1, kv_norm, kv_norm_bf16, kv_raw);
        dsv41_rope(1, N, 1, Dh, R, 1, 1, 0, kv_raw, phases, kv);
    }
    free(unrotated);
    return status;
}

/* y = (groups of RoPE⁻¹(o) through wo_a's slices) · wo_bᵀ [N, D]: o [N, H, Dh] rotated back (the phases'
 * conjugate), its row cut into G groups of I = H·Dh/G values, group g through wo_a [G, Or, I]'s slice g
 * (attention.py `_grouped_output`: one `gemv` over G pairs), then wo_b [D, G·Or] (this rank's partial
 * product under tensor parallelism; the all-reduce stays in Python). Returns 0 or -1, as above. */
int dsv41_attention_out(int64_t N, int64_t H, int64_t Dh, int64_t R, int64_t G, int64_t Or, int64_t D, int threads,
                        const uint16_t *o, const float *phases, const uint16_t *wo_a, const uint16_t *wo_b,
                        uint16_t *y) {
    const int64_t I = H * Dh / G;
    uint16_t *rotated = malloc((size_t)(N * (H * Dh + G * Or)) * sizeof(uint16_t));
    if (rotated == NULL) return -1;
    uint16_t *grouped = rotated + N * H * Dh;
    dsv41_rope(1, N, H, Dh, R, 1, 1, 1, o, phases, rotated);
    int status = dsv41_gemv(G, N, Or, I, 1, 1, 1, 0, threads, rotated, I, H * Dh, wo_a, Or * I, I, grouped, Or,
                            G * Or);
    if (status == 0) status = bf16_product(N, D, G * Or, threads, grouped, wo_b, y);
    free(rotated);
    return status;
}

/* The MoE of N bf16 tokens x [N, D]: logits = fp32(x) · fp32(gate)ᵀ [N, E] (the gate bf16, widened as it
 * is read: `widened_linear`; a gate temperature other than 1 stays with the layer); the router (`dsv41_route`: ids [N, A]
 * int64, weights [N, A] fp32 out); the routed experts of banks w1, w3 [E, I, D] and w2 [E, D, I] (bf16,
 * or fp4 bytes with scales c1, c3, c2) with the shared expert s1, s3, s2 (bf16, or NULL) added after
 * them, in fp32; y [N, D] that sum rounded to bf16 (the layer's cast). Returns 0, or -1 (no memory, a
 * product refused its shapes, an id out of range; then nothing is to be used). */
int dsv41_moe(int64_t N, int64_t D, int64_t E, int64_t A, int64_t I, int threads, const uint16_t *x,
              const uint16_t *gate, const float *bias, float scale, float eps, float limit,
              const void *w1, const void *w3, const void *w2, const void *s1, const void *s3, const void *s2,
              const uint8_t *c1, const uint8_t *c3, const uint8_t *c2, int64_t *ids, float *weights, uint16_t *y) {
    float *widened = malloc((size_t)(N * (D + E + D)) * sizeof(float));
    if (widened == NULL) return -1;
    float *logits = widened + N * D, *sum = logits + N * E;
    for (int64_t i = 0; i < N * D; i++) widened[i] = bf16_to_float(x[i]);
    int status = dsv41_gemv(1, N, E, D, 0, 1, 0, 0, threads, widened, 0, D, gate, 0, D, logits, 0, E);
    if (status == 0) status = dsv41_route(N, E, A, scale, eps, threads, logits, bias, NULL, NULL, ids, weights);
    if (status == 0)
        status = dsv41_routed_experts(N, A, E, D, I, 1, 1, limit, threads, x, ids, weights, w1, w3, w2, s1, s3, s2,
                                      c1, c3, c2, 0, sum);
    if (status == 0)
        for (int64_t i = 0; i < N * D; i++) y[i] = float_to_bf16(sum[i]);
    free(widened);
    return status;
}

/* A block's feed-forward half for N bf16 tokens of S streams (block.py `Block.run` after the attention):
 * the FFN's entry (`dsv41_hc_enter`: the attention's output o [N, D] expanded into the streams R [N, S, D]
 * with its post and comb, the FFN's mixes → pre_out [N, S] and its own post and comb, the normed input),
 * the MoE of that input (`dsv41_moe` → ids, weights), and its output expanded into the streams with the
 * FFN's post and comb (`dsv41_hc_expand` → streams_out [N, S, D]). The three calls the block makes, in
 * their order, with their arguments: their bits in one call. Returns 0, or -1 (nothing to be used). */
int dsv41_ffn_half(int64_t N, int64_t S, int64_t D, const uint16_t *o, const uint16_t *residual, const float *post,
                   const float *comb, const float *fn, const float *scale, const float *base, int64_t iters,
                   float norm_eps, float hc_eps, int mix_threads, const float *pre, const void *norm_weight,
                   int norm_bf16, float eps, int64_t E, int64_t A, int64_t I, int threads, const uint16_t *gate,
                   const float *bias, float route_scale, float route_eps, float limit, const void *w1, const void *w3,
                   const void *w2, const void *s1, const void *s3, const void *s2, const uint8_t *c1,
                   const uint8_t *c3, const uint8_t *c2, float *pre_out, int64_t *ids, float *weights,
                   uint16_t *streams_out) {
    uint16_t *entered = malloc((size_t)(N * (S * D + 2 * D)) * sizeof(uint16_t));
    float *mixes = malloc((size_t)(N * (S + S * S)) * sizeof(float));
    if (entered == NULL || mixes == NULL) {
        free(entered); free(mixes);
        return -1;
    }
    uint16_t *h = entered + N * S * D, *y = h + N * D;
    float *post_ffn = mixes, *comb_ffn = mixes + N * S;
    int status = dsv41_hc_enter(N, S, D, 1, o, residual, post, comb, entered, fn, scale, base, iters, norm_eps, hc_eps,
                                mix_threads, pre, norm_weight, norm_bf16, eps, pre_out, post_ffn, comb_ffn, h);
    if (status == 0)
        status = dsv41_moe(N, D, E, A, I, threads, h, gate, bias, route_scale, route_eps, limit, w1, w3, w2, s1, s3, s2,
                           c1, c3, c2, ids, weights, y);
    if (status == 0) dsv41_hc_expand_rows(N, S, D, 1, y, entered, post_ffn, comb_ffn, streams_out, mix_threads);
    free(entered); free(mixes);
    return status;
}

/* A block's way into its attention for N bf16 tokens of S streams: the attention's entry
 * (`dsv41_hc_enter` without a previous output: the streams' mixes → pre_out, post_out, comb_out, and the
 * normed input h [N, D]) and the query and key paths of h (`dsv41_attention_in` → qr, q, kv). The two
 * calls the block and its attention make, with their arguments: their bits in one call. Returns 0 or -1. */
int dsv41_attention_entry(int64_t N, int64_t S, int64_t D, const uint16_t *streams, const float *fn, const float *scale,
                          const float *base, int64_t iters, float norm_eps, float hc_eps, int mix_threads,
                          const float *pre, const void *norm_weight, int norm_bf16, float eps, float *pre_out,
                          float *post_out, float *comb_out, uint16_t *h, int64_t Qr, int64_t H, int64_t Dh, int64_t R,
                          int threads, const uint16_t *wq_a, const void *q_norm, int q_norm_bf16, float q_eps,
                          const uint16_t *wq_b, const uint16_t *wkv, const void *kv_norm, int kv_norm_bf16,
                          float kv_eps, const float *phases, uint16_t *qr, uint16_t *q, uint16_t *kv) {
    int status = dsv41_hc_enter(N, S, D, 1, NULL, streams, NULL, NULL, NULL, fn, scale, base, iters, norm_eps, hc_eps,
                                mix_threads, pre, norm_weight, norm_bf16, eps, pre_out, post_out, comb_out, h);
    if (status == 0)
        status = dsv41_attention_in(N, D, Qr, H, Dh, R, threads, h, wq_a, q_norm, q_norm_bf16, q_eps, wq_b, wkv,
                                    kv_norm, kv_norm_bf16, kv_eps, phases, qr, q, kv);
    return status;
}
