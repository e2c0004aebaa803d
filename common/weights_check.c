/* Load-time checks of transformed weights (weights_check.h). */
#include "common/weights_check.h"

#include <math.h>

loom_status_t loom_weights_check_scaled(const char *tensor, const char *what, const float *x, size_t n, float scale,
                                        float add, loom_err_t *err) {
    if (!isfinite(scale) || !isfinite(add))
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s': %s uses a factor that is not finite (%g, %g)", tensor,
                            what ? what : "the loader's transform", (double)scale, (double)add);
    for (size_t i = 0; i < n; i++) {
        float v = x[i] * scale + add; /* as the loader computes it, in float */
        if (!isfinite(v))
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "tensor '%s': element %zu (%g) becomes %s under %s (x %g + %g): the model would "
                                "compute NaN",
                                tensor, i, (double)x[i], isnan(v) ? "NaN" : "Inf",
                                what ? what : "the loader's transform", (double)scale, (double)add);
    }
    return LOOM_OK;
}

loom_status_t loom_weights_check_finite(const char *tensor, const char *what, const float *x, size_t n,
                                        loom_err_t *err) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s': element %zu is %s after %s: the model would "
                                                      "compute NaN",
                                tensor, i, isnan(x[i]) ? "NaN" : "Inf", what ? what : "the loader's transform");
    return LOOM_OK;
}
