/* FP8 block-quantized weights (DeepSeek-V3's checkpoints): float8_e4m3fn
 * codes with one float scale per block of rows x columns (128 x 128 as
 * shipped), stored beside the weight as NAME_scale_inv; the value is
 * code x scale_inv of its block, and the edge blocks are partial (the scale
 * grid is ceil(rows / br) x ceil(cols / bc)). Dequantized to float at load. */
#ifndef LOOM_FP8_H
#define LOOM_FP8_H

#include <stdint.h>

#include "common/safetensors.h"
#include "common/status.h"

/* float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f and 0xff NaN (the
 * checkpoint side's decoder: common/ does not link kernels/quant.c's). */
float loom_e4m3fn_value(uint8_t code);

/* Refuses (FORMAT, naming both tensors and the shapes) a scale grid that is not 2-D
 * ceil(rows / br) x ceil(cols / bc) for the 2-D F8_E4M3 weight w, or a weight of another dtype. */
loom_status_t loom_fp8_check_scale(const loom_st_tensor_t *w, const loom_st_tensor_t *scale, int br, int bc,
                                   loom_err_t *err);

/* out (rows x cols) = codes x scale_inv of each one's block: the plain reference, whole matrices in memory. */
void loom_fp8_block_dequant(const uint8_t *codes, int64_t rows, int64_t cols, const float *scale_inv, int br,
                            int bc, float *out);

/* The 2-D block [row0, row0+nrows) x [col0, col0+ncols) of an F8_E4M3 weight, dequantized into dst
 * (nrows x ncols): a TP slice reads only its own rows or columns. Checks the scale first. */
loom_status_t loom_st_read_fp8(loom_st_t *st, const loom_st_tensor_t *w, const loom_st_tensor_t *scale, int br,
                               int bc, int64_t row0, int64_t nrows, int64_t col0, int64_t ncols, float *dst,
                               loom_err_t *err);

#endif
