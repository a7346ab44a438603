/* AMX tile set-up shared by the kernels that run on the tiles (matmul_bf16.c,
 * prefill_attention.c). Include only where __AMX_TILE__ is defined. */
#ifndef PAGODA_AMX_H
#define PAGODA_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Configures all eight tiles of the calling thread as 16 rows of 64 bytes (each thread of a
 * parallel region must do this before it touches a tile). */
static inline void amx_load_full_tiles(void) {
    amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

int matmul_amx_available(void); /* matmul_bf16.c: asks Linux for the tile state once */

#endif
