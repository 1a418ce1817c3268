/* Stored fp4 (e2m1) codes decoded to bf16 in AVX-512 registers, for `gemv.c`'s stored experts and
 * `amx.c`'s stored tiles: both decode to the same values (those of formats.dequantize_fp4_weight cast to
 * bf16), so a stored bank's products have a held bank's bits (N30). */
#ifndef DSV41_FP4_H
#define DSV41_FP4_H

#include <stdint.h>

#include "kernels.h"

#if defined(__AVX512BW__)
#include <immintrin.h>

/* The codes' bf16 values at scale 1 (2^0): the scale then adds (s − 127) to the exponent field of every
 * nonzero code. Exact wherever every result stays a normal bf16: the codes' exponents span 126 … 129, so
 * for s in 2 … 252 (FP4_WIDE_SCALE); other scales take the float product (`fp4_block`). */
static const uint16_t E2M1_BF16[32] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                       0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
                                       0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                       0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};
/* The table's entries of nonzero magnitude (codes 0 and 8 are ±0 at any scale). */
#define E2M1_NONZERO 0xfefefefeu
#define FP4_WIDE_LOW 2
#define FP4_WIDE_HIGH 252
#define FP4_WIDE_SCALE(s) ((s) >= FP4_WIDE_LOW && (s) <= FP4_WIDE_HIGH)
/* Most 32-value blocks in a row that a tile decodes in registers, its exponent adds on the stack (K ≤
 * 8192: the release's widest expert input is 4096); wider rows take a scratch. */
#define FP4_TILE_BLOCKS 256

/* 16 bytes of codes → their 32 bf16 values (K order) at scale byte s (FP4_WIDE_SCALE): byte i becomes the
 * 32-bit lane b | b << 12, whose low word indexes the table by b's low 5 bits (the table repeats past 16,
 * so the high nibble's low bit does not matter) and whose high word is b >> 4. */
static inline __m512i fp4_scaled_values(const uint8_t *bytes16, __m512i exponent_add, __m512i table) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes16));
    const __m512i codes = _mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12));
    const __m512i scaled = _mm512_mask_add_epi16(table, E2M1_NONZERO, table, exponent_add);
    return _mm512_permutexvar_epi16(codes, scaled);
}

/* Scale byte s adds (s − 127) · 2^7 to a bf16 exponent field. */
static inline __m512i fp4_values(const uint8_t *bytes16, uint8_t s, __m512i table) {
    return fp4_scaled_values(bytes16, _mm512_set1_epi16((int16_t)((s - 127) * 128)), table);
}

/* The exponent adds of `count` scale bytes into out, 16 at a time, each in both 16-bit halves of a
 * 32-bit lane (so that a block takes its own by a 32-bit broadcast load). */
static inline void fp4_exponent_adds(const uint8_t *c, int64_t count, uint32_t *out) {
    for (int64_t q = 0; q < count; q += 16) {
        const __mmask16 live = count - q >= 16 ? 0xffff : (__mmask16)((1u << (count - q)) - 1u);
        const __m512i s = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, c + q));
        const __m512i add = _mm512_and_si512(_mm512_slli_epi32(_mm512_sub_epi32(s, _mm512_set1_epi32(127)), 7),
                                             _mm512_set1_epi32(0xffff));
        _mm512_mask_storeu_epi32(out + q, live, _mm512_or_si512(add, _mm512_slli_epi32(add, 16)));
    }
}

/* 1 where all `count` scale bytes are FP4_WIDE_SCALE, 64 at a time. */
static inline int fp4_wide_scales(const uint8_t *c, int64_t count) {
    const __m512i low = _mm512_set1_epi8(FP4_WIDE_LOW), high = _mm512_set1_epi8((char)FP4_WIDE_HIGH);
    for (int64_t q = 0; q < count; q += 64) {
        const __mmask64 live = count - q >= 64 ? ~0ull : (1ull << (count - q)) - 1ull;
        const __m512i s = _mm512_maskz_loadu_epi8(live, c + q);
        const __mmask64 wide = _mm512_mask_cmpge_epu8_mask(live, s, low) & _mm512_mask_cmple_epu8_mask(live, s, high);
        if (wide != live) return 0;
    }
    return 1;
}

/* For amx.c's stored tiles (and benchmarks/fp4_stream.c, which times them part by part): block k of the
 * stored rows (32 values each) decoded into slot, the A operand of one tile: row i at slot + 32 i, so the
 * tile loads it at a 64-byte stride. */
static inline __attribute__((always_inline)) void fp4_slot(const uint8_t *w, int64_t rows, int64_t K, const uint32_t *adds,
                                                           int64_t k, __m512i table, uint16_t *slot) {
    for (int64_t i = 0; i < rows; i++)
        _mm512_store_si512(slot + i * 32, fp4_scaled_values(w + i * (K / 2) + k / 2,
                                                            _mm512_set1_epi32((int)adds[i * (K / 32) + k / 32]), table));
}

/* Step k's lines of the tile after this one (`next`: AMX_ROWS rows of 16 bytes a step), asked for into L1. */
static inline __attribute__((always_inline)) void fp4_ask_next_tile(const char *next, int64_t k) {
    for (int64_t line = 0; line < AMX_ROWS * 16; line += 64) _mm_prefetch(next + k / 32 * AMX_ROWS * 16 + line, _MM_HINT_T0);
}
#endif

#endif
