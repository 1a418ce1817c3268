/* The kernels one source of this folder calls from another (sublayers.c and compressed.c string them
 * together; docs/NUMERICS.md N33–N35), and the bf16 product they all make: one declaration each, so
 * a changed signature fails to compile instead of passing arguments in the wrong places. */
#ifndef DSV41_KERNELS_H
#define DSV41_KERNELS_H

#include <stdint.h>

int dsv41_gemv(int64_t P, int64_t M, int64_t N, int64_t K, int x_bf16, int w_bf16, int out_bf16, int exact,
               int threads, const void *x, int64_t x_sp, int64_t x_sm, const void *w, int64_t w_sp, int64_t w_sn,
               void *out, int64_t o_sp, int64_t o_sm);
void dsv41_rms_norm(int64_t rows, int64_t D, float eps, const void *x, int x_bf16, const void *w, int w_bf16,
                    void *out);
void dsv41_rope(int64_t B, int64_t T, int64_t H, int64_t F, int64_t R, int64_t PB, int bf16, int conj,
                const void *x, const float *phases, void *out);
int dsv41_route(int64_t n, int64_t E, int64_t k, float scale, float eps, int threads, const float *logits,
                const float *bias, const float *bias_vl, const uint8_t *image, int64_t *ids, float *weights);
int dsv41_routed_experts(int64_t n, int64_t A, int64_t E, int64_t D, int64_t I, int w_bf16, int x_bf16, float limit,
                         int threads, const void *x, const int64_t *ids, const float *weights,
                         const void *w1, const void *w3, const void *w2, const void *s1, const void *s3,
                         const void *s2, const uint8_t *c1, const uint8_t *c3, const uint8_t *c2, int accumulate,
                         float *out);
int dsv41_index_scores(int64_t B, int64_t T, int64_t H, int64_t D, int64_t C, int bf16, int threads, const void *q,
                       const void *w, const void *keys, int64_t key_stride, void *out);
void dsv41_topk(int64_t rows, int64_t n, int64_t k, int sorted, int threads, const void *scores, int bf16,
                int64_t *heap, int64_t *indices, void *values);
int dsv41_hc_enter(int64_t rows, int64_t S, int64_t D, int bf16, const void *o, const void *residual,
                   const float *post, const float *comb, void *streams, const float *fn, const float *scale,
                   const float *base, int64_t iters, float norm_eps, float hc_eps, int threads, const float *pre,
                   const void *norm_weight, int norm_bf16, float eps, float *pre_out, float *post_out,
                   float *comb_out, void *h);
void dsv41_hc_expand(int64_t rows, int64_t S, int64_t D, int bf16, const void *o, const void *residual,
                     const float *post, const float *comb, void *out);
void dsv41_hc_expand_rows(int64_t rows, int64_t S, int64_t D, int bf16, const void *o, const void *residual,
                          const float *post, const float *comb, void *out, int threads);

/* amx.c: bf16 products on AMX tiles (N37). Weight rows per tile (A's rows), and the activation rows a
 * packed block holds (B's and C's columns): AMX_ROWS, or AMX_NARROW for a routed expert's group of at most
 * that many rows, whose block then takes half the L1 that a tile's steps walk through (N42). */
#define AMX_ROWS 16
#define AMX_NARROW 8
#define AMX_PADDED(K) (((K) + 31) / 32 * 32)
#define AMX_BLOCKS(M, columns) (((M) + (columns) - 1) / (columns))
/* 1 where this build has AMX bf16 tiles and the kernel may use them (the process asked for their state
 * once); 0 otherwise, and then no other amx function may be called. */
int dsv41_amx_ready(void);
/* The calling thread's tile configuration for blocks of `columns` activation rows, before its first
 * `dsv41_amx_tile` of them (again to change `columns`; the tiles' contents are then lost); its tiles
 * released after. */
void dsv41_amx_begin(int64_t columns);
void dsv41_amx_end(void);
/* x [M, K] (row stride x_stride) packed into B blocks b [AMX_BLOCKS(M, columns), Kp / 2, columns, 2],
 * zeros past M rows and K values. */
void dsv41_amx_pack(int64_t M, int64_t K, const uint16_t *x, int64_t x_stride, int64_t columns, uint16_t *b);
/* The rows (≤ AMX_ROWS, K values each) of weight w that a tile loads: w itself (row stride w_stride into
 * *stride) where they are a whole tile and K a multiple of 32, else their copy into scratch [AMX_ROWS,
 * AMX_PADDED(K)] (zero past K where the scratch was zeroed; stride AMX_PADDED(K)). */
const uint16_t *dsv41_amx_rows(const uint16_t *w, int64_t w_stride, int64_t rows, int64_t K, uint16_t *scratch,
                               int64_t *stride);
/* AMX_ROWS weight rows w (row stride w_stride, Kp readable values each) against `blocks` packed blocks of
 * `columns` rows (the configuration's): c [blocks, AMX_ROWS weight rows, columns activation rows] fp32. */
void dsv41_amx_tile(const uint16_t *w, int64_t w_stride, int64_t Kp, const uint16_t *b, int64_t blocks,
                    int64_t columns, float *c);
/* One block (≤ columns activation rows) against two whole tiles, 2 · AMX_ROWS rows of w from w (K a
 * multiple of 32): c0 and c1 as `dsv41_amx_tile`'s c for each tile. */
void dsv41_amx_tile_pair(const uint16_t *w, int64_t w_stride, int64_t Kp, const uint16_t *b, int64_t columns,
                         float *c0, float *c1);
/* `dsv41_amx_tile` of `rows` (≤ AMX_ROWS) stored fp4 rows, w [rows, K / 2] code bytes and s [rows, K / 32]
 * ue8m0 scales, each decoded to its bf16 values (a held bank's) as the tiles take it: the same c, rows
 * past `rows` zero. Returns 0, or -1 without touching c where a scale is not FP4_WIDE_SCALE or K is not a
 * multiple of 32 or has more than FP4_TILE_BLOCKS blocks (then decode into a scratch and take
 * `dsv41_amx_tile`). */
int dsv41_amx_tile_fp4(const uint8_t *w, const uint8_t *s, int64_t rows, int64_t K, const uint16_t *b, int64_t blocks,
                       int64_t columns, float *c);

/* One bf16 product of N rows: out [N, rows] = x [N, K] · w [rows, K]ᵀ (Linear.forward's). */
static inline int bf16_product(int64_t N, int64_t rows, int64_t K, int threads, const uint16_t *x,
                               const uint16_t *w, uint16_t *out) {
    return dsv41_gemv(1, N, rows, K, 1, 1, 1, 0, threads, x, 0, K, w, 0, K, out, 0, rows);
}

#endif
