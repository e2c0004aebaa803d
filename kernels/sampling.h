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
 * The noise depends only on (seed, step, id), where step is the index of the
 * generated token in its sequence: the same seed gives the same text alone or
 * inside any batch, and a recomputed (preempted) sequence samples the same ids. */
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

#endif
