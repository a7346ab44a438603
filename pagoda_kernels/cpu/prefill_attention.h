/* What prefill_attention.c's loops share with its AVX2 loop (prefill_attention_avx2.c): the
 * work items, the conversions to and from float, the packing of K and V into key blocks, and the
 * driver of the vector loops. */
#ifndef PAGODA_CPU_PREFILL_ATTENTION_H
#define PAGODA_CPU_PREFILL_ATTENTION_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define KEY_BLOCK 16
#define QUERY_BLOCK 32
#define MAX_HEAD_DIM 256

/* Work items: (sequence, head, query block), the blocks with the most keys first. */
typedef struct {
    int seq, head;
    int64_t q0; /* first query token of the item (absolute) */
} Item;

/* Lists the items (query blocks of `rows`) in `*items` (malloc'd), by block index from the
 * last, so the items that see the most keys go out first. Returns the count, or -1 when out of
 * memory. */
static inline int64_t list_items(const int64_t *qsl, int num_seqs, int num_heads, int64_t rows,
                                 Item **items) {
    int64_t count = 0, max_blocks = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t blocks = (qsl[s + 1] - qsl[s] + rows - 1) / rows;
        count += blocks * num_heads;
        if (blocks > max_blocks) max_blocks = blocks;
    }
    *items = malloc((count ? count : 1) * sizeof(Item));
    if (!*items) return -1;
    int64_t n = 0;
    for (int64_t b = max_blocks - 1; b >= 0; b--)
        for (int s = 0; s < num_seqs; s++) {
            const int64_t q0 = qsl[s] + b * rows;
            if (q0 >= qsl[s + 1]) continue;
            for (int h = 0; h < num_heads; h++) (*items)[n++] = (Item){s, h, q0};
        }
    return n;
}

static inline void to_float_f32(const float *src, float *dst, int n) {
    memcpy(dst, src, n * sizeof(float));
}

static inline void to_float_bf16(const uint16_t *src, float *dst, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline void from_float_f32(float *dst, const float *src, int n) {
    memcpy(dst, src, n * sizeof(float));
}

static inline void from_float_bf16(uint16_t *dst, const float *src, int n) {
    for (int i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

/* K as float [kv_head][block][head_dim][16] and V as float [kv_head][block][16][head_dim],
 * zeros past the last token (masked, but multiplied: they must be finite). */
#define DEFINE_PACK(NAME, T, LOAD)                                                                 \
static inline void NAME(const T *key, int64_t k_stride, const T *value, int64_t v_stride,          \
                        int64_t num_tokens, int num_kv_heads, int head_dim, float *kt,            \
                        float *vf) {                                                               \
    const int64_t num_blocks = (num_tokens + KEY_BLOCK - 1) / KEY_BLOCK;                           \
    const int64_t block_elems = (int64_t)KEY_BLOCK * head_dim;                                     \
    _Pragma("omp parallel for schedule(dynamic, 8)")                                               \
    for (int64_t i = 0; i < num_kv_heads * num_blocks; i++) {                                      \
        const int kh = (int)(i / num_blocks);                                                      \
        const int64_t b = i % num_blocks, t0 = b * KEY_BLOCK;                                      \
        float *kb = kt + i * block_elems, *vb = vf + i * block_elems;                              \
        float row[MAX_HEAD_DIM];                                                                   \
        for (int t = 0; t < KEY_BLOCK; t++) {                                                      \
            if (t0 + t < num_tokens) {                                                             \
                LOAD(key + (t0 + t) * k_stride + (int64_t)kh * head_dim, row, head_dim);           \
                for (int d = 0; d < head_dim; d++) kb[d * KEY_BLOCK + t] = row[d];                 \
                LOAD(value + (t0 + t) * v_stride + (int64_t)kh * head_dim,                         \
                     vb + t * head_dim, head_dim);                                                 \
            } else {                                                                               \
                for (int d = 0; d < head_dim; d++) kb[d * KEY_BLOCK + t] = 0.0f;                   \
                memset(vb + t * head_dim, 0, head_dim * sizeof(float));                            \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_PACK(pack_f32, float, to_float_f32)
DEFINE_PACK(pack_bf16, uint16_t, to_float_bf16)

/* A vector loop over whole prompts: K and V packed by PACK, then the work items, longest first,
 * each run by ITEM4 (head_dim 64) or ITEM8 (head_dim 128) on the packed blocks of its KV head.
 * Returns 0, or -2 when out of memory. (`static DEFINE_SIMD(...)` for a file's own.) */
#define DEFINE_SIMD(NAME, T, PACK, ITEM4, ITEM8)                                                   \
int NAME(const T *query, int64_t q_stride, const T *key, int64_t k_stride, const T *value,         \
         int64_t v_stride, const int64_t *qsl, int num_seqs, int num_heads, int num_kv_heads,      \
         int head_dim, float scale, T *out) {                                                      \
    const int64_t num_tokens = qsl[num_seqs];                                                      \
    const int64_t num_blocks = (num_tokens + KEY_BLOCK - 1) / KEY_BLOCK;                           \
    const int64_t head_elems = num_blocks * KEY_BLOCK * head_dim; /* one KV head's packed K */     \
    float *kt = malloc((size_t)(2 * num_kv_heads * head_elems + 1) * sizeof(float));               \
    Item *items;                                                                                   \
    const int64_t num_items =                                                                      \
        kt ? list_items(qsl, num_seqs, num_heads, QUERY_BLOCK, &items) : -1;                       \
    if (num_items < 0) { free(kt); return -2; }                                                    \
    float *vf = kt + num_kv_heads * head_elems;                                                    \
    PACK(key, k_stride, value, v_stride, num_tokens, num_kv_heads, head_dim, kt, vf);              \
    const int group = num_heads / num_kv_heads;                                                    \
    _Pragma("omp parallel for schedule(dynamic)")                                                  \
    for (int64_t i = 0; i < num_items; i++) {                                                      \
        const Item it = items[i];                                                                  \
        const int64_t end = qsl[it.seq + 1];                                                       \
        const int64_t q_end = it.q0 + QUERY_BLOCK < end ? it.q0 + QUERY_BLOCK : end;               \
        const int64_t kv = (int64_t)(it.head / group) * head_elems;                                \
        (head_dim == 64 ? ITEM4 : ITEM8)(query, q_stride, kt + kv, vf + kv, qsl[it.seq], it.q0,    \
                                         q_end, it.head, num_heads, scale, out);                   \
    }                                                                                              \
    free(items);                                                                                   \
    free(kt);                                                                                      \
    return 0;                                                                                      \
}

/* The AVX2 loop (prefill_attention_avx2.c, built where there is AVX2 and FMA but no AVX-512);
 * the same contract as the driver above. */
int prefill_avx2_f32(const float *query, int64_t q_stride, const float *key, int64_t k_stride,
                     const float *value, int64_t v_stride, const int64_t *qsl, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, float scale, float *out);
int prefill_avx2_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key,
                      int64_t k_stride, const uint16_t *value, int64_t v_stride,
                      const int64_t *qsl, int num_seqs, int num_heads, int num_kv_heads,
                      int head_dim, float scale, uint16_t *out);

#endif
