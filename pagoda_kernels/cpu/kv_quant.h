/* The 8-bit KV cache formats (pagoda_kernels/reference.py has the layouts): conversions between float
 * and fp8 e4m3 / e5m2 written as integer arithmetic that the compiler vectorises, and the int8
 * row's scale. Rounding is to nearest even and saturates to the format's largest finite value,
 * as the torch reference (clamp, then .to(float8)); NaN codes are never written. */
#ifndef PAGODA_CPU_KV_QUANT_H
#define PAGODA_CPU_KV_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The cache dtypes, as the Python wrappers pass them. */
enum { KV_INT8 = 0, KV_FP8_E4M3 = 1, KV_FP8_E5M2 = 2 };
#define KV_INT8_SCALE_BYTES 4 /* the float32 scale after an int8 row's values */

static inline uint32_t kvq_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kvq_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* e4m3 (bias 7, no inf, 448 largest): exponent-mantissa code em = exp << 3 | mantissa. Codes
 * below 8 are subnormal (em * 2^-9); above, the fp32 exponent is rebased by 127 - 7. */
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t em = b & 0x7fu;
    const float mag = em < 8u ? (float)em * 0x1p-9f : kvq_float((em << 20) + (120u << 23));
    return kvq_float(kvq_bits(mag) | ((uint32_t)(b & 0x80u) << 24));
}

/* e5m2 (bias 15, 57344 largest finite): the top byte of an fp16. */
static inline float e5m2_to_float(uint8_t b) {
    const uint32_t em = b & 0x7fu;
    const float mag = em < 4u ? (float)em * 0x1p-16f : kvq_float((em << 21) + (112u << 23));
    return kvq_float(kvq_bits(mag) | ((uint32_t)(b & 0x80u) << 24));
}

static inline uint8_t float_to_e4m3(float x) {
    const uint32_t sign = (kvq_bits(x) >> 24) & 0x80u;
    float a = fabsf(x);
    a = a > 448.0f ? 448.0f : a;
    uint32_t em;
    if (a < 0x1p-6f) {
        em = (uint32_t)rintf(a * 512.0f); /* subnormal steps of 2^-9; 8 is the least normal */
    } else {
        uint32_t u = kvq_bits(a);
        u += 0x7ffffu + ((u >> 20) & 1u); /* round the 23-bit mantissa to 3, ties to even */
        em = (u >> 20) - (120u << 3);
    }
    return (uint8_t)(sign | em);
}

static inline uint8_t float_to_e5m2(float x) {
    const uint32_t sign = (kvq_bits(x) >> 24) & 0x80u;
    float a = fabsf(x);
    a = a > 57344.0f ? 57344.0f : a;
    uint32_t em;
    if (a < 0x1p-14f) {
        em = (uint32_t)rintf(a * 65536.0f);
    } else {
        uint32_t u = kvq_bits(a);
        u += 0xfffffu + ((u >> 21) & 1u);
        em = (u >> 21) - (112u << 2);
    }
    return (uint8_t)(sign | em);
}

/* One cache row (head_dim values; int8: then its scale) -> n floats. */
static inline void kvq_load_row(const uint8_t *src, float *dst, int n, int cache_dtype) {
    if (cache_dtype == KV_INT8) {
        float scale;
        memcpy(&scale, src + n, sizeof scale);
        const int8_t *q = (const int8_t *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)q[i] * scale;
    } else if (cache_dtype == KV_FP8_E4M3) {
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = e4m3_to_float(src[i]);
    } else {
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = e5m2_to_float(src[i]);
    }
}

/* n floats -> one cache row. int8: round(x / scale), scale = absmax / 127 (0 for a row of
 * zeros, whose values are then 0). */
static inline void kvq_store_row(const float *src, uint8_t *dst, int n, int cache_dtype) {
    if (cache_dtype == KV_INT8) {
        float amax = 0.0f;
        for (int i = 0; i < n; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
        const float scale = amax / 127.0f;
        int8_t *q = (int8_t *)dst;
        for (int i = 0; i < n; i++) {
            float v = scale > 0.0f ? rintf(src[i] / scale) : 0.0f;
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            q[i] = (int8_t)v;
        }
        memcpy(dst + n, &scale, sizeof scale);
    } else if (cache_dtype == KV_FP8_E4M3) {
        for (int i = 0; i < n; i++) dst[i] = float_to_e4m3(src[i]);
    } else {
        for (int i = 0; i < n; i++) dst[i] = float_to_e5m2(src[i]);
    }
}

static inline int kvq_row_bytes(int head_dim, int cache_dtype) {
    return head_dim + (cache_dtype == KV_INT8 ? KV_INT8_SCALE_BYTES : 0);
}

#endif
