/* The inner step of the AVX2 panel matmuls (matmul_f32_avx2.c, matmul_bf16_avx2.c): R rows of x
 * against 16 output columns held in two vectors. */
#ifndef PAGODA_CPU_AVX2_ROWS_H
#define PAGODA_CPU_AVX2_ROWS_H

#include <immintrin.h>

/* acc0[i] += x_i * B0 and acc1[i] += x_i * B1 for rows i < R, x_i the float at X_AT (an
 * expression in i), broadcast. Unrolled, so that acc0 and acc1 stay in registers. */
#define AVX2_ROWS_FMA(R, X_AT, B0, B1)                                                             \
    _Pragma("GCC unroll 8")                                                                        \
    for (int i = 0; i < R; i++) {                                                                  \
        const __m256 a_ = _mm256_broadcast_ss(X_AT);                                               \
        acc0[i] = _mm256_fmadd_ps(a_, B0, acc0[i]);                                                \
        acc1[i] = _mm256_fmadd_ps(a_, B1, acc1[i]);                                                \
    }

#endif
