/* Paged decode attention with AVX-512: the fast path of paged_attention.c for head_dim 64 and
 * 128 and up to 8 query heads per KV head (what Llama-family models use). Same inputs, same
 * result up to float rounding order; the portable loop in paged_attention.c runs every other
 * shape. Built without AVX-512, this file leaves fp32 and bf16 caches to paged_attention_avx2.c
 * (where the CPU has AVX2 and FMA) and 8-bit caches to the portable loop.
 *
 * Why it is faster than the portable loop: the portable loop reduces every (token, head) dot
 * product to a scalar on its own, which costs more than the multiply-adds, and keeps its
 * accumulators in memory. Here a tile of 16 tokens is scored at once: each token's partial
 * products stay a vector, and one transposing reduction turns 16 of them into one vector of 16
 * scores (45 instructions instead of ~160), so softmax also runs on vectors.
 *
 * A work item is a sequence and as many of its KV heads as fit ITEM_HEADS query heads (one KV
 * head per item when there are too few sequences to keep the threads busy): for most models a
 * block is then read whole, in memory order, and each KV head's rows serve all the query heads
 * that share it.
 */
#include <stdint.h>

#include <omp.h>

#include "common.h"
#include "kv_quant.h"
#include "paged_attention.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "avx512.h"

#define TILE 16
/* Prefetches go FETCH_AHEAD tokens ahead, into L2 (locality 2: prefetcht1). Into L1 they held
 * the core's few L1 miss buffers while the tile's own loads queued behind them: in a bare loop
 * (30 layers, batch 64, context 192, scattered blocks) T1 took 13-15 ms a step in bf16 where T0
 * took 19-21, and 27-32 ms in fp32 where T0 took 37-46, at block sizes 16, 32 and 128; 32 tokens
 * ahead measured the same as 16, 48 slower. Both are -D knobs for measuring other CPUs. */
#ifndef FETCH_LOCALITY
#define FETCH_LOCALITY 2
#endif
#ifndef FETCH_AHEAD
#define FETCH_AHEAD 16
#endif
/* Within a tile, row t + FETCH_NEAR moves from L2 to L1 while row t is used: the L2 prefetch
 * alone left the loads waiting on L2 (bare loop as above, fp32: 4-6% faster with it). */
#ifndef FETCH_NEAR
#define FETCH_NEAR 2
#endif
/* A tile's rows are fetched from the first one's place on: whole tiles ahead keep them in one
 * block at every block size (8 to 128). */
_Static_assert(FETCH_AHEAD % TILE == 0, "FETCH_AHEAD must be a multiple of TILE");
#define ITEM_HEADS 16 /* query heads per work item at most: bounds each item's stack frame */

/* A row of nd * 16 values (a query head or a cached key) as float vectors. (Multiplying bf16
 * pairs with vdpbf16ps, skipping the conversion, measured no faster.) */
static inline __attribute__((always_inline)) void row_f32(__m512 *dst, const float *src, int nd) {
    for (int j = 0; j < nd; j++) dst[j] = _mm512_loadu_ps(src + j * TILE);
}

static inline __attribute__((always_inline)) __m512 dot16(const __m512 *q, const __m512 *k,
                                                              int nd) {
    __m512 s = _mm512_mul_ps(q[0], k[0]);
    for (int j = 1; j < nd; j++) s = _mm512_fmadd_ps(q[j], k[j], s);
    return s;
}

static inline __attribute__((always_inline)) void row_bf16(__m512 *dst, const uint16_t *src,
                                                           int nd) {
    for (int j = 0; j < nd; j++) dst[j] = load16_bf16(src + j * TILE);
}

/* The work item a thread takes after the current one (static schedule: the next index), so
 * that the rows past the current sequence's end are fetched from the next one's start and no
 * item but a thread's first begins on a cold tile (a tenth of the rows at context 192, and the
 * slowest). `shift` moves from the current item's first KV head to the next one's, in the units
 * of row_ahead's answer. table NULL: none. */
typedef struct {
    const int64_t *table;
    int64_t len, shift;
} next_item_t;

#define NO_ROW INT64_MIN

/* Where the cached row of token `token` lies (from the cache's start and the item's first KV
 * head: elements, or bytes for an 8-bit cache), continuing into `next` past the sequence's end,
 * or NO_ROW. A tile fetches the rows FETCH_AHEAD tokens after its own (the first looked up in
 * the block table, the others after it in that block) while it computes, which hides DRAM
 * latency behind the work between; a burst of prefetches for a whole block at once measured
 * slower than none at all (it floods the fill buffers), and with scattered blocks the hardware
 * prefetcher loses the stream at every block edge. */
static inline int64_t row_ahead(const int64_t *table, int64_t token, int64_t len, int block_size,
                                int64_t block_stride, int64_t token_stride,
                                const next_item_t *next) {
    if (token < len)
        return table[token / block_size] * block_stride + (token % block_size) * token_stride;
    /* From the start of the next sequence's tile: its rows then stay in one block. */
    const int unit = block_size < TILE ? block_size : TILE;
    token = (token - len) / unit * unit;
    if (!next->table || token >= next->len) return NO_ROW;
    return next->table[token / block_size] * block_stride + (token % block_size) * token_stride +
           next->shift;
}

/* Prefetches the `bytes` of a cached row (into L2, FETCH_LOCALITY) at byte `offset` from `cache`, unless
 * `ahead` (row_ahead's answer) says there is none. The last byte too: an int8 row (its scale
 * after the values) is not a whole number of lines and need not start on one. */
static inline __attribute__((always_inline)) void fetch_row(const void *cache, int64_t ahead,
                                                            int64_t offset, int bytes) {
    if (ahead == NO_ROW) return;
    const char *row = (const char *)cache + offset;
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, FETCH_LOCALITY);
    __builtin_prefetch(row + bytes - 1, 0, FETCH_LOCALITY);
}

/* Item i + 1 of num_items (sequence-major, `chunks` items of per_item KV heads a sequence) as
 * item i sees it; head_units: one KV head's width in row_ahead's units. */
static inline next_item_t next_item(int i, int num_items, int chunks, int per_item, int kh,
                                    const int64_t *block_tables, int64_t bt_stride,
                                    const int64_t *seq_lens, int64_t head_units) {
    next_item_t next = {NULL, 0, 0};
    if (i + 1 >= num_items) return next;
    const int s = (i + 1) / chunks;
    next.table = block_tables + s * bt_stride;
    next.len = seq_lens[s];
    next.shift = (int64_t)((i + 1) % chunks * per_item - kh) * head_units;
    return next;
}

/* Row t + FETCH_NEAR of a tile of n rows (`stride` bytes apart from `rows`) into L1. */
static inline __attribute__((always_inline)) void fetch_near(const void *rows, int t, int n,
                                                             int64_t stride, int bytes) {
    if (t + FETCH_NEAR >= n) return;
    const char *row = (const char *)rows + (t + FETCH_NEAR) * stride;
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, 3);
    __builtin_prefetch(row + bytes - 1, 0, 3);
}

static inline void store16_f32(float *dst, __m512 x) { _mm512_storeu_ps(dst, x); }

static inline void store16_bf16(uint16_t *dst, __m512 x) {
    float tmp[TILE];
    _mm512_storeu_ps(tmp, x);
    for (int i = 0; i < TILE; i++) dst[i] = float_to_bf16(tmp[i]);
}

/* v[0..15] -> one vector whose lane t is the sum of v[t]'s 16 lanes. */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++)  /* per 128-bit lane: tokens 4j..4j+3, one lane's share */
        x[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* One sequence and `kv_heads` of its KV heads (from the one `query`, `key_cache`, `value_cache`
 * and `out` point at): for each block, each KV head's G query heads (ND vectors of 16 each) score
 * its rows and take in its values. Expanded once per (G, ND) so that the loops over them unroll
 * and one KV head's q / acc live in registers while it works on a block; between heads they wait
 * in L1. Taking every KV head of a block in turn reads the block whole, in memory order. */
#define DEFINE_SIMD_ITEM(NAME, T, ROW, STORE16, G, ND)                                             \
static void NAME(const T *query, const T *key_cache, const T *value_cache,                         \
                 const int64_t *table, int64_t len, T *out, int kv_heads, int block_size,          \
                 int64_t token_stride, int64_t block_stride, float scale,                          \
                 const next_item_t *next) {                                                        \
    __m512 q_all[ITEM_HEADS / G][G][ND], acc_all[ITEM_HEADS / G][G][ND];                           \
    float max_all[ITEM_HEADS / G][G], sum_all[ITEM_HEADS / G][G];                                  \
    float probs[G][TILE] __attribute__((aligned(64)));                                             \
    for (int kh = 0; kh < kv_heads; kh++)                                                          \
        for (int g = 0; g < G; g++) {                                                              \
            ROW(q_all[kh][g], query + (kh * G + g) * ND * TILE, ND);                               \
            for (int j = 0; j < ND; j++) acc_all[kh][g][j] = _mm512_setzero_ps();                  \
            max_all[kh][g] = -INFINITY;                                                            \
            sum_all[kh][g] = 0.0f;                                                                 \
        }                                                                                          \
    const int row_bytes = (int)(ND * TILE * sizeof(T));                                            \
    for (int64_t start = 0; start < len; start += block_size) {                                    \
        const int in_block = (int)(len - start < block_size ? len - start : block_size);           \
        const int64_t base = table[start / block_size] * block_stride;                             \
        for (int kh = 0; kh < kv_heads; kh++) {                                                    \
            __m512 q[G][ND], acc[G][ND];                                                           \
            float run_max[G], run_sum[G];                                                          \
            for (int g = 0; g < G; g++) {                                                          \
                for (int j = 0; j < ND; j++) {                                                     \
                    q[g][j] = q_all[kh][g][j];                                                     \
                    acc[g][j] = acc_all[kh][g][j];                                                 \
                }                                                                                  \
                run_max[g] = max_all[kh][g];                                                       \
                run_sum[g] = sum_all[kh][g];                                                       \
            }                                                                                      \
            for (int t0 = 0; t0 < in_block; t0 += TILE) {                                          \
                const int n = in_block - t0 < TILE ? in_block - t0 : TILE;                         \
                const int64_t ahead = row_ahead(table, start + t0 + FETCH_AHEAD, len, block_size,  \
                                                block_stride, token_stride, next);                 \
                const T *k_rows = key_cache + base + t0 * token_stride + kh * ND * TILE;           \
                const T *v_rows = value_cache + base + t0 * token_stride + kh * ND * TILE;         \
                /* Scores: per head a vector of partial products per token, one reduction. */      \
                __m512 partial[G][TILE];                                                           \
                for (int t = 0; t < TILE; t++) {                                                   \
                    if (t < n) {                                                                   \
                        __m512 k[ND];                                                              \
                        ROW(k, k_rows + t * token_stride, ND);                                     \
                        fetch_near(k_rows, t, n, token_stride * (int64_t)sizeof(T), row_bytes);    \
                        fetch_row(key_cache, ahead, (ahead + t * token_stride) * (int64_t)sizeof(T)\
                                  + kh * row_bytes, row_bytes);                                    \
                        for (int g = 0; g < G; g++) partial[g][t] = dot16(q[g], k, ND);            \
                    } else {                                                                       \
                        for (int g = 0; g < G; g++) partial[g][t] = _mm512_setzero_ps();           \
                    }                                                                              \
                }                                                                                  \
                const __mmask16 valid = (__mmask16)((1u << n) - 1u);                               \
                for (int g = 0; g < G; g++) {                                                      \
                    const __m512 s = _mm512_mask_blend_ps(                                         \
                        valid, _mm512_set1_ps(-INFINITY),                                          \
                        _mm512_mul_ps(sum_lanes16(partial[g]), _mm512_set1_ps(scale)));            \
                    const float tile_max = _mm512_reduce_max_ps(s);                                \
                    const float new_max = tile_max > run_max[g] ? tile_max : run_max[g];           \
                    const float correction = exp_approx(run_max[g] - new_max);                     \
                    const __m512 p = exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max)));             \
                    run_max[g] = new_max;                                                          \
                    run_sum[g] = run_sum[g] * correction + _mm512_reduce_add_ps(p);                \
                    _mm512_store_ps(probs[g], p);                                                  \
                    const __m512 corr = _mm512_set1_ps(correction);                                \
                    for (int j = 0; j < ND; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], corr);       \
                }                                                                                  \
                for (int t = 0; t < n; t++) {                                                      \
                    __m512 v[ND];                                                                  \
                    ROW(v, v_rows + t * token_stride, ND);                                         \
                    fetch_near(v_rows, t, n, token_stride * (int64_t)sizeof(T), row_bytes);        \
                    fetch_row(value_cache, ahead, (ahead + t * token_stride) * (int64_t)sizeof(T)  \
                              + kh * row_bytes, row_bytes);                                        \
                    for (int g = 0; g < G; g++) {                                                  \
                        const __m512 p = _mm512_set1_ps(probs[g][t]);                              \
                        for (int j = 0; j < ND; j++)                                               \
                            acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);                       \
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
            const __m512 inv = _mm512_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);                 \
            for (int j = 0; j < ND; j++)                                                           \
                STORE16(out + ((kh * G + g) * ND + j) * TILE,                                      \
                        _mm512_mul_ps(acc_all[kh][g][j], inv));                                    \
        }                                                                                          \
}

#define DEFINE_SIMD_ITEMS(T, SFX, ROW, STORE16)                                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g1_d4, T, ROW, STORE16, 1, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g2_d4, T, ROW, STORE16, 2, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g3_d4, T, ROW, STORE16, 3, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g4_d4, T, ROW, STORE16, 4, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g5_d4, T, ROW, STORE16, 5, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g6_d4, T, ROW, STORE16, 6, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g7_d4, T, ROW, STORE16, 7, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g8_d4, T, ROW, STORE16, 8, 4)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g1_d8, T, ROW, STORE16, 1, 8)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g2_d8, T, ROW, STORE16, 2, 8)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g3_d8, T, ROW, STORE16, 3, 8)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g4_d8, T, ROW, STORE16, 4, 8)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g5_d8, T, ROW, STORE16, 5, 8)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g6_d8, T, ROW, STORE16, 6, 8)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g7_d8, T, ROW, STORE16, 7, 8)                                    \
    DEFINE_SIMD_ITEM(item_##SFX##_g8_d8, T, ROW, STORE16, 8, 8)                                    \
    typedef void (*item_##SFX##_fn)(const T *, const T *, const T *, const int64_t *, int64_t,     \
                                    T *, int, int, int64_t, int64_t, float, const next_item_t *);  \
    static const item_##SFX##_fn items_##SFX[2][8] = {                                             \
        {item_##SFX##_g1_d4, item_##SFX##_g2_d4, item_##SFX##_g3_d4, item_##SFX##_g4_d4,           \
         item_##SFX##_g5_d4, item_##SFX##_g6_d4, item_##SFX##_g7_d4, item_##SFX##_g8_d4},          \
        {item_##SFX##_g1_d8, item_##SFX##_g2_d8, item_##SFX##_g3_d8, item_##SFX##_g4_d8,           \
         item_##SFX##_g5_d8, item_##SFX##_g6_d8, item_##SFX##_g7_d8, item_##SFX##_g8_d8}};

DEFINE_SIMD_ITEMS(float, f32, row_f32, store16_f32)
DEFINE_SIMD_ITEMS(uint16_t, bf16, row_bf16, store16_bf16)

#define DEFINE_SIMD_DECODE(NAME, T, SFX)                                                           \
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
        const next_item_t next = next_item(i, num_items, chunks, per_item, kh, block_tables,       \
                                           bt_stride, seq_lens, head_dim);                         \
        item(query + s * q_stride + (int64_t)kh * group * head_dim,                                \
             key_cache + (int64_t)kh * head_dim, value_cache + (int64_t)kh * head_dim,             \
             block_tables + s * bt_stride, seq_lens[s],                                            \
             out + ((int64_t)s * num_heads + (int64_t)kh * group) * head_dim, per_item,            \
             block_size, token_stride, block_stride, scale, &next);                                \
    }                                                                                              \
    return 0;                                                                                      \
}

DEFINE_SIMD_DECODE(paged_decode_simd_f32, float, f32)
DEFINE_SIMD_DECODE(paged_decode_simd_bf16, uint16_t, bf16)

/* -- 8-bit caches (kv_quant.h): the same items, each cached row converted as it is loaded. A
 * row of 16 fp8 values widens to fp16 and converts exactly with vcvtph2ps: e5m2 is the top byte
 * of an fp16; e4m3's exponent and mantissa shifted into fp16's fields read as 2^-8 of the value
 * (bias 15 for 7), subnormals included. int8 rows are scaled by the scale after them. -- */
static inline __attribute__((always_inline)) __m512 widen16_q8(const uint8_t *src, int fmt) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    if (fmt == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i w = _mm256_cvtepu8_epi16(b);
    if (fmt == KV_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i h = _mm256_or_si256(
        sign, _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

static inline __attribute__((always_inline)) void row_q8(__m512 *dst, const uint8_t *src, int nd,
                                                         int fmt) {
    for (int j = 0; j < nd; j++) dst[j] = widen16_q8(src + j * TILE, fmt);
    if (fmt == KV_INT8) {
        float scale;
        memcpy(&scale, src + nd * TILE, sizeof scale);
        const __m512 sv = _mm512_set1_ps(scale);
        for (int j = 0; j < nd; j++) dst[j] = _mm512_mul_ps(dst[j], sv);
    }
}

/* DEFINE_SIMD_ITEM with the query and output in T and the cache as bytes of format `fmt`: rows
 * of row_bytes (ND * 16, + 4 for int8's scale), strides in bytes. */
#define DEFINE_SIMD_ITEM_Q8(NAME, T, ROW, STORE16, G, ND)                                          \
static void NAME(const T *query, const uint8_t *key_cache, const uint8_t *value_cache,             \
                 const int64_t *table, int64_t len, T *out, int kv_heads, int block_size,          \
                 int64_t token_stride, int64_t block_stride, float scale, int fmt,                 \
                 const next_item_t *next) {                                                        \
    __m512 q_all[ITEM_HEADS / G][G][ND], acc_all[ITEM_HEADS / G][G][ND];                           \
    float max_all[ITEM_HEADS / G][G], sum_all[ITEM_HEADS / G][G];                                  \
    float probs[G][TILE] __attribute__((aligned(64)));                                             \
    const int row_bytes = kvq_row_bytes(ND * TILE, fmt);                                           \
    for (int kh = 0; kh < kv_heads; kh++)                                                          \
        for (int g = 0; g < G; g++) {                                                              \
            ROW(q_all[kh][g], query + (kh * G + g) * ND * TILE, ND);                               \
            for (int j = 0; j < ND; j++) acc_all[kh][g][j] = _mm512_setzero_ps();                  \
            max_all[kh][g] = -INFINITY;                                                            \
            sum_all[kh][g] = 0.0f;                                                                 \
        }                                                                                          \
    for (int64_t start = 0; start < len; start += block_size) {                                    \
        const int in_block = (int)(len - start < block_size ? len - start : block_size);           \
        const int64_t base = table[start / block_size] * block_stride;                             \
        for (int kh = 0; kh < kv_heads; kh++) {                                                    \
            __m512 q[G][ND], acc[G][ND];                                                           \
            float run_max[G], run_sum[G];                                                          \
            for (int g = 0; g < G; g++) {                                                          \
                for (int j = 0; j < ND; j++) {                                                     \
                    q[g][j] = q_all[kh][g][j];                                                     \
                    acc[g][j] = acc_all[kh][g][j];                                                 \
                }                                                                                  \
                run_max[g] = max_all[kh][g];                                                       \
                run_sum[g] = sum_all[kh][g];                                                       \
            }                                                                                      \
            for (int t0 = 0; t0 < in_block; t0 += TILE) {                                          \
                const int n = in_block - t0 < TILE ? in_block - t0 : TILE;                         \
                const int64_t ahead = row_ahead(table, start + t0 + FETCH_AHEAD, len, block_size,  \
                                                block_stride, token_stride, next);                 \
                const uint8_t *k_rows = key_cache + base + t0 * token_stride + kh * row_bytes;     \
                const uint8_t *v_rows = value_cache + base + t0 * token_stride + kh * row_bytes;   \
                __m512 partial[G][TILE];                                                           \
                for (int t = 0; t < TILE; t++) {                                                   \
                    if (t < n) {                                                                   \
                        __m512 k[ND];                                                              \
                        row_q8(k, k_rows + t * token_stride, ND, fmt);                             \
                        fetch_near(k_rows, t, n, token_stride, row_bytes);                         \
                        fetch_row(key_cache, ahead, ahead + t * token_stride + kh * row_bytes,     \
                                  row_bytes);                                                      \
                        for (int g = 0; g < G; g++) partial[g][t] = dot16(q[g], k, ND);            \
                    } else {                                                                       \
                        for (int g = 0; g < G; g++) partial[g][t] = _mm512_setzero_ps();           \
                    }                                                                              \
                }                                                                                  \
                const __mmask16 valid = (__mmask16)((1u << n) - 1u);                               \
                for (int g = 0; g < G; g++) {                                                      \
                    const __m512 s = _mm512_mask_blend_ps(                                         \
                        valid, _mm512_set1_ps(-INFINITY),                                          \
                        _mm512_mul_ps(sum_lanes16(partial[g]), _mm512_set1_ps(scale)));            \
                    const float tile_max = _mm512_reduce_max_ps(s);                                \
                    const float new_max = tile_max > run_max[g] ? tile_max : run_max[g];           \
                    const float correction = exp_approx(run_max[g] - new_max);                     \
                    const __m512 p = exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max)));             \
                    run_max[g] = new_max;                                                          \
                    run_sum[g] = run_sum[g] * correction + _mm512_reduce_add_ps(p);                \
                    _mm512_store_ps(probs[g], p);                                                  \
                    const __m512 corr = _mm512_set1_ps(correction);                                \
                    for (int j = 0; j < ND; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], corr);       \
                }                                                                                  \
                for (int t = 0; t < n; t++) {                                                      \
                    __m512 v[ND];                                                                  \
                    row_q8(v, v_rows + t * token_stride, ND, fmt);                                 \
                    fetch_near(v_rows, t, n, token_stride, row_bytes);                             \
                    fetch_row(value_cache, ahead, ahead + t * token_stride + kh * row_bytes,       \
                              row_bytes);                                                          \
                    for (int g = 0; g < G; g++) {                                                  \
                        const __m512 p = _mm512_set1_ps(probs[g][t]);                              \
                        for (int j = 0; j < ND; j++)                                               \
                            acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);                       \
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
            const __m512 inv = _mm512_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);                 \
            for (int j = 0; j < ND; j++)                                                           \
                STORE16(out + ((kh * G + g) * ND + j) * TILE,                                      \
                        _mm512_mul_ps(acc_all[kh][g][j], inv));                                    \
        }                                                                                          \
}

#define DEFINE_SIMD_ITEMS_Q8(T, SFX, ROW, STORE16)                                                 \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g1_d4, T, ROW, STORE16, 1, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g2_d4, T, ROW, STORE16, 2, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g3_d4, T, ROW, STORE16, 3, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g4_d4, T, ROW, STORE16, 4, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g5_d4, T, ROW, STORE16, 5, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g6_d4, T, ROW, STORE16, 6, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g7_d4, T, ROW, STORE16, 7, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g8_d4, T, ROW, STORE16, 8, 4)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g1_d8, T, ROW, STORE16, 1, 8)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g2_d8, T, ROW, STORE16, 2, 8)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g3_d8, T, ROW, STORE16, 3, 8)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g4_d8, T, ROW, STORE16, 4, 8)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g5_d8, T, ROW, STORE16, 5, 8)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g6_d8, T, ROW, STORE16, 6, 8)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g7_d8, T, ROW, STORE16, 7, 8)                                   \
    DEFINE_SIMD_ITEM_Q8(q8_##SFX##_g8_d8, T, ROW, STORE16, 8, 8)                                   \
    typedef void (*q8_##SFX##_fn)(const T *, const uint8_t *, const uint8_t *, const int64_t *,   \
                                  int64_t, T *, int, int, int64_t, int64_t, float, int,            \
                                  const next_item_t *);                                            \
    static const q8_##SFX##_fn q8_items_##SFX[2][8] = {                                            \
        {q8_##SFX##_g1_d4, q8_##SFX##_g2_d4, q8_##SFX##_g3_d4, q8_##SFX##_g4_d4,                   \
         q8_##SFX##_g5_d4, q8_##SFX##_g6_d4, q8_##SFX##_g7_d4, q8_##SFX##_g8_d4},                  \
        {q8_##SFX##_g1_d8, q8_##SFX##_g2_d8, q8_##SFX##_g3_d8, q8_##SFX##_g4_d8,                   \
         q8_##SFX##_g5_d8, q8_##SFX##_g6_d8, q8_##SFX##_g7_d8, q8_##SFX##_g8_d8}};

DEFINE_SIMD_ITEMS_Q8(float, f32, row_f32, store16_f32)
DEFINE_SIMD_ITEMS_Q8(uint16_t, bf16, row_bf16, store16_bf16)

#define DEFINE_SIMD_DECODE_Q8(NAME, T, SFX)                                                        \
int NAME(const T *query, int64_t q_stride, const uint8_t *key_cache, const uint8_t *value_cache,   \
         const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, T *out,          \
         int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,              \
         float scale, int cache_dtype) {                                                           \
    const int group = num_heads / num_kv_heads;                                                    \
    if (!pagoda_attention_simd || (head_dim != 64 && head_dim != 128) || group < 1 ||              \
        group > 8 || cache_dtype < KV_INT8 || cache_dtype > KV_FP8_E5M2)                           \
        return -1;                                                                                 \
    const q8_##SFX##_fn item = q8_items_##SFX[head_dim == 128][group - 1];                         \
    const int64_t row_bytes = kvq_row_bytes(head_dim, cache_dtype);                                \
    const int64_t token_stride = (int64_t)num_kv_heads * row_bytes;                                \
    const int64_t block_stride = (int64_t)block_size * token_stride;                               \
    const int per_item = kv_heads_per_item(num_seqs, num_kv_heads, group, ITEM_HEADS,              \
                                           omp_get_max_threads());                                 \
    const int chunks = num_kv_heads / per_item;                                                    \
    const int num_items = num_seqs * chunks;                                                       \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int i = 0; i < num_items; i++) {                                                          \
        const int s = i / chunks, kh = (i % chunks) * per_item;                                    \
        const next_item_t next = next_item(i, num_items, chunks, per_item, kh, block_tables,       \
                                           bt_stride, seq_lens, row_bytes);                        \
        item(query + s * q_stride + (int64_t)kh * group * head_dim,                                \
             key_cache + kh * row_bytes, value_cache + kh * row_bytes,                             \
             block_tables + s * bt_stride, seq_lens[s],                                            \
             out + ((int64_t)s * num_heads + (int64_t)kh * group) * head_dim, per_item,            \
             block_size, token_stride, block_stride, scale, cache_dtype, &next);                   \
    }                                                                                              \
    return 0;                                                                                      \
}

DEFINE_SIMD_DECODE_Q8(paged_decode_q8_simd_f32, float, f32)
DEFINE_SIMD_DECODE_Q8(paged_decode_q8_simd_bf16, uint16_t, bf16)

#else /* no AVX-512: paged_attention_avx2.c's loop (fp32 and bf16 caches) or the portable one */

#if !(defined(__AVX2__) && defined(__FMA__))
int paged_decode_simd_f32(const float *query, int64_t q_stride, const float *key_cache,
                          const float *value_cache, const int64_t *block_tables,
                          int64_t bt_stride, const int64_t *seq_lens, float *out, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale) {
    return -1;
}

int paged_decode_simd_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key_cache,
                           const uint16_t *value_cache, const int64_t *block_tables,
                           int64_t bt_stride, const int64_t *seq_lens, uint16_t *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, float scale) {
    return -1;
}
#endif

int paged_decode_q8_simd_f32(const float *query, int64_t q_stride, const uint8_t *key_cache,
                             const uint8_t *value_cache, const int64_t *block_tables,
                             int64_t bt_stride, const int64_t *seq_lens, float *out,
                             int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                             int block_size, float scale, int cache_dtype) {
    return -1;
}

int paged_decode_q8_simd_bf16(const uint16_t *query, int64_t q_stride, const uint8_t *key_cache,
                              const uint8_t *value_cache, const int64_t *block_tables,
                              int64_t bt_stride, const int64_t *seq_lens, uint16_t *out,
                              int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                              int block_size, float scale, int cache_dtype) {
    return -1;
}

#endif
