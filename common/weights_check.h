/* Load-time checks of weights that a transform has touched: a checkpoint
 * value that is finite can become Inf when the loader folds a factor into
 * it (3e38 x 2: a norm's 1 + w, a rotary or attention factor, a block scale
 * of a quantized format). The raw values are checked as they are read; these
 * check what the loader made of them, naming the tensor, so a model that
 * would compute NaNs is refused at load instead. */
#ifndef LOOM_WEIGHTS_CHECK_H
#define LOOM_WEIGHTS_CHECK_H

#include <stddef.h>

#include "common/status.h"

/* Before a transform w' = w * scale + add over x[0..n): LOOM_OK when every
 * w' would be finite, else LOOM_ERR_FORMAT naming tensor (and what, the
 * transform, e.g. "the Gemma norm's 1 + w"), the first element and its
 * value. scale and add must be finite themselves. */
loom_status_t loom_weights_check_scaled(const char *tensor, const char *what, const float *x, size_t n, float scale,
                                        float add, loom_err_t *err);

/* After a transform: every x[i] finite, else LOOM_ERR_FORMAT as above. */
loom_status_t loom_weights_check_finite(const char *tensor, const char *what, const float *x, size_t n,
                                        loom_err_t *err);

#endif
