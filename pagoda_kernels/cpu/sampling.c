/* Greedy sampling straight from the logits: per row the first index of the largest logit and
 * its logprob, -log(sum(exp(x - max))), in two passes over the row (the second from cache),
 * with no float copy of the logits and no [rows, vocab] temporaries. Rows over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"
#include "sampling_row.h"

#define DEFINE_GREEDY(NAME, T, ROW_STATS)                                                        \
void NAME(const T *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *token_ids,     \
          float *logprobs) {                                                                    \
    _Pragma("omp parallel for schedule(static) if(rows * vocab >= PARALLEL_GRAIN)")            \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const row_stats_t st = ROW_STATS(logits + r * stride, vocab);                           \
        token_ids[r] = st.first;                                                                \
        logprobs[r] = -logf(st.sum);                                                            \
    }                                                                                           \
}

DEFINE_GREEDY(greedy_sample_f32, float, row_stats_f32)
DEFINE_GREEDY(greedy_sample_bf16, uint16_t, row_stats_bf16)
