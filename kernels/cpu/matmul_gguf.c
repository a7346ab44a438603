/* Matmuls on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1) without a dequantized copy:
 * y = x W^T (+ bias), x fp32 or bf16, for `--quantization gguf`
 * (services/worker/models/gguf_weights.py).
 *
 * A GGUF block is 32 weights of one row with an fp16 scale d (and for Q4_1 an fp16 min m):
 * Q8_0 w = d q (q int8), Q4_0 w = d (q - 8), Q4_1 w = d q + m (q 0..15). At load each weight is
 * split once into three arrays with the same bytes per weight (see `gguf_weights.py`):
 *   qs [N, K] uint8 for Q8_0, stored as q + 128 (so that it is unsigned, what VNNI multiplies);
 *   qs [N, K / 2] for Q4, each block's 16 bytes as in the file (byte i: element i in the low
 *   nibble, element i + 16 in the high one); d [N, K / 32] fp16; m [N, K / 32] fp16 (Q4_1).
 * With every weight unsigned, w = d u + c with c = -128 d (Q8_0), -8 d (Q4_0) or m (Q4_1).
 *
 * As llama.cpp does, each row of x is quantized to 8-bit blocks of 32 (d_x = max|x| / 127,
 * q_x = round(x / d_x), ties to even), so that a block's dot product is integer:
 *   sum_i w_i x_i ~ d d_x sum_i u_i q_x,i + c d_x sum_i q_x,i.
 * The AVX-512 VNNI path multiplies u8 weights by s8 activations with `vpdpbusd` (four products
 * per 32-bit lane), 4 weight rows x up to 4 activation rows per tile, block scales applied in
 * fp32 per lane; the plain C path computes the same sums block by block. The two differ only in
 * the order of the fp32 additions.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define QK 32
enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q8_0 = 8 }; /* ggml's type ids */

static int gguf_simd = 1;

void set_gguf_simd(int on) { gguf_simd = on; }

int gguf_simd_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        v.f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24: zero or subnormal */
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
}

static inline float weight_offset(int qtype, const uint16_t *d, const uint16_t *m, int64_t b) {
    return qtype == GGUF_Q4_1 ? half_to_float(m[b])
                              : (qtype == GGUF_Q4_0 ? -8.0f : -128.0f) * half_to_float(d[b]);
}

/* One block of 32 activations -> q, d_x and sum(q); the same rounding on both paths. */
static inline void quantize_block(const float *x, int8_t *q, float *d_out, int32_t *sum_out) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < QK; i++) {
        float r = nearbyintf(x[i] * id);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[i] = (int8_t)r;
        sum += (int32_t)r;
    }
    *d_out = d;
    *sum_out = sum;
}

static inline void load_row(const void *x, int bf16, int64_t k, float *out) {
    if (bf16) {
        const uint16_t *p = x;
        for (int64_t i = 0; i < k; i++) out[i] = bf16_to_float(p[i]);
    } else {
        memcpy(out, x, (size_t)k * sizeof(float));
    }
}

static inline void store(void *out, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)out)[i] = float_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

static inline float bias_at(const void *bias, int bf16, int64_t i) {
    if (!bias) return 0.0f;
    return bf16 ? bf16_to_float(((const uint16_t *)bias)[i]) : ((const float *)bias)[i];
}

/* -- plain C ---------------------------------------------------------------------------------- */
static int matmul_portable(const void *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                           const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, int64_t n,
                           const void *bias, void *out, int64_t out_stride, int bf16) {
    const int64_t nb = k / QK;
    const size_t esize = bf16 ? 2 : 4;
    int8_t *xq = malloc((size_t)(rows * k));
    float *xd = malloc((size_t)(rows * nb) * sizeof(float));
    int32_t *xsum = malloc((size_t)(rows * nb) * sizeof(int32_t));
    float *row = malloc((size_t)k * sizeof(float));
    if (!xq || !xd || !xsum || !row) {
        free(xq); free(xd); free(xsum); free(row);
        return -2;
    }
    for (int64_t r = 0; r < rows; r++) {
        load_row((const char *)x + r * x_stride * esize, bf16, k, row);
        for (int64_t b = 0; b < nb; b++)
            quantize_block(row + b * QK, xq + r * k + b * QK, xd + r * nb + b, xsum + r * nb + b);
    }
    free(row);
    const int64_t qrow = qtype == GGUF_Q8_0 ? k : k / 2;
    #pragma omp parallel for schedule(static) if (rows * n * k > (1 << 18))
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *wq = qs + j * qrow;
        const uint16_t *d = wd + j * nb, *m = wm ? wm + j * nb : NULL;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *q = xq + r * k;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot = 0;
                if (qtype == GGUF_Q8_0) {
                    for (int i = 0; i < QK; i++) dot += (int32_t)wq[b * QK + i] * q[b * QK + i];
                } else {
                    for (int i = 0; i < QK / 2; i++) {
                        const uint8_t byte = wq[b * (QK / 2) + i];
                        dot += (int32_t)(byte & 0x0f) * q[b * QK + i]
                             + (int32_t)(byte >> 4) * q[b * QK + i + QK / 2];
                    }
                }
                const float dx = xd[r * nb + b];
                acc += half_to_float(d[b]) * (dx * (float)dot)
                     + weight_offset(qtype, d, m, b) * (dx * (float)xsum[r * nb + b]);
            }
            store(out, bf16, r * out_stride + j, acc + bias_at(bias, bf16, j));
        }
    }
    free(xq); free(xd); free(xsum);
    return 0;
}

/* -- AVX-512 VNNI ----------------------------------------------------------------------------- */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>

/* A group is what one 64-byte load of weights holds: 4 blocks of Q4 (128 weights), 2 of Q8_0.
 * Activations per row and group: the q bytes in the order the weight bytes pair with (Q4: the
 * first 16 values of each block, then the last 16 of each), and per 32-bit lane of the product
 * its block's d_x and c-term factor sum(q_x) d_x / lanes (so that a block's lanes add up to it;
 * the weight's c is applied by the caller's scale vectors). */
typedef struct {
    int8_t *q;   /* [rows, groups * 128] (Q4) or [rows, groups * 64] (Q8_0) */
    float *dx;   /* [rows, groups, 16] d_x per lane */
    float *sx;   /* [rows, groups, 16] d_x sum(q_x) / lanes per block */
    int64_t groups, q_row;
} act_q;

static int quantize_activations(const void *x, int64_t x_stride, int64_t rows, int64_t k,
                                int q4, int bf16, act_q *a) {
    const int64_t nb = k / QK, per_group = q4 ? 4 : 2, lanes = 16 / per_group;
    a->groups = (nb + per_group - 1) / per_group;
    a->q_row = a->groups * 64 * (q4 ? 2 : 1);
    a->q = aligned_alloc(64, (size_t)(rows * a->q_row));
    a->dx = aligned_alloc(64, (size_t)(rows * a->groups * 16) * sizeof(float));
    a->sx = aligned_alloc(64, (size_t)(rows * a->groups * 16) * sizeof(float));
    float *row = malloc((size_t)k * sizeof(float));
    if (!a->q || !a->dx || !a->sx || !row) {
        free(row);
        return -2;
    }
    memset(a->q, 0, (size_t)(rows * a->q_row));
    memset(a->dx, 0, (size_t)(rows * a->groups * 16) * sizeof(float));
    memset(a->sx, 0, (size_t)(rows * a->groups * 16) * sizeof(float));
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        load_row((const char *)x + r * x_stride * esize, bf16, k, row);
        for (int64_t b = 0; b < nb; b++) {
            const int64_t g = b / per_group, j = b % per_group;
            const int64_t in_group = nb - g * per_group < per_group ? nb - g * per_group : per_group;
            int8_t q[QK];
            float d;
            int32_t sum;
            quantize_block(row + b * QK, q, &d, &sum);
            int8_t *dst = a->q + r * a->q_row + g * (q4 ? 128 : 64);
            if (q4) {
                memcpy(dst + 16 * j, q, 16);
                memcpy(dst + 16 * in_group + 16 * j, q + 16, 16);
            } else {
                memcpy(dst + 32 * j, q, 32);
            }
            float *dx = a->dx + (r * a->groups + g) * 16, *sx = a->sx + (r * a->groups + g) * 16;
            for (int64_t l = 0; l < lanes; l++) {
                dx[j * lanes + l] = d;
                sx[j * lanes + l] = d * (float)sum / (float)lanes;
            }
        }
    }
    free(row);
    return 0;
}

/* Lane scales of one group of a weight row: d per lane (and the c term's factor per lane). */
static inline __m512 expand_halves(const uint16_t *h, int count, int q4) {
    const __m128i v = _mm_maskz_loadu_epi16((__mmask8)((1u << count) - 1), h);
    const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(v));
    const __m512i idx = q4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                           : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_maskz_permutexvar_ps(q4 ? (__mmask16)((1u << (4 * count)) - 1)
                                          : (__mmask16)((1u << (8 * count)) - 1), idx, f);
}

#define NT 4 /* weight rows per tile */

/* acc[NT][MT] over every group for weight rows w0.. (rows past n repeat the last one, their
 * sums discarded) and activation rows r0.. . MT is a constant at each call (always_inline). */
static inline __attribute__((always_inline)) void tile(
        const act_q *a, int64_t r0, const int MT, int qtype, const uint8_t *const wq[NT],
        const uint16_t *const wd[NT], const uint16_t *const wm[NT], int64_t nb, float *sums) {
    const int q4 = qtype != GGUF_Q8_0, per_group = q4 ? 4 : 2;
    const float c = qtype == GGUF_Q4_0 ? -8.0f : -128.0f;
    __m512 acc[NT][4];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < NT; t++)
        _Pragma("GCC unroll 4")
        for (int i = 0; i < MT; i++) acc[t][i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < a->groups; g++) {
        const int count = nb - g * per_group < per_group ? (int)(nb - g * per_group) : per_group;
        const int bytes = count * (q4 ? 16 : 32);
        const __mmask64 mask = bytes == 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
        __m512i xa[4], xb[4];
        _Pragma("GCC unroll 4")
        for (int i = 0; i < MT; i++) {
            const int8_t *q = a->q + (r0 + i) * a->q_row + g * (q4 ? 128 : 64);
            xa[i] = _mm512_maskz_loadu_epi8(mask, q);
            if (q4) xb[i] = _mm512_maskz_loadu_epi8(mask, q + bytes);
        }
        _Pragma("GCC unroll 4")
        for (int t = 0; t < NT; t++) {
            const __m512i v = _mm512_maskz_loadu_epi8(mask, wq[t] + g * 64);
            const __m512 d = expand_halves(wd[t] + g * per_group, count, q4);
            /* the c term's factor per lane: Q4_1's min, else c d */
            const __m512 off = qtype == GGUF_Q4_1
                ? expand_halves(wm[t] + g * per_group, count, q4)
                : _mm512_mul_ps(d, _mm512_set1_ps(c));
            if (q4) {
                const __m512i lo = _mm512_and_si512(v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                _Pragma("GCC unroll 4")
                for (int i = 0; i < MT; i++) {
                    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xa[i]);
                    s = _mm512_dpbusd_epi32(s, hi, xb[i]);
                    const int64_t at = ((r0 + i) * a->groups + g) * 16;
                    const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(s),
                                                   _mm512_load_ps(a->dx + at));
                    acc[t][i] = _mm512_fmadd_ps(p, d, acc[t][i]);
                    acc[t][i] = _mm512_fmadd_ps(off, _mm512_load_ps(a->sx + at), acc[t][i]);
                }
            } else {
                _Pragma("GCC unroll 4")
                for (int i = 0; i < MT; i++) {
                    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xa[i]);
                    const int64_t at = ((r0 + i) * a->groups + g) * 16;
                    const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(s),
                                                   _mm512_load_ps(a->dx + at));
                    acc[t][i] = _mm512_fmadd_ps(p, d, acc[t][i]);
                    acc[t][i] = _mm512_fmadd_ps(off, _mm512_load_ps(a->sx + at), acc[t][i]);
                }
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < NT; t++)
        _Pragma("GCC unroll 4")
        for (int i = 0; i < MT; i++) sums[t * 4 + i] = _mm512_reduce_add_ps(acc[t][i]);
}

static int matmul_vnni(const void *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                       const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, int64_t n,
                       const void *bias, void *out, int64_t out_stride, int bf16) {
    act_q a;
    const int q4 = qtype != GGUF_Q8_0;
    if (quantize_activations(x, x_stride, rows, k, q4, bf16, &a) != 0) {
        free(a.q); free(a.dx); free(a.sx);
        return -2;
    }
    const int64_t nb = k / QK, qrow = q4 ? k / 2 : k, tiles = (n + NT - 1) / NT;
    #pragma omp parallel for schedule(static) if (rows * n * k > (1 << 18))
    for (int64_t tn = 0; tn < tiles; tn++) {
        const uint8_t *wq[NT];
        const uint16_t *d[NT], *m[NT];
        for (int t = 0; t < NT; t++) {
            const int64_t j = tn * NT + t < n ? tn * NT + t : n - 1;
            wq[t] = qs + j * qrow;
            d[t] = wd + j * nb;
            m[t] = wm ? wm + j * nb : NULL;
        }
        float sums[NT * 4];
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t mt = rows - r0 < 4 ? rows - r0 : 4;
            switch (mt) {
                case 4: tile(&a, r0, 4, qtype, wq, d, m, nb, sums); break;
                case 3: tile(&a, r0, 3, qtype, wq, d, m, nb, sums); break;
                case 2: tile(&a, r0, 2, qtype, wq, d, m, nb, sums); break;
                default: tile(&a, r0, 1, qtype, wq, d, m, nb, sums); break;
            }
            for (int t = 0; t < NT && tn * NT + t < n; t++) {
                const int64_t j = tn * NT + t;
                const float b = bias_at(bias, bf16, j);
                for (int64_t i = 0; i < mt; i++)
                    store(out, bf16, (r0 + i) * out_stride + j, sums[t * 4 + i] + b);
            }
        }
    }
    free(a.q); free(a.dx); free(a.sx);
    return 0;
}
#endif

/* y [rows, n] (row stride out_stride) = x [rows, k] (row stride x_stride) W^T (+ bias [n]).
 * Returns -1 for a type it does not take or k not a multiple of 32, -2 out of memory. */
static int gguf_matmul(const void *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                       const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, int64_t n,
                       const void *bias, void *out, int64_t out_stride, int bf16) {
    if (k % QK || (qtype != GGUF_Q8_0 && qtype != GGUF_Q4_0 && qtype != GGUF_Q4_1)
        || (qtype == GGUF_Q4_1 && !wm))
        return -1;
    if (rows == 0 || n == 0) return 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
    if (gguf_simd)
        return matmul_vnni(x, x_stride, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, bf16);
#endif
    return matmul_portable(x, x_stride, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, bf16);
}

int gguf_matmul_f32(const float *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                    const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, int64_t n,
                    const float *bias, float *out, int64_t out_stride) {
    return gguf_matmul(x, x_stride, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, 0);
}

int gguf_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                     const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, int64_t n,
                     const uint16_t *bias, uint16_t *out, int64_t out_stride) {
    return gguf_matmul(x, x_stride, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, 1);
}

/* Rows `ids` [count] of W (all n rows when ids is NULL) dequantized into out [count, k], values
 * as gguf's own dequantize computes them (d q, d (q - 8), d q + m in fp32), then rounded to
 * bf16 for the bf16 variant. Returns -1 for a type it does not take or an id outside [0, n). */
static int gguf_dequantize(int qtype, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm,
                           int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out,
                           int bf16) {
    if (k % QK || (qtype != GGUF_Q8_0 && qtype != GGUF_Q4_0 && qtype != GGUF_Q4_1)
        || (qtype == GGUF_Q4_1 && !wm))
        return -1;
    if (ids)
        for (int64_t r = 0; r < count; r++)
            if (ids[r] < 0 || ids[r] >= n) return -1;
    const int64_t nb = k / QK, qrow = qtype == GGUF_Q8_0 ? k : k / 2;
    #pragma omp parallel for schedule(static) if (count * k > (1 << 18))
    for (int64_t r = 0; r < count; r++) {
        const int64_t j = ids ? ids[r] : r;
        const uint8_t *wq = qs + j * qrow;
        for (int64_t b = 0; b < nb; b++) {
            const float d = half_to_float(wd[j * nb + b]);
            float v[QK];
            if (qtype == GGUF_Q8_0) {
                for (int i = 0; i < QK; i++) v[i] = d * (float)((int)wq[b * QK + i] - 128);
            } else if (qtype == GGUF_Q4_0) {
                for (int i = 0; i < QK / 2; i++) {
                    const uint8_t byte = wq[b * (QK / 2) + i];
                    v[i] = d * (float)((int)(byte & 0x0f) - 8);
                    v[i + QK / 2] = d * (float)((int)(byte >> 4) - 8);
                }
            } else {
                const float m = half_to_float(wm[j * nb + b]);
                for (int i = 0; i < QK / 2; i++) {
                    const uint8_t byte = wq[b * (QK / 2) + i];
                    v[i] = d * (float)(byte & 0x0f) + m;
                    v[i + QK / 2] = d * (float)(byte >> 4) + m;
                }
            }
            for (int i = 0; i < QK; i++) store(out, bf16, r * k + b * QK + i, v[i]);
        }
    }
    return 0;
}

int gguf_dequantize_f32(int qtype, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm,
                        int64_t n, int64_t k, const int64_t *ids, int64_t count, float *out) {
    return gguf_dequantize(qtype, qs, wd, wm, n, k, ids, count, out, 0);
}

int gguf_dequantize_bf16(int qtype, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm,
                         int64_t n, int64_t k, const int64_t *ids, int64_t count, uint16_t *out) {
    return gguf_dequantize(qtype, qs, wd, wm, n, k, ids, count, out, 1);
}
