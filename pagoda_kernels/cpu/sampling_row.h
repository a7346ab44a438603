/* One row of logits' greedy statistics, shared by greedy_sample (sampling.c) and random_sample
 * (race_sample.c): the max, the sum of exp(x - max), and the first index holding the max. */
#ifndef PAGODA_CPU_SAMPLING_ROW_H
#define PAGODA_CPU_SAMPLING_ROW_H

#include <math.h>
#include <stdint.h>

#include "common.h"

typedef struct {
    float max, sum;  /* logprob of index i: x[i] - max - log(sum) */
    int64_t first;   /* the first index of the max; NaNs are skipped (vocab - 1 when all NaN) */
} row_stats_t;

/* Two vectorised passes over the row (the second from cache). The first index of the max is
 * found in the pass that sums the exponentials: a scalar search for it cost as much as both. */
#define DEFINE_ROW_STATS(NAME, T, TO_F)                                                         \
static inline row_stats_t NAME(const T *x, int64_t vocab) {                                    \
    float max = -INFINITY;                                                                      \
    _Pragma("omp simd reduction(max:max)")                                                      \
    for (int64_t i = 0; i < vocab; i++) max = TO_F(x[i]) > max ? TO_F(x[i]) : max;              \
    int64_t best = vocab;                                                                       \
    float sum = 0.0f;                                                                           \
    _Pragma("omp simd reduction(+:sum) reduction(min:best)")                                    \
    for (int64_t i = 0; i < vocab; i++) {                                                       \
        const float v = TO_F(x[i]);                                                             \
        sum += exp_approx(v - max);                                                             \
        best = v == max && i < best ? i : best;                                                 \
    }                                                                                           \
    return (row_stats_t){max, sum, best == vocab ? vocab - 1 : best};                           \
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include "avx2.h"

/* The same two passes on 8-lane vectors: without AVX-512 the compiler's loop above (its index
 * reduction in 64-bit lanes) ran 64 rows of a 49k vocabulary at ~14 ms, slower than torch's
 * ops. max_ps returns its second operand where either is NaN, so NaNs are skipped as above;
 * the first index of the max is looked for until found, a compare and a mask a vector. */
#define DEFINE_ROW_STATS_AVX2(NAME, T, LOAD8, TO_F)                                             \
static inline row_stats_t NAME(const T *x, int64_t vocab) {                                    \
    const int64_t whole = vocab & ~(int64_t)7;                                                  \
    __m256 top = _mm256_set1_ps(-INFINITY);                                                     \
    for (int64_t i = 0; i < whole; i += 8) top = _mm256_max_ps(LOAD8(x + i), top);              \
    float lanes[8];                                                                             \
    _mm256_storeu_ps(lanes, top);                                                               \
    float max = -INFINITY;                                                                      \
    for (int j = 0; j < 8; j++) max = lanes[j] > max ? lanes[j] : max;                          \
    for (int64_t i = whole; i < vocab; i++) max = TO_F(x[i]) > max ? TO_F(x[i]) : max;          \
    const __m256 m = _mm256_set1_ps(max);                                                       \
    __m256 sums = _mm256_setzero_ps();                                                          \
    int64_t best = vocab;                                                                       \
    for (int64_t i = 0; i < whole; i += 8) {                                                    \
        const __m256 v = LOAD8(x + i);                                                          \
        sums = _mm256_add_ps(sums, exp8(_mm256_sub_ps(v, m)));                                  \
        if (best == vocab) {                                                                    \
            const int at = _mm256_movemask_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ));                 \
            if (at) best = i + __builtin_ctz(at);                                               \
        }                                                                                       \
    }                                                                                           \
    _mm256_storeu_ps(lanes, sums);                                                              \
    float sum = 0.0f;                                                                           \
    for (int j = 0; j < 8; j++) sum += lanes[j];                                                \
    for (int64_t i = whole; i < vocab; i++) {                                                   \
        const float v = TO_F(x[i]);                                                             \
        sum += exp_approx(v - max);                                                             \
        if (v == max && best == vocab) best = i;                                                \
    }                                                                                           \
    return (row_stats_t){max, sum, best == vocab ? vocab - 1 : best};                           \
}

DEFINE_ROW_STATS_AVX2(row_stats_f32, float, load8_f32, f32_id)
DEFINE_ROW_STATS_AVX2(row_stats_bf16, uint16_t, load8_bf16, bf16_to_float)
#else
DEFINE_ROW_STATS(row_stats_f32, float, f32_id)
DEFINE_ROW_STATS(row_stats_bf16, uint16_t, bf16_to_float)
#endif

#endif
