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

DEFINE_ROW_STATS(row_stats_f32, float, f32_id)
DEFINE_ROW_STATS(row_stats_bf16, uint16_t, bf16_to_float)

#endif
