/* 8-lane float helpers for the AVX2 loops (matmul_bf16_avx2.c, paged_attention_avx2.c,
 * prefill_attention_avx2.c, race_sample.c, sampling_row.h): loads, bf16 rounding and stores,
 * horizontal max and sum, and exp_approx (common.h) on a vector. */
#ifndef PAGODA_CPU_AVX2_H
#define PAGODA_CPU_AVX2_H

#include <math.h>
#include <stdint.h>

#include <immintrin.h>

/* float_to_bf16 (common.h) on 8 lanes, kept as floats: rounded to nearest even, NaN quieted. */
static inline __m256 round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    const __m256i nan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256i r = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(up), _mm256_castsi256_ps(nan), is_nan));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* 8 floats already rounded to bf16 -> their bf16 bits at out. */
static inline void store8_bf16(uint16_t *out, __m256 rounded) {
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    _mm_storeu_si128((__m128i *)out, _mm_packus_epi32(_mm256_castsi256_si128(hi),
                                                      _mm256_extracti128_si256(hi, 1)));
}

static inline __m256 load8_f32(const float *in) { return _mm256_loadu_ps(in); }

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float sum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

static inline __m256 load8_bf16(const uint16_t *in) {
    const __m128i bits = _mm_loadu_si128((const __m128i *)in);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* exp_approx (common.h) on 8 lanes, the same steps: 0 below -87, +inf above 88, NaN kept. */
static inline __m256 exp8(__m256 in) {
    const __m256 x = _mm256_min_ps(_mm256_max_ps(in, _mm256_set1_ps(-87.0f)),
                                   _mm256_set1_ps(88.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(),
                         _mm256_cmp_ps(in, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY),
                         _mm256_cmp_ps(in, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    return _mm256_blendv_ps(y, in, _mm256_cmp_ps(in, in, _CMP_UNORD_Q));
}

#endif
