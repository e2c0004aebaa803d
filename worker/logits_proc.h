/* Sampling controls on the last stage: each logit row's penalties, bias,
 * bans and allow-list (carried by its SampleParams in the step plan) are
 * applied to this worker's slice of the vocabulary before the sampling
 * parts are taken, so only winners still travel (kernels/sampling.h). */
#ifndef LOOM_LOGITS_PROC_H
#define LOOM_LOGITS_PROC_H

#include <stddef.h>

#include "common/status.h"
#include "kernels/backend.h"
#include "loom/v1/control.pb-c.h"

/* Edits rows [0, n_rows) of logits (device, (rows, vocab_len), this shard's
 * ids [vocab_begin, vocab_begin + vocab_len)) as their SampleParams ask.
 * Rows without edits are not touched (no transfer); an edited row is
 * downloaded to *buf (grown as needed), edited and uploaded. Every id and
 * count is validated first: INVALID_ARGUMENT names the bad one. */
loom_status_t loom_logits_process(loom_backend_t *be, float *logits, int n_rows, int vocab_begin, int vocab_len,
                                  int vocab_size, Loom__V1__SampleParams *const *sp, float **buf, size_t *cap,
                                  loom_err_t *err);

#endif
