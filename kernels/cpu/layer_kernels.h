/* The bf16 layer kernels blocks.c chains (defined in layer_ops.c and matmul_amx.c, which include
 * this header too, so that a changed signature fails to compile instead of mismatching). */
#ifndef PAGODA_CPU_LAYER_KERNELS_H
#define PAGODA_CPU_LAYER_KERNELS_H

#include <stdint.h>

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                   const uint16_t *weight, uint16_t *out, int64_t rows, int cols, float eps);
int rotary_bf16(uint16_t *x, int64_t x_stride, const int64_t *positions, const uint16_t *cos_sin,
                int64_t tokens, int heads, int head_dim, int64_t max_positions);
int matmul_amx_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y);

#endif
