/* bf16 matmul over packed panels: y = x W^T (+ bias), optionally followed by SiLU(gate) * up,
 * for the layers and LM head of bf16 models on CPUs with AMX or with AVX512-BF16 (on CPUs with
 * AVX2 and FMA but no AVX-512, matmul_bf16_avx2.c multiplies the same panels). One packed
 * copy of each weight serves two loops:
 * - AMX tiles, where the CPU has them and the OS grants them (Sapphire Rapids and later);
 * - vdpbf16ps dot products elsewhere (AVX512-BF16: Zen 4 and later, Cooper Lake). The packed
 *   layout is already what that instruction wants: a tile row is 16 output columns, each with
 *   the pair of K values it multiplies, 64 bytes, one vector.
 *
 * Why not oneDNN's packed matmul, which also runs on both: at decode batch sizes a matmul is a
 * stream over its weight, and oneDNN's reads it well below the memory's rate (the default model
 * at batch 64, 30 layers' weights cycled: oneDNN 7-10 GB/s, the AMX loop 15-20 GB/s; in whole
 * decode steps, with the weights cold, the layer matmuls take ~20% less time). Here each weight is
 * read once, in memory order, with software prefetch ahead. At prompt-sized batches the two are
 * within ~15% of each other either way, and with SiLU(gate) * up fused this one is ahead, so one
 * packed copy serves both. On a 2-core Zen 4 the vdpbf16ps loop ran the default model's layer
 * matmuls at 64 rows at 410-420 GFLOP/s against oneDNN's 310-370, and prompt shapes within 5%;
 * its LM head (49,152 columns, 56 MB streamed from memory) at 355-400 against 370-380, and the
 * whole decode step's matmuls in 24% less time (docs/benchmarks.md).
 *
 * Layout: W [N, K] is packed into panels of 32 output columns; a panel is K/32 steps of two
 * 16x32 B tiles (1 KiB each, K pairs interleaved as AMX wants them), contiguous, so a panel is
 * one sequential read. Threads split the panels; rows go through in chunks whose x stays in L2,
 * against the panel: 32 rows at a time on AMX (two A tiles, four accumulator tiles), 8 rows at a
 * time with vdpbf16ps (16 accumulator vectors). With `gate_up` (the fused gate/up projection),
 * panel p holds gate columns 16p.. in its first tile and the matching up columns in its second,
 * so the epilogue forms SiLU(gate) * up and only that is written.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "layer_kernels.h"

#define PANEL 32          /* output columns per panel: two 16-column B tiles */
#define KSTEP 32          /* K values per tile row: 64 bytes of bf16 */
#define TILE_ELEMS 512    /* bf16 values in one 16 x 64-byte tile */

/* W [n, k] -> panels (see the top; the AVX2 loop, matmul_bf16_avx2.c, reads them too). Returns
 * -1 when n or k is not a multiple of 32. */
int matmul_bf16_pack(const uint16_t *w, int64_t n, int64_t k, int gate_up, uint16_t *out) {
    if (n % PANEL || k % KSTEP) return -1;
    const int64_t panels = n / PANEL, steps = k / KSTEP;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t s = 0; s < steps; s++)
            for (int t = 0; t < 2; t++) {
                uint16_t *tile = out + ((p * steps + s) * 2 + t) * TILE_ELEMS;
                const int64_t col0 = gate_up ? (t ? n / 2 : 0) + p * 16 : p * PANEL + t * 16;
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++) {
                        const uint16_t *src = w + (col0 + c) * k + s * KSTEP + 2 * r;
                        tile[r * 32 + c * 2] = src[0];
                        tile[r * 32 + c * 2 + 1] = src[1];
                    }
            }
    return 0;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512.h"

#define ROW_CHUNK 256     /* rows whose x stays in L2 while every panel passes */
#define PREFETCH_STEPS 4  /* K steps (2 KiB each) ahead, AMX loop */
/* The vdpbf16ps loop computes a step more slowly than the tiles: 8 steps ahead streamed the LM
 * head (56 MB, cold) at 355-400 GFLOP/s against 327-393 with 4, the layers the same. */
#define DOT_PREFETCH_STEPS 8

static inline __m512 bias16(const uint16_t *bias) {
    return bias ? load16_bf16(bias) : _mm512_setzero_ps();
}

/* One row of a finished block: acc0/acc1 are its 16 + 16 accumulators. */
static inline void write_row(const float *acc0, const float *acc1, const uint16_t *bias,
                             int64_t p, int64_t n, int gate_up, uint16_t *y_row) {
    if (!gate_up) {
        const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(acc0), bias16(bias ? bias + p * PANEL : 0));
        const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(acc1),
                                        bias16(bias ? bias + p * PANEL + 16 : 0));
        store16_bf16_rne(y_row + p * PANEL, v0);
        store16_bf16_rne(y_row + p * PANEL + 16, v1);
        return;
    }
    /* As the Hugging Face model in bf16: gate and up rounded, SiLU rounded, product rounded. */
    const __m512 gate = round16_bf16(_mm512_add_ps(_mm512_loadu_ps(acc0),
                                                 bias16(bias ? bias + p * 16 : 0)));
    const __m512 up = round16_bf16(_mm512_add_ps(_mm512_loadu_ps(acc1),
                                               bias16(bias ? bias + n / 2 + p * 16 : 0)));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    const __m512 silu = round16_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    store16_bf16_rne(y_row + p * 16, _mm512_mul_ps(silu, up));
}

/* Rows `chunk`..chunk_end of x against every panel this thread takes: the same static split in
 * every chunk, so a thread reads the same panels again. The body runs inside a parallel region. */
#define FOR_MY_PANELS(p, panels) _Pragma("omp for schedule(static) nowait") \
    for (int64_t p = 0; p < panels; p++)

/* -- vdpbf16ps: ROWS rows x 32 columns of one panel in 2 * ROWS accumulator vectors. Per K pair,
 * the panel's two 64-byte rows are loaded once and each x row's pair is broadcast against them.
 * Expanded for 1..8 rows so that the accumulators stay in registers. -- */
#define DOT_ROWS 8

#define DEFINE_DOT_BLOCK(ROWS)                                                                     \
static void dot_block_##ROWS(const uint16_t *x, int64_t x_stride, const uint16_t *panel,          \
                             int64_t steps, int first, const uint16_t *next_panel,                 \
                             float acc_out[][2][16]) {                                             \
    __m512 acc0[ROWS], acc1[ROWS];                                                                 \
    for (int i = 0; i < ROWS; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();                        \
    for (int64_t s = 0; s < steps; s++) {                                                          \
        const uint16_t *b = panel + s * 2 * TILE_ELEMS;                                            \
        /* The first block streams the panel in; the second brings the next panel to L2. */       \
        if (first)                                                                                 \
            for (int line = 0; line < 2 * TILE_ELEMS; line += 32)                                  \
                _mm_prefetch((const char *)(b + DOT_PREFETCH_STEPS * 2 * TILE_ELEMS + line),       \
                             _MM_HINT_T0);                                                         \
        else if (next_panel)                                                                       \
            for (int line = 0; line < 2 * TILE_ELEMS; line += 32)                                  \
                _mm_prefetch((const char *)(next_panel + s * 2 * TILE_ELEMS + line),               \
                             _MM_HINT_T1);                                                         \
        const uint16_t *xs = x + s * KSTEP;                                                        \
        for (int r = 0; r < 16; r++) {                                                             \
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + r * 32);                         \
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + TILE_ELEMS + r * 32);            \
            for (int i = 0; i < ROWS; i++) {                                                       \
                int32_t pair;                                                                      \
                memcpy(&pair, xs + i * x_stride + 2 * r, sizeof pair);                             \
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);                              \
                acc0[i] = _mm512_dpbf16_ps(acc0[i], a, b0);                                        \
                acc1[i] = _mm512_dpbf16_ps(acc1[i], a, b1);                                        \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < ROWS; i++) {                                                               \
        _mm512_storeu_ps(acc_out[i][0], acc0[i]);                                                  \
        _mm512_storeu_ps(acc_out[i][1], acc1[i]);                                                  \
    }                                                                                              \
}

DEFINE_DOT_BLOCK(1) DEFINE_DOT_BLOCK(2) DEFINE_DOT_BLOCK(3) DEFINE_DOT_BLOCK(4)
DEFINE_DOT_BLOCK(5) DEFINE_DOT_BLOCK(6) DEFINE_DOT_BLOCK(7) DEFINE_DOT_BLOCK(8)

typedef void (*dot_block_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int,
                             const uint16_t *, float[][2][16]);
static const dot_block_fn dot_blocks[DOT_ROWS + 1] = {
    NULL, dot_block_1, dot_block_2, dot_block_3, dot_block_4, dot_block_5, dot_block_6,
    dot_block_7, dot_block_8};

static void matmul_dot(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                       const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y) {
    const int64_t panels = n / PANEL, steps = k / KSTEP, y_cols = gate_up ? n / 2 : n;
    #pragma omp parallel
    {
        float acc[DOT_ROWS][2][16];
        for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
            const int64_t chunk_end = chunk + ROW_CHUNK < m ? chunk + ROW_CHUNK : m;
            FOR_MY_PANELS(p, panels) {
                const uint16_t *panel = packed + p * steps * 2 * TILE_ELEMS;
                const uint16_t *next = p + 1 < panels ? panel + steps * 2 * TILE_ELEMS : NULL;
                for (int64_t r0 = chunk; r0 < chunk_end; r0 += DOT_ROWS) {
                    const int rows = (int)(chunk_end - r0 < DOT_ROWS ? chunk_end - r0 : DOT_ROWS);
                    dot_blocks[rows](x + r0 * x_stride, x_stride, panel, steps, r0 == chunk,
                                     r0 == chunk + DOT_ROWS ? next : NULL, acc);
                    for (int i = 0; i < rows; i++)
                        write_row(acc[i][0], acc[i][1], bias, p, n, gate_up,
                                  y + (r0 + i) * y_cols);
                }
            }
        }
    }
}

/* -- AMX tiles -- */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include <omp.h>

#define AMX_ROWS 32   /* rows per pass over a panel: two 16-row A tiles */
#define PACE_PASSES 4 /* with 3+ passes, the next panel is fetched over the first 4 */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int matmul_amx_available(void) {
    /* Linux hands out AMX state per process on request; asked once (a race would only ask
     * twice: the request is idempotent). */
    static int state = -1;
    if (state < 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* The rows after the last whole pass of AMX_ROWS, in a zero-padded copy (tiles load 16 rows);
 * NULL when it cannot be allocated. */
static uint16_t *padded_tail(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k) {
    const int64_t whole = m / AMX_ROWS * AMX_ROWS;
    uint16_t *tail = calloc((size_t)(AMX_ROWS * k), sizeof(uint16_t));
    if (tail)
        for (int64_t r = whole; r < m; r++)
            memcpy(tail + (r - whole) * k, x + r * x_stride, (size_t)k * sizeof(uint16_t));
    return tail;
}

/* One K step of a 32 x 32 block: two A tiles of x (rows a_stride bytes apart), the step's two
 * B tiles at b, four products into accumulator tiles 4-7. */
static inline __attribute__((always_inline)) void amx_step(const uint16_t *a, int64_t a_stride,
                                                           const uint16_t *b, int64_t s) {
    _tile_loadd(0, a + s * KSTEP, a_stride);
    _tile_loadd(1, (const char *)(a + s * KSTEP) + 16 * a_stride, a_stride);
    _tile_loadd(2, b, 64);
    _tile_loadd(3, b + TILE_ELEMS, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
}

/* Accumulator tiles 4-7 into acc (rows 0-15 then 16-31, each as 16 + 16 columns). */
static inline __attribute__((always_inline)) void amx_store_acc(float acc[4][16][16]) {
    _tile_stored(4, acc[0], 64);
    _tile_stored(5, acc[1], 64);
    _tile_stored(6, acc[2], 64);
    _tile_stored(7, acc[3], 64);
}

/* A finished block's rows r0.. (at most 32, none past m) of panel p, written to y. */
static inline void amx_write_rows(float acc[4][16][16], const uint16_t *bias, int64_t p,
                                  int64_t n, int gate_up, uint16_t *y, int64_t y_cols,
                                  int64_t r0, int64_t m) {
    for (int i = 0; i < AMX_ROWS && r0 + i < m; i++)
        write_row(acc[i / 16 * 2][i % 16], acc[i / 16 * 2 + 1][i % 16], bias, p, n, gate_up,
                  y + (r0 + i) * y_cols);
}

static int matmul_amx(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                      const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y) {
    const int64_t panels = n / PANEL, steps = k / KSTEP, y_cols = gate_up ? n / 2 : n;
    const int64_t whole = m / AMX_ROWS * AMX_ROWS;
    uint16_t *tail = NULL;
    if (whole < m && !(tail = padded_tail(x, x_stride, m, k))) return -3;
    #pragma omp parallel
    {
        amx_load_full_tiles();
        float acc[4][16][16];
        for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
            const int64_t chunk_end = chunk + ROW_CHUNK < m ? chunk + ROW_CHUNK : m;
            FOR_MY_PANELS(p, panels) {
                const uint16_t *panel = packed + p * steps * 2 * TILE_ELEMS;
                /* The next panel (32 lines a K step) is fetched into L2 during one pass when
                 * a chunk has one or two (the last of them: a lone pass used to fetch nothing
                 * ahead), and spread over the first four passes when it has more (before, the
                 * second pass fetched all of it). `pagoda bench kernels --dtype bfloat16`,
                 * matmuls, three alternated rounds: batch 16 15.2 -> 14.3 ms, 128 29.5 -> 27.0;
                 * batch 64 (two passes) runs as before, and paced over both passes it was
                 * 5% slower there. */
                const int64_t passes = (chunk_end - chunk + AMX_ROWS - 1) / AMX_ROWS;
                const int64_t paced = passes < PACE_PASSES ? passes : PACE_PASSES;
                const int64_t lines = steps * 32;
                const char *next = p + 1 < panels
                                       ? (const char *)(panel + steps * 2 * TILE_ELEMS) : NULL;
                for (int64_t r0 = chunk, pass = 0; r0 < chunk_end; r0 += AMX_ROWS, pass++) {
                    const uint16_t *a = r0 < whole ? x + r0 * x_stride : tail;
                    const int64_t a_stride = (r0 < whole ? x_stride : k) * 2;
                    /* This pass fetches lines [l0, l0 + fetch_lines) of the next panel. */
                    int64_t l0 = 0, fetch_lines = 0;
                    if (next && passes <= 2 && pass == passes - 1) {
                        fetch_lines = lines;
                    } else if (next && passes > 2 && pass < paced) {
                        l0 = lines * pass / paced;
                        fetch_lines = lines * (pass + 1) / paced - l0;
                    }
                    const char *fetch = next ? next + l0 * 64 : NULL;
                    int64_t due = 0;
                    _tile_zero(4);
                    _tile_zero(5);
                    _tile_zero(6);
                    _tile_zero(7);
                    for (int64_t s = 0; s < steps; s++) {
                        const uint16_t *b = panel + s * 2 * TILE_ELEMS;
                        if (r0 == chunk) /* the first pass streams the panel in */
                            for (int line = 0; line < 2 * TILE_ELEMS; line += 32)
                                _mm_prefetch((const char *)(b + PREFETCH_STEPS * 2 * TILE_ELEMS
                                                            + line), _MM_HINT_T0);
                        for (due += fetch_lines; due >= steps; due -= steps, fetch += 64)
                            _mm_prefetch(fetch, _MM_HINT_T1); /* fetch_lines / steps a step */
                        amx_step(a, a_stride, b, s);
                    }
                    amx_store_acc(acc);
                    amx_write_rows(acc, bias, p, n, gate_up, y, y_cols, r0, m);
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}

/* -- AMX over prompt-sized batches. The loop above passes 32 rows at a time over a whole panel:
 * its A rows and B panel (36 KiB each at K = 576) do not fit in L1 together, so every tile comes
 * from L2, four 1 KiB tiles for four tile products, more than L2 feeds. Here K is cut into
 * blocks of at most PROMPT_KB_STEPS steps: a 32-row pass keeps its A block (18 KiB) in L1 while
 * PROMPT_GROUP panels take their turn against it, and each panel's accumulators wait in L1
 * between K blocks. The panels a thread works on at once are capped at PROMPT_SPAN_BYTES (but
 * at least a group), so that they stay in L2 while every pass goes by. Each output is summed in the same order as
 * above: the results are identical. A C loop over the default model's 30 layers at 2,048 rows
 * (three rounds): 1.74-1.86 TFLOP/s -> 2.07-2.17; at 512 rows 1.66-1.74 -> 1.76-1.81; at 256
 * rows it was slower (1.44-1.53 against 1.63-1.68: the weights come from memory there, which
 * the loop above fetches ahead), hence PROMPT_ROWS. -- */
#define PROMPT_ROWS 512          /* from this many rows, the K-blocked loop */
#define PROMPT_KB_STEPS 9        /* the most K steps in a block: 18 KiB of A, 18 KiB of B */
#define PROMPT_GROUP 4           /* panels against one A block */
#define PROMPT_SPAN_BYTES (1 << 20)

static int matmul_amx_prompt(const uint16_t *x, int64_t x_stride, int64_t m,
                             const uint16_t *packed, const uint16_t *bias, int64_t n, int64_t k,
                             int gate_up, uint16_t *y) {
    const int64_t panels = n / PANEL, steps = k / KSTEP, y_cols = gate_up ? n / 2 : n;
    const int64_t whole = m / AMX_ROWS * AMX_ROWS;
    uint16_t *tail = NULL;
    if (whole < m && !(tail = padded_tail(x, x_stride, m, k))) return -3;
    const int64_t panel_elems = steps * 2 * TILE_ELEMS;
    const int64_t blocks = (steps + PROMPT_KB_STEPS - 1) / PROMPT_KB_STEPS;
    const int64_t kb_steps = (steps + blocks - 1) / blocks; /* blocks of near-equal size */
    int64_t span = PROMPT_SPAN_BYTES / (panel_elems * (int64_t)sizeof(uint16_t));
    if (span < PROMPT_GROUP) span = PROMPT_GROUP;
    #pragma omp parallel
    {
        amx_load_full_tiles();
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t mine = panels * t / threads, mine_end = panels * (t + 1) / threads;
        float acc[PROMPT_GROUP][4][16][16] __attribute__((aligned(64)));
        for (int64_t c0 = mine; c0 < mine_end; c0 += span) {
            const int64_t c1 = c0 + span < mine_end ? c0 + span : mine_end;
            for (int64_t r0 = 0; r0 < m; r0 += AMX_ROWS) {
                const uint16_t *a = r0 < whole ? x + r0 * x_stride : tail;
                const int64_t a_stride = (r0 < whole ? x_stride : k) * 2;
                for (int64_t g0 = c0; g0 < c1; g0 += PROMPT_GROUP) {
                    const int64_t g1 = g0 + PROMPT_GROUP < c1 ? g0 + PROMPT_GROUP : c1;
                    for (int64_t s0 = 0; s0 < steps; s0 += kb_steps) {
                        const int64_t s1 = s0 + kb_steps < steps ? s0 + kb_steps : steps;
                        for (int64_t p = g0; p < g1; p++) {
                            float (*c)[16][16] = acc[p - g0];
                            if (s0 == 0) {
                                _tile_zero(4);
                                _tile_zero(5);
                                _tile_zero(6);
                                _tile_zero(7);
                            } else {
                                _tile_loadd(4, c[0], 64);
                                _tile_loadd(5, c[1], 64);
                                _tile_loadd(6, c[2], 64);
                                _tile_loadd(7, c[3], 64);
                            }
                            for (int64_t s = s0; s < s1; s++)
                                amx_step(a, a_stride,
                                         packed + p * panel_elems + s * 2 * TILE_ELEMS, s);
                            amx_store_acc(c);
                            if (s1 == steps)
                                amx_write_rows(c, bias, p, n, gate_up, y, y_cols, r0, m);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}
#define HAVE_AMX_LOOP 1
#else
int matmul_amx_available(void) { return 0; }
#endif

/* set_matmul_bf16_loop: 0 the default (AMX where it runs, K-blocked from PROMPT_ROWS rows),
 * 1 the vdpbf16ps loop even where AMX runs, 2 AMX's streaming loop at every batch size. */
static int loop_choice = 0;

void set_matmul_bf16_loop(int choice) { loop_choice = choice; }

/* The loop matmul_bf16 runs: 2 AMX tiles, 1 vdpbf16ps. */
int matmul_bf16_path(void) { return loop_choice != 1 && matmul_amx_available() ? 2 : 1; }

/* y [m, n] (or [m, n/2] with gate_up) = x [m, k] (rows x_stride apart) W^T + bias, W packed by
 * matmul_bf16_pack. Returns -1 for shapes it cannot run, -3 when the AMX loop's tail copy
 * cannot be allocated. */
int matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y) {
    if (n % PANEL || k % KSTEP) return -1;
    if (m <= 0) return 0;
#ifdef HAVE_AMX_LOOP
    if (matmul_bf16_path() == 2)
        return m >= PROMPT_ROWS && k >= KSTEP && loop_choice != 2
                   ? matmul_amx_prompt(x, x_stride, m, packed, bias, n, k, gate_up, y)
                   : matmul_amx(x, x_stride, m, packed, bias, n, k, gate_up, y);
#endif
    matmul_dot(x, x_stride, m, packed, bias, n, k, gate_up, y);
    return 0;
}

#elif defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
/* Neither loop: callers keep oneDNN (which has a bf16 kernel on AVX-512 CPUs without
 * AVX512-BF16). AVX2 and FMA without AVX-512: matmul_bf16_avx2.c. */

int matmul_amx_available(void) { return 0; }

void set_matmul_bf16_loop(int choice) { (void)choice; }

int matmul_bf16_path(void) { return 0; }

int matmul_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y) {
    (void)x, (void)x_stride, (void)m, (void)packed, (void)bias, (void)n, (void)k, (void)gate_up;
    (void)y;
    return -2;
}

#endif
