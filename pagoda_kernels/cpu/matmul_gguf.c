/* Matmuls on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K) without a dequantized copy:
 * y = x W^T (+ bias), x fp32 or bf16, for `--quantization gguf`
 * (services/worker/models/gguf_weights.py).
 *
 * A GGUF block is 32 weights of one row with an fp16 scale d (and for Q4_1 an fp16 min m):
 * Q8_0 w = d q (q int8), Q4_0 w = d (q - 8), Q4_1 w = d q + m (q 0..15). At load the rows are
 * regrouped into panels of 16 (the last one padded with zero rows), with the file's bytes per
 * weight, so that one 64-byte load holds four consecutive weights of each of 16 rows: the 32-bit
 * lanes of a vector are the panel's rows, and a panel's 16 outputs come out of one vector with
 * no horizontal sums. Per panel and block:
 *   qs: Q8_0 [8 quads][16 rows][4 bytes] of q + 128 (unsigned, what VNNI multiplies), 512 bytes;
 *       Q4   [4 quads][16 rows][4 bytes], 256 bytes: byte i of quad j holds element 4j + i in
 *       its low nibble and element 16 + 4j + i in its high one (the file's own byte order,
 *       4 bytes at a time);
 *   d, m: [16 rows] fp16 (m for Q4_1 only); Q4_K's blocks of 32 as Q4_1's, d and m in fp32.
 * With every weight unsigned, w = d u + c with c = -128 d (Q8_0), -8 d (Q4_0) or m (Q4_1).
 *
 * As llama.cpp does, each row of x is quantized to 8-bit blocks of 32 (d_x = max|x| / 127,
 * q_x = round(x / d_x), ties to even), so that a block's dot product is integer:
 *   sum_i w_i x_i ~ d d_x sum_i u_i q_x,i + c d_x sum_i q_x,i.
 * The AVX-512 VNNI path multiplies a panel's u8 weights by one row's s8 activations, broadcast
 * four at a time, with `vpdpbusd`; up to 4 rows of x share each load of the weights, and a panel
 * stays in cache while further rows of x pass over it. The plain C path computes the same
 * integers and the same fused multiply-adds in the same order, so the two agree to the bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "layer_kernels.h"

#define QK 32
#define PANEL 16
enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q8_0 = 8, GGUF_Q4_K = 12 }; /* ggml's type ids */

/* Q4_K's super-blocks (256 weights, 6-bit scale and min per 32) arrive as blocks of 32 like
 * Q4_1's, with the block's scale d * sc and offset -dmin * m as fp32 (exact: an fp16 times a
 * 6-bit integer) where Q4_1 has fp16. */
static inline int has_min(int qtype) { return qtype == GGUF_Q4_1 || qtype == GGUF_Q4_K; }

static inline int known_type(int qtype) {
    return qtype == GGUF_Q8_0 || qtype == GGUF_Q4_0 || qtype == GGUF_Q4_1 || qtype == GGUF_Q4_K;
}

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

/* Scale (or min) i of a weight's scale array: fp16, or fp32 for Q4_K. */
static inline float scale_at(int qtype, const void *s, int64_t i) {
    return qtype == GGUF_Q4_K ? ((const float *)s)[i] : half_to_float(((const uint16_t *)s)[i]);
}

static inline int64_t panel_block_bytes(int qtype) { return qtype == GGUF_Q8_0 ? 512 : 256; }

/* Weight element (row lane l of a panel, element e of a block) from the block's quant bytes. */
static inline int weight_quant(int qtype, const uint8_t *q, int l, int e) {
    if (qtype == GGUF_Q8_0) return q[(e / 4) * 64 + l * 4 + e % 4];
    const int hi = e >= 16, i = e % 16;
    const uint8_t byte = q[(i / 4) * 64 + l * 4 + i % 4];
    return hi ? byte >> 4 : byte & 0x0f;
}

/* -- activations ------------------------------------------------------------------------------ */

/* Rows of x as 8-bit blocks: q [rows, k], and per block d_x and the c term's factor
 * (Q8_0: -128 d_x sum(q_x); Q4_0: -8 d_x sum(q_x); Q4_1: d_x sum(q_x), m being per lane). */
typedef struct {
    int8_t *q;
    float *dx, *cx; /* [rows, nb] */
} act_q;

static inline float c_factor(int qtype) {
    return qtype == GGUF_Q8_0 ? -128.0f : (qtype == GGUF_Q4_0 ? -8.0f : 1.0f); /* min: 1 */
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

static inline void load_block(const void *x, int bf16, int64_t at, float *out) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)x + at;
        for (int i = 0; i < QK; i++) out[i] = bf16_to_float(p[i]);
    } else {
        memcpy(out, (const float *)x + at, QK * sizeof(float));
    }
}

static void free_act(act_q *a) {
    free(a->q);
    free(a->dx);
    free(a->cx);
}

/* -2 when out of memory. x rows `x_stride` elements apart. */
static int quantize_activations(const void *x, int64_t x_stride, int64_t rows, int64_t k,
                                int qtype, int bf16, act_q *a) {
    const int64_t nb = k / QK;
    a->q = aligned_alloc(64, (size_t)((rows * k + 63) / 64 * 64));
    a->dx = malloc((size_t)(rows * nb) * sizeof(float));
    a->cx = malloc((size_t)(rows * nb) * sizeof(float));
    if (!a->q || !a->dx || !a->cx) {
        free_act(a);
        return -2;
    }
    const float c = c_factor(qtype);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            float v[QK];
            int32_t sum;
            float d;
            load_block(x, bf16, r * x_stride + b * QK, v);
            quantize_block(v, a->q + r * k + b * QK, &d, &sum);
            a->dx[r * nb + b] = d;
            a->cx[r * nb + b] = c * d * (float)sum;
        }
    return 0;
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
static void matmul_portable(const act_q *a, int64_t rows, int64_t k, int qtype, const uint8_t *qs,
                            const void *wd, const void *wm, int64_t n, const void *bias,
                            void *out, int64_t out_stride, int bf16) {
    const int64_t nb = k / QK, panels = (n + PANEL - 1) / PANEL, bb = panel_block_bytes(qtype);
    #pragma omp parallel for schedule(static) if (rows * n * k > (1 << 18))
    for (int64_t p = 0; p < panels; p++) {
        for (int l = 0; l < PANEL && p * PANEL + l < n; l++) {
            const int64_t j = p * PANEL + l;
            for (int64_t r = 0; r < rows; r++) {
                const int8_t *xq = a->q + r * k;
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *q = qs + (p * nb + b) * bb;
                    int32_t dot = 0;
                    for (int e = 0; e < QK; e++) dot += weight_quant(qtype, q, l, e) * xq[b * QK + e];
                    const float dw = scale_at(qtype, wd, (p * nb + b) * PANEL + l);
                    const float dx = a->dx[r * nb + b], cx = a->cx[r * nb + b];
                    if (has_min(qtype)) {
                        acc = fmaf((float)dot * dx, dw, acc);
                        acc = fmaf(scale_at(qtype, wm, (p * nb + b) * PANEL + l), cx, acc);
                    } else {
                        acc = fmaf(fmaf((float)dot, dx, cx), dw, acc);
                    }
                }
                store(out, bf16, r * out_stride + j, acc + bias_at(bias, bf16, j));
            }
        }
    }
}

/* -- AVX-512 VNNI ----------------------------------------------------------------------------- */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* 16 scales of a panel's block: fp16, or fp32 for Q4_K. */
static inline __m512 load_scales(int qtype, const void *s, int64_t at) {
    if (qtype == GGUF_Q4_K) return _mm512_loadu_ps((const float *)s + at);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + at)));
}

/* acc[i] (16 rows of panel `p`) += the panel's products with rows r0 .. r0 + MT - 1 of x, over
 * every block. MT is a constant at each call (always_inline). */
static inline __attribute__((always_inline)) void panel_rows(
        const act_q *a, int64_t k, int64_t r0, const int MT, int qtype, const uint8_t *wq,
        const void *wd, const void *wm, int64_t nb, __m512 acc[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    _Pragma("GCC unroll 4")
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = wq + b * panel_block_bytes(qtype);
        const __m512 dw = load_scales(qtype, wd, b * PANEL);
        __m512i w[8];
        if (qtype == GGUF_Q8_0) {
            _Pragma("GCC unroll 8")
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(q + 64 * j));
        } else {
            _Pragma("GCC unroll 4")
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * j));
                w[j] = _mm512_and_si512(v, low4);                        /* elements 4j.. */
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4); /* 16 + 4j.. */
            }
        }
        _Pragma("GCC unroll 4")
        for (int i = 0; i < MT; i++) {
            const int8_t *x = a->q + (r0 + i) * k + b * QK;
            /* Two chains of products, for the instruction's latency. */
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(x));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], bcast4(x + 4));
            s0 = _mm512_dpbusd_epi32(s0, w[2], bcast4(x + 8));
            s1 = _mm512_dpbusd_epi32(s1, w[3], bcast4(x + 12));
            s0 = _mm512_dpbusd_epi32(s0, w[4], bcast4(x + 16));
            s1 = _mm512_dpbusd_epi32(s1, w[5], bcast4(x + 20));
            s0 = _mm512_dpbusd_epi32(s0, w[6], bcast4(x + 24));
            s1 = _mm512_dpbusd_epi32(s1, w[7], bcast4(x + 28));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            const int64_t at = (r0 + i) * nb + b;
            const __m512 dx = _mm512_set1_ps(a->dx[at]), cx = _mm512_set1_ps(a->cx[at]);
            if (has_min(qtype)) {
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dx), dw, acc[i]);
                acc[i] = _mm512_fmadd_ps(load_scales(qtype, wm, b * PANEL), cx, acc[i]);
            } else {
                acc[i] = _mm512_fmadd_ps(_mm512_fmadd_ps(dot, dx, cx), dw, acc[i]);
            }
        }
    }
}

static inline void store_lanes(void *out, int bf16, int64_t at, __m512 v, __mmask16 mask) {
    if (bf16) {
        /* round to nearest even in integer arithmetic (NaN kept quiet), as float_to_bf16 */
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(
            _mm512_set1_epi32(0x7fff), lsb)), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, _mm512_cvtepi32_epi16(r));
    } else {
        _mm512_mask_storeu_ps((float *)out + at, mask, v);
    }
}

static void matmul_vnni(const act_q *a, int64_t rows, int64_t k, int qtype, const uint8_t *qs,
                        const void *wd, const void *wm, int64_t n, const void *bias,
                        void *out, int64_t out_stride, int bf16) {
    const int64_t nb = k / QK, panels = (n + PANEL - 1) / PANEL, bb = panel_block_bytes(qtype);
    const size_t ss = qtype == GGUF_Q4_K ? 4 : 2; /* bytes of a scale */
    #pragma omp parallel for schedule(static) if (rows * n * k > (1 << 18))
    for (int64_t p = 0; p < panels; p++) {
        const int64_t j0 = p * PANEL;
        const int live = n - j0 < PANEL ? (int)(n - j0) : PANEL;
        const __mmask16 mask = (__mmask16)((1u << live) - 1u);
        __m512 b16 = _mm512_setzero_ps();
        if (bias)
            b16 = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                             _mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + j0)), 16))
                       : _mm512_maskz_loadu_ps(mask, (const float *)bias + j0);
        const uint8_t *wq = qs + p * nb * bb;
        const char *d = (const char *)wd + p * nb * PANEL * ss;
        const char *m = wm ? (const char *)wm + p * nb * PANEL * ss : NULL;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            __m512 acc[4];
            const int64_t mt = rows - r0 < 4 ? rows - r0 : 4;
            switch (mt) {
                case 4: panel_rows(a, k, r0, 4, qtype, wq, d, m, nb, acc); break;
                case 3: panel_rows(a, k, r0, 3, qtype, wq, d, m, nb, acc); break;
                case 2: panel_rows(a, k, r0, 2, qtype, wq, d, m, nb, acc); break;
                default: panel_rows(a, k, r0, 1, qtype, wq, d, m, nb, acc); break;
            }
            for (int64_t i = 0; i < mt; i++)
                store_lanes(out, bf16, (r0 + i) * out_stride + j0, _mm512_add_ps(acc[i], b16),
                            mask);
        }
    }
}
#endif

/* y [rows, n] (row stride out_stride) = x [rows, k] (row stride x_stride) W^T (+ bias [n]), W in
 * the panel layout above. Returns -1 for a type it does not take or k not a multiple of 32, -2
 * out of memory. (Also called by blocks.c, through layer_kernels.h.) */
int gguf_matmul_rows(const void *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                     const uint8_t *qs, const void *wd, const void *wm, int64_t n,
                     const void *bias, void *out, int64_t out_stride, int bf16) {
    if (k % QK || !known_type(qtype) || (has_min(qtype) && !wm)) return -1;
    if (rows == 0 || n == 0) return 0;
    act_q a;
    if (quantize_activations(x, x_stride, rows, k, qtype, bf16, &a) != 0) return -2;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
    if (gguf_simd) {
        matmul_vnni(&a, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, bf16);
        free_act(&a);
        return 0;
    }
#endif
    matmul_portable(&a, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, bf16);
    free_act(&a);
    return 0;
}

int gguf_matmul_f32(const float *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                    const uint8_t *qs, const void *wd, const void *wm, int64_t n,
                    const float *bias, float *out, int64_t out_stride) {
    return gguf_matmul_rows(x, x_stride, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, 0);
}

int gguf_matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, int qtype,
                     const uint8_t *qs, const void *wd, const void *wm, int64_t n,
                     const uint16_t *bias, uint16_t *out, int64_t out_stride) {
    return gguf_matmul_rows(x, x_stride, rows, k, qtype, qs, wd, wm, n, bias, out, out_stride, 1);
}

/* Rows `ids` [count] of W (all n rows when ids is NULL) dequantized into out [count, k], values
 * as gguf's own dequantize computes them (d q, d (q - 8), d q + m in fp32), then rounded to
 * bf16 for the bf16 variant. Returns -1 for a type it does not take or an id outside [0, n). */
static int gguf_dequantize(int qtype, const uint8_t *qs, const void *wd, const void *wm,
                           int64_t n, int64_t k, const int64_t *ids, int64_t count, void *out,
                           int bf16) {
    if (k % QK || !known_type(qtype) || (has_min(qtype) && !wm)) return -1;
    if (ids)
        for (int64_t r = 0; r < count; r++)
            if (ids[r] < 0 || ids[r] >= n) return -1;
    const int64_t nb = k / QK, bb = panel_block_bytes(qtype);
    #pragma omp parallel for schedule(static) if (count * k > (1 << 18))
    for (int64_t r = 0; r < count; r++) {
        const int64_t j = ids ? ids[r] : r, p = j / PANEL;
        const int l = (int)(j % PANEL);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = qs + (p * nb + b) * bb;
            const float d = scale_at(qtype, wd, (p * nb + b) * PANEL + l);
            const float m = has_min(qtype) ? scale_at(qtype, wm, (p * nb + b) * PANEL + l) : 0.0f;
            for (int e = 0; e < QK; e++) {
                const int u = weight_quant(qtype, q, l, e);
                const float v = qtype == GGUF_Q8_0 ? d * (float)(u - 128)
                              : (qtype == GGUF_Q4_0 ? d * (float)(u - 8) : d * (float)u + m);
                store(out, bf16, r * k + b * QK + e, v);
            }
        }
    }
    return 0;
}

int gguf_dequantize_f32(int qtype, const uint8_t *qs, const void *wd, const void *wm,
                        int64_t n, int64_t k, const int64_t *ids, int64_t count, float *out) {
    return gguf_dequantize(qtype, qs, wd, wm, n, k, ids, count, out, 0);
}

int gguf_dequantize_bf16(int qtype, const uint8_t *qs, const void *wd, const void *wm,
                         int64_t n, int64_t k, const int64_t *ids, int64_t count, uint16_t *out) {
    return gguf_dequantize(qtype, qs, wd, wm, n, k, ids, count, out, 1);
}
