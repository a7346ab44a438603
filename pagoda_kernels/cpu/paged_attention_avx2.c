/* Paged decode attention with AVX2 and FMA, for CPUs without AVX-512: paged_attention_avx512.c's
 * loop on 8-lane vectors, for head_dim 64 and 128 and up to 8 query heads per KV head. Same
 * inputs, same result up to float rounding order; 8-bit caches and other shapes run the portable
 * loop in paged_attention.c.
 *
 * Why: the portable loop reduces every (token, head) dot product to a scalar on its own and
 * keeps its accumulators in memory; on a 2-core Zen 1 it read the cache at ~6.6 GB/s where a
 * plain sum reads 11. Here a tile of 8 tokens is scored at once: each token's partial products
 * stay a vector, one transposing reduction (hadd, then one exchange of 128-bit halves) turns 8
 * of them into one vector of 8 scores, and softmax runs on vectors. The query is scaled once, as
 * the portable loop does. The rows FETCH_AHEAD tokens ahead in the same block are fetched into
 * L2 while a tile computes; the next work item's rows are not (the AVX-512 loop does that). */
#include <math.h>
#include <stdint.h>

#include <omp.h>

#include "common.h"
#include "paged_attention.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2.h"

#define TILE 8
#ifndef FETCH_AHEAD
#define FETCH_AHEAD 16 /* tokens: two tiles ahead */
#endif
#ifndef FETCH_LOCALITY
#define FETCH_LOCALITY 2 /* into L2 */
#endif
_Static_assert(FETCH_AHEAD % TILE == 0, "FETCH_AHEAD must be a multiple of TILE");
#define ITEM_HEADS 16 /* query heads per work item at most: bounds each item's stack frame */

static inline __attribute__((always_inline)) void row8_f32(__m256 *dst, const float *src,
                                                           int nd) {
    for (int j = 0; j < nd; j++) dst[j] = _mm256_loadu_ps(src + j * TILE);
}

static inline __attribute__((always_inline)) void row8_bf16(__m256 *dst, const uint16_t *src,
                                                            int nd) {
    for (int j = 0; j < nd; j++) dst[j] = load8_bf16(src + j * TILE);
}

static inline void out8_f32(float *dst, __m256 x) { _mm256_storeu_ps(dst, x); }

static inline void out8_bf16(uint16_t *dst, __m256 x) { store8_bf16(dst, round8_bf16(x)); }

/* q . k over nd vectors, in two chains (nd is even). */
static inline __attribute__((always_inline)) __m256 dot8(const __m256 *q, const __m256 *k,
                                                         int nd) {
    __m256 s0 = _mm256_mul_ps(q[0], k[0]), s1 = _mm256_mul_ps(q[1], k[1]);
    for (int j = 2; j < nd; j += 2) {
        s0 = _mm256_fmadd_ps(q[j], k[j], s0);
        s1 = _mm256_fmadd_ps(q[j + 1], k[j + 1], s1);
    }
    return _mm256_add_ps(s0, s1);
}

/* v[0..7] -> one vector whose lane t is the sum of v[t]'s 8 lanes. Two rounds of hadd leave each
 * 128-bit half with v[t]'s half sums in lane t % 4; adding the halves crosswise finishes. */
static inline __m256 sum_lanes8(const __m256 *v) {
    const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                         _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* `bytes` of the row at `row` into L2 (FETCH_LOCALITY). */
static inline __attribute__((always_inline)) void fetch_l2(const void *row, int bytes) {
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)row + c, 0, FETCH_LOCALITY);
}

/* One sequence and `kv_heads` of its KV heads (from the one `query`, `key_cache`, `value_cache`
 * and `out` point at), as paged_attention_avx512.c's items: per block, each KV head's G query
 * heads (ND vectors of 8 each) score its rows and take in its values; a block is read whole, in
 * memory order. Expanded once per (G, ND) so that the loops over them unroll. */
#define DEFINE_AVX2_ITEM(NAME, T, ROW, OUT8, G, ND)                                                \
static void NAME(const T *query, const T *key_cache, const T *value_cache,                         \
                 const int64_t *table, int64_t len, T *out, int kv_heads, int block_size,          \
                 int64_t token_stride, int64_t block_stride, float scale) {                        \
    __m256 q_all[ITEM_HEADS / G][G][ND], acc_all[ITEM_HEADS / G][G][ND];                           \
    float max_all[ITEM_HEADS / G][G], sum_all[ITEM_HEADS / G][G];                                  \
    float probs[G][TILE] __attribute__((aligned(32)));                                             \
    const __m256 scale8 = _mm256_set1_ps(scale);                                                   \
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);                                    \
    for (int kh = 0; kh < kv_heads; kh++)                                                          \
        for (int g = 0; g < G; g++) {                                                              \
            ROW(q_all[kh][g], query + (kh * G + g) * ND * TILE, ND);                               \
            for (int j = 0; j < ND; j++) {                                                         \
                q_all[kh][g][j] = _mm256_mul_ps(q_all[kh][g][j], scale8);                          \
                acc_all[kh][g][j] = _mm256_setzero_ps();                                           \
            }                                                                                      \
            max_all[kh][g] = -INFINITY;                                                            \
            sum_all[kh][g] = 0.0f;                                                                 \
        }                                                                                          \
    const int row_bytes = (int)(ND * TILE * sizeof(T));                                            \
    for (int64_t start = 0; start < len; start += block_size) {                                    \
        const int in_block = (int)(len - start < block_size ? len - start : block_size);           \
        const int64_t base = table[start / block_size] * block_stride;                             \
        for (int kh = 0; kh < kv_heads; kh++) {                                                    \
            __m256 q[G][ND], acc[G][ND];                                                           \
            float run_max[G], run_sum[G];                                                          \
            for (int g = 0; g < G; g++) {                                                          \
                for (int j = 0; j < ND; j++) {                                                     \
                    q[g][j] = q_all[kh][g][j];                                                     \
                    acc[g][j] = acc_all[kh][g][j];                                                 \
                }                                                                                  \
                run_max[g] = max_all[kh][g];                                                       \
                run_sum[g] = sum_all[kh][g];                                                       \
            }                                                                                      \
            for (int t0 = 0; t0 < in_block; t0 += TILE) {                                         \
                const int n = in_block - t0 < TILE ? in_block - t0 : TILE;                         \
                const T *k_rows = key_cache + base + t0 * token_stride + kh * ND * TILE;           \
                const T *v_rows = value_cache + base + t0 * token_stride + kh * ND * TILE;         \
                /* The rows FETCH_AHEAD tokens on, as far as they stay in one block. */            \
                const int64_t ahead = start + t0 + FETCH_AHEAD;                                    \
                int n_ahead = 0;                                                                   \
                int64_t ahead_at = 0;                                                              \
                if (ahead < len) {                                                                 \
                    const int at = (int)(ahead % block_size);                                      \
                    n_ahead = block_size - at < TILE ? block_size - at : TILE;                     \
                    n_ahead = len - ahead < n_ahead ? (int)(len - ahead) : n_ahead;                \
                    ahead_at = table[ahead / block_size] * block_stride + at * token_stride        \
                               + kh * ND * TILE;                                                   \
                }                                                                                  \
                __m256 partial[G][TILE];                                                           \
                for (int t = 0; t < TILE; t++) {                                                   \
                    if (t < n) {                                                                   \
                        __m256 k[ND];                                                              \
                        ROW(k, k_rows + t * token_stride, ND);                                     \
                        if (t < n_ahead)                                                           \
                            fetch_l2(key_cache + ahead_at + t * token_stride, row_bytes);          \
                        for (int g = 0; g < G; g++) partial[g][t] = dot8(q[g], k, ND);             \
                    } else {                                                                       \
                        for (int g = 0; g < G; g++) partial[g][t] = _mm256_setzero_ps();           \
                    }                                                                              \
                }                                                                                  \
                const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)n), _CMP_LT_OQ);    \
                for (int g = 0; g < G; g++) {                                                      \
                    const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),                   \
                                                      sum_lanes8(partial[g]), valid);              \
                    const float tile_max = max8(s);                                                \
                    const float new_max = tile_max > run_max[g] ? tile_max : run_max[g];           \
                    const float correction = exp_approx(run_max[g] - new_max);                     \
                    const __m256 p = exp8(_mm256_sub_ps(s, _mm256_set1_ps(new_max)));              \
                    run_max[g] = new_max;                                                          \
                    run_sum[g] = run_sum[g] * correction + sum8(p);                                \
                    _mm256_store_ps(probs[g], p);                                                  \
                    const __m256 corr = _mm256_set1_ps(correction);                                \
                    for (int j = 0; j < ND; j++) acc[g][j] = _mm256_mul_ps(acc[g][j], corr);       \
                }                                                                                  \
                for (int t = 0; t < n; t++) {                                                      \
                    __m256 v[ND];                                                                  \
                    ROW(v, v_rows + t * token_stride, ND);                                         \
                    if (t < n_ahead)                                                               \
                        fetch_l2(value_cache + ahead_at + t * token_stride, row_bytes);            \
                    for (int g = 0; g < G; g++) {                                                  \
                        const __m256 p = _mm256_set1_ps(probs[g][t]);                              \
                        for (int j = 0; j < ND; j++)                                               \
                            acc[g][j] = _mm256_fmadd_ps(p, v[j], acc[g][j]);                       \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int g = 0; g < G; g++) {                                                          \
                for (int j = 0; j < ND; j++) acc_all[kh][g][j] = acc[g][j];                        \
                max_all[kh][g] = run_max[g];                                                       \
                sum_all[kh][g] = run_sum[g];                                                       \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int kh = 0; kh < kv_heads; kh++)                                                          \
        for (int g = 0; g < G; g++) {                                                              \
            const float total = sum_all[kh][g];                                                    \
            const __m256 inv = _mm256_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);                 \
            for (int j = 0; j < ND; j++)                                                           \
                OUT8(out + ((kh * G + g) * ND + j) * TILE, _mm256_mul_ps(acc_all[kh][g][j], inv)); \
        }                                                                                          \
}

#define DEFINE_AVX2_ITEMS(T, SFX, ROW, OUT8)                                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g1_d8, T, ROW, OUT8, 1, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g2_d8, T, ROW, OUT8, 2, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g3_d8, T, ROW, OUT8, 3, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g4_d8, T, ROW, OUT8, 4, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g5_d8, T, ROW, OUT8, 5, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g6_d8, T, ROW, OUT8, 6, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g7_d8, T, ROW, OUT8, 7, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g8_d8, T, ROW, OUT8, 8, 8)                                       \
    DEFINE_AVX2_ITEM(item_##SFX##_g1_d16, T, ROW, OUT8, 1, 16)                                     \
    DEFINE_AVX2_ITEM(item_##SFX##_g2_d16, T, ROW, OUT8, 2, 16)                                     \
    DEFINE_AVX2_ITEM(item_##SFX##_g3_d16, T, ROW, OUT8, 3, 16)                                     \
    DEFINE_AVX2_ITEM(item_##SFX##_g4_d16, T, ROW, OUT8, 4, 16)                                     \
    DEFINE_AVX2_ITEM(item_##SFX##_g5_d16, T, ROW, OUT8, 5, 16)                                     \
    DEFINE_AVX2_ITEM(item_##SFX##_g6_d16, T, ROW, OUT8, 6, 16)                                     \
    DEFINE_AVX2_ITEM(item_##SFX##_g7_d16, T, ROW, OUT8, 7, 16)                                     \
    DEFINE_AVX2_ITEM(item_##SFX##_g8_d16, T, ROW, OUT8, 8, 16)                                     \
    typedef void (*item_##SFX##_fn)(const T *, const T *, const T *, const int64_t *, int64_t,     \
                                    T *, int, int, int64_t, int64_t, float);                       \
    static const item_##SFX##_fn items_##SFX[2][8] = {                                             \
        {item_##SFX##_g1_d8, item_##SFX##_g2_d8, item_##SFX##_g3_d8, item_##SFX##_g4_d8,           \
         item_##SFX##_g5_d8, item_##SFX##_g6_d8, item_##SFX##_g7_d8, item_##SFX##_g8_d8},          \
        {item_##SFX##_g1_d16, item_##SFX##_g2_d16, item_##SFX##_g3_d16, item_##SFX##_g4_d16,       \
         item_##SFX##_g5_d16, item_##SFX##_g6_d16, item_##SFX##_g7_d16, item_##SFX##_g8_d16}};

DEFINE_AVX2_ITEMS(float, f32, row8_f32, out8_f32)
DEFINE_AVX2_ITEMS(uint16_t, bf16, row8_bf16, out8_bf16)

#define DEFINE_AVX2_DECODE(NAME, T, SFX)                                                           \
int NAME(const T *query, int64_t q_stride, const T *key_cache, const T *value_cache,               \
         const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, T *out,          \
         int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,              \
         float scale) {                                                                            \
    const int group = num_heads / num_kv_heads;                                                    \
    if (!pagoda_attention_simd || (head_dim != 64 && head_dim != 128) || group < 1 ||              \
        group > 8)                                                                                 \
        return -1;                                                                                 \
    const item_##SFX##_fn item = items_##SFX[head_dim == 128][group - 1];                          \
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;                                 \
    const int64_t block_stride = (int64_t)block_size * token_stride;                               \
    const int per_item = kv_heads_per_item(num_seqs, num_kv_heads, group, ITEM_HEADS,              \
                                           omp_get_max_threads());                                 \
    const int chunks = num_kv_heads / per_item;                                                    \
    const int num_items = num_seqs * chunks;                                                       \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int i = 0; i < num_items; i++) {                                                          \
        const int s = i / chunks, kh = (i % chunks) * per_item;                                    \
        item(query + s * q_stride + (int64_t)kh * group * head_dim,                                \
             key_cache + (int64_t)kh * head_dim, value_cache + (int64_t)kh * head_dim,             \
             block_tables + s * bt_stride, seq_lens[s],                                            \
             out + ((int64_t)s * num_heads + (int64_t)kh * group) * head_dim, per_item,            \
             block_size, token_stride, block_stride, scale);                                       \
    }                                                                                              \
    return 0;                                                                                      \
}

DEFINE_AVX2_DECODE(paged_decode_simd_f32, float, f32)
DEFINE_AVX2_DECODE(paged_decode_simd_bf16, uint16_t, bf16)

#endif
