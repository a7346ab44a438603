/* bf16 matmul on AMX tiles: y = x W^T (+ bias), optionally followed by SiLU(gate) * up, for
 * the layers and LM head of bf16 models on CPUs with AMX (Sapphire Rapids and later).
 *
 * Why not oneDNN's packed matmul, which also runs on AMX: at decode batch sizes a matmul is a
 * stream over its weight, and oneDNN's reads it well below the memory's rate (the default model
 * at batch 64, 30 layers' weights cycled: oneDNN 7-10 GB/s, this loop 15-20 GB/s; in whole decode
 * steps, with the weights cold, the layer matmuls take ~20% less time). Here each weight is read
 * once, in memory order, with software prefetch ahead of the tiles. At prompt-sized batches the
 * two are within ~15% of each other either way, and with SiLU(gate) * up fused this one is ahead,
 * so one packed copy serves both.
 *
 * Layout: W [N, K] is packed into panels of 32 output columns; a panel is K/32 steps of two
 * 16x32 B tiles (1 KiB each, K pairs interleaved as AMX wants them), contiguous, so a panel is
 * one sequential read. Threads split the panels; rows go through in chunks whose x stays in L2,
 * 32 rows (two A tiles) at a time against the panel's two B tiles: four accumulator tiles.
 * With `gate_up` (the fused gate/up projection), panel p holds gate columns 16p.. in its first
 * tile and the matching up columns in its second, so the epilogue forms SiLU(gate) * up and
 * only that is written.
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "layer_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "avx512.h"

#define PANEL 32          /* output columns per panel: two 16-column B tiles */
#define KSTEP 32          /* K values per tile row: 64 bytes of bf16 */
#define TILE_ELEMS 512    /* bf16 values in one 16 x 64-byte tile */
#define ROW_BLOCK 32      /* rows per pass over a panel: two 16-row A tiles */
#define ROW_CHUNK 256     /* rows whose x stays in L2 while every panel passes */
#define PREFETCH_STEPS 4  /* K steps (2 KiB each) ahead */

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

/* W [n, k] -> panels (see the top). Returns -1 when n or k is not a multiple of 32. */
int matmul_amx_pack_bf16(const uint16_t *w, int64_t n, int64_t k, int gate_up, uint16_t *out) {
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

/* y [m, n] (or [m, n/2] with gate_up) = x [m, k] (rows x_stride apart) W^T + bias, W packed by
 * matmul_amx_pack_bf16. Returns -1 for shapes it cannot run, -2 without AMX. */
int matmul_amx_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y) {
    if (n % PANEL || k % KSTEP) return -1;
    if (!matmul_amx_available()) return -2;
    if (m <= 0) return 0;
    const int64_t panels = n / PANEL, steps = k / KSTEP, y_cols = gate_up ? n / 2 : n;
    /* The last partial block of rows is read from a zero-padded copy: tiles load 16 rows. */
    const int64_t whole = m / ROW_BLOCK * ROW_BLOCK;
    uint16_t *tail = NULL;
    if (whole < m) {
        tail = calloc((size_t)(ROW_BLOCK * k), sizeof(uint16_t));
        if (!tail) return -3;
        for (int64_t r = whole; r < m; r++)
            memcpy(tail + (r - whole) * k, x + r * x_stride, (size_t)k * sizeof(uint16_t));
    }
    #pragma omp parallel
    {
        amx_load_full_tiles();
        float acc[4][16][16];
        for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
            const int64_t chunk_end = chunk + ROW_CHUNK < m ? chunk + ROW_CHUNK : m;
            /* The same static split in every chunk: a thread reads the same panels again. */
            #pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < panels; p++) {
                const uint16_t *panel = packed + p * steps * 2 * TILE_ELEMS;
                for (int64_t r0 = chunk; r0 < chunk_end; r0 += ROW_BLOCK) {
                    const uint16_t *a = r0 < whole ? x + r0 * x_stride : tail;
                    const int64_t a_stride = (r0 < whole ? x_stride : k) * 2;
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
                        else if (r0 == chunk + ROW_BLOCK)
                            /* the second finds it in cache: it brings the next panel to L2,
                             * so that memory is never idle while the tiles compute */
                            for (int line = 0; line < 2 * TILE_ELEMS; line += 32)
                                _mm_prefetch((const char *)(b + steps * 2 * TILE_ELEMS + line),
                                             _MM_HINT_T1);
                        _tile_loadd(0, a + s * KSTEP, a_stride);
                        _tile_loadd(1, (const char *)(a + s * KSTEP) + 16 * a_stride, a_stride);
                        _tile_loadd(2, b, 64);
                        _tile_loadd(3, b + TILE_ELEMS, 64);
                        _tile_dpbf16ps(4, 0, 2);
                        _tile_dpbf16ps(5, 0, 3);
                        _tile_dpbf16ps(6, 1, 2);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                    _tile_stored(4, acc[0], 64);
                    _tile_stored(5, acc[1], 64);
                    _tile_stored(6, acc[2], 64);
                    _tile_stored(7, acc[3], 64);
                    for (int i = 0; i < ROW_BLOCK && r0 + i < m; i++)
                        write_row(acc[i / 16 * 2][i % 16], acc[i / 16 * 2 + 1][i % 16], bias, p,
                                  n, gate_up, y + (r0 + i) * y_cols);
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}

#else

int matmul_amx_available(void) { return 0; }

int matmul_amx_pack_bf16(const uint16_t *w, int64_t n, int64_t k, int gate_up, uint16_t *out) {
    (void)w, (void)n, (void)k, (void)gate_up, (void)out;
    return -2;
}

int matmul_amx_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    const uint16_t *bias, int64_t n, int64_t k, int gate_up, uint16_t *y) {
    (void)x, (void)x_stride, (void)m, (void)packed, (void)bias, (void)n, (void)k, (void)gate_up;
    (void)y;
    return -2;
}

#endif
