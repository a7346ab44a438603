/* The bf16 panel matmul (matmul_bf16.c) for CPUs with AVX2 and FMA but no AVX-512: the
 * same packed panels, so the same pack, the same callers and the C layer blocks (blocks.c) run
 * bf16 models on these CPUs too, with bf16 weights (half fp32's bytes) and bf16 activations.
 *
 * Why: without bf16 instructions oneDNN has no bf16 kernel, and torch's bf16 matmul there ran
 * the default model's shapes at ~10 GFLOP/s where fp32 ran 35-45 (a 2-core Zen 1). Here the
 * products are the fp32 panel matmul's (matmul_f32_avx2.c): each bf16 value widens exactly to
 * fp32 and the sums are fp32, as a bf16 matmul with fp32 accumulation computes them; only the
 * summation order differs.
 *
 * Two loops, by the rows a chunk has (WIDEN_MIN_ROWS, set by the timings below):
 * - On the packed tiles, for a few rows (decode at small batches, where the weight's bytes are
 *   the cost): a tile row is 16 columns, each with a pair of K values (2r, 2r + 1); a 32-byte
 *   load holds 8 columns' pairs, and shifting each 32-bit lane left by 16 gives the 8 columns'
 *   first K value as floats, clearing its low 16 bits their second. A block is 4 rows against
 *   one 16-column tile: per K pair two loads, two shifts and two ANDs among 16 FMAs.
 * - Widened, for more rows: each thread widens a panel's tile once per chunk into a buffer of K
 *   rows of 16 floats (L1/L2) and runs blocks of 6 rows on it as the fp32 loop runs its half
 *   panels, no shifts among the FMAs. The widening's cost is shared by the chunk's blocks.
 * On a 2-core Zen 1 (fp32 FMA peak ~68 GFLOP/s), the default model's shapes at 64 rows ran
 * widened at 65-69 GFLOP/s (the fp32 panels: 59-72), on the tiles at 57-63; at 8-16 rows on the
 * tiles at 56-57 against 42-55 widened; at 1 row 23 (fp32 panels 12-21: half the bytes).
 * x is widened to fp32 once per chunk of rows, so a broadcast is one load. With `gate_up` the
 * first tile holds the gate columns and the second the up columns: the gate pass writes
 * SiLU(gate) (rounded to bf16, as the model computes it) where the output goes and the up pass
 * multiplies it in. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "layer_kernels.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2.h"
#include "avx2_rows.h"

#define PANEL 32       /* output columns per panel, as matmul_bf16.c packs them */
#define KSTEP 32       /* K values per panel step: 16 pairs */
#define TILE_ELEMS 512 /* one 16-column tile of a step */
#define HALF 16
#define CHUNK_BYTES (256 << 10)  /* x (widened) a thread takes against its panels per chunk */
#ifndef BF16_AVX2_ROWS
#define BF16_AVX2_ROWS 4  /* rows a block on the packed tiles: 4 ran faster than 6 on a Zen 1 */
#endif
#ifndef WIDE_ROWS
#define WIDE_ROWS 6       /* rows a block on a widened tile, as the fp32 loop's taller block */
#endif
#ifndef WIDEN_MIN_ROWS
#define WIDEN_MIN_ROWS 24 /* chunks of fewer rows run on the packed tiles */
#endif

/* One row's 8 outputs z (bias added) of a block: `epilogue` as block_R's. */
static inline void write8(__m256 z, int epilogue, uint16_t *out) {
    if (epilogue == 0) {
        store8_bf16(out, round8_bf16(z));
    } else if (epilogue == 1) { /* gate rounded, SiLU of it rounded */
        const __m256 gate = round8_bf16(z);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
        store8_bf16(out, round8_bf16(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), e))));
    } else { /* up rounded, times the SiLU, rounded */
        store8_bf16(out, round8_bf16(_mm256_mul_ps(load8_bf16(out), round8_bf16(z))));
    }
}

/* The end of a block: its 2R accumulators plus bias, through write8. */
#define WRITE_BLOCK(R)                                                                             \
    do {                                                                                           \
        const __m256 b0 = bias ? load8_bf16(bias) : _mm256_setzero_ps();                           \
        const __m256 b1 = bias ? load8_bf16(bias + 8) : _mm256_setzero_ps();                       \
        /* unrolled: accumulators indexed by a variable would live in memory */                   \
        _Pragma("GCC unroll 8")                                                                    \
        for (int i = 0; i < R; i++) {                                                              \
            write8(_mm256_add_ps(acc0[i], b0), epilogue, y + i * y_cols);                          \
            write8(_mm256_add_ps(acc1[i], b1), epilogue, y + i * y_cols + 8);                      \
        }                                                                                          \
    } while (0)

/* Tile row r of one step: its 16 columns' pair against R rows of x (fp32, from xs). The first K
 * value of a pair is the low half of a 32-bit lane (shifted up), the second the high half (the
 * low one masked off). */
#define PAIR_STEP(R)                                                                               \
    do {                                                                                           \
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(tile + r * 32));                  \
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(tile + r * 32 + 16));             \
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));                         \
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));                         \
        AVX2_ROWS_FMA(R, xs + i * x_stride + 2 * r, e0, e1);                                       \
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));                       \
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));                       \
        AVX2_ROWS_FMA(R, xs + i * x_stride + 2 * r + 1, o0, o1);                                   \
    } while (0)

/* R rows x one tile column of a panel (`half`: the tile in the panel's first step, steps
 * 2 * TILE_ELEMS apart). `bias`: the tile's 16 biases (or NULL). `epilogue`: 0 stores
 * x W^T + b, 1 SiLU of it (a gate tile), 2 multiplies it into what y holds (an up tile). */
#define DEFINE_BLOCK(R)                                                                            \
static void block_##R(const float *x, int64_t x_stride, const uint16_t *half, int64_t steps,     \
                      const uint16_t *bias, int epilogue, uint16_t *y, int64_t y_cols) {          \
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);                                      \
    __m256 acc0[R], acc1[R];                                                                       \
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();                           \
    for (int64_t s = 0; s < steps; s++) {                                                          \
        const uint16_t *tile = half + s * 2 * TILE_ELEMS;                                          \
        const float *xs = x + s * KSTEP;                                                           \
        for (int r = 0; r < 16; r++) PAIR_STEP(R);                                                 \
    }                                                                                              \
    WRITE_BLOCK(R);                                                                                \
}

DEFINE_BLOCK(1) DEFINE_BLOCK(2) DEFINE_BLOCK(3) DEFINE_BLOCK(4) DEFINE_BLOCK(5) DEFINE_BLOCK(6)

typedef void (*block_fn)(const float *, int64_t, const uint16_t *, int64_t, const uint16_t *,
                         int, uint16_t *, int64_t);
static const block_fn blocks[] = {NULL, block_1, block_2, block_3, block_4, block_5, block_6};
_Static_assert(BF16_AVX2_ROWS >= 1 && BF16_AVX2_ROWS <= 6, "blocks of 1 to 6 rows");

/* -- Rows enough to pay for widening the weight: each tile of a panel is widened once per chunk
 * into a thread's buffer, K rows of 16 floats, and blocks of WIDE_ROWS rows run on it as the
 * fp32 loop runs on its half panels, with no shifts among the FMAs. -- */

/* Tile `half` of every step (steps 2 * TILE_ELEMS apart) -> wide [steps * 32][16] floats. */
static void widen_tile(const uint16_t *half, int64_t steps, float *wide) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t *tile = half + s * 2 * TILE_ELEMS;
        float *rows = wide + s * KSTEP * HALF;
        for (int r = 0; r < 16; r++)
            for (int q = 0; q < 2; q++) {  /* columns 0-7, then 8-15 */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(tile + r * 32 + q * 16));
                _mm256_storeu_ps(rows + (2 * r) * HALF + q * 8,
                                 _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
                _mm256_storeu_ps(rows + (2 * r + 1) * HALF + q * 8,
                                 _mm256_castsi256_ps(_mm256_and_si256(w, high)));
            }
    }
}

#define DEFINE_WIDE_BLOCK(R)                                                                       \
static void wide_block_##R(const float *x, int64_t x_stride, const float *wide, int64_t k,       \
                           const uint16_t *bias, int epilogue, uint16_t *y, int64_t y_cols) {     \
    __m256 acc0[R], acc1[R];                                                                       \
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();                           \
    for (int64_t s = 0; s < k; s++) {                                                              \
        const __m256 b0 = _mm256_loadu_ps(wide + s * HALF);                                        \
        const __m256 b1 = _mm256_loadu_ps(wide + s * HALF + 8);                                    \
        AVX2_ROWS_FMA(R, x + i * x_stride + s, b0, b1);                                            \
    }                                                                                              \
    WRITE_BLOCK(R);                                                                                \
}

DEFINE_WIDE_BLOCK(1) DEFINE_WIDE_BLOCK(2) DEFINE_WIDE_BLOCK(3) DEFINE_WIDE_BLOCK(4)
DEFINE_WIDE_BLOCK(5) DEFINE_WIDE_BLOCK(6)

typedef void (*wide_block_fn)(const float *, int64_t, const float *, int64_t, const uint16_t *,
                              int, uint16_t *, int64_t);
static const wide_block_fn wide_blocks[] = {NULL, wide_block_1, wide_block_2, wide_block_3,
                                            wide_block_4, wide_block_5, wide_block_6};
_Static_assert(WIDE_ROWS >= 1 && WIDE_ROWS <= 6, "wide blocks of 1 to 6 rows");

int matmul_amx_available(void) { return 0; }

void set_matmul_bf16_loop(int choice) { (void)choice; } /* one loop here */

/* The loop matmul_bf16 runs: 3, this one (matmul_bf16.c: 2 AMX, 1 vdpbf16ps). */
int matmul_bf16_path(void) { return 3; }

/* Rows a chunk for blocks of R rows: whole blocks holding about CHUNK_BYTES of widened x, as
 * even as whole blocks make them (as matmul_f32_avx2.c sizes its chunks). */
static int64_t even_chunk_rows(int64_t m, int64_t k, int R) {
    const int64_t blocks_in_m = (m + R - 1) / R;
    const int64_t fit_rows = CHUNK_BYTES / (k * (int64_t)sizeof(float));
    const int64_t most_blocks = fit_rows > R ? (fit_rows + R - 1) / R : 1;
    const int64_t chunks = (blocks_in_m + most_blocks - 1) / most_blocks;
    return (blocks_in_m + chunks - 1) / chunks * R;
}

/* y [m, n] (or [m, n/2] with gate_up) = x [m, k] (rows x_stride apart) W^T + bias, W packed by
 * matmul_bf16_pack. Returns -1 for shapes it cannot run, -3 when x's fp32 copy cannot be
 * allocated. */
int matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y) {
    if (n % PANEL || k % KSTEP || k <= 0) return -1;
    if (m <= 0) return 0;
    const int64_t panels = n / PANEL, steps = k / KSTEP, y_cols = gate_up ? n / 2 : n;
    /* Chunks sized for widened blocks; where that leaves too few rows a chunk to widen (long
     * rows), sized again for blocks on the tiles, so no chunk ends in a short block needlessly. */
    int64_t chunk_rows = m >= WIDEN_MIN_ROWS ? even_chunk_rows(m, k, WIDE_ROWS) : 0;
    const int widen_any = chunk_rows >= WIDEN_MIN_ROWS;
    if (!widen_any) chunk_rows = even_chunk_rows(m, k, BF16_AVX2_ROWS);
    float *x32 = malloc((size_t)(chunk_rows * k) * sizeof(float));
    if (!x32) return -3;
    int failed = 0;
    #pragma omp parallel
    {
        /* 64-byte aligned: a K row is one cache line (a split load costs twice) */
        float *wide = widen_any ? aligned_alloc(64, (size_t)(k * HALF) * sizeof(float)) : NULL;
        if (widen_any && !wide) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        for (int64_t chunk = 0; chunk < m && !failed; chunk += chunk_rows) {
            const int64_t chunk_end = chunk + chunk_rows < m ? chunk + chunk_rows : m;
            #pragma omp for schedule(static)
            for (int64_t i = chunk; i < chunk_end; i++)
                for (int64_t j = 0; j < k; j++)
                    x32[(i - chunk) * k + j] = bf16_to_float(x[i * x_stride + j]);
            /* (the loop's barrier: every row widened before any block reads it) */
            const int widen = widen_any && chunk_end - chunk >= WIDEN_MIN_ROWS;
            const int block_rows = widen ? WIDE_ROWS : BF16_AVX2_ROWS;
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++)
                for (int h = 0; h < 2; h++) {
                    const uint16_t *half = packed + p * steps * 2 * TILE_ELEMS + h * TILE_ELEMS;
                    /* gate_up: both tiles land on the panel's 16 outputs, gate first */
                    const int64_t col = gate_up ? p * HALF : p * PANEL + h * HALF;
                    const int64_t bias_col = gate_up ? (h ? n / 2 : 0) + p * HALF : col;
                    const uint16_t *b = bias ? bias + bias_col : NULL;
                    const int epilogue = gate_up ? 1 + h : 0;
                    if (widen) widen_tile(half, steps, wide);
                    for (int64_t r0 = chunk; r0 < chunk_end; r0 += block_rows) {
                        const int rows = (int)(chunk_end - r0 < block_rows ? chunk_end - r0
                                                                           : block_rows);
                        const float *xr = x32 + (r0 - chunk) * k;
                        uint16_t *yr = y + r0 * y_cols + col;
                        if (widen)
                            wide_blocks[rows](xr, k, wide, k, b, epilogue, yr, y_cols);
                        else
                            blocks[rows](xr, k, half, steps, b, epilogue, yr, y_cols);
                    }
                }
            #pragma omp barrier /* the next chunk overwrites x32 */
        }
        free(wide);
    }
    free(x32);
    return failed ? -3 : 0;
}

#endif
