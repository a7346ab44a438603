/* The fp32 panel matmul (matmul_f32.c) for CPUs with AVX2 and FMA but no AVX-512: the same
 * packed panels of 32 output columns, so the same pack, the same callers and the C layer blocks
 * (blocks.c) run fp32 models' decode steps on these CPUs too.
 *
 * With 16 vector registers of 8 floats, a block is R rows (4 or 6, set_matmul_f32_rows) against
 * one 16-column half of a panel: 2R accumulators, two loads of the half's K row and a broadcast
 * per row for every two FMAs per row (at R = 6, 15 registers). A panel is taken half by half; a
 * half's K row is one 64-byte line of the panel's 128-byte row, so a half reads every other
 * line. With `gate_up` the first half holds the gate columns and the second the up columns
 * (matmul_f32_pack): the gate pass writes SiLU(gate) where the output goes and the up pass
 * multiplies it in.
 *
 * The first block of each half also fetches the same half of the thread's next panel into L2,
 * a line per K step, so that the next panel's first block does not wait on memory: at a decode
 * batch of 64 every panel is read from memory once and from L2 by the blocks after the first,
 * and the first block's loads, with only 2R FMAs per line, were bound by memory latency. */
#include <stdint.h>

#include "common.h"
#include "layer_kernels.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "avx2_rows.h"

#define PANEL 32       /* output columns per panel, as matmul_f32.c packs them */
#define HALF 16        /* columns a block takes: two vectors */
#define CHUNK_BYTES (256 << 10)  /* x a thread takes against its panels before the next chunk */
#define MAX_ROWS 6

#ifndef F32_FETCH_NEXT
#define F32_FETCH_NEXT 1 /* 0: no fetch of the next panel (a -D knob for measuring) */
#endif
#ifndef F32_FETCH_BLOCKS
/* How many of a chunk's first blocks share the fetch of the next panel (0: all of them). A
 * -D knob: on a 2-core Zen 3, 1, 4 and all ran a decode step's layer products alike within
 * that machine's noise (71-73 GFLOP/s, medians of 7 alternated rounds). */
#define F32_FETCH_BLOCKS 1
#endif

/* One K step `s` of a block: the half's two vectors at row s against R broadcast x values;
 * with FETCH, also line s of `fetch` into L2. */
#define HALF_STEP(R, FETCH)                                                                        \
    do {                                                                                           \
        if (FETCH) __builtin_prefetch(fetch + s * PANEL, 0, 2);                                    \
        const __m256 b0 = _mm256_loadu_ps(half + s * PANEL);                                       \
        const __m256 b1 = _mm256_loadu_ps(half + s * PANEL + 8);                                   \
        AVX2_ROWS_FMA(R, x + i * x_stride + s, b0, b1);                                            \
    } while (0)

/* R rows x one half. `bias` points at the half's 16 biases (or NULL). `epilogue`: 0 stores
 * x W^T + b, 1 stores SiLU of it (a gate half), 2 multiplies it into what y holds (an up
 * half). The first `fetch_steps` K steps also fetch a line each of `fetch` (this block's share
 * of another panel) into L2: a loop of their own, so that no branch sits among the FMAs (one
 * there left the accumulators in memory, half the rate). */
#define DEFINE_BLOCK(NAME, R)                                                                      \
static void NAME(const float *x, int64_t x_stride, const float *half, int64_t k,                 \
                 const float *bias, int epilogue, float *y, int64_t y_cols, const float *fetch,   \
                 int64_t fetch_steps) {                                                           \
    __m256 acc0[R], acc1[R];                                                                       \
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();                           \
    int64_t s = 0;                                                                                 \
    for (; s < fetch_steps; s++) HALF_STEP(R, 1);                                                  \
    for (; s < k; s++) HALF_STEP(R, 0);                                                            \
    float v[R][HALF];                                                                              \
    _Pragma("GCC unroll 8")                                                                        \
    for (int i = 0; i < R; i++) {                                                                  \
        _mm256_storeu_ps(v[i], acc0[i]);                                                           \
        _mm256_storeu_ps(v[i] + 8, acc1[i]);                                                       \
    }                                                                                              \
    for (int i = 0; i < R; i++) {                                                                  \
        float *row = y + i * y_cols;                                                               \
        for (int c = 0; c < HALF; c++) {                                                           \
            const float z = v[i][c] + (bias ? bias[c] : 0.0f);                                     \
            /* SiLU as silu_mul_rows computes it in fp32: gate / (1 + exp(-gate)) */              \
            row[c] = epilogue == 0 ? z : epilogue == 1 ? z / (1.0f + exp_approx(-z))               \
                                                       : row[c] * z;                               \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_BLOCK(block_1, 1) DEFINE_BLOCK(block_2, 2) DEFINE_BLOCK(block_3, 3)
DEFINE_BLOCK(block_4, 4) DEFINE_BLOCK(block_5, 5) DEFINE_BLOCK(block_6, 6)

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, const float *, int,
                         float *, int64_t, const float *, int64_t);
static const block_fn blocks[MAX_ROWS + 1] = {NULL, block_1, block_2, block_3, block_4, block_5,
                                              block_6};

static int block_rows = MAX_ROWS;  /* rows per block: 4 or 6 */

int matmul_f32_rows_choice(int i) {
    static const int choices[] = {4, 6};
    return i >= 0 && i < 2 ? choices[i] : 0;
}

int set_matmul_f32_rows(int rows) {
    if (rows != 4 && rows != 6) return -1;
    block_rows = rows;
    return 0;
}

/* y [m, n] (or [m, n/2] with gate_up) = x [m, k] (rows x_stride apart) W^T + bias, W packed by
 * matmul_f32_pack. Returns -1 for shapes it cannot run. */
int matmul_f32(const float *x, int64_t x_stride, int64_t m, const float *packed,
               const float *bias, int64_t n, int64_t k, int gate_up, float *y) {
    if (n % PANEL || k <= 0) return -1;
    if (m <= 0) return 0;
    const int64_t panels = n / PANEL, y_cols = gate_up ? n / 2 : n;
    const int R = block_rows;
    /* Chunks of whole blocks holding about CHUNK_BYTES of x (L2 keeps them beside the panel;
     * the rows that fit, rounded up to whole blocks), as even as whole blocks make them: a
     * short last chunk would read every panel again for a few rows. */
    const int64_t blocks_in_m = (m + R - 1) / R;
    const int64_t fit_rows = CHUNK_BYTES / (k * (int64_t)sizeof(float));
    const int64_t most_blocks = fit_rows > R ? (fit_rows + R - 1) / R : 1;
    const int64_t chunks = (blocks_in_m + most_blocks - 1) / most_blocks;
    const int64_t chunk_rows = (blocks_in_m + chunks - 1) / chunks * R;
    #pragma omp parallel
    for (int64_t chunk = 0; chunk < m; chunk += chunk_rows) {
        const int64_t chunk_end = chunk + chunk_rows < m ? chunk + chunk_rows : m;
        /* The same static split in every chunk: a thread reads the same panels again. */
        #pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++)
            for (int h = 0; h < 2; h++) {
                const float *half = packed + p * k * PANEL + h * HALF;
                /* gate_up: both halves land on the panel's 16 outputs, gate first */
                const int64_t col = gate_up ? p * HALF : p * PANEL + h * HALF;
                const int64_t bias_col = gate_up ? (h ? n / 2 : 0) + p * HALF : col;
                const int epilogue = gate_up ? 1 + h : 0;
                /* (the next panel may be another thread's at the end of this one's share) */
                const float *next = F32_FETCH_NEXT && p + 1 < panels ? half + k * PANEL : NULL;
                const int64_t chunk_blocks = (chunk_end - chunk + R - 1) / R;
                const int64_t fetchers = F32_FETCH_BLOCKS && F32_FETCH_BLOCKS < chunk_blocks
                                             ? F32_FETCH_BLOCKS : chunk_blocks;
                const int64_t share = (k + fetchers - 1) / fetchers;  /* lines a block fetches */
                for (int64_t r0 = chunk, b = 0; r0 < chunk_end; r0 += R, b++) {
                    const int rows = (int)(chunk_end - r0 < R ? chunk_end - r0 : R);
                    const int64_t from = b * share < k ? b * share : k;
                    const int64_t steps = next && from + share < k ? share : next ? k - from : 0;
                    blocks[rows](x + r0 * x_stride, x_stride, half, k,
                                 bias ? bias + bias_col : NULL, epilogue, y + r0 * y_cols + col,
                                 y_cols, next ? next + from * PANEL : NULL, steps);
                }
            }
    }
    return 0;
}

int matmul_f32_available(void) { return 1; }

#endif
