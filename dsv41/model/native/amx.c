/* bf16 products on AMX tiles (docs/NUMERICS.md N37), for `gemv.c`'s dense products and routed experts
 * of more than a few rows.
 *
 * out[m, n] = Σ_k x[m, k] · w[n, k] as Cᵀ = W · Xᵀ: a row-major weight is already a tile's A operand
 * (16 weight rows × 32 values, read in place at the weight's row stride), and the activation rows are
 * packed once per call into B (`dsv41_amx_pack`: pairs of values of 16 rows side by side, the layout
 * tdpbf16ps takes). oneDNN instead repacks each weight on every call, which reads a cold decode-step
 * weight at a third of the memory's rate; here the weight is read once, as it lies.
 *
 * Each output element is its own dot product in the tile unit: its bits depend on its weight row, its
 * activation row and K, not on how many other rows share the tiles. The unit's own order of summation
 * is not a sequence of fp32 multiply-adds (N37), so these are fast numerics' bits only.
 *
 * Shapes: M activation rows (B columns, `columns` a block: 16, or 8 for a small group, N42), N weight
 * rows (A rows, 16 a tile), K values, Kp = K rounded up to 32 (the K tail packs as zeros, which add
 * nothing).
 */
#include <stdint.h>
#include <string.h>

#include "fp4.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands a process the tile registers' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA): without it the first tile instruction faults. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int dsv41_amx_ready(void) {
    /* the answer never changes within a process: asked once (the request is idempotent, so two
     * threads asking at once get the same answer) */
    static int answer;
    int known = __atomic_load_n(&answer, __ATOMIC_ACQUIRE);
    if (known == 0) {
        known = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&answer, known, __ATOMIC_RELEASE);
    }
    return known > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

void dsv41_amx_begin(int64_t columns) {
    /* every tile 16 rows: A (tiles 4 and 6) 32 bf16 a row; C (0 … 3) `columns` fp32, B (5) `columns` pairs */
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = AMX_ROWS;
        config.colsb[t] = t == 4 || t == 6 ? 64 : (uint16_t)(columns * 4);
    }
    /* GCC 12 does not see ldtilecfg read the struct and drops the stores above it without this */
    __asm__ volatile("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

void dsv41_amx_end(void) {
    _tile_release();
}

void dsv41_amx_pack(int64_t M, int64_t K, const uint16_t *x, int64_t x_stride, int64_t columns, uint16_t *b) {
    const int64_t Kp = AMX_PADDED(K);
    /* zeros first, then each row's pairs into its column: a decode step's group has a few rows, so most
     * of a block is the zeros (a test per element cost the experts of a dim-1024 layer 0.8 ms at 16 tokens) */
    memset(b, 0, (size_t)(AMX_BLOCKS(M, columns) * Kp * columns) * sizeof(uint16_t));
    for (int64_t m = 0; m < M; m++) {
        uint16_t *column = b + (m / columns) * Kp * columns + (m % columns) * 2;
        const uint16_t *row = x + m * x_stride;
        for (int64_t q = 0; q < K / 2; q++) memcpy(column + q * 2 * columns, row + 2 * q, 2 * sizeof(uint16_t));
        if (K % 2 != 0) column[K / 2 * 2 * columns] = row[K - 1];
    }
}

const uint16_t *dsv41_amx_rows(const uint16_t *w, int64_t w_stride, int64_t rows, int64_t K, uint16_t *scratch,
                               int64_t *stride) {
    if (rows == AMX_ROWS && K % 32 == 0) {
        *stride = w_stride;
        return w;
    }
    /* a partial tile's load would read rows past the weight, and a K tail values past the row */
    for (int64_t i = 0; i < rows; i++) memcpy(scratch + i * AMX_PADDED(K), w + i * w_stride, (size_t)K * sizeof(uint16_t));
    *stride = AMX_PADDED(K);
    return scratch;
}

/* C tiles 0 … count − 1 hold the sums over B blocks c0, c0 + 1 …; A is tile 4 and B tile 5, loaded per 32
 * values of K. count is a constant where these inline, so the tests on it fold away. */
static inline __attribute__((always_inline)) void c_zero(int count) {
    _tile_zero(0);
    if (count > 1) _tile_zero(1);
    if (count > 2) _tile_zero(2);
    if (count > 3) _tile_zero(3);
}

/* The A tile (tile 4) against the step's 32 values of `count` B blocks of `columns` rows from bk (blocks
 * Kp · columns apart). */
static inline __attribute__((always_inline)) void c_step(int count, const uint16_t *bk, int64_t Kp, int64_t columns) {
    _tile_loadd(5, bk, columns * 4);
    _tile_dpbf16ps(0, 4, 5);
    if (count > 1) { _tile_loadd(5, bk + Kp * columns, columns * 4); _tile_dpbf16ps(1, 4, 5); }
    if (count > 2) { _tile_loadd(5, bk + 2 * Kp * columns, columns * 4); _tile_dpbf16ps(2, 4, 5); }
    if (count > 3) { _tile_loadd(5, bk + 3 * Kp * columns, columns * 4); _tile_dpbf16ps(3, 4, 5); }
}

static inline __attribute__((always_inline)) void c_store(int count, float *c, int64_t columns) {
    _tile_stored(0, c, columns * 4);
    if (count > 1) _tile_stored(1, c + AMX_ROWS * columns, columns * 4);
    if (count > 2) _tile_stored(2, c + 2 * AMX_ROWS * columns, columns * 4);
    if (count > 3) _tile_stored(3, c + 3 * AMX_ROWS * columns, columns * 4);
}

/* A held weight's tiles read in place. No software prefetch: the hardware's alone read a cold 1024 × 1024
 * weight at 16 rows in 122 µs; asking for the next tile's lines (into L1 or L2), or for this tile's
 * further on, took 137–178 (N37). */
static inline __attribute__((always_inline)) void amx_pass(int count, const uint16_t *w, int64_t w_stride, int64_t Kp,
                                                           const uint16_t *b, int64_t columns, float *c) {
    c_zero(count);
    for (int64_t k = 0; k < Kp; k += 32) {
        _tile_loadd(4, w + k, w_stride * 2);
        c_step(count, b + k * columns, Kp, columns);      /* step k's pairs: k / 2 rows of 2 · columns */
    }
    c_store(count, c, columns);
}

void dsv41_amx_tile(const uint16_t *w, int64_t w_stride, int64_t Kp, const uint16_t *b, int64_t blocks,
                    int64_t columns, float *c) {
    for (int64_t c0 = 0; c0 < blocks; c0 += 4) {
        const uint16_t *bc = b + c0 * Kp * columns;             /* block c0: Kp / 2 pairs × columns × 2 */
        float *cc = c + c0 * AMX_ROWS * columns;
        switch (blocks - c0) {
            case 1: amx_pass(1, w, w_stride, Kp, bc, columns, cc); break;
            case 2: amx_pass(2, w, w_stride, Kp, bc, columns, cc); break;
            case 3: amx_pass(3, w, w_stride, Kp, bc, columns, cc); break;
            default: amx_pass(4, w, w_stride, Kp, bc, columns, cc); break;
        }
    }
}
/* Two whole tiles of a held weight's rows (2 · AMX_ROWS rows from w) against one packed block side by
 * side: each step loads the block once and the two tiles' rows, so a thread has twice the rows' lines
 * in flight and two independent sums. c0, c1: each tile's sums, as `dsv41_amx_tile`'s. */
void dsv41_amx_tile_pair(const uint16_t *w, int64_t w_stride, int64_t Kp, const uint16_t *b, int64_t columns,
                         float *c0, float *c1) {
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t *w1 = w + AMX_ROWS * w_stride;
    for (int64_t k = 0; k < Kp; k += 32) {
        _tile_loadd(5, b + k * columns, columns * 4);
        _tile_loadd(4, w + k, w_stride * 2);
        _tile_loadd(6, w1 + k, w_stride * 2);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 6, 5);
    }
    _tile_stored(0, c0, columns * 4);
    _tile_stored(1, c1, columns * 4);
}

#if defined(__AVX512BW__)
/* `amx_pass` over stored rows: each block of 32 values is decoded into one slot of a pair while the
 * tiles multiply the block before it from the other (decoding the whole tile into a scratch first, or
 * each block just before its load, left the decoding and the tiles taking turns: 6.7 and 6.2 cycles a
 * row's block where this takes 3.8, hot, one B block). The tile after this one (the next AMX_ROWS rows
 * of the bank, K / 2 bytes each) is asked for a 32nd a block, so that its lines arrive before it starts:
 * with the hardware's prefetch alone a cold bank took 8.5 cycles a row's block, with this 5.8. The last
 * step is peeled off the loop, which then tests nothing per step, and `rows` is AMX_ROWS as a constant
 * wherever the tile is whole, so the decoding's row loop unrolls (N42). */
static inline __attribute__((always_inline)) void amx_pass_fp4(int count, const uint8_t *w, int64_t rows, int64_t K,
                                                               int64_t columns, const uint32_t *adds,
                                                               const uint16_t *b, float *c,
                                                               uint16_t (*slots)[AMX_ROWS * 32]) {
    const __m512i table = _mm512_loadu_si512(E2M1_BF16);
    const char *next = (const char *)w + AMX_ROWS * (K / 2);
    c_zero(count);
    fp4_slot(w, rows, K, adds, 0, table, slots[0]);
    int64_t k = 0;
    for (; k + 32 < K; k += 32) {
        fp4_ask_next_tile(next, k);
        fp4_slot(w, rows, K, adds, k + 32, table, slots[(k / 32 + 1) % 2]);
        _tile_loadd(4, slots[(k / 32) % 2], 64);
        c_step(count, b + k * columns, K, columns);
    }
    fp4_ask_next_tile(next, k);
    _tile_loadd(4, slots[(k / 32) % 2], 64);
    c_step(count, b + k * columns, K, columns);
    c_store(count, c, columns);
}

int dsv41_amx_tile_fp4(const uint8_t *w, const uint8_t *s, int64_t rows, int64_t K, const uint16_t *b, int64_t blocks,
                       int64_t columns, float *c) {
    if (K % 32 != 0 || K / 32 > FP4_TILE_BLOCKS || !fp4_wide_scales(s, rows * (K / 32))) return -1;
    uint32_t adds[AMX_ROWS * FP4_TILE_BLOCKS];
    uint16_t slots[2][AMX_ROWS * 32] __attribute__((aligned(64)));
    fp4_exponent_adds(s, rows * (K / 32), adds);
    if (rows < AMX_ROWS) memset(slots, 0, sizeof slots);       /* the rows past the weight's multiply as zeros */
    for (int64_t c0 = 0; c0 < blocks; c0 += 4) {
        const uint16_t *bc = b + c0 * K * columns;
        float *cc = c + c0 * AMX_ROWS * columns;
        if (rows == AMX_ROWS && blocks - c0 == 1) {              /* a decode step's group: one block, whole tiles */
            amx_pass_fp4(1, w, AMX_ROWS, K, columns, adds, bc, cc, slots);
            continue;
        }
        switch (blocks - c0) {
            case 1: amx_pass_fp4(1, w, rows, K, columns, adds, bc, cc, slots); break;
            case 2: amx_pass_fp4(2, w, rows, K, columns, adds, bc, cc, slots); break;
            case 3: amx_pass_fp4(3, w, rows, K, columns, adds, bc, cc, slots); break;
            default: amx_pass_fp4(4, w, rows, K, columns, adds, bc, cc, slots); break;
        }
    }
    return 0;
}
#else
int dsv41_amx_tile_fp4(const uint8_t *w, const uint8_t *s, int64_t rows, int64_t K, const uint16_t *b, int64_t blocks,
                       int64_t columns, float *c) {
    (void)w; (void)s; (void)rows; (void)K; (void)b; (void)blocks; (void)columns; (void)c;
    return -1;
}
#endif
#else
int dsv41_amx_ready(void) {
    return 0;
}
#endif
