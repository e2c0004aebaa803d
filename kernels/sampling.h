/* Token sampling that works the same on one device or across a vocab-parallel
 * LM head. Each shard of the vocabulary reduces its logits to a small
 * loom_sample_part_t (only winners travel); merging the parts picks the token.
 *
 * Semantics (identical for every grid and backend):
 *  - temperature <= 0: greedy, the largest logit, ties to the smallest id;
 *  - temperature > 0, no top-k and top-p >= 1: exact sampling from
 *    softmax(logits / T) by the Gumbel-max trick: argmax z_i + g_i, with
 *    g_i = -log(-log(u_i)) and u_i a hash of (seed, step, id). One winner per shard;
 *  - otherwise (top-k and/or top-p): each shard keeps its K best z = logit / T
 *    (K = min(top_k, LOOM_SAMPLE_MAX_CAND), or LOOM_SAMPLE_MAX_CAND when only
 *    top-p is set) plus its max and sum of exp(z - max); the merge sorts the
 *    candidates and keeps top-k, cuts the nucleus with probabilities
 *    renormalised over the top-k when top-k is set (as Hugging Face and vLLM
 *    do) or over the *whole* vocabulary when only top-p is, and samples inside
 *    it by Gumbel-max with the same noise. A nucleus larger than
 *    LOOM_SAMPLE_MAX_CAND tokens is cut there.
 *  - min_p > 0 (with temperature > 0) makes the row filtered too: candidates
 *    whose probability is below min_p times the largest one are dropped, and
 *    top-p renormalises over the survivors (vLLM's order: temperature, min-p,
 *    top-k, top-p). At most LOOM_SAMPLE_MAX_CAND survivors per shard count.
 * The noise depends only on (seed, step, id), where step is the index of the
 * generated token in its sequence: the same seed gives the same text alone or
 * inside any batch, and a recomputed (preempted) sequence samples the same ids.
 *
 * Logit edits (loom_logits_edit) come before all of this, on each shard's own
 * slice of the vocabulary: an allow-list, bans, logit_bias, then the
 * repetition, frequency and presence penalties (vLLM's formulas). Everything
 * they read (counts, bans) is carried per row by the step plan, so they too
 * are a pure function of the sequence. */
#ifndef LOOM_SAMPLING_H
#define LOOM_SAMPLING_H

#include <stdint.h>

#define LOOM_SAMPLE_MAX_CAND 1024 /* candidates per shard at most (top_k above it is capped) */
#define LOOM_SAMPLE_MAX_PARTS 64  /* vocabulary shards (tensor-parallel ranks) at most */

typedef struct loom_sampling {
    float temperature; /* <= 0: greedy */
    int top_k;         /* 0: off */
    float top_p;       /* >= 1: off */
    uint64_t seed;
    float min_p;       /* 0: off */
} loom_sampling_t;

typedef enum { LOOM_SAMPLE_GREEDY = 0, LOOM_SAMPLE_GUMBEL, LOOM_SAMPLE_FILTERED } loom_sample_mode_t;

/* What one vocabulary shard reports for one row. */
typedef struct loom_sample_part {
    float max_z;   /* max of z over the shard (z = logit / T; the logit when greedy) */
    float sum_exp; /* sum of exp(z - max_z) over the shard (filtered mode only) */
    int n;         /* candidates written */
    int32_t *ids;  /* (k) global token ids, best first */
    float *keys;   /* (k) greedy: logit; gumbel: z + g; filtered: z */
} loom_sample_part_t;

loom_sample_mode_t loom_sample_mode(const loom_sampling_t *s, int vocab_size);
/* Candidates a shard must produce for this row (1 for greedy and gumbel). */
int loom_sample_k(const loom_sampling_t *s, int vocab_size);
/* Uniform in (0, 1) from (seed, step, id): the counter-based RNG. */
double loom_sample_uniform(uint64_t seed, uint64_t step, uint64_t id);
/* Reference shard reduction over logits[0..n) whose global ids start at
 * id_offset; `vocab_size` is the full vocabulary. out->ids/keys hold k entries. */
void loom_sample_shard(const float *logits, int n, int id_offset, int vocab_size,
                       const loom_sampling_t *s, uint64_t step, int k, loom_sample_part_t *out);
/* Picks the token from the shards' parts. */
int32_t loom_sample_merge(const loom_sample_part_t *parts, int n_parts, int vocab_size,
                          const loom_sampling_t *s, uint64_t step);

/* Edits of one row's logits before sampling (see the top). Ids are global;
 * each shard applies those in its own slice and ignores the rest. */
typedef struct loom_logit_edits {
    const int32_t *allowed;    /* (n_allowed) ascending; when n_allowed > 0 every other id is -inf */
    int n_allowed;
    const int32_t *banned;     /* (n_banned) these ids are -inf (bad words, EOS before min_tokens) */
    int n_banned;
    const int32_t *bias_ids;   /* (n_bias) logit_bias: added to the logit */
    const float *bias;
    int n_bias;
    const int32_t *seen_ids;   /* (n_seen) distinct ids of the sequence (prompt and output) */
    const int32_t *out_counts; /* (n_seen) times each was generated (0: only in the prompt) */
    int n_seen;
    float repetition;          /* 0 or 1: off; a seen id's logit is divided by it when > 0, else multiplied */
    float frequency;           /* subtracted times the output count */
    float presence;            /* subtracted once for an id generated at least once */
} loom_logit_edits_t;

/* 1 when the edits change anything. */
int loom_logits_edits_active(const loom_logit_edits_t *e);
/* Applies the edits to logits[0..n) whose global ids start at id_offset.
 * seen_ids must be distinct (the effect of a repeated one is applied once per
 * occurrence). */
void loom_logits_edit(float *logits, int n, int id_offset, const loom_logit_edits_t *e);

/* Log probabilities over a vocabulary-parallel head. They are the model's
 * raw ones, log_softmax(logits), before temperature, penalties, bias and
 * masks (vLLM's default, logprobs_mode "raw_logprobs"). Each shard reports
 * its max, its sum of exp(logit - max) and its top_n (id, logit); the merge
 * gives log Z = M + log sum_s S_s exp(m_s - M), and a token's logprob is its
 * logit - log Z. Only these travel, never vocabulary-sized rows. */
#define LOOM_MAX_TOP_LOGPROBS 20

typedef struct loom_lp_part {
    float max;      /* largest logit of the shard */
    float sum_exp;  /* sum of exp(logit - max) over the shard */
    int n;          /* entries in ids / vals */
    int32_t *ids;   /* (top_n) global ids, best first (ties: smaller id) */
    float *vals;    /* (top_n) their logits */
} loom_lp_part_t;

void loom_logprob_shard(const float *logits, int n, int id_offset, int top_n, loom_lp_part_t *out);
/* log Z of the whole row from the shards' parts. */
double loom_logprob_log_z(const loom_lp_part_t *parts, int n_parts);
/* The global top_n (ids best first, logprobs) from the parts; returns how many. */
int loom_logprob_top(const loom_lp_part_t *parts, int n_parts, int top_n, double log_z, int32_t *ids, float *lps);

#endif
