/* int8 matmuls for `--quantization int8` (weight-only) and `--quantization w8a8`:
 * y = x (q * s)^T (+ bias), optionally followed by SiLU(gate) * up, with q int8 [N, K] and one
 * fp32 scale per output channel; x and y bf16 or fp32.
 *
 * w8a8: each row of x is quantized to int8 with its own scale (max|x| / 127, symmetric), the
 * products are summed in int32, and y = acc * x_scale * w_scale. Few rows (decode) run on
 * AVX-512 VNNI, which multiplies unsigned by signed bytes: x + 128 goes in, and the
 * 128 * sum(q) that adds (per channel, computed at packing) comes off. 16 rows and more run on
 * AMX-INT8 tiles (signed by signed).
 * int8 (weight-only): x keeps its precision. bf16 x with 16 rows and more: each panel is widened
 * once into bf16 tiles (exact: int8 values are bf16 values) that stay in L2 while the rows pass
 * them on AMX; the scale is applied to the fp32 sums. Otherwise, with VNNI: x in 24-bit fixed
 * point per row, three byte planes through VNNI (see vnni_weight_only); without: the weights
 * widened to fp32 and multiplied with FMA (AVX-512).
 * Everywhere else (no AVX-512 for weight-only, no VNNI for w8a8, or K past a path's limit:
 * FIXED_MAX_K, W8A8_MAX_K) a plain C loop over the same layout.
 *
 * Layout (packed in Python, pagoda_kernels/cpu/int8.py): K is zero-padded to a multiple of 64 and
 * N to whole panels of 32 output columns. A panel is K/64 steps of two 1 KiB tiles; tile row r
 * holds, for each of the tile's 16 columns, the 4 weights k = 64 s + 4 r .. + 3. That is the
 * AMX-INT8 B tile, and one tile row is one VNNI register, so every path streams a panel in
 * memory order. With gate_up the weight is [gate; up] (N even) and panel p holds gate columns
 * 16p.. in its first tile and the matching up columns in its second.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "layer_kernels.h"

#define PANEL 32          /* output columns per panel: two 16-column tiles */
#define KSTEP 64          /* K values per step */
#define TILE_BYTES 1024   /* 16 rows of 64 bytes */
#define STEP_BYTES 2048   /* the two tiles of a step */
#define ROW_BLOCK 32      /* rows per AMX pass over a panel: two 16-row A tiles */
#define ROW_CHUNK 256     /* rows whose activations stay in L2 while every panel passes */
#define PREFETCH_STEPS 4  /* steps (2 KiB each) ahead */
#define AMX_MIN_ROWS 16   /* fewer rows than one A tile: the vector paths are faster */
#define FIXED_MAX_K 32768 /* weight-only VNNI: int32 sums of 255 * 127 * K stay in range */
/* w8a8 on VNNI and AMX: the int32 sum x q (|x|, |q| <= 127) stays in range, 127 * 127 * K < 2^31.
 * (VNNI's sum of (x + 128) q can wrap past 66k, but vpdpbusd and the subtraction of
 * 128 * sum(q) are both modulo 2^32, so the wrap cancels.) Longer rows run the portable loop,
 * which sums in int64. */
#define W8A8_MAX_K 131072

enum { PATH_AUTO = 0, PATH_PORTABLE = 1, PATH_AVX512 = 2, PATH_VNNI = 3, PATH_AMX = 4 };

typedef struct {
    int64_t n, k, kp, steps, panels, half; /* half: columns of gate (and of up) with gate_up */
    int gate_up, bf16;                     /* bf16: x, bias and y are bf16, else fp32 */
} shape_t;

static int make_shape(int64_t n, int64_t k, int gate_up, int bf16, shape_t *s) {
    if (n <= 0 || k <= 0 || (gate_up && n % 2)) return -1;
    s->n = n, s->k = k, s->gate_up = gate_up, s->bf16 = bf16;
    s->kp = (k + KSTEP - 1) / KSTEP * KSTEP;
    s->steps = s->kp / KSTEP;
    s->half = gate_up ? n / 2 : 0;
    s->panels = gate_up ? (s->half + 15) / 16 : (n + PANEL - 1) / PANEL;
    return 0;
}

/* The first weight row (output channel) of panel p's tile t, and how many of its 16 are real. */
static inline int64_t first_col(const shape_t *s, int64_t p, int t) {
    return s->gate_up ? t * s->half + p * 16 : p * PANEL + t * 16;
}

static inline int real_cols(const shape_t *s, int64_t p, int t) {
    const int64_t left = s->gate_up ? s->half - p * 16 : s->n - (p * PANEL + t * 16);
    return left >= 16 ? 16 : (left > 0 ? (int)left : 0);
}

static inline float load_value(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_value(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

/* One row of panel p: v[32] are its products, scaled (tile 0, then tile 1). */
static void finish_row_scalar(const float *v, const shape_t *s, int64_t p, const void *bias,
                              void *y_row) {
    const int bf16 = s->bf16;
    if (!s->gate_up) {
        for (int t = 0; t < 2; t++)
            for (int c = 0; c < real_cols(s, p, t); c++) {
                const int64_t col = first_col(s, p, t) + c;
                store_value(y_row, col, v[t * 16 + c] + (bias ? load_value(bias, col, bf16) : 0),
                            bf16);
            }
        return;
    }
    /* bf16 rounds gate, up and SiLU as the bf16 model (and matmul_bf16.c) does. */
    for (int c = 0; c < real_cols(s, p, 0); c++) {
        float gate = v[c] + (bias ? load_value(bias, first_col(s, p, 0) + c, bf16) : 0);
        float up = v[16 + c] + (bias ? load_value(bias, first_col(s, p, 1) + c, bf16) : 0);
        if (bf16) gate = round_bf16(gate), up = round_bf16(up);
        float silu = gate / (1.0f + exp_approx(-gate));
        if (bf16) silu = round_bf16(silu);
        store_value(y_row, p * 16 + c, silu * up, bf16);
    }
}

/* -- activations ----------------------------------------------------------------------------- */

/* Row i of x -> int8 [kp] (zero-padded) and its scale max|x| / 127 (1 for a zero row). */
static void quantize_row(const void *x, int64_t k, int64_t kp, int bf16, int8_t *q, float *scale) {
    float amax = 0.0f;
    #pragma omp simd reduction(max:amax)
    for (int64_t j = 0; j < k; j++) {
        const float a = fabsf(load_value(x, j, bf16));
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    const float inv = 1.0f / s;
    #pragma omp simd
    for (int64_t j = 0; j < k; j++) {
        float v = rintf(load_value(x, j, bf16) * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[j] = (int8_t)v;
    }
    memset(q + k, 0, (size_t)(kp - k));
    *scale = s;
}

/* x rows -> fp32 [m, kp], zero-padded. */
static void widen_rows(const void *x, int64_t x_stride, int64_t m, const shape_t *s, float *out) {
    const size_t esize = s->bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if(m * s->k >= PARALLEL_GRAIN)
    for (int64_t i = 0; i < m; i++) {
        const char *row = (const char *)x + i * x_stride * esize;
        float *o = out + i * s->kp;
        for (int64_t j = 0; j < s->k; j++) o[j] = load_value(row, j, s->bf16);
        for (int64_t j = s->k; j < s->kp; j++) o[j] = 0.0f;
    }
}

/* -- plain C ---------------------------------------------------------------------------------- */

/* Panel by panel, row by row: acc = x q summed in `acc_t`, out = acc * row scale * ws. w8a8
 * sums in int64, exact for any K (the fallback past W8A8_MAX_K); weight-only in fp32. */
#define PORTABLE_MATMUL(name, x_t, acc_t, ROW_SCALE)                                             \
static void name(const x_t *xs_rows, const float *xs, int64_t m, const int8_t *packed,           \
                 const float *ws, const void *bias, const shape_t *s, void *y, int64_t y_cols) { \
    const size_t esize = s->bf16 ? 2 : 4;                                                        \
    (void)xs;                                                                                    \
    _Pragma("omp parallel for schedule(static)")                                                 \
    for (int64_t p = 0; p < s->panels; p++) {                                                    \
        const int8_t *panel = packed + p * s->steps * STEP_BYTES;                                \
        for (int64_t i = 0; i < m; i++) {                                                        \
            acc_t acc[PANEL] = {0};                                                              \
            const x_t *xr = xs_rows + i * s->kp;                                                 \
            for (int64_t st = 0; st < s->steps; st++)                                            \
                for (int t = 0; t < 2; t++)                                                      \
                    for (int r = 0; r < 16; r++) {                                               \
                        const int8_t *w = panel + st * STEP_BYTES + t * TILE_BYTES + r * 64;     \
                        const x_t *xk = xr + st * KSTEP + 4 * r;                                 \
                        for (int c = 0; c < 16; c++)                                             \
                            for (int j = 0; j < 4; j++)                                          \
                                acc[t * 16 + c] += (acc_t)w[c * 4 + j] * xk[j];                  \
                    }                                                                            \
            float v[PANEL];                                                                      \
            for (int t = 0; t < 2; t++)                                                          \
                for (int c = 0; c < 16; c++)                                                     \
                    v[t * 16 + c] = c < real_cols(s, p, t)                                       \
                        ? (float)acc[t * 16 + c] * (ROW_SCALE) * ws[first_col(s, p, t) + c]      \
                        : 0.0f;                                                                  \
            finish_row_scalar(v, s, p, bias, (char *)y + i * y_cols * esize);                    \
        }                                                                                        \
    }                                                                                            \
}

PORTABLE_MATMUL(portable_w8a8, int8_t, int64_t, xs[i])
PORTABLE_MATMUL(portable_weight_only, float, float, 1.0f)
#undef PORTABLE_MATMUL

/* -- AVX-512 ---------------------------------------------------------------------------------- */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#include <immintrin.h>
#include <omp.h>

#include "avx512.h"

#define FMA_ROWS 8     /* rows per pass of the weight-only FMA loop: 16 accumulators */
#define STREAM_ROWS 3  /* up to this many rows, weight-only reads the int8 panel directly */
#define VNNI_ROWS 8  /* rows per pass of the VNNI loop */

static inline __mmask16 first_lanes(int count) { return (__mmask16)((1u << count) - 1u); }

static inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    return pack16_bf16(v);
#else  /* round to nearest even by hand (NaN aside, which no layer makes) */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

static inline __m512 load_lanes(const void *p, int64_t i, __mmask16 mask, int bf16) {
    if (bf16) return widen16_bf16(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i));
    return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
}

static inline void store_lanes(void *p, int64_t i, __mmask16 mask, __m512 v, int bf16) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, mask, to_bf16(v));
    else _mm512_mask_storeu_ps((float *)p + i, mask, v);
}

static inline __m512 bf16_round16(__m512 v) { return widen16_bf16(to_bf16(v)); }

/* finish_row_scalar on 16 + 16 lanes. */
static inline void finish_row(__m512 v0, __m512 v1, const shape_t *s, int64_t p,
                              const void *bias, void *y_row) {
    const int bf16 = s->bf16;
    const __mmask16 m0 = first_lanes(real_cols(s, p, 0)), m1 = first_lanes(real_cols(s, p, 1));
    const int64_t c0 = first_col(s, p, 0), c1 = first_col(s, p, 1);
    if (bias) {
        v0 = _mm512_add_ps(v0, load_lanes(bias, c0, m0, bf16));
        v1 = _mm512_add_ps(v1, load_lanes(bias, c1, m1, bf16));
    }
    if (!s->gate_up) {
        store_lanes(y_row, c0, m0, v0, bf16);
        store_lanes(y_row, c1, m1, v1, bf16);
        return;
    }
    if (bf16) v0 = bf16_round16(v0), v1 = bf16_round16(v1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v0));
    __m512 silu = _mm512_div_ps(v0, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    if (bf16) silu = bf16_round16(silu);
    store_lanes(y_row, p * 16, m0, _mm512_mul_ps(silu, v1), bf16);
}

/* Panel p's channel scales for its two tiles. */
static inline void panel_scales(const float *ws, const shape_t *s, int64_t p, __m512 *s0,
                                __m512 *s1) {
    *s0 = _mm512_maskz_loadu_ps(first_lanes(real_cols(s, p, 0)), ws + first_col(s, p, 0));
    *s1 = _mm512_maskz_loadu_ps(first_lanes(real_cols(s, p, 1)), ws + first_col(s, p, 1));
}

static inline void prefetch_step(const int8_t *b, int r) {
    _mm_prefetch((const char *)(b + PREFETCH_STEPS * STEP_BYTES + r * 64), _MM_HINT_T0);
    _mm_prefetch((const char *)(b + PREFETCH_STEPS * STEP_BYTES + TILE_BYTES + r * 64),
                 _MM_HINT_T0);
}

#define HAVE_WEIGHT_ONLY_AVX512 1

/* Weight-only: panel p widened to fp32, k-major: out[k][32] (tile 0's columns, then tile 1's).
 * An int8 tile row is 16 columns x 4 k (byte 4c + j: column c, k j); it becomes 4 k x 16
 * columns (byte 16j + c) in two steps that need only AVX-512 BW, not VBMI's byte permutation:
 * a byte shuffle in each 128-bit lane (columns 4L.. : byte 4j + c <- 4c + j), then a dword
 * permutation (dword 4j + L <- 4L + j). */
static void widen_panel_f32(const int8_t *panel, int64_t steps, float *out) {
    uint8_t in_lane[64];
    int32_t lanes[16];
    for (int L = 0; L < 4; L++)
        for (int j = 0; j < 4; j++) {
            for (int c = 0; c < 4; c++) in_lane[16 * L + 4 * j + c] = (uint8_t)(4 * c + j);
            lanes[4 * j + L] = 4 * L + j;
        }
    const __m512i shuffle = _mm512_loadu_si512(in_lane), perm = _mm512_loadu_si512(lanes);
    for (int64_t st = 0; st < steps; st++)
        for (int t = 0; t < 2; t++)
            for (int r = 0; r < 16; r++) {
                const int8_t *src = panel + st * STEP_BYTES + t * TILE_BYTES + r * 64;
                _mm_prefetch((const char *)(src + PREFETCH_STEPS * STEP_BYTES), _MM_HINT_T0);
                const __m512i w = _mm512_permutexvar_epi32(
                    perm, _mm512_shuffle_epi8(_mm512_loadu_si512(src), shuffle));
                float *dst = out + (st * KSTEP + 4 * r) * PANEL + t * 16;
                _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 0))));
                _mm512_storeu_ps(dst + PANEL, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 1))));
                _mm512_storeu_ps(dst + 2 * PANEL, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 2))));
                _mm512_storeu_ps(dst + 3 * PANEL, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 3))));
            }
}

/* Weight-only: rows [rows) of xf (fp32, kp apart) against a widened panel wf [kp][32]. */
static inline __attribute__((always_inline)) void fma_rows(
        const shape_t *s, int64_t p, const float *wf, const float *xf, const int rows,
        const float *ws, const void *bias, void *y, int64_t y_row_bytes) {
    __m512 acc[FMA_ROWS][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < s->kp; k++) {
        const __m512 w0 = _mm512_loadu_ps(wf + k * PANEL);
        const __m512 w1 = _mm512_loadu_ps(wf + k * PANEL + 16);
        for (int i = 0; i < rows; i++) {
            const __m512 xv = _mm512_set1_ps(xf[i * s->kp + k]);
            acc[i][0] = _mm512_fmadd_ps(w0, xv, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w1, xv, acc[i][1]);
        }
    }
    __m512 s0, s1;
    panel_scales(ws, s, p, &s0, &s1);
    for (int i = 0; i < rows; i++)
        finish_row(_mm512_mul_ps(acc[i][0], s0), _mm512_mul_ps(acc[i][1], s1), s, p, bias,
                   (char *)y + i * y_row_bytes);
}

/* Sums the 4 lanes of each 128-bit quarter of a0..a3 (quarter L of a_q: column 4q + L):
 * -> the 16 columns' sums in order. */
static inline __m512 sum_quads(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    /* quarter L: a0 a1 a2 a3 of column L (element 4L + q is column 4q + L) */
    const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44),
                                   _mm512_shuffle_ps(s01, s23, 0xee));
    int32_t order[16];
    for (int c = 0; c < 16; c++) order[c] = (c % 4) * 4 + c / 4;
    return _mm512_permutexvar_ps(_mm512_loadu_si512(order), v);
}

/* Weight-only, few rows: straight from the int8 panel, no widened copy. 16 bytes of a tile row
 * (4 columns x 4 k) widen to 16 fp32 lanes and meet x's 4 k repeated in each quarter; the 4
 * partial sums of a column are added at the end. */
static inline __attribute__((always_inline)) void stream_rows(
        const shape_t *s, int64_t p, const int8_t *panel, const float *xf, const int rows,
        const float *ws, const void *bias, void *y, int64_t y_row_bytes) {
    __m512 acc[STREAM_ROWS][8];
    for (int i = 0; i < rows; i++)
        for (int q = 0; q < 8; q++) acc[i][q] = _mm512_setzero_ps();
    for (int64_t st = 0; st < s->steps; st++) {
        const int8_t *b = panel + st * STEP_BYTES;
        const float *xk = xf + st * KSTEP;
        for (int r = 0; r < 16; r++) {
            prefetch_step(b, r);
            __m512 xv[STREAM_ROWS];
            for (int i = 0; i < rows; i++)
                xv[i] = _mm512_broadcast_f32x4(_mm_loadu_ps(xk + i * s->kp + 4 * r));
            for (int q = 0; q < 8; q++) {  /* tile q / 4, columns 4 (q % 4) .. + 3 */
                const int8_t *w = b + (q / 4) * TILE_BYTES + r * 64 + (q % 4) * 16;
                const __m512 wf = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
                for (int i = 0; i < rows; i++)
                    acc[i][q] = _mm512_fmadd_ps(wf, xv[i], acc[i][q]);
            }
        }
    }
    __m512 s0, s1;
    panel_scales(ws, s, p, &s0, &s1);
    for (int i = 0; i < rows; i++)
        finish_row(_mm512_mul_ps(sum_quads(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), s0),
                   _mm512_mul_ps(sum_quads(acc[i][4], acc[i][5], acc[i][6], acc[i][7]), s1),
                   s, p, bias, (char *)y + i * y_row_bytes);
}

/* Up to STREAM_ROWS rows, `stream_rows`; more, each panel is widened once into an
 * L2-resident fp32 copy (kp * 128 bytes per thread), which every block of rows then reads. */
static int avx512_weight_only(const float *xf, int64_t m, const int8_t *packed,
                              const float *ws, const void *bias, const shape_t *s, void *y,
                              int64_t y_cols) {
    const int64_t row_bytes = y_cols * (s->bf16 ? 2 : 4);
    if (m <= STREAM_ROWS) {
        #pragma omp parallel for schedule(static)
        for (int64_t p = 0; p < s->panels; p++) {
            const int8_t *panel = packed + p * s->steps * STEP_BYTES;
            switch (m) {
            case 1: stream_rows(s, p, panel, xf, 1, ws, bias, y, row_bytes); break;
            case 2: stream_rows(s, p, panel, xf, 2, ws, bias, y, row_bytes); break;
            default: stream_rows(s, p, panel, xf, STREAM_ROWS, ws, bias, y, row_bytes); break;
            }
        }
        return 0;
    }
    float *widened = aligned_alloc(64, (size_t)(omp_get_max_threads() * s->kp * PANEL)
                                           * sizeof(float));
    if (!widened) return -3;
    #pragma omp parallel
    {
        float *wf = widened + (int64_t)omp_get_thread_num() * s->kp * PANEL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < s->panels; p++) {
            widen_panel_f32(packed + p * s->steps * STEP_BYTES, s->steps, wf);
            for (int64_t r0 = 0; r0 < m; r0 += FMA_ROWS) {
                const int64_t left = m - r0;
                const float *x0 = xf + r0 * s->kp;
                char *y0 = (char *)y + r0 * row_bytes;
                switch (left >= FMA_ROWS ? FMA_ROWS : left) {
#define FMA_CASE(R) case R: fma_rows(s, p, wf, x0, R, ws, bias, y0, row_bytes); break;
                FMA_CASE(1) FMA_CASE(2) FMA_CASE(3) FMA_CASE(4) FMA_CASE(5) FMA_CASE(6)
                FMA_CASE(7)
#undef FMA_CASE
                default: fma_rows(s, p, wf, x0, FMA_ROWS, ws, bias, y0, row_bytes); break;
                }
            }
        }
    }
    free(widened);
    return 0;
}

#if defined(__AVX512VNNI__)
#define HAVE_VNNI 1

/* w8a8: rows [rows) of xq (int8, kp apart) against panel p; x + 128 as unsigned bytes (a flip
 * of the top bit), corrected by 128 * the channel's weight sum. */
static inline __attribute__((always_inline)) void vnni_rows(
        const shape_t *s, int64_t p, const int8_t *panel, const int8_t *xq, const float *xs,
        const int rows, const float *ws, const int32_t *wsum, const void *bias, void *y,
        int64_t y_row_bytes, int prefetch) {
    __m512i acc[VNNI_ROWS][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi32((int32_t)0x80808080u);
    for (int64_t st = 0; st < s->steps; st++) {
        const int8_t *b = panel + st * STEP_BYTES;
        const int8_t *xk = xq + st * KSTEP;
        for (int r = 0; r < 16; r++) {
            if (prefetch) prefetch_step(b, r);
            const __m512i w0 = _mm512_loadu_si512(b + r * 64);
            const __m512i w1 = _mm512_loadu_si512(b + TILE_BYTES + r * 64);
            for (int i = 0; i < rows; i++) {
                int32_t four;
                memcpy(&four, xk + i * s->kp + 4 * r, 4);
                const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(four), flip);
                acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], a, w0);
                acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], a, w1);
            }
        }
    }
    __m512 s0, s1;
    panel_scales(ws, s, p, &s0, &s1);
    const __m512i c0 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(
        first_lanes(real_cols(s, p, 0)), wsum + first_col(s, p, 0)), 7);
    const __m512i c1 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(
        first_lanes(real_cols(s, p, 1)), wsum + first_col(s, p, 1)), 7);
    for (int i = 0; i < rows; i++) {
        const __m512 xsv = _mm512_set1_ps(xs[i]);
        const __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][0], c0)),
                                        _mm512_mul_ps(s0, xsv));
        const __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][1], c1)),
                                        _mm512_mul_ps(s1, xsv));
        finish_row(v0, v1, s, p, bias, (char *)y + i * y_row_bytes);
    }
}

static void vnni_w8a8(const int8_t *xq, const float *xs, int64_t m, const int8_t *packed,
                      const float *ws, const int32_t *wsum, const void *bias, const shape_t *s,
                      void *y, int64_t y_cols) {
    const int64_t row_bytes = y_cols * (s->bf16 ? 2 : 4);
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < s->panels; p++) {
        const int8_t *panel = packed + p * s->steps * STEP_BYTES;
        for (int64_t r0 = 0; r0 < m; r0 += VNNI_ROWS) {
            const int64_t left = m - r0;
            const int8_t *x0 = xq + r0 * s->kp;
            const float *xs0 = xs + r0;
            char *y0 = (char *)y + r0 * row_bytes;
            const int first = r0 == 0;
            switch (left >= VNNI_ROWS ? VNNI_ROWS : left) {
#define VNNI_CASE(R)                                                                             \
            case R: vnni_rows(s, p, panel, x0, xs0, R, ws, wsum, bias, y0, row_bytes, first);    \
                break;
            VNNI_CASE(1) VNNI_CASE(2) VNNI_CASE(3) VNNI_CASE(4) VNNI_CASE(5) VNNI_CASE(6)
            VNNI_CASE(7)
#undef VNNI_CASE
            default: vnni_rows(s, p, panel, x0, xs0, VNNI_ROWS, ws, wsum, bias, y0, row_bytes,
                               first);
                break;
            }
        }
    }
}

/* Weight-only on VNNI: each row of x becomes 24-bit fixed point against its max,
 * x ~ s * (x2 * 2^16 + u1 * 2^8 + u0) in three byte planes (x2 signed, u1 and u0 unsigned):
 * three u8 x s8 products per weight instead of a widening to fp32. s is a power of two,
 * 2^(e - 23) for the row's largest magnitude in [2^(e-1), 2^e), so that |x / s| < 2^23 and a
 * value whose last mantissa bit is worth at least s is exact: every bf16 value (8 significant
 * bits) of at least 2^-15 of the row's largest, and fp32 values with their low bits zero. Any
 * other value is rounded to a multiple of s (off by at most s / 2, at most 2^-23 of the
 * largest). The sums stay within int32 for K up to FIXED_MAX_K. */
#define FIXED_ROWS 4

static void fixed_point_row(const void *x, int64_t k, int64_t kp, int bf16, int8_t *planes,
                            float *scale) {
    float amax = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float a = fabsf(load_value(x, j, bf16));
        amax = a > amax ? a : amax;
    }
    int e = 0;
    if (amax > 0.0f) frexpf(amax, &e); /* amax = f 2^e, f in [0.5, 1) */
    /* 2^-126 at the least: 1 / s stays finite, and such a row still fits (amax < 2^-103) */
    const float s = amax > 0.0f ? ldexpf(1.0f, e - 23 < -126 ? -126 : e - 23) : 1.0f;
    const float inv = 1.0f / s;
    /* (the clamp: an fp32 value just under 2^e can round up to 2^23) */
    for (int64_t j = 0; j < kp; j++) {
        int32_t v = j < k ? (int32_t)rintf(load_value(x, j, bf16) * inv) : 0;
        v = v > 8388607 ? 8388607 : (v < -8388607 ? -8388607 : v);
        planes[j] = (int8_t)(uint8_t)(v & 255);
        planes[kp + j] = (int8_t)(uint8_t)((v >> 8) & 255);
        planes[2 * kp + j] = (int8_t)(v >> 16);
    }
    *scale = s;
}

static inline __attribute__((always_inline)) void fixed_rows(
        const shape_t *s, int64_t p, const int8_t *panel, const int8_t *xp, const float *xs,
        const int rows, const float *ws, const int32_t *wsum, const void *bias, void *y,
        int64_t y_row_bytes, int prefetch) {
    __m512i acc[FIXED_ROWS][3][2];
    for (int i = 0; i < rows; i++)
        for (int l = 0; l < 3; l++) acc[i][l][0] = acc[i][l][1] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi32((int32_t)0x80808080u);
    const int64_t kp = s->kp;
    for (int64_t st = 0; st < s->steps; st++) {
        const int8_t *b = panel + st * STEP_BYTES;
        const int8_t *xk = xp + st * KSTEP;
        for (int r = 0; r < 16; r++) {
            if (prefetch) prefetch_step(b, r);
            const __m512i w0 = _mm512_loadu_si512(b + r * 64);
            const __m512i w1 = _mm512_loadu_si512(b + TILE_BYTES + r * 64);
            for (int i = 0; i < rows; i++)
                for (int l = 0; l < 3; l++) {
                    int32_t four;
                    memcpy(&four, xk + (3 * i + l) * kp + 4 * r, 4);
                    __m512i a = _mm512_set1_epi32(four);
                    if (l == 2) a = _mm512_xor_si512(a, flip);  /* x2 + 128 */
                    acc[i][l][0] = _mm512_dpbusd_epi32(acc[i][l][0], a, w0);
                    acc[i][l][1] = _mm512_dpbusd_epi32(acc[i][l][1], a, w1);
                }
        }
    }
    __m512 s0, s1;
    panel_scales(ws, s, p, &s0, &s1);
    const __m512i c0 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(
        first_lanes(real_cols(s, p, 0)), wsum + first_col(s, p, 0)), 7);
    const __m512i c1 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(
        first_lanes(real_cols(s, p, 1)), wsum + first_col(s, p, 1)), 7);
    for (int i = 0; i < rows; i++) {
        __m512 v[2];
        for (int t = 0; t < 2; t++) {
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][2][t], t ? c1 : c0));
            const __m512 mid = _mm512_cvtepi32_ps(acc[i][1][t]);
            const __m512 lo = _mm512_cvtepi32_ps(acc[i][0][t]);
            v[t] = _mm512_fmadd_ps(hi, _mm512_set1_ps(65536.0f),
                                   _mm512_fmadd_ps(mid, _mm512_set1_ps(256.0f), lo));
        }
        const __m512 xsv = _mm512_set1_ps(xs[i]);
        finish_row(_mm512_mul_ps(v[0], _mm512_mul_ps(s0, xsv)),
                   _mm512_mul_ps(v[1], _mm512_mul_ps(s1, xsv)), s, p, bias,
                   (char *)y + i * y_row_bytes);
    }
}

static int vnni_weight_only(const void *x, int64_t x_stride, int64_t m, const int8_t *packed,
                            const float *ws, const int32_t *wsum, const void *bias,
                            const shape_t *s, void *y, int64_t y_cols) {
    const int64_t row_bytes = y_cols * (s->bf16 ? 2 : 4), kp = s->kp;
    const size_t esize = s->bf16 ? 2 : 4;
    int8_t *planes = aligned_alloc(64, (size_t)(3 * m * kp));
    float *xs = malloc((size_t)m * sizeof(float));
    if (!planes || !xs) {
        free(planes), free(xs);
        return -3;
    }
    #pragma omp parallel for schedule(static) if(m * s->k >= PARALLEL_GRAIN)
    for (int64_t i = 0; i < m; i++)
        fixed_point_row((const char *)x + i * x_stride * esize, s->k, kp, s->bf16,
                        planes + 3 * i * kp, xs + i);
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < s->panels; p++) {
        const int8_t *panel = packed + p * s->steps * STEP_BYTES;
        for (int64_t r0 = 0; r0 < m; r0 += FIXED_ROWS) {
            const int64_t left = m - r0;
            const int8_t *x0 = planes + 3 * r0 * kp;
            const float *xs0 = xs + r0;
            char *y0 = (char *)y + r0 * row_bytes;
            const int first = r0 == 0;
            switch (left >= FIXED_ROWS ? FIXED_ROWS : left) {
#define FIXED_CASE(R)                                                                            \
            case R: fixed_rows(s, p, panel, x0, xs0, R, ws, wsum, bias, y0, row_bytes, first);   \
                break;
            FIXED_CASE(1) FIXED_CASE(2) FIXED_CASE(3)
#undef FIXED_CASE
            default: fixed_rows(s, p, panel, x0, xs0, FIXED_ROWS, ws, wsum, bias, y0, row_bytes,
                                first);
                break;
            }
        }
    }
    free(planes), free(xs);
    return 0;
}
#endif /* VNNI */

/* -- AMX -------------------------------------------------------------------------------------- */

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) \
    && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include "amx.h"

/* While the first pass over a panel streams it in, the second brings the next panel to L2 (as
 * matmul_bf16.c does). */
static inline void amx_prefetch(const char *b, int64_t pass, int64_t panel_bytes,
                                int64_t step_bytes) {
    if (pass == 0)
        for (int64_t line = 0; line < step_bytes; line += 64)
            _mm_prefetch(b + PREFETCH_STEPS * step_bytes + line, _MM_HINT_T0);
    else if (pass == 1)
        for (int64_t line = 0; line < step_bytes; line += 64)
            _mm_prefetch(b + panel_bytes + line, _MM_HINT_T1);
}

/* w8a8 on AMX-INT8: xq [ceil(m / 32) * 32, kp], zero rows past m. */
static void amx_w8a8(const int8_t *xq, const float *xs, int64_t m, const int8_t *packed,
                     const float *ws, const void *bias, const shape_t *s, void *y,
                     int64_t y_cols) {
    const int64_t row_bytes = y_cols * (s->bf16 ? 2 : 4), panel_bytes = s->steps * STEP_BYTES;
    #pragma omp parallel
    {
        amx_load_full_tiles();
        int32_t acc[4][16][16];
        for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
            const int64_t chunk_end = chunk + ROW_CHUNK < m ? chunk + ROW_CHUNK : m;
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < s->panels; p++) {
                const int8_t *panel = packed + p * panel_bytes;
                __m512 s0, s1;
                panel_scales(ws, s, p, &s0, &s1);
                for (int64_t r0 = chunk; r0 < chunk_end; r0 += ROW_BLOCK) {
                    const int8_t *a = xq + r0 * s->kp;
                    _tile_zero(4);
                    _tile_zero(5);
                    _tile_zero(6);
                    _tile_zero(7);
                    for (int64_t st = 0; st < s->steps; st++) {
                        const int8_t *b = panel + st * STEP_BYTES;
                        amx_prefetch((const char *)b, (r0 - chunk) / ROW_BLOCK, panel_bytes,
                                     STEP_BYTES);
                        _tile_loadd(0, a + st * KSTEP, s->kp);
                        _tile_loadd(1, a + 16 * s->kp + st * KSTEP, s->kp);
                        _tile_loadd(2, b, 64);
                        _tile_loadd(3, b + TILE_BYTES, 64);
                        _tile_dpbssd(4, 0, 2);
                        _tile_dpbssd(5, 0, 3);
                        _tile_dpbssd(6, 1, 2);
                        _tile_dpbssd(7, 1, 3);
                    }
                    _tile_stored(4, acc[0], 64);
                    _tile_stored(5, acc[1], 64);
                    _tile_stored(6, acc[2], 64);
                    _tile_stored(7, acc[3], 64);
                    for (int i = 0; i < ROW_BLOCK && r0 + i < m; i++) {
                        const __m512 xsv = _mm512_set1_ps(xs[r0 + i]);
                        const int h = i / 16 * 2, row = i % 16;
                        const __m512 v0 = _mm512_mul_ps(
                            _mm512_cvtepi32_ps(_mm512_loadu_si512(acc[h][row])),
                            _mm512_mul_ps(s0, xsv));
                        const __m512 v1 = _mm512_mul_ps(
                            _mm512_cvtepi32_ps(_mm512_loadu_si512(acc[h + 1][row])),
                            _mm512_mul_ps(s1, xsv));
                        finish_row(v0, v1, s, p, bias, (char *)y + (r0 + i) * row_bytes);
                    }
                }
            }
        }
        _tile_release();
    }
}

/* Panel -> bf16 B tiles for AMX (K steps of 32, pairs of k interleaved): int8 tile row r
 * (k = 4r .. 4r + 3 of its step) becomes rows 2 (r % 8) and 2 (r % 8) + 1 of bf16 step
 * 2 step + r / 8. */
static void widen_panel_bf16(const int8_t *panel, int64_t steps, uint16_t *out) {
    int32_t even[16], odd[16];
    for (int i = 0; i < 16; i++) even[i] = 2 * i, odd[i] = 2 * i + 1;
    const __m512i pick_even = _mm512_loadu_si512(even), pick_odd = _mm512_loadu_si512(odd);
    for (int64_t st = 0; st < steps; st++)
        for (int t = 0; t < 2; t++)
            for (int r = 0; r < 16; r++) {
                const int8_t *src = panel + st * STEP_BYTES + t * TILE_BYTES + r * 64;
                _mm_prefetch((const char *)(src + PREFETCH_STEPS * STEP_BYTES), _MM_HINT_T0);
                const __m512i w = _mm512_loadu_si512(src);
                const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 0)));
                const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 1)));
                const __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 2)));
                const __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm512_extracti32x4_epi32(w, 3)));
                /* dword 2c + pair for columns 0..7, then 8..15 */
                const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
                const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f3, f2);
                uint16_t *dst = out + ((2 * st + r / 8) * 2 + t) * 512 + (r % 8) * 64;
                _mm512_storeu_si512(dst, _mm512_permutex2var_epi32(lo, pick_even, hi));
                _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi32(lo, pick_odd, hi));
            }
}

/* Weight-only, bf16 x on AMX: x rows `a_stride` elements apart; `tail` holds the rows past the
 * last whole block of 32 (zero-padded) when x itself is read, `padded` every row otherwise. */
static int amx_weight_only(const uint16_t *x, int64_t x_stride, int64_t m, const int8_t *packed,
                           const float *ws, const void *bias, const shape_t *s, void *y,
                           int64_t y_cols) {
    const int64_t row_bytes = y_cols * 2, panel_bytes = s->steps * STEP_BYTES;
    const int64_t kp = s->kp, whole = m / ROW_BLOCK * ROW_BLOCK;
    const int pad_all = s->k != kp;
    const int64_t copy_from = pad_all ? 0 : whole;
    const int64_t copied = (m - copy_from + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    uint16_t *copy = NULL;
    if (copied > 0) {
        copy = calloc((size_t)(copied * kp), sizeof(uint16_t));
        if (!copy) return -3;
        for (int64_t r = copy_from; r < m; r++)
            memcpy(copy + (r - copy_from) * kp, x + r * x_stride, (size_t)s->k * 2);
    }
    /* Each thread's panel in bf16 tiles (kp * 64 bytes: it stays in L2). */
    uint16_t *widened = aligned_alloc(64, (size_t)(omp_get_max_threads() * kp * 64));
    if (!widened) {
        free(copy);
        return -3;
    }
    #pragma omp parallel
    {
        uint16_t *wb = widened + (int64_t)omp_get_thread_num() * kp * 32;
        amx_load_full_tiles();
        float acc[4][16][16];
        for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
            const int64_t chunk_end = chunk + ROW_CHUNK < m ? chunk + ROW_CHUNK : m;
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < s->panels; p++) {
                widen_panel_bf16(packed + p * panel_bytes, s->steps, wb);
                __m512 s0, s1;
                panel_scales(ws, s, p, &s0, &s1);
                for (int64_t r0 = chunk; r0 < chunk_end; r0 += ROW_BLOCK) {
                    const int from_copy = r0 >= copy_from;
                    const uint16_t *a = from_copy ? copy + (r0 - copy_from) * kp
                                                  : x + r0 * x_stride;
                    const int64_t a_stride = (from_copy ? kp : x_stride) * 2;
                    _tile_zero(4);
                    _tile_zero(5);
                    _tile_zero(6);
                    _tile_zero(7);
                    for (int64_t st = 0; st < kp / 32; st++) {
                        const uint16_t *b = wb + st * 1024;
                        _tile_loadd(0, a + st * 32, a_stride);
                        _tile_loadd(1, (const char *)(a + st * 32) + 16 * a_stride, a_stride);
                        _tile_loadd(2, b, 64);
                        _tile_loadd(3, b + 512, 64);
                        _tile_dpbf16ps(4, 0, 2);
                        _tile_dpbf16ps(5, 0, 3);
                        _tile_dpbf16ps(6, 1, 2);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                    _tile_stored(4, acc[0], 64);
                    _tile_stored(5, acc[1], 64);
                    _tile_stored(6, acc[2], 64);
                    _tile_stored(7, acc[3], 64);
                    for (int i = 0; i < ROW_BLOCK && r0 + i < m; i++) {
                        const int h = i / 16 * 2, row = i % 16;
                        finish_row(_mm512_mul_ps(_mm512_loadu_ps(acc[h][row]), s0),
                                   _mm512_mul_ps(_mm512_loadu_ps(acc[h + 1][row]), s1), s, p,
                                   bias, (char *)y + (r0 + i) * row_bytes);
                    }
                }
            }
        }
        _tile_release();
    }
    free(widened);
    free(copy);
    return 0;
}
#endif /* AMX */
#endif /* AVX-512 */

/* -- entry points ----------------------------------------------------------------------------- */

/* Bit (1 << path) for each path built here and usable on this CPU. */
int matmul_int8_paths(void) {
    int paths = 1 << PATH_PORTABLE;
#ifdef HAVE_WEIGHT_ONLY_AVX512
    paths |= 1 << PATH_AVX512;
#endif
#ifdef HAVE_VNNI
    paths |= 1 << PATH_VNNI;
#endif
#ifdef HAVE_AMX
    if (matmul_amx_available()) paths |= 1 << PATH_AMX;
#endif
    return paths;
}

/* y [m, n] (or [m, n / 2] with gate_up) from x [m, k] (rows x_stride elements apart), the weight
 * packed as above with fp32 channel scales ws [n] and the channel weight sums wsum [n] (needed
 * by the VNNI paths). path: PATH_* (auto: AMX from 16 rows where it runs, else the fastest vector
 * path (weight-only: VNNI under 16 rows, AVX-512 FMA from 16 with fp32 x); w8a8 has no plain
 * AVX-512 path, weight-only AMX needs bf16 x; K past FIXED_MAX_K / W8A8_MAX_K leaves VNNI /
 * AMX). Returns -1 for a bad shape, -2 for a path that
 * does not run here (or for this mode or K), -3 when out of memory. */
int matmul_int8(const void *x, int64_t x_stride, int64_t m, int bf16, const int8_t *packed,
                const float *ws, const int32_t *wsum, const void *bias, int64_t n, int64_t k,
                int gate_up, int w8a8, int path, void *y) {
    shape_t s;
    if (make_shape(n, k, gate_up, bf16, &s) != 0) return -1;
    const int have = matmul_int8_paths();
    if (path == PATH_AUTO) {
        const int amx = (have >> PATH_AMX & 1) && m >= AMX_MIN_ROWS
                        && (w8a8 ? k <= W8A8_MAX_K : bf16);
        /* weight-only VNNI makes three passes per weight: from 16 rows FMA is faster (and the
         * FMA path is built wherever VNNI is: it needs only AVX-512 F/BW/VL) */
        const int vnni = (have >> PATH_VNNI & 1)
                         && (w8a8 ? k <= W8A8_MAX_K
                                  : wsum && k <= FIXED_MAX_K && m < AMX_MIN_ROWS);
        path = amx ? PATH_AMX : vnni ? PATH_VNNI
             : (!w8a8 && (have >> PATH_AVX512 & 1)) ? PATH_AVX512 : PATH_PORTABLE;
    }
    if (path < PATH_PORTABLE || path > PATH_AMX || !(have >> path & 1)) return -2;
    if ((w8a8 && path == PATH_AVX512) || (!w8a8 && path == PATH_AMX && !bf16)
        || (!w8a8 && path == PATH_VNNI && (!wsum || k > FIXED_MAX_K))
        || (w8a8 && (path == PATH_VNNI || path == PATH_AMX) && k > W8A8_MAX_K))
        return -2;
    if (m <= 0) return 0;
    const int64_t y_cols = gate_up ? s.half : n;
    const size_t esize = bf16 ? 2 : 4;
    int rc = 0;
    if (w8a8) {
        const int64_t rows = (m + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
        int8_t *xq = aligned_alloc(64, (size_t)(rows * s.kp));
        float *xs = malloc((size_t)m * sizeof(float));
        if (!xq || !xs) {
            free(xq), free(xs);
            return -3;
        }
        #pragma omp parallel for schedule(static) if(m * k >= PARALLEL_GRAIN)
        for (int64_t i = 0; i < m; i++)
            quantize_row((const char *)x + i * x_stride * esize, k, s.kp, bf16, xq + i * s.kp,
                         xs + i);
        memset(xq + m * s.kp, 0, (size_t)((rows - m) * s.kp));
        switch (path) {
#ifdef HAVE_AMX
        case PATH_AMX: amx_w8a8(xq, xs, m, packed, ws, bias, &s, y, y_cols); break;
#endif
#ifdef HAVE_VNNI
        case PATH_VNNI: vnni_w8a8(xq, xs, m, packed, ws, wsum, bias, &s, y, y_cols); break;
#endif
        default: portable_w8a8(xq, xs, m, packed, ws, bias, &s, y, y_cols); break;
        }
        free(xq), free(xs);
        return rc;
    }
#ifdef HAVE_VNNI
    if (path == PATH_VNNI)
        return vnni_weight_only(x, x_stride, m, packed, ws, wsum, bias, &s, y, y_cols);
#endif
#ifdef HAVE_AMX
    if (path == PATH_AMX)
        return amx_weight_only(x, x_stride, m, packed, ws, bias, &s, y, y_cols);
#endif
    float *xf = aligned_alloc(64, (size_t)(m * s.kp) * sizeof(float));
    if (!xf) return -3;
    widen_rows(x, x_stride, m, &s, xf);
#ifdef HAVE_WEIGHT_ONLY_AVX512
    if (path == PATH_AVX512) rc = avx512_weight_only(xf, m, packed, ws, bias, &s, y, y_cols);
    else
#endif
        portable_weight_only(xf, NULL, m, packed, ws, bias, &s, y, y_cols);
    free(xf);
    return rc;
}
