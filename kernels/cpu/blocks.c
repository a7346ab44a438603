/* A bf16 decoder layer's work outside attention in two calls, for CPUs with AMX:
 *
 *   attention input:  [residual += x;] h = RMSNorm(x or residual); qkv = h Wqkv^T; rotate q, k
 *   attention output: o = attn Wo^T; residual += o; h = RMSNorm(residual);
 *                     out = (SiLU(h Wg^T) * (h Wu^T)) Wd^T
 *
 * Each step is the kernel it would be on its own (layer_ops.c, matmul_amx.c); chaining them here
 * only removes the interpreter between them. That matters more than the call count suggests:
 * every matmul and attention call streams megabytes through the caches, and the Python and
 * torch code that ran between two kernels then ran cold, at 30-90 us a step where it takes 2-20
 * us warm (measured on the default model at batch 64: an RMSNorm call took 90 us inside a
 * decode step and 18 us on its own).
 */
#include <stdint.h>

#include "common.h"
#include "layer_kernels.h"

/* x, residual, h [rows, hidden]; qkv [rows, n_qkv], its first rotary_heads * head_dim columns
 * (q then k) rotated at `positions`. With residual NULL (the first layer) x is normalised as it
 * is. Returns 0, a matmul_amx_bf16 error, or -10 for a position outside the rotary table. */
int attention_input_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *norm_weight,
                         float eps, const uint16_t *qkv_packed, const uint16_t *qkv_bias,
                         int64_t n_qkv, int64_t rows, int64_t hidden, const int64_t *positions,
                         const uint16_t *cos_sin, int64_t max_positions, int rotary_heads,
                         int head_dim, uint16_t *h, uint16_t *qkv) {
    rms_norm_bf16(x, hidden, residual, norm_weight, h, rows, (int)hidden, eps);
    int rc = matmul_amx_bf16(h, hidden, rows, qkv_packed, qkv_bias, n_qkv, hidden, 0, qkv);
    if (rc != 0) return rc;
    if (rotary_bf16(qkv, n_qkv, positions, cos_sin, rows, rotary_heads, head_dim, max_positions))
        return -10;
    return 0;
}

/* attn [rows, attn_width]; residual, h, out [rows, hidden]; act [rows, inter] (gate_up packed
 * with the fused SiLU: 2 * inter columns). Returns 0 or a matmul_amx_bf16 error. */
int attention_output_mlp_bf16(const uint16_t *attn, int64_t attn_width, const uint16_t *o_packed,
                              const uint16_t *o_bias, uint16_t *residual,
                              const uint16_t *norm_weight, float eps,
                              const uint16_t *gate_up_packed, const uint16_t *gate_up_bias,
                              const uint16_t *down_packed, const uint16_t *down_bias,
                              int64_t rows, int64_t hidden, int64_t inter, uint16_t *h,
                              uint16_t *act, uint16_t *out) {
    int rc = matmul_amx_bf16(attn, attn_width, rows, o_packed, o_bias, hidden, attn_width, 0, h);
    if (rc != 0) return rc;
    rms_norm_bf16(h, hidden, residual, norm_weight, h, rows, (int)hidden, eps);
    rc = matmul_amx_bf16(h, hidden, rows, gate_up_packed, gate_up_bias, 2 * inter, hidden, 1,
                         act);
    if (rc != 0) return rc;
    return matmul_amx_bf16(act, inter, rows, down_packed, down_bias, hidden, inter, 0, out);
}
