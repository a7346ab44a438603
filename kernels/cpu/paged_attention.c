/* Paged decode attention for the CPU: one query token per sequence reads its K/V blocks where
 * they lie in the cache, with no gathered copy (kernels/reference.py gathers, then calls SDPA).
 *
 * Layouts (as in kernels/reference.py):
 *   query        [num_seqs, num_heads, head_dim], rows `q_stride` elements apart
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables [num_seqs, bt_stride] int64;  seq_lens [num_seqs] int64
 *   out          [num_seqs, num_heads, head_dim], contiguous
 *
 * One work item is a (sequence, KV head) pair: the query heads that share the KV head are
 * scored together, so each cached K/V row is converted to float once and used by all of them.
 * Softmax is computed online block by block (running max and sum, accumulators rescaled once per
 * block). Float accumulation for every dtype. Built by kernels/cpu/build.py with -O3
 * -march=native -fopenmp; OpenMP is the same runtime torch uses, so torch.set_num_threads holds.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MAX_GROUP 16    /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128

static inline void load_f32(const float *src, float *dst, int n) {
    memcpy(dst, src, n * sizeof(float));
}

static inline void store_f32(float *dst, const float *src, int n) {
    memcpy(dst, src, n * sizeof(float));
}

static inline void load_bf16(const uint16_t *src, float *dst, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline void store_bf16(uint16_t *dst, const float *src, int n) {
    for (int i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* One (sequence, KV head) work item. Always inlined into call sites where head_dim is a
 * constant (64, 128), so the compiler unrolls the head_dim loops and keeps rows in registers. */
#define DEFINE_DECODE_ITEM(NAME, T, LOAD, STORE)                                                 \
static inline __attribute__((always_inline)) void NAME(                                         \
        const T *query, int64_t q_stride, const T *key_cache, const T *value_cache,             \
        const int64_t *table, int64_t len, T *out, int s, int h, int group, int num_heads,      \
        int head_dim, int block_size, int64_t token_stride, int64_t block_stride, float scale) {\
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                             \
    float scores[MAX_GROUP][MAX_BLOCK], row[MAX_HEAD_DIM];                                      \
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];                                               \
    for (int g = 0; g < group; g++) {                                                           \
        LOAD(query + s * q_stride + (int64_t)(h * group + g) * head_dim, q[g], head_dim);       \
        for (int d = 0; d < head_dim; d++) { q[g][d] *= scale; acc[g][d] = 0.0f; }              \
        run_max[g] = -INFINITY;                                                                 \
        run_sum[g] = 0.0f;                                                                      \
    }                                                                                           \
    for (int64_t start = 0; start < len; start += block_size) {                                \
        const int n = (int)(len - start < block_size ? len - start : block_size);              \
        const int64_t base = table[start / block_size] * block_stride + h * head_dim;          \
        if (start + block_size < len) {                                                         \
            /* The next block is elsewhere in memory: start loading it while this one is      \
             * computed (the hardware prefetcher only follows this block's stride). */          \
            const int64_t next = table[start / block_size + 1] * block_stride + h * head_dim;   \
            for (int t = 0; t < block_size; t++)                                                \
                for (int d = 0; d < head_dim; d += 64 / (int)sizeof(T)) {                       \
                    __builtin_prefetch(key_cache + next + t * token_stride + d);                \
                    __builtin_prefetch(value_cache + next + t * token_stride + d);              \
                }                                                                               \
        }                                                                                       \
        for (int t = 0; t < n; t++) {                                                           \
            LOAD(key_cache + base + t * token_stride, row, head_dim);                           \
            for (int g = 0; g < group; g++) {                                                   \
                float dot = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:dot)")                                            \
                for (int d = 0; d < head_dim; d++) dot += q[g][d] * row[d];                     \
                scores[g][t] = dot;                                                             \
            }                                                                                   \
        }                                                                                       \
        for (int g = 0; g < group; g++) {                                                       \
            float block_max = scores[g][0];                                                     \
            for (int t = 1; t < n; t++)                                                         \
                block_max = scores[g][t] > block_max ? scores[g][t] : block_max;                \
            const float new_max = block_max > run_max[g] ? block_max : run_max[g];              \
            const float correction = exp_approx(run_max[g] - new_max);                     \
            run_max[g] = new_max;                                                               \
            float sum = run_sum[g] * correction;                                                \
            _Pragma("omp simd reduction(+:sum)")                                                \
            for (int t = 0; t < n; t++) {                                                       \
                scores[g][t] = exp_approx(scores[g][t] - new_max);                         \
                sum += scores[g][t];                                                            \
            }                                                                                   \
            run_sum[g] = sum;                                                                   \
            for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;                         \
        }                                                                                       \
        for (int t = 0; t < n; t++) {                                                           \
            LOAD(value_cache + base + t * token_stride, row, head_dim);                         \
            for (int g = 0; g < group; g++) {                                                   \
                const float p = scores[g][t];                                                   \
                _Pragma("omp simd")                                                             \
                for (int d = 0; d < head_dim; d++) acc[g][d] += p * row[d];                     \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int g = 0; g < group; g++) {                                                           \
        const float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;                         \
        for (int d = 0; d < head_dim; d++) row[d] = acc[g][d] * inv;                            \
        STORE(out + ((int64_t)s * num_heads + h * group + g) * head_dim, row, head_dim);        \
    }                                                                                           \
}

#define DEFINE_PAGED_DECODE(NAME, ITEM, T)                                                       \
int NAME(const T *query, int64_t q_stride, const T *key_cache, const T *value_cache,            \
         const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, T *out,       \
         int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,           \
         float scale) {                                                                         \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||               \
        group * num_kv_heads != num_heads)                                                      \
        return -1;                                                                              \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                             \
    const int64_t block_stride = (int64_t)block_size * token_stride;                           \
    const int num_items = num_seqs * num_kv_heads;                                              \
    _Pragma("omp parallel for schedule(static)")                                                \
    for (int item = 0; item < num_items; item++) {                                              \
        const int s = item / num_kv_heads, h = item % num_kv_heads;                             \
        const int64_t *table = block_tables + s * bt_stride;                                    \
        if (head_dim == 64)                                                                     \
            ITEM(query, q_stride, key_cache, value_cache, table, seq_lens[s], out, s, h, group, \
                 num_heads, 64, block_size, token_stride, block_stride, scale);                 \
        else if (head_dim == 128)                                                               \
            ITEM(query, q_stride, key_cache, value_cache, table, seq_lens[s], out, s, h, group, \
                 num_heads, 128, block_size, token_stride, block_stride, scale);                \
        else                                                                                    \
            ITEM(query, q_stride, key_cache, value_cache, table, seq_lens[s], out, s, h, group, \
                 num_heads, head_dim, block_size, token_stride, block_stride, scale);           \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_DECODE_ITEM(decode_item_f32, float, load_f32, store_f32)
DEFINE_DECODE_ITEM(decode_item_bf16, uint16_t, load_bf16, store_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, decode_item_f32, float)
DEFINE_PAGED_DECODE(paged_decode_bf16, decode_item_bf16, uint16_t)
