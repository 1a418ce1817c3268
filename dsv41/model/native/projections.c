/* A fast decode step's attention projections in two calls instead of eleven (attention.py
 * `Attention.forward`, docs/NUMERICS.md N33): into the attention, the query path (wq_a, q_norm, wq_b, RoPE)
 * and the key path (wkv, kv_norm, RoPE); out of it, the inverse RoPE, wo_a's groups and wo_b.
 *
 * Each part is the kernel the layer would call on its own (`dsv41_gemv`, `dsv41_rms_norm`, `dsv41_rope`),
 * with the same arguments, in the same order, so the results have the same bits. What the fusion saves is
 * what lies between the kernels: a wrapper, a tensor allocation and a ctypes call each, and the torch and
 * Python steps of the layer, all of which run out of a cache the weight streams have just flushed
 * (a dim-1024 window layer spent ~200 of its ~490 µs between its eleven kernels).
 *
 * Shapes: N packed tokens, D dim, Qr query rank, H heads, Dh head dim, R rope dim, G output groups,
 * Or output rank per group. Activations and weights bf16; norm weights bf16 or fp32; phases fp32
 * (re, im) [N, R/2], one per token. All contiguous.
 */
#include <stdint.h>
#include <stdlib.h>

int dsv41_gemv(int64_t P, int64_t M, int64_t N, int64_t K, int x_bf16, int w_bf16, int out_bf16, int exact,
               int threads, const void *x, int64_t x_sp, int64_t x_sm, const void *w, int64_t w_sp, int64_t w_sn,
               void *out, int64_t o_sp, int64_t o_sm);
void dsv41_rms_norm(int64_t rows, int64_t D, float eps, const void *x, int x_bf16, const void *w, int w_bf16,
                    void *out);
void dsv41_rope(int64_t B, int64_t T, int64_t H, int64_t F, int64_t R, int64_t PB, int bf16, int conj,
                const void *x, const float *phases, void *out);

/* One bf16 product of N rows: out [N, rows] = x [N, K] · w [rows, K]ᵀ (Linear.forward's). */
static int product(int64_t N, int64_t rows, int64_t K, int threads, const uint16_t *x, const uint16_t *w,
                   uint16_t *out) {
    return dsv41_gemv(1, N, rows, K, 1, 1, 1, 0, threads, x, 0, K, w, 0, K, out, 0, rows);
}

/* qr = q_norm(x · wq_aᵀ) [N, Qr]; q = RoPE(qr · wq_bᵀ) [N, H, Dh]; kv = RoPE(kv_norm(x · wkvᵀ)) [N, Dh].
 * Returns 0, or -1 (no memory, or a product refused its shapes; then nothing is to be used). */
int dsv41_attention_in(int64_t N, int64_t D, int64_t Qr, int64_t H, int64_t Dh, int64_t R, int threads,
                       const uint16_t *x, const uint16_t *wq_a, const void *q_norm, int q_norm_bf16, float q_eps,
                       const uint16_t *wq_b, const uint16_t *wkv, const void *kv_norm, int kv_norm_bf16,
                       float kv_eps, const float *phases, uint16_t *qr, uint16_t *q, uint16_t *kv) {
    uint16_t *unrotated = malloc((size_t)(N * (H + 1) * Dh) * sizeof(uint16_t));
    if (unrotated == NULL) return -1;
    uint16_t *q_raw = unrotated, *kv_raw = unrotated + N * H * Dh;
    int status = product(N, Qr, D, threads, x, wq_a, qr);
    if (status == 0) {
        dsv41_rms_norm(N, Qr, q_eps, qr, 1, q_norm, q_norm_bf16, qr);
        status = product(N, H * Dh, Qr, threads, qr, wq_b, q_raw);
    }
    if (status == 0) {
        dsv41_rope(1, N, H, Dh, R, 1, 1, 0, q_raw, phases, q);
        status = product(N, Dh, D, threads, x, wkv, kv_raw);
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
    if (status == 0) status = product(N, D, G * Or, threads, grouped, wo_b, y);
    free(rotated);
    return status;
}
