/* Causal prefill attention for whole prompts (nothing cached before them) on the step's own K/V:
 * what pagoda_kernels/reference.py's causal_prefill_attention computes, with no padding and no T x T
 * score matrix.
 *
 * Layouts:
 *   query  [T, num_heads, head_dim], tokens `q_stride` elements apart, heads contiguous
 *   key    [T, num_kv_heads, head_dim], tokens `k_stride` apart; value likewise (`v_stride`)
 *   query_start_loc [num_seqs + 1] int64: sequence s holds tokens [qsl[s], qsl[s + 1])
 *   out    [T, num_heads, head_dim], contiguous, in the input dtype
 *
 * Query token i of a sequence attends to the sequence's tokens 0..i. Softmax runs online over
 * blocks of 16 keys (running max and sum per query row, accumulators rescaled once a block),
 * accumulated in float for every dtype.
 *
 * With AVX-512 (head_dim 64 or 128) a first pass turns K into float blocks laid out
 * [kv_head][block][head_dim][16], V into [kv_head][block][16][head_dim]: a block's 16 scores for
 * one query row are then head_dim multiply-adds of a broadcast query element by a row of 16
 * keys, with no horizontal sums, and bf16 is widened once per call instead of once per query
 * head. Blocks are counted from token 0 of the whole step, so a block may straddle two
 * sequences; the keys outside a row's range are masked. A work item is (sequence, query head,
 * block of 32 queries); rows go four at a time, so each K row and V row loaded serves four.
 * bf16 goes further where the CPU has them: AMX tiles, else AVX512-BF16's pair products on K
 * and V kept in bf16 (both below). With AVX2 and FMA but no AVX-512, prefill_attention_avx2.c
 * runs the same blocks on 8-lane vectors. Elsewhere a portable loop computes the same from the
 * inputs directly.
 *
 * Items are handed out with schedule(dynamic), longest first: the cores are shared with other
 * processes, and a thread that is descheduled must not hold back the others.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "common.h"
#include "prefill_attention.h"

static int pagoda_prefill_simd = 1, pagoda_prefill_amx = 1, pagoda_prefill_dpbf16 = 1;

/* Which path runs (tests compare them on one machine): set_prefill_simd(0) the portable loop,
 * set_prefill_amx(0) no AMX, set_prefill_dpbf16(0) bf16 widened to float on AVX-512 instead of
 * AVX512-BF16's pair products. */
void set_prefill_simd(int on) { pagoda_prefill_simd = on; }
void set_prefill_amx(int on) { pagoda_prefill_amx = on; }
void set_prefill_dpbf16(int on) { pagoda_prefill_dpbf16 = on; }

/* 0 when query_start_loc runs from 0 to num_tokens without going back. */
static int check_starts(const int64_t *qsl, int num_seqs, int64_t num_tokens) {
    if (num_seqs < 0 || qsl[0] != 0 || qsl[num_seqs] != num_tokens) return -1;
    for (int s = 0; s < num_seqs; s++)
        if (qsl[s + 1] < qsl[s]) return -1;
    return 0;
}

/* --- portable loop --------------------------------------------------------------------------- */

/* One query row against keys [first, last] (absolute tokens), 16 keys a step. */
#define DEFINE_PORTABLE_ROW(NAME, T, LOAD)                                                         \
static void NAME(const float *q, const T *key, int64_t k_stride, const T *value,                   \
                 int64_t v_stride, int64_t first, int64_t last, int head_dim, float *acc) {        \
    float run_max = -INFINITY, run_sum = 0.0f, row[MAX_HEAD_DIM], scores[KEY_BLOCK];               \
    for (int d = 0; d < head_dim; d++) acc[d] = 0.0f;                                              \
    for (int64_t k0 = first; k0 <= last; k0 += KEY_BLOCK) {                                        \
        const int n = (int)(last - k0 + 1 < KEY_BLOCK ? last - k0 + 1 : KEY_BLOCK);                \
        float block_max = -INFINITY;                                                               \
        for (int t = 0; t < n; t++) {                                                              \
            LOAD(key + (k0 + t) * k_stride, row, head_dim);                                        \
            float s = 0.0f;                                                                        \
            _Pragma("omp simd reduction(+:s)")                                                     \
            for (int d = 0; d < head_dim; d++) s += q[d] * row[d];                                 \
            scores[t] = s;                                                                         \
            block_max = s > block_max ? s : block_max;                                             \
        }                                                                                          \
        const float new_max = block_max > run_max ? block_max : run_max;                           \
        const float correction = exp_approx(run_max - new_max);                                    \
        run_max = new_max;                                                                         \
        run_sum *= correction;                                                                     \
        for (int d = 0; d < head_dim; d++) acc[d] *= correction;                                   \
        for (int t = 0; t < n; t++) {                                                              \
            const float p = exp_approx(scores[t] - new_max);                                       \
            run_sum += p;                                                                          \
            LOAD(value + (k0 + t) * v_stride, row, head_dim);                                      \
            _Pragma("omp simd")                                                                    \
            for (int d = 0; d < head_dim; d++) acc[d] += p * row[d];                               \
        }                                                                                          \
    }                                                                                              \
    const float inv = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;                                      \
    for (int d = 0; d < head_dim; d++) acc[d] *= inv;                                              \
}

DEFINE_PORTABLE_ROW(portable_row_f32, float, to_float_f32)
DEFINE_PORTABLE_ROW(portable_row_bf16, uint16_t, to_float_bf16)

#define DEFINE_PORTABLE(NAME, T, LOAD, STORE, ROW)                                                 \
static int NAME(const T *query, int64_t q_stride, const T *key, int64_t k_stride,                  \
                const T *value, int64_t v_stride, const int64_t *qsl, int num_seqs,                \
                int num_heads, int num_kv_heads, int head_dim, float scale, T *out) {              \
    Item *items;                                                                                   \
    const int64_t num_items = list_items(qsl, num_seqs, num_heads, QUERY_BLOCK, &items);           \
    if (num_items < 0) return -2;                                                                  \
    const int group = num_heads / num_kv_heads;                                                    \
    _Pragma("omp parallel for schedule(dynamic)")                                                  \
    for (int64_t i = 0; i < num_items; i++) {                                                      \
        const Item it = items[i];                                                                  \
        const int64_t start = qsl[it.seq], end = qsl[it.seq + 1];                                  \
        const int64_t q_end = it.q0 + QUERY_BLOCK < end ? it.q0 + QUERY_BLOCK : end;               \
        const int kh = it.head / group;                                                            \
        float q[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];                                                  \
        for (int64_t t = it.q0; t < q_end; t++) {                                                  \
            LOAD(query + t * q_stride + (int64_t)it.head * head_dim, q, head_dim);                 \
            for (int d = 0; d < head_dim; d++) q[d] *= scale;                                      \
            ROW(q, key + (int64_t)kh * head_dim, k_stride, value + (int64_t)kh * head_dim,         \
                v_stride, start, t, head_dim, acc);                                                \
            STORE(out + (t * num_heads + it.head) * head_dim, acc, head_dim);                      \
        }                                                                                          \
    }                                                                                              \
    free(items);                                                                                   \
    return 0;                                                                                      \
}

DEFINE_PORTABLE(portable_f32, float, to_float_f32, from_float_f32, portable_row_f32)
DEFINE_PORTABLE(portable_bf16, uint16_t, to_float_bf16, from_float_bf16, portable_row_bf16)

/* --- AVX-512 --------------------------------------------------------------------------------- */
#if defined(__AVX512F__)
#include <immintrin.h>

#include "avx512.h"

#define ROWS 4 /* query rows that share each K and V row loaded */

/* Lanes of block `b` (keys 16b..16b+15) that row q sees: keys in [start, q]. */
static inline __mmask16 visible_lanes(int64_t b, int64_t start, int64_t q) {
    const int64_t k0 = b * KEY_BLOCK;
    const int64_t lo = start - k0 < 0 ? 0 : (start - k0 > KEY_BLOCK ? KEY_BLOCK : start - k0);
    const int64_t hi = q - k0 + 1 < 0 ? 0 : (q - k0 + 1 > KEY_BLOCK ? KEY_BLOCK : q - k0 + 1);
    const uint32_t upto = (uint32_t)((1ull << hi) - 1), below = (uint32_t)((1ull << lo) - 1);
    return (__mmask16)(upto & ~below);
}

/* One row's online-softmax update for one key block: `s` its scaled scores, `valid` the keys it
 * sees. Returns the block's probabilities; *corr is the factor the row's accumulators take. A
 * row with no visible key here (past its causal end) keeps its state: its first block always
 * has a visible key, so run_max is finite by then. */
static inline __attribute__((always_inline)) __m512 softmax_block(
        __m512 s, __mmask16 valid, float *run_max, __m512 *run_sum, __m512 *corr) {
    const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), s);
    const float block_max = _mm512_reduce_max_ps(sc);
    const float new_max = block_max > *run_max ? block_max : *run_max;
    *corr = _mm512_set1_ps(exp_approx(*run_max - new_max));
    const __m512 p = exp16(_mm512_sub_ps(sc, _mm512_set1_ps(new_max)));
    *run_max = new_max;
    *run_sum = _mm512_fmadd_ps(*run_sum, *corr, p);
    return p;
}

/* R query rows (`q`: R x head_dim floats, scale folded in) take in one key block: scores,
 * online-softmax update of run_max / run_sum, and acc (R x head_dim) += p V. Expanded for each
 * (R, ND = head_dim / 16) so that the loops over them unroll. */
#define DEFINE_ROWS_STEP(NAME, R, ND)                                                              \
static inline __attribute__((always_inline)) void NAME(                                            \
        const float *q, const float *kb, const float *vb, const __mmask16 *valid,                  \
        float *run_max, __m512 *run_sum, float *acc) {                                             \
    enum { D = ND * 16 };                                                                          \
    __m512 s[R][2];                                                                                \
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();                           \
    for (int d = 0; d < D; d += 2) { /* two chains a row: R * 2 multiply-adds in flight */         \
        const __m512 k0 = _mm512_loadu_ps(kb + d * KEY_BLOCK);                                     \
        const __m512 k1 = _mm512_loadu_ps(kb + (d + 1) * KEY_BLOCK);                               \
        for (int r = 0; r < R; r++) {                                                              \
            s[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, s[r][0]);                  \
            s[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d + 1]), k1, s[r][1]);              \
        }                                                                                          \
    }                                                                                              \
    float probs[R][KEY_BLOCK] __attribute__((aligned(64)));                                        \
    __m512 corr[R];                                                                                \
    for (int r = 0; r < R; r++)                                                                    \
        _mm512_store_ps(probs[r], softmax_block(_mm512_add_ps(s[r][0], s[r][1]), valid[r],         \
                                                run_max + r, run_sum + r, corr + r));              \
    for (int j0 = 0; j0 < ND; j0 += 4) { /* 4 vectors of head_dim a pass: R * 4 accumulators */    \
        __m512 a[R][4];                                                                            \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < 4; j++)                                                            \
                a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + (j0 + j) * 16), corr[r]);    \
        for (int t = 0; t < KEY_BLOCK; t++) {                                                      \
            __m512 v[4];                                                                           \
            for (int j = 0; j < 4; j++) v[j] = _mm512_loadu_ps(vb + t * D + (j0 + j) * 16);        \
            for (int r = 0; r < R; r++) {                                                          \
                const __m512 p = _mm512_set1_ps(probs[r][t]);                                      \
                for (int j = 0; j < 4; j++) a[r][j] = _mm512_fmadd_ps(p, v[j], a[r][j]);           \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + r * D + (j0 + j) * 16, a[r][j]);    \
    }                                                                                              \
}

DEFINE_ROWS_STEP(step4_d4, 4, 4)
DEFINE_ROWS_STEP(step1_d4, 1, 4)
DEFINE_ROWS_STEP(step4_d8, 4, 8)
DEFINE_ROWS_STEP(step1_d8, 1, 8)

/* One work item: query rows [q0, q_end) of one head, keys from the packed blocks. */
#define DEFINE_SIMD_ITEM(NAME, T, LOAD, STORE, ND, STEP4, STEP1)                                   \
static void NAME(const T *query, int64_t q_stride, const float *kt, const float *vf,               \
                 int64_t start, int64_t q0, int64_t q_end, int head, int num_heads, float scale,   \
                 T *out) {                                                                         \
    enum { D = ND * 16 };                                                                          \
    const int n = (int)(q_end - q0);                                                               \
    float q[QUERY_BLOCK * D] __attribute__((aligned(64)));                                         \
    float acc[QUERY_BLOCK * D] __attribute__((aligned(64)));                                       \
    float run_max[QUERY_BLOCK];                                                                    \
    __m512 run_sum[QUERY_BLOCK];                                                                   \
    for (int r = 0; r < n; r++) {                                                                  \
        LOAD(query + (q0 + r) * q_stride + (int64_t)head * D, q + r * D, D);                       \
        for (int d = 0; d < D; d++) { q[r * D + d] *= scale; acc[r * D + d] = 0.0f; }              \
        run_max[r] = -INFINITY;                                                                    \
        run_sum[r] = _mm512_setzero_ps();                                                          \
    }                                                                                              \
    const int64_t first = start / KEY_BLOCK, last = (q_end - 1) / KEY_BLOCK;                       \
    for (int64_t b = first; b <= last; b++) {                                                      \
        const float *kb = kt + b * KEY_BLOCK * D, *vb = vf + b * KEY_BLOCK * D;                    \
        /* Rows before the block's first key see none of it. */                                    \
        int r = (int)(b * KEY_BLOCK - q0 > 0 ? b * KEY_BLOCK - q0 : 0);                            \
        __mmask16 valid[ROWS];                                                                     \
        for (; r + ROWS <= n; r += ROWS) {                                                         \
            for (int i = 0; i < ROWS; i++) valid[i] = visible_lanes(b, start, q0 + r + i);         \
            STEP4(q + r * D, kb, vb, valid, run_max + r, run_sum + r, acc + r * D);                \
        }                                                                                          \
        for (; r < n; r++) {                                                                       \
            valid[0] = visible_lanes(b, start, q0 + r);                                            \
            STEP1(q + r * D, kb, vb, valid, run_max + r, run_sum + r, acc + r * D);                \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < n; r++) {                                                                  \
        const float total = _mm512_reduce_add_ps(run_sum[r]);                                      \
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                      \
        for (int d = 0; d < D; d++) acc[r * D + d] *= inv;                                         \
        STORE(out + ((q0 + r) * num_heads + head) * D, acc + r * D, D);                            \
    }                                                                                              \
}

static inline void from_float_bf16_simd(uint16_t *dst, const float *src, int n) {
#if defined(__AVX512BF16__)
    for (int i = 0; i < n; i += 16) store16_bf16_rne(dst + i, _mm512_loadu_ps(src + i));
#else
    from_float_bf16(dst, src, n);
#endif
}

DEFINE_SIMD_ITEM(item_f32_d4, float, to_float_f32, from_float_f32, 4, step4_d4, step1_d4)
DEFINE_SIMD_ITEM(item_f32_d8, float, to_float_f32, from_float_f32, 8, step4_d8, step1_d8)
DEFINE_SIMD_ITEM(item_bf16_d4, uint16_t, to_float_bf16, from_float_bf16_simd, 4, step4_d4,
                 step1_d4)
DEFINE_SIMD_ITEM(item_bf16_d8, uint16_t, to_float_bf16, from_float_bf16_simd, 8, step4_d8,
                 step1_d8)

static DEFINE_SIMD(simd_f32, float, pack_f32, item_f32_d4, item_f32_d8)
static DEFINE_SIMD(simd_bf16, uint16_t, pack_bf16, item_bf16_d4, item_bf16_d8)

#if defined(__AVX512BF16__)
/* --- bf16 on AVX512-BF16 (CPUs with it and without AMX: AMD Zen 4 and later) ------------------
 * The path above widens bf16 to float and multiplies-adds 16 lanes an instruction; vdpbf16ps
 * takes 16 pairs of bf16 products an instruction, the rate the bf16 matmul panels run at
 * (twice fp32's). Both products run on it: Q K^T on the bf16 query and keys as they are (each
 * product exact, sums in float), the scale applied to the scores; P V on the probabilities
 * rounded to bf16, as the AMX path and GPU flash attention do. The softmax stays in float.
 * K and V are first laid out in the pairs the instruction takes:
 *   K [kv_head][block][head_dim / 2][16 keys][2 dims]: one vector holds dims d, d + 1 of the
 *     block's 16 keys, and a broadcast (q[d], q[d + 1]) scores all 16 at once;
 *   V [kv_head][block][8 key pairs][head_dim][2 keys]: one vector holds keys t, t + 1 of 16
 *     dims, and a broadcast (p[t], p[t + 1]) adds both into 16 accumulator lanes. */
static void pack_bf16_pairs(const uint16_t *key, int64_t k_stride, const uint16_t *value,
                            int64_t v_stride, int64_t num_tokens, int num_kv_heads,
                            int head_dim, uint16_t *kp, uint16_t *vp) {
    const int64_t num_blocks = (num_tokens + KEY_BLOCK - 1) / KEY_BLOCK;
    const int64_t block_elems = (int64_t)KEY_BLOCK * head_dim;
    _Pragma("omp parallel for schedule(dynamic, 8)")
    for (int64_t i = 0; i < num_kv_heads * num_blocks; i++) {
        const int kh = (int)(i / num_blocks);
        const int64_t b = i % num_blocks, t0 = b * KEY_BLOCK;
        uint16_t *kb = kp + i * block_elems, *vb = vp + i * block_elems;
        for (int t = 0; t < KEY_BLOCK; t++) {
            uint16_t *kt = kb + 2 * t, *vt = vb + (t / 2) * 2 * head_dim + (t & 1);
            if (t0 + t >= num_tokens) { /* zeros past the last token (no pointer to it) */
                for (int d = 0; d < head_dim; d++) kt[(d / 2) * 2 * KEY_BLOCK + (d & 1)] = 0;
                for (int d = 0; d < head_dim; d++) vt[2 * d] = 0;
                continue;
            }
            const uint16_t *kr = key + (t0 + t) * k_stride + (int64_t)kh * head_dim;
            const uint16_t *vr = value + (t0 + t) * v_stride + (int64_t)kh * head_dim;
            for (int d = 0; d < head_dim; d++) kt[(d / 2) * 2 * KEY_BLOCK + (d & 1)] = kr[d];
            for (int d = 0; d < head_dim; d++) vt[2 * d] = vr[d];
        }
    }
}

/* As DEFINE_ROWS_STEP, with pair products: `q` holds R rows of head_dim / 2 bf16 pairs. */
#define DEFINE_PAIRS_STEP(NAME, R, ND)                                                             \
static inline __attribute__((always_inline)) void NAME(                                            \
        const uint32_t *q, const uint16_t *kb, const uint16_t *vb, const __mmask16 *valid,         \
        float scale, float *run_max, __m512 *run_sum, float *acc) {                                \
    enum { D = ND * 16, PAIRS = ND * 8 };                                                          \
    __m512 s[R][2];                                                                                \
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();                           \
    for (int d2 = 0; d2 < PAIRS; d2 += 2) { /* two chains a row */                                 \
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + d2 * 2 * KEY_BLOCK);                 \
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (d2 + 1) * 2 * KEY_BLOCK);           \
        for (int r = 0; r < R; r++) {                                                              \
            s[r][0] = _mm512_dpbf16_ps(s[r][0], (__m512bh)_mm512_set1_epi32(                       \
                (int)q[r * PAIRS + d2]), k0);                                                      \
            s[r][1] = _mm512_dpbf16_ps(s[r][1], (__m512bh)_mm512_set1_epi32(                       \
                (int)q[r * PAIRS + d2 + 1]), k1);                                                  \
        }                                                                                          \
    }                                                                                              \
    uint32_t probs[R][KEY_BLOCK / 2] __attribute__((aligned(32)));                                 \
    __m512 corr[R];                                                                                \
    const __m512 scales = _mm512_set1_ps(scale);                                                   \
    for (int r = 0; r < R; r++) {                                                                  \
        const __m512 p = softmax_block(_mm512_mul_ps(_mm512_add_ps(s[r][0], s[r][1]), scales),     \
                                       valid[r], run_max + r, run_sum + r, corr + r);              \
        _mm256_store_si256((__m256i *)probs[r], (__m256i)_mm512_cvtneps_pbh(p));                   \
    }                                                                                              \
    for (int j0 = 0; j0 < ND; j0 += 4) {                                                           \
        __m512 a[R][4];                                                                            \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < 4; j++)                                                            \
                a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + (j0 + j) * 16), corr[r]);    \
        for (int tp = 0; tp < KEY_BLOCK / 2; tp++) {                                               \
            __m512bh v[4];                                                                         \
            for (int j = 0; j < 4; j++)                                                            \
                v[j] = (__m512bh)_mm512_loadu_si512(vb + tp * 2 * D + (j0 + j) * 32);              \
            for (int r = 0; r < R; r++) {                                                          \
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)probs[r][tp]);                 \
                for (int j = 0; j < 4; j++) a[r][j] = _mm512_dpbf16_ps(a[r][j], p, v[j]);          \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + r * D + (j0 + j) * 16, a[r][j]);    \
    }                                                                                              \
}

DEFINE_PAIRS_STEP(pairs4_d4, 4, 4)
DEFINE_PAIRS_STEP(pairs1_d4, 1, 4)
DEFINE_PAIRS_STEP(pairs4_d8, 4, 8)
DEFINE_PAIRS_STEP(pairs1_d8, 1, 8)

/* As DEFINE_SIMD_ITEM, on the paired layouts. */
#define DEFINE_PAIRS_ITEM(NAME, ND, STEP4, STEP1)                                                  \
static void NAME(const uint16_t *query, int64_t q_stride, const uint16_t *kp,                      \
                 const uint16_t *vp, int64_t start, int64_t q0, int64_t q_end, int head,           \
                 int num_heads, float scale, uint16_t *out) {                                      \
    enum { D = ND * 16, PAIRS = ND * 8 };                                                          \
    const int n = (int)(q_end - q0);                                                               \
    uint32_t q[QUERY_BLOCK * PAIRS] __attribute__((aligned(64)));                                  \
    float acc[QUERY_BLOCK * D] __attribute__((aligned(64)));                                       \
    float run_max[QUERY_BLOCK];                                                                    \
    __m512 run_sum[QUERY_BLOCK];                                                                   \
    for (int r = 0; r < n; r++) {                                                                  \
        memcpy(q + r * PAIRS, query + (q0 + r) * q_stride + (int64_t)head * D,                     \
               D * sizeof(uint16_t));                                                              \
        for (int d = 0; d < D; d++) acc[r * D + d] = 0.0f;                                         \
        run_max[r] = -INFINITY;                                                                    \
        run_sum[r] = _mm512_setzero_ps();                                                          \
    }                                                                                              \
    const int64_t first = start / KEY_BLOCK, last = (q_end - 1) / KEY_BLOCK;                       \
    for (int64_t b = first; b <= last; b++) {                                                      \
        const uint16_t *kb = kp + b * KEY_BLOCK * D, *vb = vp + b * KEY_BLOCK * D;                 \
        int r = (int)(b * KEY_BLOCK - q0 > 0 ? b * KEY_BLOCK - q0 : 0);                            \
        __mmask16 valid[ROWS];                                                                     \
        for (; r + ROWS <= n; r += ROWS) {                                                         \
            for (int i = 0; i < ROWS; i++) valid[i] = visible_lanes(b, start, q0 + r + i);         \
            STEP4(q + r * PAIRS, kb, vb, valid, scale, run_max + r, run_sum + r, acc + r * D);     \
        }                                                                                          \
        for (; r < n; r++) {                                                                       \
            valid[0] = visible_lanes(b, start, q0 + r);                                            \
            STEP1(q + r * PAIRS, kb, vb, valid, scale, run_max + r, run_sum + r, acc + r * D);     \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < n; r++) {                                                                  \
        const float total = _mm512_reduce_add_ps(run_sum[r]);                                      \
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;                                      \
        for (int d = 0; d < D; d++) acc[r * D + d] *= inv;                                         \
        from_float_bf16_simd(out + ((q0 + r) * num_heads + head) * D, acc + r * D, D);             \
    }                                                                                              \
}

DEFINE_PAIRS_ITEM(pairs_item_d4, 4, pairs4_d4, pairs1_d4)
DEFINE_PAIRS_ITEM(pairs_item_d8, 8, pairs4_d8, pairs1_d8)

static int pairs_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key,
                      int64_t k_stride, const uint16_t *value, int64_t v_stride,
                      const int64_t *qsl, int num_seqs, int num_heads, int num_kv_heads,
                      int head_dim, float scale, uint16_t *out) {
    const int64_t num_tokens = qsl[num_seqs];
    const int64_t num_blocks = (num_tokens + KEY_BLOCK - 1) / KEY_BLOCK;
    const int64_t head_elems = num_blocks * KEY_BLOCK * head_dim; /* one KV head's K */
    uint16_t *kp = malloc((size_t)(2 * num_kv_heads * head_elems) * sizeof(uint16_t));
    Item *items;
    const int64_t num_items =
        kp ? list_items(qsl, num_seqs, num_heads, QUERY_BLOCK, &items) : -1;
    if (num_items < 0) { free(kp); return -2; }
    uint16_t *vp = kp + num_kv_heads * head_elems;
    pack_bf16_pairs(key, k_stride, value, v_stride, num_tokens, num_kv_heads, head_dim, kp, vp);
    const int group = num_heads / num_kv_heads;
    _Pragma("omp parallel for schedule(dynamic)")
    for (int64_t i = 0; i < num_items; i++) {
        const Item it = items[i];
        const int64_t end = qsl[it.seq + 1];
        const int64_t q_end = it.q0 + QUERY_BLOCK < end ? it.q0 + QUERY_BLOCK : end;
        const int64_t kv = (int64_t)(it.head / group) * head_elems;
        (head_dim == 64 ? pairs_item_d4 : pairs_item_d8)(query, q_stride, kp + kv, vp + kv,
                                                         qsl[it.seq], it.q0, q_end, it.head,
                                                         num_heads, scale, out);
    }
    free(items);
    free(kp);
    return 0;
}
#endif /* __AVX512BF16__ */
#endif

/* --- bf16 on AMX ------------------------------------------------------------------------------
 * Per item (sequence, query head, up to AMX_ROWS = 32 query rows) and block of 32 keys: scores
 * S = Q K^T in two 16 x 16 float tiles per 16 query rows, softmax on them with AVX-512 (the
 * probabilities rounded to bf16, as the second product takes bf16), then P V into head_dim / 16
 * float tiles per 16 rows that are added into the rescaled accumulators. K and V are first
 * rearranged into the tiles' pair-interleaved layout:
 *   K: [kv_head][block][head_dim / 32 steps][2 halves of 16 keys] tiles, row i holding dims
 *      2i, 2i + 1 of each of the 16 keys;
 *   V: [kv_head][block][head_dim / 16 column groups] tiles, row i holding keys 2i, 2i + 1 of
 *      each of the 16 dims. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_KEYS 32
#define AMX_ROWS 32
#define TILE_ELEMS 512 /* bf16 values in one 16 x 64-byte tile */

#include "amx.h"


static void amx_pack(const uint16_t *key, int64_t k_stride, const uint16_t *value,
                     int64_t v_stride, int64_t num_tokens, int num_kv_heads, int head_dim,
                     uint16_t *kp, uint16_t *vp) {
    const int64_t num_blocks = (num_tokens + AMX_KEYS - 1) / AMX_KEYS;
    const int64_t block_elems = (int64_t)AMX_KEYS * head_dim;
    #pragma omp parallel for schedule(dynamic, 8)
    for (int64_t i = 0; i < num_kv_heads * num_blocks; i++) {
        const int kh = (int)(i / num_blocks);
        const int64_t t0 = (i % num_blocks) * AMX_KEYS;
        /* moved as 32-bit pairs: K's pairs are two dims of one key, V's two keys of one dim */
        uint32_t *kb = (uint32_t *)(kp + i * block_elems), *vb = (uint32_t *)(vp + i * block_elems);
        for (int t = 0; t < AMX_KEYS; t++) {
            uint32_t *tile_col = kb + (t / 16) * (TILE_ELEMS / 2) + t % 16;
            if (t0 + t < num_tokens) {
                const uint16_t *row = key + (t0 + t) * k_stride + (int64_t)kh * head_dim;
                for (int d2 = 0; d2 < head_dim / 2; d2++) { /* tile d / 32, row (d % 32) / 2 */
                    uint32_t pair;
                    memcpy(&pair, row + 2 * d2, sizeof pair);
                    tile_col[(d2 / 16) * TILE_ELEMS + (d2 % 16) * 16] = pair;
                }
            } else {
                for (int d2 = 0; d2 < head_dim / 2; d2++)
                    tile_col[(d2 / 16) * TILE_ELEMS + (d2 % 16) * 16] = 0;
            }
        }
        for (int t = 0; t < AMX_KEYS; t += 2) {
            /* a padding key's row is past the end of `value`: no pointer to it is formed */
            const int have_even = t0 + t < num_tokens, have_odd = t0 + t + 1 < num_tokens;
            const uint16_t *even =
                have_even ? value + (t0 + t) * v_stride + (int64_t)kh * head_dim : NULL;
            const uint16_t *odd = have_odd ? even + v_stride : NULL;
            uint32_t *tile_row = vb + (t / 2) * 16; /* tile d / 16, row t / 2, column d % 16 */
            for (int d = 0; d < head_dim; d++)
                tile_row[(d / 16) * (TILE_ELEMS / 2) + d % 16] =
                    (have_even ? even[d] : 0u) | (uint32_t)(have_odd ? odd[d] : 0u) << 16;
        }
    }
}

/* P V of one block for column groups g, g + 1 of the first row tile, the probabilities in tile
 * 4: tiles 0 and 1 accumulate, 6 and 7 take V (an item of at most 16 rows). */
static inline __attribute__((always_inline)) void amx_pv1(const uint16_t *vb, int g,
                                                          float *pv, int dim) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, vb + g * TILE_ELEMS, 64);
    _tile_loadd(7, vb + (g + 1) * TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_stored(0, pv + g * 16, dim * sizeof(float));
    _tile_stored(1, pv + (g + 1) * 16, dim * sizeof(float));
}

/* P V of one block for column groups g, g + 1 of both row tiles, the probabilities in tiles 4
 * and 5: tiles 0-3 accumulate, 6 and 7 take V. */
static inline __attribute__((always_inline)) void amx_pv2(const uint16_t *vb, int g,
                                                          float *pv, int dim) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(6, vb + g * TILE_ELEMS, 64);
    _tile_loadd(7, vb + (g + 1) * TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, pv + g * 16, dim * sizeof(float));
    _tile_stored(1, pv + (g + 1) * 16, dim * sizeof(float));
    _tile_stored(2, pv + 16 * dim + g * 16, dim * sizeof(float));
    _tile_stored(3, pv + 16 * dim + (g + 1) * 16, dim * sizeof(float));
}

/* P V of one block added straight into the accumulators (rows `dim` floats apart) for column
 * groups g, g + 1: when no row's running max moved, there is nothing to rescale. `tiles` row
 * tiles, their probabilities in tiles 4 (and 5). */
static inline __attribute__((always_inline)) void amx_pv_into(const uint16_t *vb, int g,
                                                              float *acc, int dim, int tiles) {
    const int stride = dim * (int)sizeof(float);
    _tile_loadd(0, acc + g * 16, stride);
    _tile_loadd(1, acc + (g + 1) * 16, stride);
    _tile_loadd(6, vb + g * TILE_ELEMS, 64);
    _tile_loadd(7, vb + (g + 1) * TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_stored(0, acc + g * 16, stride);
    _tile_stored(1, acc + (g + 1) * 16, stride);
    if (tiles == 2) {
        _tile_loadd(2, acc + 16 * dim + g * 16, stride);
        _tile_loadd(3, acc + 16 * dim + (g + 1) * 16, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_stored(2, acc + 16 * dim + g * 16, stride);
        _tile_stored(3, acc + 16 * dim + (g + 1) * 16, stride);
    }
}

/* One work item: query rows [q0, q_end) (at most 32: two A tiles) of one head. Each key block
 * gives four independent score tiles (rows 0-15 / 16-31 x keys 0-15 / 16-31), so the tile unit
 * is never waiting on one accumulator. */
static void amx_item(const uint16_t *query, int64_t q_stride, const uint16_t *kp,
                     const uint16_t *vp, int64_t start, int64_t q0, int64_t q_end, int head,
                     int num_heads, int head_dim, float scale, uint16_t *out) {
    const int n = (int)(q_end - q0), steps = head_dim / 32, groups = head_dim / 16;
    const int64_t block_elems = (int64_t)AMX_KEYS * head_dim;
    /* rows head_dim apart: at head_dim 64 the item's buffers take half the L1 */
    const int dim = head_dim;
    uint16_t q[AMX_ROWS * 128] __attribute__((aligned(64)));
    uint16_t p[AMX_ROWS][AMX_KEYS] __attribute__((aligned(64)));
    float s[AMX_ROWS][AMX_KEYS] __attribute__((aligned(64)));
    float pv[AMX_ROWS * 128] __attribute__((aligned(64)));
    float acc[AMX_ROWS * 128] __attribute__((aligned(64)));
    float run_max[AMX_ROWS] __attribute__((aligned(64)));
    float block_max[AMX_ROWS] __attribute__((aligned(64)));
    float corr[AMX_ROWS] __attribute__((aligned(64)));
    __m512 run_sum[AMX_ROWS];
    const int tiles = n > 16 ? 2 : 1; /* row tiles with a real row */
    for (int r = 0; r < 16 * tiles; r++) {
        if (r < n) memcpy(q + r * dim, query + (q0 + r) * q_stride + (int64_t)head * head_dim,
                          head_dim * sizeof(uint16_t));
        else memset(q + r * dim, 0, head_dim * sizeof(uint16_t));
        memset(acc + r * dim, 0, head_dim * sizeof(float));
        run_max[r] = -INFINITY;
        run_sum[r] = _mm512_setzero_ps();
    }
    const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-INFINITY);
    const int64_t first = start / AMX_KEYS, last = (q_end - 1) / AMX_KEYS;
    for (int64_t b = first; b <= last; b++) {
        const uint16_t *kb = kp + b * block_elems, *vb = vp + b * block_elems;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int st = 0; st < steps; st++) {
            _tile_loadd(4, q + st * 32, dim * sizeof(uint16_t));
            _tile_loadd(6, kb + (st * 2) * TILE_ELEMS, 64);
            _tile_loadd(7, kb + (st * 2 + 1) * TILE_ELEMS, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (tiles == 2) {
                _tile_loadd(5, q + 16 * dim + st * 32, dim * sizeof(uint16_t));
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, &s[0][0], AMX_KEYS * sizeof(float));
        _tile_stored(1, &s[0][16], AMX_KEYS * sizeof(float));
        if (tiles == 2) {
            _tile_stored(2, &s[16][0], AMX_KEYS * sizeof(float));
            _tile_stored(3, &s[16][16], AMX_KEYS * sizeof(float));
        }
        /* Scaled and masked scores, and each row's block max. */
        const int64_t k0 = b * AMX_KEYS;
        const int64_t lo = start - k0 < 0 ? 0 : (start - k0 > AMX_KEYS ? AMX_KEYS : start - k0);
        __m512 s0[AMX_ROWS], s1[AMX_ROWS];
        for (int r = 0; r < 16 * tiles; r++) {
            /* keys [start, q0 + r] of this block; none for the padding rows past the item */
            const int64_t end = q0 + r - k0 + 1;
            const int64_t hi = r >= n || end < 0 ? 0 : (end > AMX_KEYS ? AMX_KEYS : end);
            const uint64_t lanes = ((1ull << hi) - 1) & ~((1ull << lo) - 1);
            /* unscaled: the scale is applied inside the exponentials (it is positive, so the
             * max is the same key either way) */
            s0[r] = _mm512_mask_blend_ps((__mmask16)lanes, neg_inf, _mm512_load_ps(&s[r][0]));
            s1[r] = _mm512_mask_blend_ps((__mmask16)(lanes >> 16), neg_inf,
                                         _mm512_load_ps(&s[r][16]));
            block_max[r] = _mm512_reduce_max_ps(_mm512_max_ps(s0[r], s1[r]));
        }
        /* The rescaling factors 16 rows at a time; a row that sees nothing here (-inf block
         * max: past its causal end, or padding) keeps its state. Once the running maxima have
         * settled (often at the first key, which most rows weigh most), every factor is 1. */
        int rescale = 0;
        for (int r0 = 0; r0 < 16 * tiles; r0 += 16) {
            const __m512 old = _mm512_load_ps(run_max + r0), bm = _mm512_load_ps(block_max + r0);
            const __mmask16 seen = _mm512_cmp_ps_mask(bm, neg_inf, _CMP_NEQ_OQ);
            const __m512 new_max = _mm512_mask_max_ps(old, seen, old, bm);
            /* the first block's factor: exp(-inf) = 0 */
            const __m512 c = exp16(_mm512_mul_ps(_mm512_sub_ps(old, new_max), vscale));
            const __m512 factor = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.0f), c);
            rescale |= _mm512_cmp_ps_mask(factor, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
            _mm512_store_ps(corr + r0, factor);
            _mm512_store_ps(run_max + r0, new_max);
        }
        for (int r = 0; r < 16 * tiles; r++) {
            if (block_max[r] == -INFINITY) {
                memset(p[r], 0, sizeof p[r]);
                continue;
            }
            const __m512 m = _mm512_set1_ps(run_max[r] * scale);
            const __m512 p0 = exp16(_mm512_fmsub_ps(s0[r], vscale, m));
            const __m512 p1 = exp16(_mm512_fmsub_ps(s1[r], vscale, m));
            run_sum[r] = _mm512_fmadd_ps(run_sum[r], _mm512_set1_ps(corr[r]),
                                         _mm512_add_ps(p0, p1));
            _mm512_store_si512((__m512i *)p[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        /* p's rows 16-31 are written only when the item has them (two row tiles) */
        _tile_loadd(4, p[0], AMX_KEYS * sizeof(uint16_t));
        if (tiles == 2) _tile_loadd(5, p[16], AMX_KEYS * sizeof(uint16_t));
        if (!rescale) {
            for (int g = 0; g < groups; g += 2) amx_pv_into(vb, g, acc, dim, tiles);
            continue;
        }
        if (tiles == 2) {
            for (int g = 0; g < groups; g += 2) amx_pv2(vb, g, pv, dim);
        } else {
            for (int g = 0; g < groups; g += 2) amx_pv1(vb, g, pv, dim);
        }
        for (int r = 0; r < n; r++) {
            const __m512 c = _mm512_set1_ps(corr[r]);
            for (int j = 0; j < groups; j++) {
                float *a = acc + r * dim + j * 16;
                _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), c,
                                                   _mm512_load_ps(pv + r * dim + j * 16)));
            }
        }
    }
    for (int r = 0; r < n; r++) {
        const float total = _mm512_reduce_add_ps(run_sum[r]);
        const __m512 inv = _mm512_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);
        uint16_t *o = out + ((q0 + r) * num_heads + head) * head_dim;
        for (int j = 0; j < groups; j++)
            store16_bf16_rne(o + j * 16,
                             _mm512_mul_ps(_mm512_load_ps(acc + r * dim + j * 16), inv));
    }
}

/* -2 when out of memory or AMX is not granted (the caller then takes the AVX-512 path). */
static int amx_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key,
                    int64_t k_stride, const uint16_t *value, int64_t v_stride,
                    const int64_t *qsl, int num_seqs, int num_heads, int num_kv_heads,
                    int head_dim, float scale, uint16_t *out) {
    if (!matmul_amx_available()) return -2;
    const int64_t num_tokens = qsl[num_seqs];
    const int64_t num_blocks = (num_tokens + AMX_KEYS - 1) / AMX_KEYS;
    const int64_t head_elems = num_blocks * AMX_KEYS * head_dim; /* one KV head's packed K */
    uint16_t *kp = aligned_alloc(64, (size_t)(2 * num_kv_heads * head_elems) * sizeof(uint16_t));
    Item *items;
    const int64_t num_items = kp ? list_items(qsl, num_seqs, num_heads, AMX_ROWS, &items) : -1;
    if (num_items < 0) { free(kp); return -2; }
    uint16_t *vp = kp + num_kv_heads * head_elems;
    amx_pack(key, k_stride, value, v_stride, num_tokens, num_kv_heads, head_dim, kp, vp);
    const int group = num_heads / num_kv_heads;
    #pragma omp parallel
    {
        amx_load_full_tiles();
        #pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < num_items; i++) {
            const Item it = items[i];
            const int64_t end = qsl[it.seq + 1];
            const int64_t q_end = it.q0 + AMX_ROWS < end ? it.q0 + AMX_ROWS : end;
            const int64_t kv = (int64_t)(it.head / group) * head_elems;
            amx_item(query, q_stride, kp + kv, vp + kv, qsl[it.seq], it.q0, q_end, it.head,
                     num_heads, head_dim, scale, out);
        }
        _tile_release();
    }
    free(items);
    free(kp);
    return 0;
}
#endif

/* Which vector loop runs fp32 and bf16 prompts: 2 AVX-512, 1 AVX2 (prefill_attention_avx2.c),
 * 0 none. */
int prefill_simd_available(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int prefill_dpbf16_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int prefill_amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return matmul_amx_available();
#else
    return 0;
#endif
}

/* 0 when done; -1 for shapes it does not run (head_dim other than 64 and 128, heads not a
 * multiple of the KV heads): the caller runs the torch op; -2 out of memory; -3 when
 * query_start_loc does not run from 0 to num_tokens in order. Nothing is written unless 0. */
#define DEFINE_ENTRY(NAME, T, SFX)                                                                 \
int NAME(const T *query, int64_t q_stride, const T *key, int64_t k_stride, const T *value,         \
         int64_t v_stride, const int64_t *query_start_loc, int num_seqs, int64_t num_tokens,       \
         int num_heads, int num_kv_heads, int head_dim, float scale, T *out) {                     \
    if ((head_dim != 64 && head_dim != 128) || num_kv_heads < 1 || num_heads < num_kv_heads ||     \
        num_heads % num_kv_heads != 0)                                                             \
        return -1;                                                                                 \
    if (check_starts(query_start_loc, num_seqs, num_tokens) != 0) return -3;                       \
    if (num_tokens == 0) return 0;                                                                 \
    SIMD_CALL(SFX)                                                                                 \
    return portable_##SFX(query, q_stride, key, k_stride, value, v_stride, query_start_loc,        \
                          num_seqs, num_heads, num_kv_heads, head_dim, scale, out);                \
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_CALL_bf16                                                                              \
    if (pagoda_prefill_simd && pagoda_prefill_amx &&                                               \
        amx_bf16(query, q_stride, key, k_stride, value, v_stride, query_start_loc, num_seqs,       \
                 num_heads, num_kv_heads, head_dim, scale, out) == 0)                              \
        return 0;
#else
#define AMX_CALL_bf16
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DPBF16_CALL_bf16                                                                           \
    if (pagoda_prefill_simd && pagoda_prefill_dpbf16)                                              \
        return pairs_bf16(query, q_stride, key, k_stride, value, v_stride, query_start_loc,        \
                          num_seqs, num_heads, num_kv_heads, head_dim, scale, out);
#else
#define DPBF16_CALL_bf16
#endif
#define AMX_CALL_f32
#define DPBF16_CALL_f32

#if defined(__AVX512F__)
#define SIMD_CALL(SFX)                                                                             \
    AMX_CALL_##SFX                                                                                 \
    DPBF16_CALL_##SFX                                                                              \
    if (pagoda_prefill_simd)                                                                       \
        return simd_##SFX(query, q_stride, key, k_stride, value, v_stride, query_start_loc,        \
                          num_seqs, num_heads, num_kv_heads, head_dim, scale, out);
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD_CALL(SFX)                                                                             \
    if (pagoda_prefill_simd)                                                                       \
        return prefill_avx2_##SFX(query, q_stride, key, k_stride, value, v_stride,                 \
                                  query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim,    \
                                  scale, out);
#else
#define SIMD_CALL(SFX)
#endif

DEFINE_ENTRY(causal_prefill_f32, float, f32)
DEFINE_ENTRY(causal_prefill_bf16, uint16_t, bf16)
