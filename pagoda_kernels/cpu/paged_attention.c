/* Paged decode attention for the CPU: one query token per sequence reads its K/V blocks where
 * they lie in the cache, with no gathered copy (pagoda_kernels/reference.py gathers, then calls SDPA).
 *
 * Layouts (as in pagoda_kernels/reference.py):
 *   query        [num_seqs, num_heads, head_dim], rows `q_stride` elements apart
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables [num_seqs, bt_stride] int64;  seq_lens [num_seqs] int64
 *   out          [num_seqs, num_heads, head_dim], contiguous
 *
 * A work item is a sequence and a run of its KV heads (all of them when their query heads fit
 * MAX_HEADS and there are enough sequences to share out): each cached K/V row is converted to
 * float once and scored against all the query heads that share it, and a block is read in
 * memory order.
 * Softmax is computed online block by block (running max and sum, accumulators rescaled once per
 * block). Float accumulation for every dtype. Built by pagoda_kernels/cpu/build.py with -O3
 * -march=native -fopenmp; OpenMP is the same runtime torch uses, so torch.set_num_threads holds.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include "common.h"
#include "kv_quant.h"
#include "paged_attention.h"
#include "layer_kernels.h"

int pagoda_attention_simd = 1;

void set_attention_simd(int on) { pagoda_attention_simd = on; }

int attention_simd_available(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#define MAX_HEADS 16    /* query heads per work item (so per KV head, at most) */
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

/* One work item: a sequence and `kv_heads` of its KV heads starting at `h0`, so one pass over
 * each cached block serves all the query heads of those KV heads (up to MAX_HEADS), and a block's
 * rows are read in memory order. Always inlined into call sites where head_dim is a constant
 * (64, 128), so the compiler unrolls the head_dim loops. */
#define DEFINE_DECODE_ITEM(NAME, T, LOAD, STORE)                                                 \
static inline __attribute__((always_inline)) void NAME(                                         \
        const T *query, int64_t q_stride, const T *key_cache, const T *value_cache,             \
        const int64_t *table, int64_t len, T *out, int s, int h0, int kv_heads, int group,      \
        int num_heads, int head_dim, int block_size, int64_t token_stride,                      \
        int64_t block_stride, float scale) {                                                    \
    float q[MAX_HEADS][MAX_HEAD_DIM], acc[MAX_HEADS][MAX_HEAD_DIM];                             \
    float scores[MAX_HEADS][MAX_BLOCK], row[MAX_HEAD_DIM];                                      \
    float run_max[MAX_HEADS], run_sum[MAX_HEADS];                                               \
    const int heads = kv_heads * group; /* query heads h0 * group .. + heads */                 \
    const T *q0 = query + s * q_stride + (int64_t)h0 * group * head_dim;                        \
    for (int i = 0; i < heads; i++) {                                                           \
        LOAD(q0 + (int64_t)i * head_dim, q[i], head_dim);                                       \
        for (int d = 0; d < head_dim; d++) { q[i][d] *= scale; acc[i][d] = 0.0f; }              \
        run_max[i] = -INFINITY;                                                                 \
        run_sum[i] = 0.0f;                                                                      \
    }                                                                                           \
    const int64_t span = (int64_t)kv_heads * head_dim; /* this item's part of a token row */   \
    for (int64_t start = 0; start < len; start += block_size) {                                \
        const int n = (int)(len - start < block_size ? len - start : block_size);              \
        const int64_t base = table[start / block_size] * block_stride + (int64_t)h0 * head_dim; \
        if (start + block_size < len) {                                                         \
            /* The next block is elsewhere in memory: start loading it while this one is      \
             * computed (the hardware prefetcher only follows this block's stride). */          \
            const int64_t next = table[start / block_size + 1] * block_stride                   \
                                 + (int64_t)h0 * head_dim;                                      \
            for (int t = 0; t < block_size; t++)                                                \
                for (int64_t d = 0; d < span; d += 64 / (int64_t)sizeof(T)) {                   \
                    __builtin_prefetch(key_cache + next + t * token_stride + d);                \
                    __builtin_prefetch(value_cache + next + t * token_stride + d);              \
                }                                                                               \
        }                                                                                       \
        for (int t = 0; t < n; t++)                                                             \
            for (int kh = 0; kh < kv_heads; kh++) {                                             \
                LOAD(key_cache + base + t * token_stride + kh * head_dim, row, head_dim);       \
                for (int g = 0; g < group; g++) {                                               \
                    const int i = kh * group + g;                                               \
                    float dot = 0.0f;                                                           \
                    _Pragma("omp simd reduction(+:dot)")                                        \
                    for (int d = 0; d < head_dim; d++) dot += q[i][d] * row[d];                 \
                    scores[i][t] = dot;                                                         \
                }                                                                               \
            }                                                                                   \
        for (int i = 0; i < heads; i++) {                                                       \
            float block_max = scores[i][0];                                                     \
            for (int t = 1; t < n; t++)                                                         \
                block_max = scores[i][t] > block_max ? scores[i][t] : block_max;                \
            const float new_max = block_max > run_max[i] ? block_max : run_max[i];              \
            const float correction = exp_approx(run_max[i] - new_max);                          \
            run_max[i] = new_max;                                                               \
            float sum = run_sum[i] * correction;                                                \
            _Pragma("omp simd reduction(+:sum)")                                                \
            for (int t = 0; t < n; t++) {                                                       \
                scores[i][t] = exp_approx(scores[i][t] - new_max);                              \
                sum += scores[i][t];                                                            \
            }                                                                                   \
            run_sum[i] = sum;                                                                   \
            for (int d = 0; d < head_dim; d++) acc[i][d] *= correction;                         \
        }                                                                                       \
        for (int t = 0; t < n; t++)                                                             \
            for (int kh = 0; kh < kv_heads; kh++) {                                             \
                LOAD(value_cache + base + t * token_stride + kh * head_dim, row, head_dim);     \
                for (int g = 0; g < group; g++) {                                               \
                    const int i = kh * group + g;                                               \
                    const float p = scores[i][t];                                               \
                    _Pragma("omp simd")                                                         \
                    for (int d = 0; d < head_dim; d++) acc[i][d] += p * row[d];                 \
                }                                                                               \
            }                                                                                   \
    }                                                                                           \
    for (int i = 0; i < heads; i++) {                                                           \
        const float inv = run_sum[i] > 0.0f ? 1.0f / run_sum[i] : 0.0f;                         \
        for (int d = 0; d < head_dim; d++) row[d] = acc[i][d] * inv;                            \
        STORE(out + ((int64_t)s * num_heads + (int64_t)h0 * group + i) * head_dim, row,         \
              head_dim);                                                                        \
    }                                                                                           \
}

#define DEFINE_PAGED_DECODE(NAME, ITEM, SIMD, T)                                                 \
int NAME(const T *query, int64_t q_stride, const T *key_cache, const T *value_cache,            \
         const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, T *out,       \
         int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,           \
         float scale) {                                                                         \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_HEADS || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||               \
        group * num_kv_heads != num_heads)                                                      \
        return -1;                                                                              \
    if (SIMD(query, q_stride, key_cache, value_cache, block_tables, bt_stride, seq_lens, out,    \
             num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale) == 0)              \
        return 0;                                                                               \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                             \
    const int64_t block_stride = (int64_t)block_size * token_stride;                           \
    const int per_item = kv_heads_per_item(num_seqs, num_kv_heads, group, MAX_HEADS,           \
                                           omp_get_max_threads());                             \
    const int chunks = num_kv_heads / per_item;                                                 \
    const int num_items = num_seqs * chunks;                                                    \
    _Pragma("omp parallel for schedule(static)")                                                \
    for (int item = 0; item < num_items; item++) {                                              \
        const int s = item / chunks, h0 = (item % chunks) * per_item;                           \
        const int64_t *table = block_tables + s * bt_stride;                                    \
        if (head_dim == 64)                                                                     \
            ITEM(query, q_stride, key_cache, value_cache, table, seq_lens[s], out, s, h0,       \
                 per_item, group, num_heads, 64, block_size, token_stride, block_stride, scale);\
        else if (head_dim == 128)                                                               \
            ITEM(query, q_stride, key_cache, value_cache, table, seq_lens[s], out, s, h0,       \
                 per_item, group, num_heads, 128, block_size, token_stride, block_stride,       \
                 scale);                                                                        \
        else                                                                                    \
            ITEM(query, q_stride, key_cache, value_cache, table, seq_lens[s], out, s, h0,       \
                 per_item, group, num_heads, head_dim, block_size, token_stride, block_stride,  \
                 scale);                                                                        \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_DECODE_ITEM(decode_item_f32, float, load_f32, store_f32)
DEFINE_DECODE_ITEM(decode_item_bf16, uint16_t, load_bf16, store_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, decode_item_f32, paged_decode_simd_f32, float)
DEFINE_PAGED_DECODE(paged_decode_bf16, decode_item_bf16, paged_decode_simd_bf16, uint16_t)

/* -- 8-bit caches (kv_quant.h): the same walk, each cached row converted from its 8-bit format
 * (int8 rows scaled by the scale stored after them). Query and output in the model dtype. -- */
#define DEFINE_DECODE_ITEM_Q8(NAME, T, LOAD, STORE)                                              \
static inline __attribute__((always_inline)) void NAME(                                         \
        const T *query, int64_t q_stride, const uint8_t *key_cache,                             \
        const uint8_t *value_cache, const int64_t *table, int64_t len, T *out, int s, int h0,   \
        int kv_heads, int group, int num_heads, int head_dim, int block_size,                   \
        int cache_dtype, float scale) {                                                         \
    float q[MAX_HEADS][MAX_HEAD_DIM], acc[MAX_HEADS][MAX_HEAD_DIM];                             \
    float scores[MAX_HEADS][MAX_BLOCK], row[MAX_HEAD_DIM];                                      \
    float run_max[MAX_HEADS], run_sum[MAX_HEADS];                                               \
    const int heads = kv_heads * group;                                                         \
    const int64_t row_bytes = kvq_row_bytes(head_dim, cache_dtype);                             \
    const int64_t token_stride = (int64_t)(num_heads / group) * row_bytes;                      \
    const int64_t block_stride = (int64_t)block_size * token_stride;                            \
    const T *q0 = query + s * q_stride + (int64_t)h0 * group * head_dim;                        \
    for (int i = 0; i < heads; i++) {                                                           \
        LOAD(q0 + (int64_t)i * head_dim, q[i], head_dim);                                       \
        for (int d = 0; d < head_dim; d++) { q[i][d] *= scale; acc[i][d] = 0.0f; }              \
        run_max[i] = -INFINITY;                                                                 \
        run_sum[i] = 0.0f;                                                                      \
    }                                                                                           \
    const int64_t span = (int64_t)kv_heads * row_bytes;                                         \
    for (int64_t start = 0; start < len; start += block_size) {                                \
        const int n = (int)(len - start < block_size ? len - start : block_size);              \
        const int64_t base = table[start / block_size] * block_stride + (int64_t)h0 * row_bytes;\
        if (start + block_size < len) {                                                         \
            const int64_t next = table[start / block_size + 1] * block_stride                   \
                                 + (int64_t)h0 * row_bytes;                                     \
            for (int t = 0; t < block_size; t++)                                                \
                for (int64_t d = 0; d < span; d += 64) {                                        \
                    __builtin_prefetch(key_cache + next + t * token_stride + d);                \
                    __builtin_prefetch(value_cache + next + t * token_stride + d);              \
                }                                                                               \
        }                                                                                       \
        for (int t = 0; t < n; t++)                                                             \
            for (int kh = 0; kh < kv_heads; kh++) {                                             \
                kvq_load_row(key_cache + base + t * token_stride + kh * row_bytes, row,         \
                             head_dim, cache_dtype);                                            \
                for (int g = 0; g < group; g++) {                                               \
                    const int i = kh * group + g;                                               \
                    float dot = 0.0f;                                                           \
                    _Pragma("omp simd reduction(+:dot)")                                        \
                    for (int d = 0; d < head_dim; d++) dot += q[i][d] * row[d];                 \
                    scores[i][t] = dot;                                                         \
                }                                                                               \
            }                                                                                   \
        for (int i = 0; i < heads; i++) {                                                       \
            float block_max = scores[i][0];                                                     \
            for (int t = 1; t < n; t++)                                                         \
                block_max = scores[i][t] > block_max ? scores[i][t] : block_max;                \
            const float new_max = block_max > run_max[i] ? block_max : run_max[i];              \
            const float correction = exp_approx(run_max[i] - new_max);                          \
            run_max[i] = new_max;                                                               \
            float sum = run_sum[i] * correction;                                                \
            _Pragma("omp simd reduction(+:sum)")                                                \
            for (int t = 0; t < n; t++) {                                                       \
                scores[i][t] = exp_approx(scores[i][t] - new_max);                              \
                sum += scores[i][t];                                                            \
            }                                                                                   \
            run_sum[i] = sum;                                                                   \
            for (int d = 0; d < head_dim; d++) acc[i][d] *= correction;                         \
        }                                                                                       \
        for (int t = 0; t < n; t++)                                                             \
            for (int kh = 0; kh < kv_heads; kh++) {                                             \
                kvq_load_row(value_cache + base + t * token_stride + kh * row_bytes, row,       \
                             head_dim, cache_dtype);                                            \
                for (int g = 0; g < group; g++) {                                               \
                    const int i = kh * group + g;                                               \
                    const float p = scores[i][t];                                               \
                    _Pragma("omp simd")                                                         \
                    for (int d = 0; d < head_dim; d++) acc[i][d] += p * row[d];                 \
                }                                                                               \
            }                                                                                   \
    }                                                                                           \
    for (int i = 0; i < heads; i++) {                                                           \
        const float inv = run_sum[i] > 0.0f ? 1.0f / run_sum[i] : 0.0f;                         \
        for (int d = 0; d < head_dim; d++) row[d] = acc[i][d] * inv;                            \
        STORE(out + ((int64_t)s * num_heads + (int64_t)h0 * group + i) * head_dim, row,         \
              head_dim);                                                                        \
    }                                                                                           \
}

/* Head dims 64 and 128 and each cache dtype as constants, so each call site is specialised. */
#define Q8_ITEM_CALL(ITEM, HD, CD)                                                               \
    ITEM(query, q_stride, key_cache, value_cache, table, seq_lens[s], out, s, h0, per_item,      \
         group, num_heads, HD, block_size, CD, scale)
#define Q8_ITEM_DTYPES(ITEM, HD)                                                                 \
    do {                                                                                         \
        if (cache_dtype == KV_INT8) Q8_ITEM_CALL(ITEM, HD, KV_INT8);                             \
        else if (cache_dtype == KV_FP8_E4M3) Q8_ITEM_CALL(ITEM, HD, KV_FP8_E4M3);                \
        else Q8_ITEM_CALL(ITEM, HD, KV_FP8_E5M2);                                                \
    } while (0)

/* As paged_decode_f32 / _bf16 over an 8-bit cache of `cache_dtype` (KV_INT8, KV_FP8_E4M3,
 * KV_FP8_E5M2). -1 for shapes it does not run, -2 for an unknown cache dtype. */
#define DEFINE_PAGED_DECODE_Q8(NAME, ITEM, SIMD, T)                                              \
int NAME(const T *query, int64_t q_stride, const uint8_t *key_cache,                           \
         const uint8_t *value_cache, const int64_t *block_tables, int64_t bt_stride,           \
         const int64_t *seq_lens, T *out, int num_seqs, int num_heads, int num_kv_heads,       \
         int head_dim, int block_size, float scale, int cache_dtype) {                          \
    const int group = num_heads / num_kv_heads;                                                 \
    if (group > MAX_HEADS || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ||               \
        group * num_kv_heads != num_heads)                                                      \
        return -1;                                                                              \
    if (cache_dtype < KV_INT8 || cache_dtype > KV_FP8_E5M2) return -2;                          \
    if (SIMD(query, q_stride, key_cache, value_cache, block_tables, bt_stride, seq_lens, out,    \
             num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, cache_dtype) == 0)  \
        return 0;                                                                               \
    const int per_item = kv_heads_per_item(num_seqs, num_kv_heads, group, MAX_HEADS,           \
                                           omp_get_max_threads());                             \
    const int chunks = num_kv_heads / per_item;                                                 \
    const int num_items = num_seqs * chunks;                                                    \
    _Pragma("omp parallel for schedule(static)")                                                \
    for (int item = 0; item < num_items; item++) {                                              \
        const int s = item / chunks, h0 = (item % chunks) * per_item;                           \
        const int64_t *table = block_tables + s * bt_stride;                                    \
        if (head_dim == 64) Q8_ITEM_DTYPES(ITEM, 64);                                           \
        else if (head_dim == 128) Q8_ITEM_DTYPES(ITEM, 128);                                    \
        else Q8_ITEM_DTYPES(ITEM, head_dim);                                                    \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_DECODE_ITEM_Q8(decode_item_q8_f32, float, load_f32, store_f32)
DEFINE_DECODE_ITEM_Q8(decode_item_q8_bf16, uint16_t, load_bf16, store_bf16)
DEFINE_PAGED_DECODE_Q8(paged_decode_q8_f32, decode_item_q8_f32, paged_decode_q8_simd_f32, float)
DEFINE_PAGED_DECODE_Q8(paged_decode_q8_bf16, decode_item_q8_bf16, paged_decode_q8_simd_bf16,
                       uint16_t)
