/* Writes a step's new K and V rows into their paged cache slots: one call where torch takes a
 * view and an index_copy_ for each of K and V (in a decode step those ops ran with the caches
 * cold after attention's stream over the cache, at ~50 us a layer). Works on bytes, so on any
 * model dtype (an 8-bit cache quantizes: kv_cache_write_q8 below). */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kv_quant.h"
#include "layer_kernels.h"

/* key/value: `tokens` rows of row_bytes, row t at key + t * key_stride (bytes); cache slot s
 * at key_cache + s * row_bytes. Returns -1, writing nothing, if a slot is outside
 * [0, num_slots). */
int kv_cache_write(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                   char *key_cache, char *value_cache, const int64_t *slots, int64_t tokens,
                   int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(key_cache + slots[t] * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slots[t] * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}

/* The write into an 8-bit cache (kv_quant.h): each (token, KV head) row of head_dim float32
 * (src_bf16 0) or bf16 (1) values quantized into its slot, K and V alike. Rows at key +
 * t * key_stride (bytes), heads head_dim values apart; the cache's rows are kvq_row_bytes
 * apart. Returns -1, writing nothing, if a slot is outside [0, num_slots); -2 for an unknown
 * cache dtype. */
int kv_cache_write_q8(const char *key, int64_t key_stride, const char *value,
                      int64_t value_stride, uint8_t *key_cache, uint8_t *value_cache,
                      const int64_t *slots, int64_t tokens, int num_kv_heads, int head_dim,
                      int src_bf16, int cache_dtype, int64_t num_slots) {
    if (cache_dtype < KV_INT8 || cache_dtype > KV_FP8_E5M2 || head_dim > 1024) return -2;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int64_t row_bytes = kvq_row_bytes(head_dim, cache_dtype);
    const int64_t elem = src_bf16 ? 2 : 4;
    float row[1024];
    for (int64_t t = 0; t < tokens; t++)
        for (int kv = 0; kv < 2; kv++) {
            const char *src = (kv ? value + t * value_stride : key + t * key_stride);
            uint8_t *dst = (kv ? value_cache : key_cache) + slots[t] * num_kv_heads * row_bytes;
            for (int h = 0; h < num_kv_heads; h++) {
                const char *head = src + (int64_t)h * head_dim * elem;
                if (src_bf16) {
                    const uint16_t *b = (const uint16_t *)head;
                    for (int d = 0; d < head_dim; d++) row[d] = bf16_to_float(b[d]);
                } else {
                    memcpy(row, head, (size_t)head_dim * sizeof(float));
                }
                kvq_store_row(row, dst + h * row_bytes, head_dim, cache_dtype);
            }
        }
    return 0;
}
