/* Conversions and math shared by the CPU kernels. */
#ifndef PAGODA_CPU_COMMON_H
#define PAGODA_CPU_COMMON_H

#include <math.h>
#include <stdint.h>

/* Element-wise loops go parallel only above this many elements (torch's own grain size): below
 * it, waking the other threads costs more than the work, and far more when they are descheduled. */
#define PARALLEL_GRAIN 32768

static inline float f32_id(float x) { return x; }

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(v.u >> 16);
}

/* exp written so that the compiler vectorises the loops that call it (libm's expf is a scalar
 * call): x = k ln2 + r, exp(r) by a degree-6 polynomial, 2^k from the exponent bits. Relative
 * error ~2e-7 over [-87, 88]; below that range 0, above it +inf (as expf, near enough), so that
 * exp(-inf) is exactly 0 (a softmax's first rescaling) rather than e^-87. */
static inline float exp_approx(float x) {
    const float in = x;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float k = rintf(x * 1.44269504088896341f);
    const float r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)k + 127) << 23;
    const float y = p * scale.f;
    return in < -87.0f ? 0.0f : (in > 88.0f ? INFINITY : y); /* NaN falls through as NaN */
}

#endif
