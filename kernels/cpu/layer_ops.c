/* Element-wise layer ops for the CPU, each one pass over memory where torch takes several:
 * RMSNorm (optionally fused with the residual add before it) and the rotary embedding applied
 * in place. (SiLU-and-multiply is left to torch: its two vectorised ops are as fast.) Float
 * arithmetic; for bf16 the results are rounded where the Hugging Face models round them (see
 * each function), so bf16 outputs match theirs closely. Rows are split over OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"

#define DEFINE_RMS_NORM(NAME, T, TO_F, FROM_F)                                                   \
/* out = x / rms(x) * weight; with `residual` non-NULL, first residual += x (rounded to T) and   \
 * the sum is normalised (vLLM's fused_add_rms_norm). x may alias out. */                       \
void NAME(const T *x, int64_t x_stride, T *residual, const T *weight, T *out, int64_t rows,    \
          int cols, float eps) {                                                                \
    _Pragma("omp parallel for schedule(static) if(rows * cols >= PARALLEL_GRAIN)")              \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const T *xr = x + r * x_stride;                                                         \
        T *res = residual ? residual + r * (int64_t)cols : 0;                                   \
        T *o = out + r * (int64_t)cols;                                                         \
        float sum = 0.0f;                                                                       \
        if (res) {                                                                              \
            _Pragma("omp simd reduction(+:sum)")                                                \
            for (int c = 0; c < cols; c++) {                                                    \
                const T v = FROM_F(TO_F(xr[c]) + TO_F(res[c]));                                 \
                res[c] = v;                                                                     \
                sum += TO_F(v) * TO_F(v);                                                       \
            }                                                                                   \
        } else {                                                                                \
            _Pragma("omp simd reduction(+:sum)")                                                \
            for (int c = 0; c < cols; c++) sum += TO_F(xr[c]) * TO_F(xr[c]);                    \
        }                                                                                       \
        const float inv = 1.0f / sqrtf(sum / cols + eps);                                       \
        const T *src = res ? res : xr;                                                          \
        /* As Hugging Face: normalise, round to the dtype, then scale by the weight. */         \
        _Pragma("omp simd")                                                                     \
        for (int c = 0; c < cols; c++)                                                          \
            o[c] = FROM_F(TO_F(FROM_F(TO_F(src[c]) * inv)) * TO_F(weight[c]));                  \
    }                                                                                           \
}

#define DEFINE_ROTARY(NAME, T, TO_F, FROM_F)                                                     \
/* In place on x [tokens, heads, head_dim] (rows `x_stride` apart, heads contiguous):           \
 * x = x * cos + rotate_half(x) * sin, with cos_sin [max_positions, 2, head_dim] holding         \
 * [cos, cos] and [-sin, sin] (the Hugging Face / GPT-NeoX halves layout). */                    \
int NAME(T *x, int64_t x_stride, const int64_t *positions, const T *cos_sin, int64_t tokens,    \
         int heads, int head_dim, int64_t max_positions) {                                      \
    for (int64_t t = 0; t < tokens; t++) /* the table is indexed unchecked below */              \
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;                       \
    const int half = head_dim / 2;                                                              \
    _Pragma("omp parallel for schedule(static) if(tokens * heads * head_dim >= PARALLEL_GRAIN)")\
    for (int64_t t = 0; t < tokens; t++) {                                                      \
        const T *cos = cos_sin + positions[t] * 2 * (int64_t)head_dim, *sin = cos + head_dim;   \
        for (int h = 0; h < heads; h++) {                                                       \
            T *v = x + t * x_stride + (int64_t)h * head_dim;                                    \
            _Pragma("omp simd")                                                                 \
            for (int i = 0; i < half; i++) {                                                    \
                const float a = TO_F(v[i]), b = TO_F(v[i + half]);                              \
                v[i] = FROM_F(TO_F(FROM_F(a * TO_F(cos[i]))) + TO_F(FROM_F(b * TO_F(sin[i]))));  \
                v[i + half] = FROM_F(TO_F(FROM_F(b * TO_F(cos[i + half])))                      \
                                     + TO_F(FROM_F(a * TO_F(sin[i + half]))));                  \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_RMS_NORM(rms_norm_f32, float, f32_id, f32_id)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_id, f32_id)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_float, float_to_bf16)
