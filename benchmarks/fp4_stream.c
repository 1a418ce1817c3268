/* What a stored expert's tile loop costs from memory, piece by piece (docs/NUMERICS.md N42), for
 * bench_fp4_stream.py, which compiles it beside the package's amx.c.
 *
 * A pool of stored experts (gate and up 512 × 1024, down 1024 × 512: fp4 codes and a scale byte per 32
 * values) is walked the way `dsv41_routed_experts` walks a 16-token step's experts: per expert its gate
 * tiles, its up tiles, then its down tiles, each thread a contiguous share, every tile one packed block
 * of activations. Each variant keeps the kernel's address stream (the next tile asked for a 32nd at a
 * step) and adds one part of the kernel's work (blocks of AMX_NARROW activation rows, as a 16-token step's
 * groups take them):
 *   stream    the prefetches alone: the rate the memory gives this loop's stream
 *   tiles     + per step the two tile loads and the product, from a fixed slot (no decoding)
 *   decoding  + the codes decoded into the slots (no tiles)
 *   kernel    `dsv41_amx_tile_fp4` itself
 * and `kernel` once more on a pool of two experts a thread, which stays in the core's L2.
 *
 * Prints ns a 32-value block per thread and the rate the codes and scales are read at on all threads.
 *
 *     fp4_stream THREADS EXPERTS
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <omp.h>

#include "fp4.h"
#include "kernels.h"

#define D 1024
#define I 512
#define VALUES (3 * I * D)                       /* an expert's weights: gate, up, down */
#define TILES (2 * (I / AMX_ROWS) + D / AMX_ROWS) /* gate, up, then down */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

typedef void (*TileFn)(const uint8_t *codes, const uint8_t *scales, int64_t K, const uint16_t *b, float *c,
                       uint16_t (*slots)[AMX_ROWS * 32]);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The kernel's prefetch (fp4.h): the next tile's 16 rows' codes, 16 bytes a row at step k. */
static inline void ask_next(const uint8_t *codes, int64_t K, int64_t k) {
    fp4_ask_next_tile((const char *)codes + AMX_ROWS * (K / 2), k);
}

static void stream(const uint8_t *codes, const uint8_t *scales, int64_t K, const uint16_t *b, float *c,
                   uint16_t (*slots)[AMX_ROWS * 32]) {
    (void)scales; (void)b; (void)c; (void)slots;
    for (int64_t k = 0; k < K; k += 32) ask_next(codes, K, k);
}

static void tiles(const uint8_t *codes, const uint8_t *scales, int64_t K, const uint16_t *b, float *c,
                  uint16_t (*slots)[AMX_ROWS * 32]) {
    (void)scales;
    _tile_zero(0);
    for (int64_t k = 0; k < K; k += 32) {
        ask_next(codes, K, k);
        _tile_loadd(4, slots[(k / 32) % 2], 64);
        _tile_loadd(5, b + k * AMX_NARROW, AMX_NARROW * 4);
        _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, c, AMX_NARROW * 4);
}

static void decoding(const uint8_t *codes, const uint8_t *scales, int64_t K, const uint16_t *b, float *c,
                     uint16_t (*slots)[AMX_ROWS * 32]) {
    (void)b;
    uint32_t adds[AMX_ROWS * (D / 32)];
    const __m512i table = _mm512_loadu_si512(E2M1_BF16);
    fp4_exponent_adds(scales, AMX_ROWS * (K / 32), adds);
    for (int64_t k = 0; k < K; k += 32) {
        ask_next(codes, K, k);
        fp4_slot(codes, AMX_ROWS, K, adds, k, table, slots[(k / 32) % 2]);
    }
    c[0] = (float)slots[0][0];                    /* the slots are read, so the decoding stays */
}

static void kernel(const uint8_t *codes, const uint8_t *scales, int64_t K, const uint16_t *b, float *c,
                   uint16_t (*slots)[AMX_ROWS * 32]) {
    (void)slots;
    if (dsv41_amx_tile_fp4(codes, scales, AMX_ROWS, K, b, 1, AMX_NARROW, c) != 0) c[0] = -1.0f;
}

/* Tile u of an expert: its codes and scales within the expert's (gate, up, down) and its K. */
static int64_t tile_at(const uint8_t *codes, const uint8_t *scales, int64_t u, const uint8_t **w, const uint8_t **s) {
    if (u < 2 * (I / AMX_ROWS)) {
        const int64_t bank = u / (I / AMX_ROWS), row = (u % (I / AMX_ROWS)) * AMX_ROWS;
        *w = codes + bank * (I * D / 2) + row * (D / 2);
        *s = scales + bank * (I * D / 32) + row * (D / 32);
        return D;
    }
    const int64_t row = (u - 2 * (I / AMX_ROWS)) * AMX_ROWS;
    *w = codes + 2 * (I * D / 2) + row * (I / 2);
    *s = scales + 2 * (I * D / 32) + row * (I / 32);
    return I;
}

/* Best seconds of `rounds` walks over `experts` experts' tiles (each walk `repeat` times over them). */
static double walk(TileFn fn, const uint8_t *codes, const uint8_t *scales, int64_t experts, int threads, int rounds,
                   int repeat, const uint16_t *b) {
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        const double start = now();
        #pragma omp parallel num_threads(threads)
        {
            float c[AMX_ROWS * AMX_ROWS];
            uint16_t slots[2][AMX_ROWS * 32] __attribute__((aligned(64)));
            memset(slots, 0, sizeof slots);
            dsv41_amx_begin(AMX_NARROW);
            const int64_t total = experts * TILES, n = omp_get_num_threads(), id = omp_get_thread_num();
            for (int pass = 0; pass < repeat; pass++)
                for (int64_t u = total * id / n; u < total * (id + 1) / n; u++) {
                    const int64_t e = u / TILES;
                    const uint8_t *w, *s;
                    const int64_t K = tile_at(codes + e * (VALUES / 2), scales + e * (VALUES / 32), u % TILES, &w, &s);
                    fn(w, s, K, b, c, slots);
                }
            dsv41_amx_end();
        }
        const double took = now() - start;
        if (took < best) best = took;
    }
    return best;
}

static void report(const char *name, double seconds, int64_t experts, int threads, int repeat) {
    const double blocks = (double)experts * repeat * (VALUES / 32);
    printf("  %-30s %6.3f ns a block per thread   %5.1f GB/s\n", name, seconds * 1e9 * threads / blocks,
           blocks * 17.0 / seconds / 1e9);
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    const int64_t experts = argc > 2 ? atoll(argv[2]) : 360;
    if (threads < 1 || experts < 2 * threads) {
        fprintf(stderr, "fp4_stream: needs a thread or more and at least 2 experts a thread (got %d, %lld)\n", threads,
                (long long)experts);
        return 2;
    }
    if (!dsv41_amx_ready()) {
        printf("the AMX tiles are not available to this process\n");
        return 0;
    }
    const size_t page = 2u << 20, code_bytes = (size_t)experts * (VALUES / 2), scale_bytes = (size_t)experts * (VALUES / 32);
    uint8_t *codes = aligned_alloc(page, (code_bytes + page - 1) / page * page);
    uint8_t *scales = aligned_alloc(page, (scale_bytes + page - 1) / page * page);
    uint16_t *b = aligned_alloc(64, D * AMX_NARROW * sizeof(uint16_t));
    if (codes == NULL || scales == NULL || b == NULL) {
        fprintf(stderr, "fp4_stream: no memory for %lld experts\n", (long long)experts);
        return 1;
    }
    madvise(codes, (code_bytes + page - 1) / page * page, MADV_HUGEPAGE);
    uint32_t state = 12345;
    for (size_t i = 0; i < code_bytes; i++) codes[i] = (uint8_t)((state = state * 1664525u + 1013904223u) >> 24);
    for (size_t i = 0; i < scale_bytes; i++) scales[i] = (uint8_t)(120 + i % 11);  /* within FP4_WIDE_SCALE */
    for (int64_t i = 0; i < D * AMX_NARROW; i++) b[i] = i % (2 * AMX_NARROW) < 6 ? 0x3f80 : 0;  /* 3 rows */
    printf("%lld stored experts (%.0f MB) read in turn, %d thread(s), best of 5:\n", (long long)experts,
           (code_bytes + scale_bytes) / 1e6, threads);
    const struct { const char *name; TileFn fn; } parts[] = {
        {"stream (prefetches alone)", stream}, {"stream + tiles, no decoding", tiles},
        {"stream + decoding, no tiles", decoding}, {"kernel", kernel}};
    for (size_t p = 0; p < sizeof parts / sizeof parts[0]; p++)
        report(parts[p].name, walk(parts[p].fn, codes, scales, experts, threads, 5, 1, b), experts, threads, 1);
    const int64_t small = 2 * threads, repeat = (int)(experts / small) + 1;
    report("kernel, 2 experts a thread", walk(kernel, codes, scales, small, threads, 5, repeat, b), small, threads, repeat);
    free(codes); free(scales); free(b);
    return 0;
}
#else
int main(void) {
    printf("this build has no AMX bf16 tiles (or no AVX-512 BW): nothing to measure\n");
    return 0;
}
#endif
