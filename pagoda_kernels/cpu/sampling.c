/* Greedy sampling straight from the logits: per row the first index of the largest logit and
 * its logprob, -log(sum(exp(x - max))), in two passes over the row (the second from cache),
 * with no float copy of the logits and no [rows, vocab] temporaries. Rows over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"

#define DEFINE_GREEDY(NAME, T, TO_F)                                                             \
void NAME(const T *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *token_ids,     \
          float *logprobs) {                                                                    \
    _Pragma("omp parallel for schedule(static) if(rows * vocab >= PARALLEL_GRAIN)")            \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const T *x = logits + r * stride;                                                       \
        float max = -INFINITY;                                                                  \
        _Pragma("omp simd reduction(max:max)")                                                  \
        for (int64_t i = 0; i < vocab; i++) max = TO_F(x[i]) > max ? TO_F(x[i]) : max;          \
        /* The first index holding the max, found in the vectorised pass that sums the        \
         * exponentials (a scalar search for it cost as much as both passes). */                \
        int64_t best = vocab;                                                                   \
        float sum = 0.0f;                                                                       \
        _Pragma("omp simd reduction(+:sum) reduction(min:best)")                                \
        for (int64_t i = 0; i < vocab; i++) {                                                   \
            const float v = TO_F(x[i]);                                                         \
            sum += exp_approx(v - max);                                                         \
            best = v == max && i < best ? i : best;                                             \
        }                                                                                       \
        if (best == vocab) best = vocab - 1; /* no value equals max: all NaN */                 \
        token_ids[r] = best;                                                                    \
        logprobs[r] = -logf(sum);                                                               \
    }                                                                                           \
}

DEFINE_GREEDY(greedy_sample_f32, float, f32_id)
DEFINE_GREEDY(greedy_sample_bf16, uint16_t, bf16_to_float)
