/* The worker's side of the sampling controls (see logits_proc.h). */
#include "worker/logits_proc.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/util.h"
#include "kernels/sampling.h"

static void edits_of(const Loom__V1__SampleParams *sp, loom_logit_edits_t *e) {
    *e = (loom_logit_edits_t){.allowed = sp->allowed_ids, .n_allowed = (int)sp->n_allowed_ids,
                              .banned = sp->banned_ids, .n_banned = (int)sp->n_banned_ids,
                              .bias_ids = sp->bias_ids, .bias = sp->bias_values, .n_bias = (int)sp->n_bias_ids,
                              .seen_ids = sp->seen_ids, .out_counts = sp->out_counts, .n_seen = (int)sp->n_seen_ids,
                              .repetition = sp->repetition_penalty, .frequency = sp->frequency_penalty,
                              .presence = sp->presence_penalty};
}

static loom_status_t check_ids(const int32_t *ids, size_t n, int vocab_size, int ascending, const char *what,
                               int row, loom_err_t *err) {
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= vocab_size)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: %s id %d is outside the vocabulary [0, %d)",
                                row, what, ids[i], vocab_size);
        if (ascending && i > 0 && ids[i] <= ids[i - 1])
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: %s ids are not strictly ascending", row,
                                what);
    }
    return LOOM_OK;
}

static loom_status_t check_row(const Loom__V1__SampleParams *sp, int vocab_size, int r, loom_err_t *err) {
    if (sp->n_bias_ids != sp->n_bias_values || sp->n_seen_ids != sp->n_out_counts)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: bias or count arrays of unequal length", r);
    LOOM_CHECK(check_ids(sp->allowed_ids, sp->n_allowed_ids, vocab_size, 1, "allowed", r, err));
    LOOM_CHECK(check_ids(sp->banned_ids, sp->n_banned_ids, vocab_size, 0, "banned", r, err));
    LOOM_CHECK(check_ids(sp->bias_ids, sp->n_bias_ids, vocab_size, 0, "bias", r, err));
    LOOM_CHECK(check_ids(sp->seen_ids, sp->n_seen_ids, vocab_size, 1, "seen", r, err));
    for (size_t i = 0; i < sp->n_bias_values; i++)
        if (!isfinite(sp->bias_values[i]))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: a logit bias is not finite", r);
    for (size_t i = 0; i < sp->n_out_counts; i++)
        if (sp->out_counts[i] < 0)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: a negative token count", r);
    if (!isfinite(sp->repetition_penalty) || sp->repetition_penalty < 0.0f || !isfinite(sp->frequency_penalty) ||
        !isfinite(sp->presence_penalty) || !(sp->min_p >= 0.0f && sp->min_p <= 1.0f))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "row %d: a penalty or min_p out of range", r);
    return LOOM_OK;
}

loom_status_t loom_logits_process(loom_backend_t *be, float *logits, int n_rows, int vocab_begin, int vocab_len,
                                  int vocab_size, Loom__V1__SampleParams *const *sp, float **buf, size_t *cap,
                                  loom_err_t *err) {
    for (int r = 0; r < n_rows; r++) LOOM_CHECK(check_row(sp[r], vocab_size, r, err));
    size_t row_bytes = (size_t)vocab_len * sizeof(float);
    for (int r = 0; r < n_rows; r++) {
        loom_logit_edits_t e;
        edits_of(sp[r], &e);
        if (!loom_logits_edits_active(&e)) continue;
        if (*cap < (size_t)vocab_len) { /* once per shard: the row size never changes */
            free(*buf);
            *buf = loom_xmalloc(row_bytes);
            *cap = (size_t)vocab_len;
        }
        float *dev = logits + (size_t)r * (size_t)vocab_len;
        loom_backend_download(be, *buf, dev, row_bytes);
        loom_logits_edit(*buf, vocab_len, vocab_begin, &e);
        loom_backend_upload(be, dev, *buf, row_bytes);
    }
    return LOOM_OK;
}
