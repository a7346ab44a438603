/* Causal prefill attention (prefill_attention.c's contract) for CPUs with AVX2 and FMA but no
 * AVX-512: the AVX-512 loop's key blocks on 8-lane vectors. K and V are packed as there
 * (prefill_attention.h: K [kv_head][block][head_dim][16], V [kv_head][block][16][head_dim]), so
 * a block's 16 scores for a query row are two vectors of 8 keys, each head_dim multiply-adds of
 * a broadcast query element by a row of the block, with no horizontal sums.
 *
 * Rows go four at a time: the scores take 4 rows x 2 vectors = 8 accumulators (two FMA units of
 * four cycles' latency need 8 independent chains), and p V takes 4 rows x 2 vectors of head_dim
 * a pass, so that accumulators, the V row and the broadcast probability fit in 16 registers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "prefill_attention.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2.h"

#define ROWS 4 /* query rows that share each K and V row loaded */

/* Loads a and b once into registers: left to itself the compiler folds the load into each of
 * the R multiply-adds that use it, R loads instead of one, and the loop waits on load ports. */
#define KEEP_IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))

/* Lanes of block `b` (keys 16b..16b+15) that row q sees, keys in [start, q], as all-ones lanes:
 * keys 16b..16b+7 in `lo`, 16b+8..16b+15 in `hi`. */
static inline void visible_lanes(int64_t b, int64_t start, int64_t q, __m256 *lo, __m256 *hi) {
    const int64_t k0 = b * KEY_BLOCK;
    const int64_t from = start - k0 < 0 ? 0 : (start - k0 > KEY_BLOCK ? KEY_BLOCK : start - k0);
    const int64_t to = q - k0 + 1 < 0 ? 0 : (q - k0 + 1 > KEY_BLOCK ? KEY_BLOCK : q - k0 + 1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
    const __m256i below = _mm256_set1_epi32((int)from - 1), upto = _mm256_set1_epi32((int)to);
    /* from <= lane < to */
    *lo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane, below),
                                               _mm256_cmpgt_epi32(upto, lane)));
    const __m256i lane_hi = _mm256_add_epi32(lane, eight);
    *hi = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane_hi, below),
                                               _mm256_cmpgt_epi32(upto, lane_hi)));
}

/* One row's online-softmax update for one key block (the AVX-512 loop's softmax_block on two
 * halves): s0, s1 its scaled scores, lo, hi the keys it sees. Writes the block's probabilities
 * to p[0..15]; *corr is the factor the row's accumulators take. A row that sees no key of the
 * block keeps its state (its first block always has one, so run_max is finite by then). */
static inline __attribute__((always_inline)) void softmax_block(
        __m256 s0, __m256 s1, __m256 lo, __m256 hi, float *run_max, __m256 *run_sum,
        __m256 *corr, float *p) {
    const __m256 none = _mm256_set1_ps(-INFINITY);
    const __m256 sc0 = _mm256_blendv_ps(none, s0, lo), sc1 = _mm256_blendv_ps(none, s1, hi);
    const float block_max = max8(_mm256_max_ps(sc0, sc1));
    const float new_max = block_max > *run_max ? block_max : *run_max;
    *corr = _mm256_set1_ps(exp_approx(*run_max - new_max));
    const __m256 m = _mm256_set1_ps(new_max);
    const __m256 p0 = exp8(_mm256_sub_ps(sc0, m)), p1 = exp8(_mm256_sub_ps(sc1, m));
    *run_max = new_max;
    *run_sum = _mm256_fmadd_ps(*run_sum, *corr, _mm256_add_ps(p0, p1));
    _mm256_store_ps(p, p0);
    _mm256_store_ps(p + 8, p1);
}

/* R query rows (`q`: R x head_dim floats, scale folded in) take in one key block: scores,
 * online-softmax update of run_max / run_sum, and acc (R x head_dim) += p V. Expanded for each
 * (R, ND = head_dim / 8) so that the loops over them unroll. */
#define DEFINE_ROWS_STEP(NAME, R, ND)                                                              \
static inline __attribute__((always_inline)) void NAME(                                            \
        const float *q, const float *kb, const float *vb, const __m256 *lo, const __m256 *hi,     \
        float *run_max, __m256 *run_sum, float *acc) {                                             \
    enum { D = ND * 8 };                                                                           \
    __m256 s[R][2];                                                                                \
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();                           \
    for (int d = 0; d < D; d++) {                                                                  \
        __m256 k0 = _mm256_loadu_ps(kb + d * KEY_BLOCK);                                           \
        __m256 k1 = _mm256_loadu_ps(kb + d * KEY_BLOCK + 8);                                       \
        KEEP_IN_REGISTERS(k0, k1);                                                                 \
        for (int r = 0; r < R; r++) {                                                              \
            const __m256 qd = _mm256_broadcast_ss(q + r * D + d);                                  \
            s[r][0] = _mm256_fmadd_ps(qd, k0, s[r][0]);                                            \
            s[r][1] = _mm256_fmadd_ps(qd, k1, s[r][1]);                                            \
        }                                                                                          \
    }                                                                                              \
    float probs[R][KEY_BLOCK] __attribute__((aligned(32)));                                        \
    __m256 corr[R];                                                                                \
    _Pragma("GCC unroll 4") /* unrolled, or s[][] is kept in memory: a store per FMA */         \
    for (int r = 0; r < R; r++)                                                                    \
        softmax_block(s[r][0], s[r][1], lo[r], hi[r], run_max + r, run_sum + r, corr + r,         \
                      probs[r]);                                                                   \
    for (int j0 = 0; j0 < ND; j0 += 2) { /* 2 vectors of head_dim a pass: R * 2 accumulators */    \
        __m256 a[R][2];                                                                            \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < 2; j++)                                                            \
                a[r][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + (j0 + j) * 8), corr[r]);     \
        for (int t = 0; t < KEY_BLOCK; t++) {                                                      \
            __m256 v0 = _mm256_loadu_ps(vb + t * D + j0 * 8);                                      \
            __m256 v1 = _mm256_loadu_ps(vb + t * D + j0 * 8 + 8);                                  \
            KEEP_IN_REGISTERS(v0, v1);                                                             \
            for (int r = 0; r < R; r++) {                                                          \
                const __m256 p = _mm256_broadcast_ss(&probs[r][t]);                                \
                a[r][0] = _mm256_fmadd_ps(p, v0, a[r][0]);                                         \
                a[r][1] = _mm256_fmadd_ps(p, v1, a[r][1]);                                         \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < 2; j++) _mm256_storeu_ps(acc + r * D + (j0 + j) * 8, a[r][j]);     \
    }                                                                                              \
}

DEFINE_ROWS_STEP(step4_d8, 4, 8)
DEFINE_ROWS_STEP(step1_d8, 1, 8)
DEFINE_ROWS_STEP(step4_d16, 4, 16)
DEFINE_ROWS_STEP(step1_d16, 1, 16)

/* One work item: query rows [q0, q_end) of one head, keys from the packed blocks. */
#define DEFINE_ITEM(NAME, T, LOAD, STORE, ND, STEP4, STEP1)                                        \
static void NAME(const T *query, int64_t q_stride, const float *kt, const float *vf,               \
                 int64_t start, int64_t q0, int64_t q_end, int head, int num_heads, float scale,   \
                 T *out) {                                                                         \
    enum { D = ND * 8 };                                                                           \
    const int n = (int)(q_end - q0);                                                               \
    float q[QUERY_BLOCK * D] __attribute__((aligned(32)));                                         \
    float acc[QUERY_BLOCK * D] __attribute__((aligned(32)));                                       \
    float run_max[QUERY_BLOCK];                                                                    \
    __m256 run_sum[QUERY_BLOCK];                                                                   \
    for (int r = 0; r < n; r++) {                                                                  \
        LOAD(query + (q0 + r) * q_stride + (int64_t)head * D, q + r * D, D);                       \
        for (int d = 0; d < D; d++) { q[r * D + d] *= scale; acc[r * D + d] = 0.0f; }              \
        run_max[r] = -INFINITY;                                                                    \
        run_sum[r] = _mm256_setzero_ps();                                                          \
    }                                                                                              \
    const int64_t first = start / KEY_BLOCK, last = (q_end - 1) / KEY_BLOCK;                       \
    for (int64_t b = first; b <= last; b++) {                                                      \
        const float *kb = kt + b * KEY_BLOCK * D, *vb = vf + b * KEY_BLOCK * D;                    \
        /* Rows before the block's first key see none of it. */                                    \
        int r = (int)(b * KEY_BLOCK - q0 > 0 ? b * KEY_BLOCK - q0 : 0);                            \
        __m256 lo[ROWS], hi[ROWS];                                                                 \
        for (; r + ROWS <= n; r += ROWS) {                                                         \
            for (int i = 0; i < ROWS; i++) visible_lanes(b, start, q0 + r + i, lo + i, hi + i);    \
            STEP4(q + r * D, kb, vb, lo, hi, run_max + r, run_sum + r, acc + r * D);               \
        }                                                                                          \
        for (; r < n; r++) {                                                                       \
            visible_lanes(b, start, q0 + r, lo, hi);                                               \
            STEP1(q + r * D, kb, vb, lo, hi, run_max + r, run_sum + r, acc + r * D);               \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < n; r++) {                                                                  \
        const float total = sum8(run_sum[r]);                                                      \
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                      \
        for (int d = 0; d < D; d++) acc[r * D + d] *= inv;                                         \
        STORE(out + ((q0 + r) * num_heads + head) * D, acc + r * D, D);                            \
    }                                                                                              \
}

/* bf16 out as float_to_bf16 rounds it (nearest even, NaN kept), 8 lanes at a time */
static inline void from_float_bf16_avx2(uint16_t *dst, const float *src, int n) {
    for (int i = 0; i < n; i += 8) store8_bf16(dst + i, round8_bf16(_mm256_loadu_ps(src + i)));
}

DEFINE_ITEM(item_f32_d8, float, to_float_f32, from_float_f32, 8, step4_d8, step1_d8)
DEFINE_ITEM(item_f32_d16, float, to_float_f32, from_float_f32, 16, step4_d16, step1_d16)
DEFINE_ITEM(item_bf16_d8, uint16_t, to_float_bf16, from_float_bf16_avx2, 8, step4_d8, step1_d8)
DEFINE_ITEM(item_bf16_d16, uint16_t, to_float_bf16, from_float_bf16_avx2, 16, step4_d16,
            step1_d16)

DEFINE_SIMD(prefill_avx2_f32, float, pack_f32, item_f32_d8, item_f32_d16)
DEFINE_SIMD(prefill_avx2_bf16, uint16_t, pack_bf16, item_bf16_d8, item_bf16_d16)

#endif
