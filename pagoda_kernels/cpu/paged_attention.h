/* The vector decode attention (paged_attention_avx512.c, or paged_attention_avx2.c without
 * AVX-512), tried first by paged_attention.c. */
#ifndef PAGODA_CPU_PAGED_ATTENTION_H
#define PAGODA_CPU_PAGED_ATTENTION_H

#include <stdint.h>

/* 0 when done; -1 when it does not run these shapes here (the caller runs the portable loop). */
int paged_decode_simd_f32(const float *query, int64_t q_stride, const float *key_cache,
                          const float *value_cache, const int64_t *block_tables,
                          int64_t bt_stride, const int64_t *seq_lens, float *out, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale);
int paged_decode_simd_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int64_t *block_tables,
                           int64_t bt_stride, const int64_t *seq_lens, uint16_t *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, float scale);
/* The same over an 8-bit cache (kv_quant.h's cache_dtype), rows as bytes. */
int paged_decode_q8_simd_f32(const float *query, int64_t q_stride, const uint8_t *key_cache,
                             const uint8_t *value_cache, const int64_t *block_tables,
                             int64_t bt_stride, const int64_t *seq_lens, float *out,
                             int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                             int block_size, float scale, int cache_dtype);
int paged_decode_q8_simd_bf16(const uint16_t *query, int64_t q_stride, const uint8_t *key_cache,
                              const uint8_t *value_cache, const int64_t *block_tables,
                              int64_t bt_stride, const int64_t *seq_lens, uint16_t *out,
                              int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                              int block_size, float scale, int cache_dtype);

/* How many KV heads a work item takes: as many as fit `max_heads` query heads (a divisor of
 * num_kv_heads), so a block is read once for all of them; but one when there are too few
 * sequences to keep every thread busy. */
static inline int kv_heads_per_item(int num_seqs, int num_kv_heads, int group, int max_heads,
                                    int threads) {
    if (num_seqs < 4 * threads) return 1;
    for (int k = num_kv_heads; k > 1; k--)
        if (num_kv_heads % k == 0 && k * group <= max_heads) return k;
    return 1;
}

/* The vector path the library was built with: 2 paged_attention_avx512.c (every cache dtype), 1
 * paged_attention_avx2.c (fp32 and bf16 caches), 0 none. set_attention_simd(0) turns it off
 * (tests compare it with the portable loop on one machine); the flag is read by those paths. */
int attention_simd_available(void);
void set_attention_simd(int on);
extern int pagoda_attention_simd;

#endif
