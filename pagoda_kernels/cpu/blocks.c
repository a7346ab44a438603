/* A decoder layer's work outside attention in two calls, and a whole decode step's layers in
 * one, for bf16 or fp32 activations and any matmul weight the CPU kernels take (bf16 or fp32
 * panels, int8 / w8a8, GGUF blocks):
 *
 *   attention input:  [residual += x;] h = RMSNorm(x or residual); qkv = h Wqkv^T; rotate q, k
 *   attention output: o = attn Wo^T; residual += o; h = RMSNorm(residual);
 *                     out = (SiLU(h Wg^T) * (h Wu^T)) Wd^T
 *   decode_layers:    for each layer: attention input; K, V into the cache (the activation
 *                     dtype or 8 bits); paged decode attention; attention output; then the
 *                     final norm
 *
 * Each step is the kernel it would be on its own (layer_ops.c, the matmul files, kv_cache.c,
 * paged_attention.c); chaining them here only removes the interpreter between them. That
 * matters more than the call count suggests: every matmul and attention call streams megabytes
 * through the caches, and the Python and torch code that ran between two kernels then ran cold,
 * at 30-90 us a step where it takes 2-20 us warm (measured on the default model at batch 64: an
 * RMSNorm call took 90 us inside a decode step and 18 us on its own). With quantized weights a
 * single-stream decode step is ~10 ms of kernels, and the layer-by-layer Python around them
 * was as much again.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "layer_kernels.h"

enum { LINEAR_BF16 = 1, LINEAR_INT8 = 2, LINEAR_W8A8 = 3, LINEAR_GGUF = 4, LINEAR_F32 = 5 };
#define MAX_PARTS 4

/* A matmul weight [n, k] as one of the kernels holds it (mirrored by pagoda_kernels/cpu/blocks.py). */
typedef struct {
    int64_t kind;     /* LINEAR_* */
    int64_t n, k;
    int64_t gate_up;  /* [gate; up] with SiLU(gate) * up in the kernel: n / 2 outputs */
    const void *data; /* bf16, fp32 or int8 panels */
    const float *scale;       /* int8: per output row */
    const int32_t *sums;      /* int8: each row's sum of q */
    const void *bias;         /* activation dtype, or NULL */
    int64_t parts;            /* GGUF: row ranges of one type each */
    int64_t qtype[MAX_PARTS], row0[MAX_PARTS], rows[MAX_PARTS];
    const uint8_t *qs[MAX_PARTS];
    const void *d[MAX_PARTS], *m[MAX_PARTS]; /* fp16 scales (fp32 for Q4_K) */
} linear_t;

/* y [rows, outputs] contiguous = x W^T (+ bias). Returns 0 or the kernel's error; -20 for a
 * weight kind this build does not run with these activations. */
static int run_linear(const linear_t *w, const void *x, int64_t x_stride, int64_t rows,
                      int bf16, void *y) {
    const size_t esize = bf16 ? 2 : 4;
    switch (w->kind) {
    case LINEAR_BF16:
        if (!bf16) return -20;
        return matmul_bf16(x, x_stride, rows, w->data, w->bias, w->n, w->k, (int)w->gate_up, y);
    case LINEAR_F32:
        if (bf16) return -20;
        return matmul_f32(x, x_stride, rows, w->data, w->bias, w->n, w->k, (int)w->gate_up, y);
    case LINEAR_INT8:
    case LINEAR_W8A8:
        return matmul_int8(x, x_stride, rows, bf16, w->data, w->scale, w->sums, w->bias, w->n,
                           w->k, (int)w->gate_up, w->kind == LINEAR_W8A8, 0, y);
    case LINEAR_GGUF:
        for (int64_t p = 0; p < w->parts; p++) {
            const char *bias = w->bias ? (const char *)w->bias + w->row0[p] * esize : NULL;
            const int rc = gguf_matmul_rows(x, x_stride, rows, w->k, (int)w->qtype[p], w->qs[p],
                                            w->d[p], w->m[p], w->rows[p], bias,
                                            (char *)y + w->row0[p] * esize, w->n, bf16);
            if (rc != 0) return rc;
        }
        return 0;
    default:
        return -20;
    }
}

/* act [rows, inter] = SiLU(gate) * up of gu [rows, 2 * inter] ([gate | up] per row), each op
 * rounded to the dtype as torch's F.silu(gate) * up rounds it; exp as exp_approx (common.h), so
 * that the loop vectorises. Also what SiluAndMulLinear runs for a gate/up weight whose kernel
 * does not fuse it (pagoda_kernels/cpu/blocks.py: silu_mul), so that a model's layers give the same
 * numbers as blocks and module by module. */
void silu_mul_rows(const void *gu, int64_t rows, int64_t inter, void *act, int bf16) {
    #pragma omp parallel for schedule(static) if(rows * inter >= PARALLEL_GRAIN)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gu + r * 2 * inter, *u = g + inter;
            uint16_t *o = (uint16_t *)act + r * inter;
            #pragma omp simd
            for (int64_t i = 0; i < inter; i++) {
                const float gate = bf16_to_float(g[i]);
                const float s = bf16_to_float(float_to_bf16(gate / (1.0f + exp_approx(-gate))));
                o[i] = float_to_bf16(s * bf16_to_float(u[i]));
            }
        } else {
            const float *g = (const float *)gu + r * 2 * inter, *u = g + inter;
            float *o = (float *)act + r * inter;
            #pragma omp simd
            for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
        }
    }
}

static void norm(const void *x, int64_t x_stride, void *residual, const void *weight, void *out,
                 int64_t rows, int64_t cols, float eps, int bf16) {
    if (bf16)
        rms_norm_bf16(x, x_stride, residual, weight, out, rows, (int)cols, eps);
    else
        rms_norm_f32(x, x_stride, residual, weight, out, rows, (int)cols, eps);
}

/* x, residual, h [rows, hidden]; qkv [rows, n_qkv], its first rotary_heads * head_dim columns
 * (q then k) rotated at `positions`. With residual NULL (the first layer) x is normalised as it
 * is. Returns 0, a matmul error, or -10 for a position outside the rotary table. */
int attention_input(const linear_t *qkv_w, const void *x, void *residual,
                    const void *norm_weight, float eps, int64_t rows, int64_t hidden,
                    const int64_t *positions, const void *cos_sin, int64_t max_positions,
                    int rotary_heads, int head_dim, void *h, void *qkv, int bf16) {
    norm(x, hidden, residual, norm_weight, h, rows, hidden, eps, bf16);
    int rc = run_linear(qkv_w, h, hidden, rows, bf16, qkv);
    if (rc != 0) return rc;
    const int64_t n = qkv_w->n;
    rc = bf16 ? rotary_bf16(qkv, n, positions, cos_sin, rows, rotary_heads, head_dim,
                            max_positions)
              : rotary_f32(qkv, n, positions, cos_sin, rows, rotary_heads, head_dim,
                           max_positions);
    return rc ? -10 : 0;
}

/* attn [rows, attn_width]; residual, h, out [rows, hidden]; act [rows, inter]; gu
 * [rows, 2 * inter], used only when gate_up does not fuse SiLU * up. Returns 0 or a matmul
 * error. */
int attention_output_mlp(const linear_t *o_w, const linear_t *gate_up_w, const linear_t *down_w,
                         const void *attn, int64_t attn_width, void *residual,
                         const void *norm_weight, float eps, int64_t rows, int64_t hidden,
                         int64_t inter, void *h, void *gu, void *act, void *out, int bf16) {
    int rc = run_linear(o_w, attn, attn_width, rows, bf16, h);
    if (rc != 0) return rc;
    norm(h, hidden, residual, norm_weight, h, rows, hidden, eps, bf16);
    if (gate_up_w->gate_up) {
        rc = run_linear(gate_up_w, h, hidden, rows, bf16, act);
    } else {
        rc = run_linear(gate_up_w, h, hidden, rows, bf16, gu);
        if (rc == 0) silu_mul_rows(gu, rows, inter, act, bf16);
    }
    if (rc != 0) return rc;
    return run_linear(down_w, act, inter, rows, bf16, out);
}

/* One layer of decode_layers (mirrored by pagoda_kernels/cpu/blocks.py). */
typedef struct {
    linear_t qkv, o, gate_up, down;
    const void *norm1, *norm2;     /* [hidden], activation dtype */
    void *k_cache, *v_cache;       /* [blocks, block_size, kv_heads, row]: activation dtype, or
                                      an 8-bit format's rows (kv_quant.h) */
} decode_layer_t;

/* The model's shapes for decode_layers. */
typedef struct {
    int64_t hidden, inter, heads, kv_heads, head_dim;
    int64_t block_size, num_slots, max_positions;
    int64_t cache_dtype;  /* -1: the activation dtype; else kv_quant.h's 8-bit format */
    const void *cos_sin;  /* [max_positions, 2, head_dim] */
    float eps, scale;
} decode_model_t;

/* A decode step (one new token per sequence, `rows` sequences) through every layer: x
 * [rows, hidden] the embedded tokens (used as the residual stream, so overwritten), positions,
 * slots [rows] (each token's cache slot), block_tables [rows, *] (bt_stride apart), seq_lens
 * [rows] (with the new token); workspace h, out [rows, hidden], qkv [rows, q + 2 kv], attn
 * [rows, q], gu [rows, 2 inter] (for a gate_up that does not fuse), act [rows, inter]; the final
 * norm's output into `hidden_out`. Returns 0; a layer's error as -(1000 (layer + 1)) + error. */
int decode_layers(const decode_layer_t *layers, int64_t num_layers, const decode_model_t *md,
                  const void *final_norm, void *x, const int64_t *positions, const int64_t *slots,
                  const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                  int64_t rows, void *h, void *qkv, void *attn, void *gu, void *act, void *out,
                  void *hidden_out, int bf16) {
    const int64_t q_size = md->heads * md->head_dim, kv_size = md->kv_heads * md->head_dim;
    const int64_t n_qkv = q_size + 2 * kv_size;
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t l = 0; l < num_layers; l++) {
        const decode_layer_t *layer = &layers[l];
        const int fail = -1000 * (int)(l + 1);
        /* Layer 0 normalises x as it is; later ones first add the last MLP output into x. */
        int rc = attention_input(&layer->qkv, l == 0 ? x : out, l == 0 ? NULL : x, layer->norm1,
                                 md->eps, rows, md->hidden, positions, md->cos_sin,
                                 md->max_positions, (int)(md->heads + md->kv_heads),
                                 (int)md->head_dim, h, qkv, bf16);
        if (rc != 0) return fail + rc;
        const char *k = (const char *)qkv + q_size * esize, *v = k + kv_size * esize;
        const int heads = (int)md->heads, kv_heads = (int)md->kv_heads;
        const int head_dim = (int)md->head_dim, block_size = (int)md->block_size;
        const int cd = (int)md->cache_dtype;
        rc = cd < 0 ? kv_cache_write(k, n_qkv * esize, v, n_qkv * esize, layer->k_cache,
                                     layer->v_cache, slots, rows, kv_size * esize, md->num_slots)
                    : kv_cache_write_q8(k, n_qkv * esize, v, n_qkv * esize, layer->k_cache,
                                        layer->v_cache, slots, rows, kv_heads, head_dim, bf16, cd,
                                        md->num_slots);
        if (rc != 0) return fail - (rc == -2 ? 32 : 30); /* a slot outside, or no such format */
        if (cd >= 0)
            rc = bf16 ? paged_decode_q8_bf16(qkv, n_qkv, layer->k_cache, layer->v_cache,
                                             block_tables, bt_stride, seq_lens, attn, (int)rows,
                                             heads, kv_heads, head_dim, block_size, md->scale, cd)
                      : paged_decode_q8_f32(qkv, n_qkv, layer->k_cache, layer->v_cache,
                                            block_tables, bt_stride, seq_lens, attn, (int)rows,
                                            heads, kv_heads, head_dim, block_size, md->scale, cd);
        else
            rc = bf16 ? paged_decode_bf16(qkv, n_qkv, layer->k_cache, layer->v_cache,
                                          block_tables, bt_stride, seq_lens, attn, (int)rows,
                                          heads, kv_heads, head_dim, block_size, md->scale)
                      : paged_decode_f32(qkv, n_qkv, layer->k_cache, layer->v_cache,
                                         block_tables, bt_stride, seq_lens, attn, (int)rows,
                                         heads, kv_heads, head_dim, block_size, md->scale);
        if (rc != 0) return fail - 31;
        rc = attention_output_mlp(&layer->o, &layer->gate_up, &layer->down, attn, q_size, x,
                                  layer->norm2, md->eps, rows, md->hidden, md->inter, h, gu, act,
                                  out, bf16);
        if (rc != 0) return fail + rc;
    }
    norm(out, md->hidden, x, final_norm, hidden_out, rows, md->hidden, md->eps, bf16);
    return 0;
}
