/* AVX-512 helpers shared by the kernels: bf16 <-> float on 16 lanes, and exp. */
#ifndef PAGODA_CPU_AVX512_H
#define PAGODA_CPU_AVX512_H

#include <stdint.h>

#include <immintrin.h>

static inline __m512 widen16_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16_bf16(const uint16_t *p) {
    return widen16_bf16(_mm256_loadu_si256((const __m256i *)p));
}

#if defined(__AVX512BF16__)
/* Rounded to nearest even, NaN kept quiet, as float_to_bf16 (common.h) rounds each lane, except
 * that the instruction flushes subnormal inputs and results to zero (no model value is that
 * small). */
static inline __m256i pack16_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline __m512 round16_bf16(__m512 v) { return widen16_bf16(pack16_bf16(v)); }

static inline void store16_bf16_rne(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, pack16_bf16(v));
}
#endif

/* common.h's exp_approx on 16 lanes: the same range reduction and polynomial, 2^k by scalef.
 * 0 below -87 (so exp(-inf), a softmax's first rescaling, is exactly 0), +inf past ~88.7 (as
 * expf; exp_approx goes to +inf from 88), NaN kept. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(89.0f)); /* e^89: inf */
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), c);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512 y = _mm512_maskz_mov_ps((__mmask16)~under, _mm512_scalef_ps(p, k));
    return _mm512_mask_mov_ps(y, nan, x);
}

#endif
