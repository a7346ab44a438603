/* Writes a step's new K and V rows into their paged cache slots: one call where torch takes a
 * view and an index_copy_ for each of K and V (in a decode step those ops ran with the caches
 * cold after attention's stream over the cache, at ~50 us a layer). Works on bytes, so on any
 * dtype. */
#include <stdint.h>
#include <string.h>

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
