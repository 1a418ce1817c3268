/* e^x in sixteen fp32 lanes, for the kernels that take exp of many values at once (gemv.c's SwiGLU,
 * attention.c's softmax; docs/NUMERICS.md N39): fast numerics' exp, within ~1 ulp of fp32, where
 * libm's expf took a call per value (a 16-token dim-1024 layer's experts made 49k of them). */
#ifndef DSV41_EXP_H
#define DSV41_EXP_H

#if defined(__AVX512F__)
#include <immintrin.h>

#define EXP_LANES 1

/* x = n·ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 in a high part exact in n·ln 2 and a low part), e^r by its
 * Taylor series to r⁷ (the next term is < 10⁻⁸ of it), then · 2ⁿ by scalef, which saturates to 0 or ∞
 * far out and passes a NaN. Each lane's steps are its own: a value's bits do not depend on its lane. */
static inline __m512 exp_lanes(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    const float inverse_factorial[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m512 e = _mm512_set1_ps(inverse_factorial[0]);
    for (int i = 1; i < 8; i++) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(inverse_factorial[i]));
    return _mm512_scalef_ps(e, n);
}
#endif

#endif
