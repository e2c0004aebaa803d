/* The request's sampling controls (penalties, min_p, logit_bias, allowed
 * and bad words, min_tokens) turned into step-plan fields. The coordinator
 * holds every sequence's tokens, so each plan row is recomputed from them
 * (token counts, matched bad-word prefixes, whether min_tokens is reached):
 * workers keep no per-sequence state, and preemption, re-prefill and
 * failover give the same rows. See kernels/sampling.h for what the workers
 * do with them. */
#ifndef LOOM_SAMPLING_PARAMS_H
#define LOOM_SAMPLING_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#include "common/model_config.h"
#include "common/request_limits.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "coordinator/sched.h"
#include "loom/v1/api.pb-c.h"
#include "loom/v1/control.pb-c.h"


typedef struct loom_sparams loom_sparams_t;
struct loom_guide;

/* Validates and compiles g's controls. *out is NULL when the request asks
 * for none. stop_ids are the request's stop_token_ids (banned with EOS
 * before min_tokens). INVALID_ARGUMENT names the field. */
loom_status_t loom_sparams_create(const Loom__V1__GenerateRequest *g, const loom_tokenizer_t *tok,
                                  const loom_model_config_t *mcfg, loom_sparams_t **out, loom_err_t *err);
void loom_sparams_destroy(loom_sparams_t **p_p); /* safe on NULL and twice */
int loom_sparams_min_tokens(const loom_sparams_t *p); /* 0 for NULL */
/* Constrained decoding: *p takes the guide (created when NULL). min_tokens
 * is off with a grammar: the grammar alone decides where the output may end. */
void loom_sparams_set_guide(loom_sparams_t **p, struct loom_guide *guide);
struct loom_guide *loom_sparams_guide(const loom_sparams_t *p); /* NULL for none */

/* Whether q's next plan row is the same whatever token it samples now
 * (overlapped scheduling): not with a grammar, penalties or bad words, nor
 * before min_tokens is reached (the row's bans count the output). NULL: 1. */
int loom_sparams_plan_ahead(const loom_sparams_t *p, const struct loom_seq *q);

/* Memory for the plan rows' arrays, valid until the next fill. */
typedef struct loom_sparams_arena {
    void **blocks;
    int n, cap;
} loom_sparams_arena_t;
void loom_sparams_arena_free(loom_sparams_arena_t *a);

/* Fills the control fields of sp[i] (already initialised, one per logit row
 * of mb) from each row's sequence (seq->sparams). */
void loom_sparams_fill_plan(loom_sparams_arena_t *a, const loom_microbatch_t *mb, Loom__V1__SampleParams *const *sp);

/* One sampled token's log probabilities, from a StepResult. */
typedef struct loom_token_lp {
    float logprob;
    int n_top;
    const int32_t *top_ids;
    const float *top_lps;
} loom_token_lp_t;

/* A completed micro-batch's logprobs, by sequence. */
typedef struct loom_lp_view {
    const loom_microbatch_t *mb;
    const Loom__V1__StepResult *r; /* NULL: nothing bound */
    int *top_off;                  /* (rows) offset of each row's top entries */
    int cap;
    loom_token_lp_t cur;
} loom_lp_view_t;

/* Binds r's logprob arrays to mb's rows after checking their sizes and ids
 * (-1 with a message when malformed; no logprobs in r is fine). */
int loom_lp_view_bind(loom_lp_view_t *v, const loom_microbatch_t *mb, const Loom__V1__StepResult *r, int vocab_size,
                      char *msg, size_t n);
void loom_lp_view_unbind(loom_lp_view_t *v);
void loom_lp_view_free(loom_lp_view_t *v);
/* The bound logprobs of seq's latest token (the row whose step is its
 * index: a speculating sequence has several), NULL when it has none. */
const loom_token_lp_t *loom_lp_view_get(loom_lp_view_t *v, const loom_seq_t *seq);

#endif
