/* Quantized linear weights on the host, between the checkpoint and the
 * backend: reading blocks of linears a checkpoint stores quantized (Loom's
 * own `loom quantize` layout, 4-bit AWQ and GPTQ; docs/model-format.md) into
 * the canonical layout of kernels/quant.h, and slicing and stacking such
 * blocks the way the loader slices float weights for tensor parallelism.
 * Every error names the tensor at fault. */
#ifndef LOOM_QWEIGHTS_H
#define LOOM_QWEIGHTS_H

#include <stdint.h>

#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "kernels/quant.h"

/* Whether the checkpoint stores linear `prefix` (e.g.
 * "model.layers.0.mlp.down_proj") quantized: `prefix.qweight` exists. */
int loom_qw_stored(const loom_st_t *st, const char *prefix);

/* Reads rows [r0, r0+nr) x input columns [c0, c0+nc) of the quantized linear
 * `prefix` of logical shape (rows, cols) into a newly allocated (owned)
 * canonical tensor of nr x nc. AWQ and GPTQ become Q4 with min, exactly
 * (w = s * (q - z) = s * q + (-s * z)). A column range that does not start
 * and end on a group boundary is an error. */
loom_status_t loom_qw_read(loom_st_t *st, const loom_model_config_t *cfg, const char *prefix, int64_t rows,
                           int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, loom_qtensor_t *out,
                           loom_err_t *err);

/* Columns [c0, c0+nc) of t as a new owned tensor: per-channel schemes keep
 * each row's scale; Q4 needs c0 and nc to be whole groups (asserted). */
void loom_qw_slice_cols(const loom_qtensor_t *t, int64_t c0, int64_t nc, loom_qtensor_t *out);

/* Stacks the rows of n tensors with the same scheme, group and columns into
 * a new owned tensor; FORMAT error naming `what` when they differ. */
loom_status_t loom_qw_stack_rows(const loom_qtensor_t *parts, int n, const char *what, loom_qtensor_t *out,
                                 loom_err_t *err);

#endif
