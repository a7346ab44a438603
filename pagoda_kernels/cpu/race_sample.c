/* Random draws for the sampler on CPUs with AVX-512 (F, BW, VL), or with AVX2 and FMA: the
 * exponential race of services/worker/sampler.py (`exponential_race`) with no [rows, vocab]
 * temporaries, and the sampler's temperature-only path built on it. The torch race builds its
 * noise in ~15 full passes over [rows, vocab] int64 and float tensors; at 64 rows of a 49k
 * vocabulary the whole torch draw (float copy, logsumexp, temperature, noise, race) took ~39 ms
 * of a ~120 ms decode step.
 *
 * Per row: token = the first argmax_i of x_i - log(E_i), E_i = -log1p(-u_i), with u_i the row's
 * uniform noise for vocab id i computed as `uniform_noise` computes it (a 32-bit hash of the
 * row's key and i, to (0, 1) in float32), in one pass: the torch race's draw up to the last bit
 * of the two logarithms. Unlike torch's argmax, a NaN key is never drawn (torch would draw the
 * first NaN; only a broken model gives NaN logits). The AVX2 loop takes the same steps on 8
 * lanes (the unsigned conversion, getmant and getexp that AVX2 lacks built from integer ops,
 * exactly). With neither, the functions return -2 and the sampler keeps torch's ops.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"
#include "sampling_row.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "avx512.h"

/* sampler.mix32 on 16 lanes of 32-bit values. */
static inline __m512i mix32_16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x2C1B3C6D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 12));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x297A2D39));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}

/* log(v) for positive normal floats, within ~1 ulp: v = m 2^e with m in [sqrt(1/2), sqrt(2)),
 * log(m) = log(1 + f) by the odd series in s = f / (2 + f) (the classic fdlibm scheme). */
static inline __m512 log16(__m512 v) {
    __m512 m = _mm512_getmant_ps(v, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    __m512 e = _mm512_getexp_ps(v);
    const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.0f));
    const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
    const __m512 s = _mm512_div_ps(f, _mm512_add_ps(f, _mm512_set1_ps(2.0f)));
    const __m512 z = _mm512_mul_ps(s, s), w = _mm512_mul_ps(z, z);
    __m512 t1 = _mm512_fmadd_ps(w, _mm512_set1_ps(1.5313838422e-01f), _mm512_set1_ps(2.2222198546e-01f));
    t1 = _mm512_mul_ps(w, _mm512_fmadd_ps(w, t1, _mm512_set1_ps(4.0000000596e-01f)));
    __m512 t2 = _mm512_fmadd_ps(w, _mm512_set1_ps(1.4798198640e-01f), _mm512_set1_ps(1.8183572590e-01f));
    t2 = _mm512_fmadd_ps(w, t2, _mm512_set1_ps(2.8571429849e-01f));
    t2 = _mm512_mul_ps(z, _mm512_fmadd_ps(w, t2, _mm512_set1_ps(6.6666668653e-01f)));
    const __m512 r = _mm512_add_ps(t1, t2);
    const __m512 hfsq = _mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_mul_ps(f, f));
    /* e ln2_hi - ((hfsq - (s (hfsq + r) + e ln2_lo)) - f) */
    const __m512 inner = _mm512_fmadd_ps(s, _mm512_add_ps(hfsq, r),
                                         _mm512_mul_ps(e, _mm512_set1_ps(9.0580006145e-06f)));
    return _mm512_fmsub_ps(e, _mm512_set1_ps(6.9313812256e-01f),
                           _mm512_sub_ps(_mm512_sub_ps(hfsq, inner), f));
}

/* -log(E) for 16 vocab ids (vocab_hash: their mix32(id ^ 0x85EBCA6B)) of a row with `key`:
 * u = (bits + 0.5) 2^-32 clamped below 1, E = -log1p(-u), log1p(-u) as
 * log(1 - u) (-u) / ((1 - u) - 1), and -u where 1 - u rounds to 1. */
static inline __m512 neg_log_noise16(__m512i key, __m512i vocab_hash) {
    const __m512i bits = mix32_16(_mm512_xor_si512(key, vocab_hash));
    __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepu32_ps(bits), _mm512_set1_ps(0.5f)),
                             _mm512_set1_ps(2.3283064365386963e-10f)); /* 2^-32 */
    u = _mm512_min_ps(u, _mm512_set1_ps(0.99999994f)); /* the largest float below 1 */
    const __m512 w = _mm512_sub_ps(_mm512_set1_ps(1.0f), u);
    const __m512 d = _mm512_sub_ps(w, _mm512_set1_ps(1.0f));
    const __mmask16 exact = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_EQ_OQ);
    const __m512 ratio = _mm512_mask_blend_ps(   /* log1p(-u) / -u */
        exact, _mm512_div_ps(log16(w), _mm512_mask_blend_ps(exact, d, _mm512_set1_ps(-1.0f))),
        _mm512_set1_ps(1.0f));
    return _mm512_sub_ps(_mm512_setzero_ps(), log16(_mm512_mul_ps(u, ratio)));
}

static inline __m512 load16(const float *p, __mmask16 m) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p);
}

static inline __m512 load16_bf16_masked(const uint16_t *p, __mmask16 m) {
    const __m512 v = widen16_bf16(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), v);
}

/* The first index of the largest of x_i / scale - log(E_i) over a row (-inf never wins). */
#define DEFINE_RACE_ROW(NAME, T, LOAD)                                                          \
static int64_t NAME(const T *x, int64_t vocab, float scale, uint32_t key) {                    \
    const __m512i key16 = _mm512_set1_epi32((int32_t)key);                                      \
    const __m512 scale16 = _mm512_set1_ps(scale);                                               \
    __m512i id = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);        \
    __m512 best = _mm512_set1_ps(-INFINITY);                                                    \
    __m512i best_id = _mm512_set1_epi32(INT32_MAX);                                             \
    for (int64_t i = 0; i < vocab; i += 16) {                                                   \
        const __mmask16 m = vocab - i >= 16 ? (__mmask16)0xFFFF                                 \
                                            : (__mmask16)((1u << (vocab - i)) - 1);             \
        const __m512i vocab_hash = mix32_16(_mm512_xor_si512(id, _mm512_set1_epi32(            \
            (int32_t)0x85EBCA6Bu)));                                                            \
        /* x / scale exactly as torch divides (scale 1 leaves x as it is) */                    \
        const __m512 k = _mm512_add_ps(_mm512_div_ps(LOAD(x + i, m), scale16),                  \
                                       neg_log_noise16(key16, vocab_hash));                     \
        /* strictly greater: each lane keeps its first index of its largest key */              \
        const __mmask16 up = _mm512_mask_cmp_ps_mask(m, k, best, _CMP_GT_OQ);                   \
        best = _mm512_mask_mov_ps(best, up, k);                                                 \
        best_id = _mm512_mask_mov_epi32(best_id, up, id);                                       \
        id = _mm512_add_epi32(id, _mm512_set1_epi32(16));                                       \
    }                                                                                           \
    const float top = _mm512_reduce_max_ps(best);                                               \
    const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);         \
    const int32_t first = _mm512_mask_reduce_min_epi32(at_top, best_id);                        \
    return at_top && first < vocab ? first : 0; /* every key -inf or NaN: token 0 */            \
}

DEFINE_RACE_ROW(race_row_f32, float, load16)
DEFINE_RACE_ROW(race_row_bf16, uint16_t, load16_bf16_masked)

#define RACE_SIMD 1

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2.h"

/* sampler.mix32 on 8 lanes of 32-bit values. */
static inline __m256i mix32_8(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x2C1B3C6D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 12));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x297A2D39));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

/* Unsigned 32-bit lanes to float, rounded once as _mm512_cvtepu32_ps rounds: the high half
 * times 2^16 and the low half are exact in float, so their sum is the one rounding. */
static inline __m256 u32_to_float8(__m256i b) {
    const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 16)),
                                    _mm256_set1_ps(65536.0f));
    return _mm256_add_ps(hi, _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xffff))));
}

/* log16 (the AVX-512 loop's) on 8 lanes, for positive normal floats: the mantissa in [1, 2)
 * and the exponent taken from the bits, as getmant and getexp give them there. */
static inline __m256 log8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23),
                                                   _mm256_set1_epi32(127)));
    const __m256 high = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), high);
    e = _mm256_blendv_ps(e, _mm256_add_ps(e, _mm256_set1_ps(1.0f)), high);
    const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
    const __m256 s = _mm256_div_ps(f, _mm256_add_ps(f, _mm256_set1_ps(2.0f)));
    const __m256 z = _mm256_mul_ps(s, s), w = _mm256_mul_ps(z, z);
    __m256 t1 = _mm256_fmadd_ps(w, _mm256_set1_ps(1.5313838422e-01f),
                                _mm256_set1_ps(2.2222198546e-01f));
    t1 = _mm256_mul_ps(w, _mm256_fmadd_ps(w, t1, _mm256_set1_ps(4.0000000596e-01f)));
    __m256 t2 = _mm256_fmadd_ps(w, _mm256_set1_ps(1.4798198640e-01f),
                                _mm256_set1_ps(1.8183572590e-01f));
    t2 = _mm256_fmadd_ps(w, t2, _mm256_set1_ps(2.8571429849e-01f));
    t2 = _mm256_mul_ps(z, _mm256_fmadd_ps(w, t2, _mm256_set1_ps(6.6666668653e-01f)));
    const __m256 r = _mm256_add_ps(t1, t2);
    const __m256 hfsq = _mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(f, f));
    const __m256 inner = _mm256_fmadd_ps(s, _mm256_add_ps(hfsq, r),
                                         _mm256_mul_ps(e, _mm256_set1_ps(9.0580006145e-06f)));
    return _mm256_fmsub_ps(e, _mm256_set1_ps(6.9313812256e-01f),
                           _mm256_sub_ps(_mm256_sub_ps(hfsq, inner), f));
}

/* neg_log_noise16 on 8 lanes. */
static inline __m256 neg_log_noise8(__m256i key, __m256i vocab_hash) {
    const __m256i bits = mix32_8(_mm256_xor_si256(key, vocab_hash));
    __m256 u = _mm256_mul_ps(_mm256_add_ps(u32_to_float8(bits), _mm256_set1_ps(0.5f)),
                             _mm256_set1_ps(2.3283064365386963e-10f)); /* 2^-32 */
    u = _mm256_min_ps(u, _mm256_set1_ps(0.99999994f)); /* the largest float below 1 */
    const __m256 w = _mm256_sub_ps(_mm256_set1_ps(1.0f), u);
    const __m256 d = _mm256_sub_ps(w, _mm256_set1_ps(1.0f));
    const __m256 exact = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ);
    const __m256 ratio = _mm256_blendv_ps(   /* log1p(-u) / -u */
        _mm256_div_ps(log8(w), _mm256_blendv_ps(d, _mm256_set1_ps(-1.0f), exact)),
        _mm256_set1_ps(1.0f), exact);
    return _mm256_sub_ps(_mm256_setzero_ps(), log8(_mm256_mul_ps(u, ratio)));
}

/* The first index of the largest of x_i / scale - log(E_i) over a row (-inf never wins). The
 * last, partial vector is read from a copy padded with -inf (`PAD`). */
#define DEFINE_RACE_ROW(NAME, T, LOAD, PAD)                                                     \
static int64_t NAME(const T *x, int64_t vocab, float scale, uint32_t key) {                    \
    const __m256i key8 = _mm256_set1_epi32((int32_t)key);                                       \
    const __m256 scale8 = _mm256_set1_ps(scale);                                                \
    __m256i id = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                     \
    __m256 best = _mm256_set1_ps(-INFINITY);                                                    \
    __m256i best_id = _mm256_set1_epi32(INT32_MAX);                                             \
    T tail[8];                                                                                  \
    for (int64_t i = 0; i < vocab; i += 8) {                                                    \
        const T *at = x + i;                                                                    \
        if (vocab - i < 8) {                                                                    \
            for (int j = 0; j < 8; j++) tail[j] = j < vocab - i ? at[j] : PAD;                  \
            at = tail;                                                                          \
        }                                                                                       \
        const __m256i vocab_hash = mix32_8(_mm256_xor_si256(id, _mm256_set1_epi32(             \
            (int32_t)0x85EBCA6Bu)));                                                            \
        /* x / scale exactly as torch divides (scale 1 leaves x as it is) */                    \
        const __m256 k = _mm256_add_ps(_mm256_div_ps(LOAD(at), scale8),                         \
                                       neg_log_noise8(key8, vocab_hash));                       \
        /* strictly greater: each lane keeps its first index of its largest key */              \
        const __m256 up = _mm256_cmp_ps(k, best, _CMP_GT_OQ);                                   \
        best = _mm256_blendv_ps(best, k, up);                                                   \
        best_id = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_id),            \
                                                       _mm256_castsi256_ps(id), up));           \
        id = _mm256_add_epi32(id, _mm256_set1_epi32(8));                                        \
    }                                                                                           \
    float lanes[8];                                                                             \
    int32_t ids[8];                                                                             \
    _mm256_storeu_ps(lanes, best);                                                              \
    _mm256_storeu_si256((__m256i *)ids, best_id);                                               \
    float top = -INFINITY;                                                                      \
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;                          \
    int32_t first = INT32_MAX;                                                                  \
    for (int j = 0; j < 8; j++)                                                                 \
        if (lanes[j] == top && ids[j] < first) first = ids[j];                                  \
    return first < vocab ? first : 0; /* every key -inf or NaN: token 0 */                      \
}

DEFINE_RACE_ROW(race_row_f32, float, load8_f32, -INFINITY)
DEFINE_RACE_ROW(race_row_bf16, uint16_t, load8_bf16, (uint16_t)0xFF80) /* bf16 -inf */

#define RACE_SIMD 1
#endif

#if defined(RACE_SIMD)
/* tokens [rows] = the race over x [rows, vocab] (rows `stride` apart; scaled and filtered
 * logits), row r with the 32-bit key keys[r] (`noise_keys`). Returns 0. */
#define DEFINE_RACE(NAME, ROW, T)                                                               \
int NAME(const T *x, int64_t stride, int64_t rows, int64_t vocab, const uint32_t *keys,       \
         int64_t *tokens) {                                                                     \
    _Pragma("omp parallel for schedule(static) if(rows > 1 && rows * vocab >= PARALLEL_GRAIN)")            \
    for (int64_t r = 0; r < rows; r++) tokens[r] = ROW(x + r * stride, vocab, 1.0f, keys[r]);  \
    return 0;                                                                                   \
}

DEFINE_RACE(race_sample_f32, race_row_f32, float)
DEFINE_RACE(race_sample_bf16, race_row_bf16, uint16_t)

/* The sampler's temperature-only path in one call: rows without penalties, filters or top
 * logprobs, each greedy (greedy[r] != 0: the first argmax, NaNs skipped, as greedy_sample) or
 * drawn by the race over logits / temperature[r]; logprobs [rows] = the token's logprob under
 * the raw logits, x - max - log(sum(exp(x - max))). Three passes over a row, the last two from
 * cache: the max, then the exponentials' sum and first argmax (sampling_row.h), then the race.
 * Returns 0. */
#define DEFINE_SAMPLE(NAME, ROW, T, ROW_STATS, TO_F)                                            \
int NAME(const T *logits, int64_t stride, int64_t rows, int64_t vocab,                         \
         const float *temperature, const uint8_t *greedy, const uint32_t *keys,                \
         int64_t *tokens, float *logprobs) {                                                    \
    _Pragma("omp parallel for schedule(static) if(rows > 1 && rows * vocab >= PARALLEL_GRAIN)")            \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const T *x = logits + r * stride;                                                       \
        const row_stats_t st = ROW_STATS(x, vocab);                                             \
        const int64_t token = greedy[r] ? st.first : ROW(x, vocab, temperature[r], keys[r]);    \
        tokens[r] = token;                                                                      \
        logprobs[r] = (TO_F(x[token]) - st.max) - logf(st.sum);                                 \
    }                                                                                           \
    return 0;                                                                                   \
}

DEFINE_SAMPLE(random_sample_f32, race_row_f32, float, row_stats_f32, f32_id)
DEFINE_SAMPLE(random_sample_bf16, race_row_bf16, uint16_t, row_stats_bf16, bf16_to_float)

int race_sample_available(void) { return 1; }

#else /* neither AVX-512 BW/VL nor AVX2 with FMA: the sampler keeps its torch ops */

int race_sample_available(void) { return 0; }

#define DEFINE_STUBS(SUFFIX, T)                                                                 \
int race_sample_##SUFFIX(const T *x, int64_t stride, int64_t rows, int64_t vocab,             \
                         const uint32_t *keys, int64_t *tokens) {                               \
    (void)x, (void)stride, (void)rows, (void)vocab, (void)keys, (void)tokens;                   \
    return -2;                                                                                  \
}                                                                                               \
int random_sample_##SUFFIX(const T *logits, int64_t stride, int64_t rows, int64_t vocab,      \
                           const float *temperature, const uint8_t *greedy,                    \
                           const uint32_t *keys, int64_t *tokens, float *logprobs) {            \
    (void)logits, (void)stride, (void)rows, (void)vocab, (void)temperature, (void)greedy;       \
    (void)keys, (void)tokens, (void)logprobs;                                                   \
    return -2;                                                                                  \
}
DEFINE_STUBS(f32, float)
DEFINE_STUBS(bf16, uint16_t)

#endif
