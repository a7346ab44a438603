/* fp32 matmul over packed panels: y = x W^T (+ bias), optionally followed by SiLU(gate) * up,
 * for the layers of fp32 models on CPUs with AVX-512 (here) or AVX2 and FMA
 * (matmul_f32_avx2.c, the same panels).
 *
 * Why not oneDNN's packed matmul: at decode batch sizes a matmul is a stream over its weight,
 * and fp32 weights are twice bf16's bytes. oneDNN's kernel computes near the FMA peak when the
 * weight is in cache, but in a decode step every weight comes from memory, and there it ran the
 * default model's matmuls at ~160 GFLOP/s where it reaches 200-210 warm (2-core Zen 4, batch
 * 64). Here each weight is read once, in memory order, with software prefetch ahead, as the
 * bf16 panels are (matmul_bf16.c); and a panel weight lets the C layer blocks (blocks.c) run
 * fp32 models' decode steps, and the gate/up projection apply SiLU(gate) * up before anything
 * is written.
 *
 * Layout: W [N, K] is packed into panels of 32 output columns; a panel is K rows of 32 floats
 * (128 bytes, two vectors), contiguous, so a panel is one sequential read. Threads split the
 * panels; rows go through in chunks whose x stays in L2, 8 or 12 rows at a time against a panel
 * (16 or 24 accumulator vectors; per K value, two panel loads and a broadcast per row feed two
 * FMAs per row). Which height runs faster depends on the core, so it is set at run time
 * (set_matmul_f32_rows; panels.py times both): on a core with two 512-bit FMA units (a Xeon)
 * 12 rows ran the model's shapes 5-10% faster than 8 (and 14 no faster than 12); on a Zen 4,
 * whose 512-bit FMAs take both of its 256-bit units, 8 rows ran 64-row products 3-12% faster
 * than 12. With
 * `gate_up` (the fused gate/up projection) panel p holds gate columns 16p.. in its first 16
 * and the matching up columns in its last 16, so the epilogue forms SiLU(gate) * up.
 */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "layer_kernels.h"

#define PANEL 32          /* output columns per panel */

/* W [n, k] -> panels (see the top). Returns -1 when n is not a multiple of 32. */
int matmul_f32_pack(const float *w, int64_t n, int64_t k, int gate_up, float *out) {
    if (n % PANEL || k <= 0) return -1;
    const int64_t panels = n / PANEL;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int half = 0; half < 2; half++) {
            const int64_t col0 = gate_up ? (half ? n / 2 : 0) + p * 16 : p * PANEL + half * 16;
            float *dst = out + p * k * PANEL + half * 16;
            for (int c = 0; c < 16; c++) {
                const float *src = w + (col0 + c) * k;
                for (int64_t s = 0; s < k; s++) dst[s * PANEL + c] = src[s];
            }
        }
    return 0;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "avx512.h"

#define PACE_BLOCKS 4     /* the next panel is fetched over a chunk's first 4 blocks */
#define ROW_CHUNK 256     /* rows a thread takes against its panels before the next chunk */
#define MAX_ROWS 12       /* the tallest block: 24 accumulator vectors */
#define STREAM_MIN_COLS 16384        /* outputs this wide (a vocabulary) ... */
#define STREAM_MIN_BYTES (8 << 20)   /* ... and this large are stored around the caches */
#ifndef PREFETCH_K
#define PREFETCH_K 32     /* K values (4 KiB of panel) the first block fetches ahead */
#endif

static inline __m512 bias16(const float *bias) {
    return bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
}

/* One row of a finished block: acc0/acc1 its 16 + 16 accumulators. `stream`: store around
 * the caches (see matmul_f32). */
static inline void write_row(__m512 acc0, __m512 acc1, const float *bias, int64_t p, int64_t n,
                             int gate_up, int stream, float *y_row) {
    if (!gate_up) {
        const __m512 y0 = _mm512_add_ps(acc0, bias16(bias ? bias + p * PANEL : 0));
        const __m512 y1 = _mm512_add_ps(acc1, bias16(bias ? bias + p * PANEL + 16 : 0));
        if (stream) {
            _mm512_stream_ps(y_row + p * PANEL, y0);
            _mm512_stream_ps(y_row + p * PANEL + 16, y1);
        } else {
            _mm512_storeu_ps(y_row + p * PANEL, y0);
            _mm512_storeu_ps(y_row + p * PANEL + 16, y1);
        }
        return;
    }
    const __m512 gate = _mm512_add_ps(acc0, bias16(bias ? bias + p * 16 : 0));
    const __m512 up = _mm512_add_ps(acc1, bias16(bias ? bias + n / 2 + p * 16 : 0));
    /* As silu_mul_rows computes it in fp32: gate / (1 + exp(-gate)) * up. */
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(y_row + p * 16, _mm512_mul_ps(silu, up));
}

/* R rows x 32 columns of one panel in 2R accumulator vectors, written out by write_row.
 * Memory and the FMAs overlap only if the weight stream is paced: each block fetches its share
 * of the next panel's cache lines into L2 (`fetch_lines` of them from `fetch`), one every few K
 * steps. Fetched in a burst (the whole next panel during one block, as before), a decode
 * step's matmuls took about their memory time (batch 1) plus their FMA time: no overlap.
 * Paced, a step of the default model's matmuls at batch 8-128 takes 11-18% less time, and
 * prompts run 4-7% faster. The first block of a chunk also streams its own panel ahead into L1,
 * for a panel nobody fetched.
 * Expanded for 1..12 rows so the accumulators stay in registers. */

/* The first block's stream of its own panel: K row s + PREFETCH_K into L1. */
static inline void fetch_own_ahead(const float *panel, int64_t s) {
    const float *ahead = panel + (s + PREFETCH_K) * PANEL;
    _mm_prefetch((const char *)ahead, _MM_HINT_T0);
    _mm_prefetch((const char *)(ahead + 16), _MM_HINT_T0);
}

/* One K step `s` of block_R: uses the block's x, x_stride, panel and accumulators. */
#define BLOCK_STEP(R)                                                                              \
    do {                                                                                           \
        const float *b = panel + s * PANEL;                                                        \
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);                        \
        for (int i = 0; i < R; i++) {                                                              \
            const __m512 a = _mm512_set1_ps(x[i * x_stride + s]);                                  \
            acc0[i] = _mm512_fmadd_ps(a, b0, acc0[i]);                                             \
            acc1[i] = _mm512_fmadd_ps(a, b1, acc1[i]);                                             \
        }                                                                                          \
    } while (0)

#define DEFINE_BLOCK(R)                                                                            \
static void block_##R(const float *x, int64_t x_stride, const float *panel, int64_t k,           \
                      int first, const float *fetch, int64_t fetch_lines, const float *bias,      \
                      int64_t p, int64_t n, int gate_up, int stream, float *y, int64_t y_cols) {  \
    __m512 acc0[R], acc1[R];                                                                       \
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();                           \
    if (fetch_lines) {                                                                             \
        int64_t due = 0;                                                                           \
        for (int64_t s = 0; s < k; s++) {                                                          \
            if (first) fetch_own_ahead(panel, s);                                                  \
            due += fetch_lines;                                                                    \
            if (due >= k) { /* at most one line a step: fetch_lines <= k */                       \
                due -= k;                                                                          \
                _mm_prefetch((const char *)fetch, _MM_HINT_T1);                                    \
                fetch += 16;                                                                       \
            }                                                                                      \
            BLOCK_STEP(R);                                                                         \
        }                                                                                          \
    } else if (first) {                                                                            \
        for (int64_t s = 0; s < k; s++) {                                                          \
            fetch_own_ahead(panel, s);                                                             \
            BLOCK_STEP(R);                                                                         \
        }                                                                                          \
    } else {                                                                                       \
        for (int64_t s = 0; s < k; s++) BLOCK_STEP(R);                                             \
    }                                                                                              \
    for (int i = 0; i < R; i++)                                                                    \
        write_row(acc0[i], acc1[i], bias, p, n, gate_up, stream, y + i * y_cols);                  \
}

DEFINE_BLOCK(1) DEFINE_BLOCK(2) DEFINE_BLOCK(3) DEFINE_BLOCK(4)
DEFINE_BLOCK(5) DEFINE_BLOCK(6) DEFINE_BLOCK(7) DEFINE_BLOCK(8)
DEFINE_BLOCK(9) DEFINE_BLOCK(10) DEFINE_BLOCK(11) DEFINE_BLOCK(12)

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, int, const float *,
                         int64_t, const float *, int64_t, int64_t, int, int, float *, int64_t);
static const block_fn blocks[MAX_ROWS + 1] = {NULL, block_1, block_2, block_3, block_4,
                                          block_5, block_6, block_7, block_8,
                                          block_9, block_10, block_11, block_12};

static int block_rows = MAX_ROWS;  /* rows per block: 8 or 12 (see the top) */

int matmul_f32_rows_choice(int i) {
    static const int choices[] = {8, 12};
    return i >= 0 && i < 2 ? choices[i] : 0;
}

int set_matmul_f32_rows(int rows) {
    if (rows != 8 && rows != 12) return -1;
    block_rows = rows;
    return 0;
}

/* One thread's share of matmul_f32, called in its parallel region (the panels split by an
 * orphaned `omp for`); `stream`: outputs stored around the caches. */
static void matmul_f32_share(const float *x, int64_t x_stride, int64_t m, const float *packed,
                             const float *bias, int64_t n, int64_t k, int gate_up, int stream,
                             float *y) {
    const int64_t panels = n / PANEL, y_cols = gate_up ? n / 2 : n;
    const int R = block_rows;
    for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
        const int64_t chunk_end = chunk + ROW_CHUNK < m ? chunk + ROW_CHUNK : m;
        /* The same static split in every chunk: a thread reads the same panels again. */
        #pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            const float *panel = packed + p * k * PANEL;
            const float *next = p + 1 < panels ? panel + k * PANEL : NULL;
            /* The next panel's 2k cache lines, split over the first blocks, at most k to a
             * block: a lone block (a block's rows or fewer) fetches the first half, which ran faster
             * at batch 8-12 than fetching it all (the first block's own stream takes the rest). */
            const int64_t nb = (chunk_end - chunk + R - 1) / R, lines = 2 * k;
            const int64_t paced = nb < PACE_BLOCKS ? nb : PACE_BLOCKS;
            for (int64_t blk = 0, r0 = chunk; r0 < chunk_end; r0 += R, blk++) {
                const int rows = (int)(chunk_end - r0 < R ? chunk_end - r0 : R);
                const int64_t l0 = blk < paced ? lines * blk / paced : 0;
                const int64_t l1 = blk < paced ? lines * (blk + 1) / paced : 0;
                const int64_t fetch_lines = !next ? 0 : l1 - l0 < k ? l1 - l0 : k;
                blocks[rows](x + r0 * x_stride, x_stride, panel, k, blk == 0,
                             next ? next + l0 * 16 : NULL, fetch_lines, bias, p, n, gate_up,
                             stream, y + r0 * y_cols, y_cols);
            }
        }
    }
}

/* y [m, n] (or [m, n/2] with gate_up) = x [m, k] (rows x_stride apart) W^T + bias, W packed by
 * matmul_f32_pack. Returns -1 for shapes it cannot run. */
int matmul_f32(const float *x, int64_t x_stride, int64_t m, const float *packed,
               const float *bias, int64_t n, int64_t k, int gate_up, float *y) {
    if (n % PANEL || k <= 0) return -1;
    if (m <= 0) return 0;
    const int64_t y_cols = gate_up ? n / 2 : n;
    /* An LM head's logits (a vocabulary wide, megabytes at decode batch sizes) are written
     * around the caches: nothing reads them until the sampler, after the whole matmul, and a
     * cached store first reads each line it writes from memory. The head at 64 rows (49,152
     * columns, 12.6 MB of logits) then took ~8% less time, a read of the logits after it
     * included. Layer outputs, read by the next kernel at once, stay cached. Rows are n
     * floats apart and panels 32 floats wide, so every store is aligned when y is. */
    const int stream = !gate_up && y_cols >= STREAM_MIN_COLS &&
                       m * y_cols * (int64_t)sizeof(float) >= STREAM_MIN_BYTES &&
                       ((uintptr_t)y & 63) == 0;
    #pragma omp parallel
    {
        matmul_f32_share(x, x_stride, m, packed, bias, n, k, gate_up, stream, y);
        if (stream) _mm_sfence(); /* streamed stores are weakly ordered: done before the join */
    }
    return 0;
}

int matmul_f32_available(void) { return 1; }

#elif !(defined(__AVX2__) && defined(__FMA__)) /* AVX2: matmul_f32_avx2.c. Else callers keep
                                                 * oneDNN or MKL */

int matmul_f32_available(void) { return 0; }

int matmul_f32_rows_choice(int i) {
    (void)i;
    return 0;
}

int set_matmul_f32_rows(int rows) {
    (void)rows;
    return -1;
}

int matmul_f32(const float *x, int64_t x_stride, int64_t m, const float *packed,
               const float *bias, int64_t n, int64_t k, int gate_up, float *y) {
    (void)x, (void)x_stride, (void)m, (void)packed, (void)bias, (void)n, (void)k, (void)gate_up;
    (void)y;
    return -2;
}

#endif
