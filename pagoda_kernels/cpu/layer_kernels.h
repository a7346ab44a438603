/* The kernels blocks.c chains, defined in layer_ops.c, the matmul files, kv_cache.c and
 * paged_attention.c, each of which includes this header too, so that a changed signature
 * there fails to compile instead of mismatching. */
#ifndef PAGODA_CPU_LAYER_KERNELS_H
#define PAGODA_CPU_LAYER_KERNELS_H

#include <stdint.h>

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                   const uint16_t *weight, uint16_t *out, int64_t rows, int cols, float eps);
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, const float *weight,
                  float *out, int64_t rows, int cols, float eps);
int rotary_bf16(uint16_t *x, int64_t x_stride, const int64_t *positions, const uint16_t *cos_sin,
                int64_t tokens, int heads, int head_dim, int64_t max_positions);
int rotary_f32(float *x, int64_t x_stride, const int64_t *positions, const float *cos_sin,
               int64_t tokens, int heads, int head_dim, int64_t max_positions);
int matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y);
int matmul_f32(const float *x, int64_t x_stride, int64_t m, const float *packed,
               const float *bias, int64_t n, int64_t k, int gate_up, float *y);
int matmul_int8(const void *x, int64_t x_stride, int64_t m, int bf16, const int8_t *packed,
                const float *ws, const int32_t *wsum, const void *bias, int64_t n, int64_t k,
                int gate_up, int w8a8, int path, void *y);
/* y = x W^T (+ bias) on a GGUF weight in matmul_gguf.c's panel layout (scales wd, wm fp16, fp32
 * for Q4_K); x, bias, y fp32 or (bf16 != 0) bf16. */
int gguf_matmul_rows(const void *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                     const uint8_t *qs, const void *wd, const void *wm, int64_t n,
                     const void *bias, void *out, int64_t out_stride, int bf16);
int kv_cache_write(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                   char *key_cache, char *value_cache, const int64_t *slots, int64_t tokens,
                   int64_t row_bytes, int64_t num_slots);
int paged_decode_f32(const float *query, int64_t q_stride, const float *key_cache,
                     const float *value_cache, const int64_t *block_tables, int64_t bt_stride,
                     const int64_t *seq_lens, float *out, int num_seqs, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, float scale);
int paged_decode_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key_cache,
                      const uint16_t *value_cache, const int64_t *block_tables,
                      int64_t bt_stride, const int64_t *seq_lens, uint16_t *out, int num_seqs,
                      int num_heads, int num_kv_heads, int head_dim, int block_size,
                      float scale);
int kv_cache_write_q8(const char *key, int64_t key_stride, const char *value,
                      int64_t value_stride, uint8_t *key_cache, uint8_t *value_cache,
                      const int64_t *slots, int64_t tokens, int num_kv_heads, int head_dim,
                      int src_bf16, int cache_dtype, int64_t num_slots);
int paged_decode_q8_f32(const float *query, int64_t q_stride, const uint8_t *key_cache,
                        const uint8_t *value_cache, const int64_t *block_tables,
                        int64_t bt_stride, const int64_t *seq_lens, float *out, int num_seqs,
                        int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, int cache_dtype);
int paged_decode_q8_bf16(const uint16_t *query, int64_t q_stride, const uint8_t *key_cache,
                         const uint8_t *value_cache, const int64_t *block_tables,
                         int64_t bt_stride, const int64_t *seq_lens, uint16_t *out,
                         int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int cache_dtype);

#endif
