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

/* Log probabilities of the rows whose SampleParams ask for them (see
 * kernels/sampling.h): each shard keeps the raw logits of those rows (host)
 * until the sampling parts exist, so that it can report the raw logit of
 * each of its candidates next to its (max, sum_exp, top-n) part. */
typedef struct loom_logprobs {
    float *raw;              /* (n_rows_lp, vocab_len) raw logits, host */
    size_t cap_raw;
    int *slot;               /* (rows) row -> index in raw, -1: no logprobs */
    loom_lp_part_t *parts;   /* (rows) this shard's parts */
    int32_t *ids;            /* (rows, LOOM_MAX_TOP_LOGPROBS) */
    float *vals;
    float *cand_raw;         /* (rows, LOOM_SAMPLE_MAX_CAND) raw logits of the sampling candidates */
    int cap_rows, vocab_begin, vocab_len;
    /* results (TP rank 0), for StepResult */
    float *lp;               /* (n_lp) */
    uint32_t *n_top;         /* (n_lp) */
    int32_t *top_ids;        /* (n_tops) */
    float *top_lps;
    int n_lp, n_tops;
    int any;                 /* a row of this step asks for logprobs */
} loom_logprobs_t;

void loom_logprobs_free(loom_logprobs_t *l);
/* Before the edits: keeps the raw rows and computes this shard's parts. */
loom_status_t loom_logprobs_capture(loom_logprobs_t *l, loom_backend_t *be, const float *logits, int n_rows,
                                    int vocab_begin, int vocab_len, Loom__V1__SampleParams *const *sp,
                                    loom_err_t *err);
/* After the sampling parts: the raw logit of each candidate of row r. */
void loom_logprobs_candidates(loom_logprobs_t *l, int r, const loom_sample_part_t *part);
/* Bytes row r adds to the gathered parts (0 without logprobs); k: its candidates. */
size_t loom_logprobs_extra_bytes(const Loom__V1__SampleParams *sp, int k);
size_t loom_logprobs_max_extra_bytes(void);
uint8_t *loom_logprobs_pack(const loom_logprobs_t *l, int r, const Loom__V1__SampleParams *sp, int k, uint8_t *p);
const uint8_t *loom_logprobs_unpack(const uint8_t *p, const Loom__V1__SampleParams *sp, int k, loom_lp_part_t *lp,
                                    const float **cand_raw);
/* TP rank 0, rows in order: appends row r's results (sampled id `id`) from
 * the shards' parts. When any row of the step asks for logprobs, every row
 * gets an entry (NaN and no top for the others), so the coordinator reads
 * them by row; otherwise nothing is added. */
void loom_logprobs_reset_results(loom_logprobs_t *l);
void loom_logprobs_finish(loom_logprobs_t *l, const Loom__V1__SampleParams *sp, const loom_lp_part_t *lp,
                          const float *const *cand_raw, const loom_sample_part_t *parts, int n_parts, int32_t id);

/* Prompt logprobs (StepPlan.prompt_lp_*): the LM head runs again at the
 * plan's prompt positions, in batches of at most the model's logit rows.
 * Per batch each shard downloads the rows, takes its (max, sum_exp, top-n)
 * part and the raw logit of the row's prompt token (its owner's; the TP
 * group sums them by an all-reduce so every shard knows it), and counts its
 * logits >= that one (the rank, as vLLM counts it). Only these parts travel
 * to TP rank 0, which merges them by log-sum-exp as for generated tokens. */
typedef struct loom_prompt_lp {
    float *host;             /* (batch, vocab_len) the batch's logits, host */
    size_t cap_host;
    float *target;           /* (batch) raw logit of each row's prompt token */
    uint32_t *count;         /* (batch) this shard's logits >= target */
    loom_lp_part_t *parts;   /* (batch) */
    int32_t *ids;            /* (batch, LOOM_MAX_TOP_LOGPROBS) */
    float *vals;
    int cap_batch;
    /* results (TP rank 0), one per plan row, for StepResult */
    float *lp;
    uint32_t *rank, *n_top;
    int32_t *top_ids;        /* (n_tops) */
    float *top_lps;
    int n, n_tops, cap_res;
} loom_prompt_lp_t;

void loom_prompt_lp_free(loom_prompt_lp_t *l);
void loom_prompt_lp_reset(loom_prompt_lp_t *l, int n_rows); /* a step of n_rows plan rows */
/* Host logits of a batch of n rows (vocab_len each) to fill. */
float *loom_prompt_lp_batch(loom_prompt_lp_t *l, int n, int vocab_len);
/* This shard's parts of the batch: tops[i] the top size, ids[i] the prompt
 * token; the targets are this shard's contribution (0 where it does not own
 * the id), to be summed across the TP group before loom_prompt_lp_count. */
void loom_prompt_lp_parts(loom_prompt_lp_t *l, int n, int vocab_begin, int vocab_len, const uint32_t *tops,
                          const int32_t *ids);
void loom_prompt_lp_count(loom_prompt_lp_t *l, int n, int vocab_len);
size_t loom_prompt_lp_bytes(const uint32_t *tops, int n);
void loom_prompt_lp_pack(const loom_prompt_lp_t *l, int n, const uint32_t *tops, uint8_t *out);
/* TP rank 0: appends the batch's results from the shards' packed parts
 * (recv: n_parts blocks of `bytes` each; NULL with n_parts 1: this shard's
 * own parts). */
void loom_prompt_lp_merge(loom_prompt_lp_t *l, int n, const uint32_t *tops, const uint8_t *recv, size_t bytes,
                          int n_parts);
