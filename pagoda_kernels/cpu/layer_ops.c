/* Element-wise layer ops for the CPU, each one pass over memory where torch takes several:
 * RMSNorm (optionally fused with the residual add before it) and the rotary embedding applied
 * in place. (SiLU-and-multiply runs in the bf16 panel matmul's epilogue, else on torch: a separate C
 * loop was no faster than torch's two vectorised ops.) Float
 * arithmetic; for bf16 the results are rounded where the Hugging Face models round them (see
 * each function), so bf16 outputs match theirs closely. Rows are split over OpenMP threads.
 * For bf16 on CPUs with AVX-512 BF16 the same arithmetic runs on 16 lanes, rounding with the
 * conversion instruction (the portable loops round in integer code, which made a decode step's
 * norms and rotations cost 4-5x their memory traffic).
 */
#include <math.h>
#include <stdint.h>

#include "common.h"
#include "layer_kernels.h"

/* Whether every position indexes the rotary table (which the loops then index unchecked). */
static inline int positions_in_table(const int64_t *positions, int64_t tokens,
                                     int64_t max_positions) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return 0;
    return 1;
}

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
    if (!positions_in_table(positions, tokens, max_positions)) return -1;                      \
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
DEFINE_RMS_NORM(rms_norm_bf16_portable, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_ROTARY(rotary_f32, float, f32_id, f32_id)
DEFINE_ROTARY(rotary_bf16_portable, uint16_t, bf16_to_float, float_to_bf16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512.h"

/* rms_norm_bf16_portable on 16 lanes, for rows of a multiple of 16 values. */
static void rms_norm_bf16_simd(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                               const uint16_t *weight, uint16_t *out, int64_t rows, int cols,
                               float eps) {
    #pragma omp parallel for schedule(static) if(rows * cols >= PARALLEL_GRAIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = x + r * x_stride;
        uint16_t *o = out + r * (int64_t)cols;
        __m512 sum = _mm512_setzero_ps();
        if (residual) {
            uint16_t *res = residual + r * (int64_t)cols;
            for (int c = 0; c < cols; c += 16) {
                const __m256i v = pack16_bf16(_mm512_add_ps(load16_bf16(src + c),
                                                            load16_bf16(res + c)));
                _mm256_storeu_si256((__m256i *)(res + c), v);
                const __m512 f = widen16_bf16(v);
                sum = _mm512_fmadd_ps(f, f, sum);
            }
            src = res;
        } else {
            for (int c = 0; c < cols; c += 16) {
                const __m512 f = load16_bf16(src + c);
                sum = _mm512_fmadd_ps(f, f, sum);
            }
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / cols + eps));
        for (int c = 0; c < cols; c += 16) {
            const __m512 normed = round16_bf16(_mm512_mul_ps(load16_bf16(src + c), inv));
            store16_bf16_rne(o + c, _mm512_mul_ps(normed, load16_bf16(weight + c)));
        }
    }
}

/* rotary_bf16_portable on 16 lanes, for head_dim a multiple of 32; positions checked first. */
static void rotary_bf16_simd(uint16_t *x, int64_t x_stride, const int64_t *positions,
                             const uint16_t *cos_sin, int64_t tokens, int heads, int head_dim) {
    const int half = head_dim / 2;
    #pragma omp parallel for schedule(static) if(tokens * heads * head_dim >= PARALLEL_GRAIN)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *cos = cos_sin + positions[t] * 2 * (int64_t)head_dim;
        const uint16_t *sin = cos + head_dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + t * x_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i += 16) {
                const __m512 a = load16_bf16(v + i), b = load16_bf16(v + i + half);
                const __m512 lo = _mm512_add_ps(
                    round16_bf16(_mm512_mul_ps(a, load16_bf16(cos + i))),
                    round16_bf16(_mm512_mul_ps(b, load16_bf16(sin + i))));
                const __m512 hi = _mm512_add_ps(
                    round16_bf16(_mm512_mul_ps(b, load16_bf16(cos + i + half))),
                    round16_bf16(_mm512_mul_ps(a, load16_bf16(sin + i + half))));
                store16_bf16_rne(v + i, lo);
                store16_bf16_rne(v + i + half, hi);
            }
        }
    }
}
#define LAYER_OPS_SIMD 1
#else
#define LAYER_OPS_SIMD 0
#endif

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                   const uint16_t *weight, uint16_t *out, int64_t rows, int cols, float eps) {
#if LAYER_OPS_SIMD
    if (cols % 16 == 0) {
        rms_norm_bf16_simd(x, x_stride, residual, weight, out, rows, cols, eps);
        return;
    }
#endif
    rms_norm_bf16_portable(x, x_stride, residual, weight, out, rows, cols, eps);
}

int rotary_bf16(uint16_t *x, int64_t x_stride, const int64_t *positions, const uint16_t *cos_sin,
                int64_t tokens, int heads, int head_dim, int64_t max_positions) {
#if LAYER_OPS_SIMD
    if (head_dim % 32 == 0) {
        if (!positions_in_table(positions, tokens, max_positions)) return -1;
        rotary_bf16_simd(x, x_stride, positions, cos_sin, tokens, heads, head_dim);
        return 0;
    }
#endif
    return rotary_bf16_portable(x, x_stride, positions, cos_sin, tokens, heads, head_dim,
                                max_positions);
}
