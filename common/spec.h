/* Speculative decoding: the parts that are pure functions of a sequence's
 * tokens and of counters, shared by the one-process engine (worker/local.c)
 * and, later, the coordinator's scheduler.
 *
 * A target step verifies a sequence's last token plus K drafted tokens at
 * once (K+1 logit rows). Row i is sampled exactly as non-speculative decoding
 * would sample generated token g+i (same logits processing, same noise
 * (seed, g+i, id)); the run of drafts that equal the sampled tokens is
 * accepted, and the first sampled token that differs (or the bonus token
 * after K accepted drafts) is emitted too. For a deterministic drafter (ngram)
 * this *is* the standard rejection rule, not an approximation (docs/
 * speculative.md): the draft distribution q is a point mass on d, so the rule
 * "accept with min(1, p(d)/q(d)) = p(d), else sample from norm(max(0, p - q))
 * = p with d removed, renormalised" is met by drawing x ~ p with the row's
 * noise and accepting iff x == d: P(accept) = p(d), and given x != d, x has
 * law p(x)/(1 - p(d)), the residual. So the output (greedy or sampled with a
 * seed) is the same token sequence with speculation on or off.
 *
 * The ngram drafter (prompt lookup): the longest suffix of the history of
 * length in [ngram_min, ngram_max] that also occurs earlier; the tokens that
 * followed its most recent earlier occurrence are the drafts.
 *
 * Adaptive K: an estimate of the per-token acceptance a (decayed counts of
 * accepted drafts over drafts tried until the first rejection) and a verify
 * cost model give the K that maximises expected tokens per unit of step time,
 * E(K) / (1 + c K) with E(K) = (1 - a^(K+1)) / (1 - a); when a step already
 * carries `compute_knee` tokens or more (the matmuls stop being bound by
 * reading the weights) speculation is off for that step. */
#ifndef LOOM_SPEC_H
#define LOOM_SPEC_H

#include <stdint.h>

#include "common/status.h"

#define LOOM_SPEC_MAX_K 16 /* drafts per sequence per step at most */

/* MTP: DeepSeek-V3's multi-token prediction module drafts (loom run only) */
typedef enum { LOOM_SPEC_OFF = 0, LOOM_SPEC_NGRAM = 1, LOOM_SPEC_DRAFT = 2, LOOM_SPEC_MTP = 3 } loom_spec_method_t;

typedef struct loom_spec_config {
    loom_spec_method_t method; /* OFF: no speculation */
    int k;                     /* most drafts per step, 1..LOOM_SPEC_MAX_K */
    int ngram_min, ngram_max;  /* lookup suffix lengths, 1 <= min <= max <= 64 */
    int fixed_k;               /* 1: always draft k (no adaptation) */
    double verify_cost;        /* c: cost of one extra verified row relative to a decode step */
    int compute_knee;          /* tokens in a step from which speculation backs off (0: never) */
} loom_spec_config_t;

/* Defaults: ngram 1..4, c = 0.05, knee 32 (the CPU's row-batched matmul limit). */
void loom_spec_config_defaults(loom_spec_config_t *c);
/* "ngram", "draft", "mtp" (or "deepseek_mtp"), "none"/"off": 0 when unknown. */
int loom_spec_method_parse(const char *s, loom_spec_method_t *out);
const char *loom_spec_method_name(loom_spec_method_t m);
/* INVALID_ARGUMENT naming the bad field (K outside 1..16, ngram range). */
loom_status_t loom_spec_config_check(const loom_spec_config_t *c, loom_err_t *err);

/* Up to k drafts for hist[0..n) into out; returns how many (0: no match). */
int loom_spec_ngram_propose(const int32_t *hist, int n, int ngram_min, int ngram_max, int k, int32_t *out);

typedef struct loom_spec_adapt {
    double tried, accepted; /* decayed counts */
    int idle;               /* steps since the last draft while speculation did not pay */
} loom_spec_adapt_t;

/* The measured step cost: a least-squares line t = a + b n through the
 * (tokens, seconds) of recent steps (decayed sums). Speculating K tokens in
 * a step of d decode tokens costs c K more, c = b d / (a + b d): near 0
 * while the step is bound by reading the weights, near 1 once every token
 * costs its own compute (a tiny model, or a large batch). */
typedef struct loom_spec_cost {
    double w, sn, snn, st, snt;
} loom_spec_cost_t;

void loom_spec_cost_observe(loom_spec_cost_t *c, int n_tokens, double seconds);
/* c for a step of d decode tokens; `fallback` until the steps seen differ in size. */
double loom_spec_cost_relative(const loom_spec_cost_t *c, int d, double fallback);

void loom_spec_adapt_init(loom_spec_adapt_t *a);
/* Acceptance estimate in (0, 1) (Laplace-smoothed). */
double loom_spec_adapt_rate(const loom_spec_adapt_t *a);
/* After a verify step that drafted n and accepted j (0 <= j <= n). */
void loom_spec_adapt_update(loom_spec_adapt_t *a, int n, int j);
/* Drafts to ask for in a step that carries step_tokens decode tokens, with
 * c->verify_cost the relative cost of one more token (loom_spec_cost_relative).
 * 0 when no K pays for itself, except one probing draft every 16 such steps
 * so the acceptance estimate stays current. */
int loom_spec_adapt_k(loom_spec_adapt_t *a, const loom_spec_config_t *c, int step_tokens);
/* Expected tokens per verify step with per-token acceptance a and K drafts. */
double loom_spec_expected_tokens(double a, int k);

/* Counters (vLLM's spec_decode metrics plus target steps). */
typedef struct loom_spec_stats {
    int64_t num_drafts;       /* verify steps with at least one draft */
    int64_t num_draft_tokens;
    int64_t num_accepted_tokens;
    int64_t accepted_per_pos[LOOM_SPEC_MAX_K];
    int64_t target_steps;     /* forwards that produced sampled tokens */
    int64_t emitted_tokens;   /* tokens those produced */
} loom_spec_stats_t;

/* One target step: n_drafted drafts verified, n_accepted of them accepted,
 * n_emitted tokens emitted (n_accepted + 1 unless the output ended first). */
void loom_spec_stats_record(loom_spec_stats_t *s, int n_drafted, int n_accepted, int n_emitted);
double loom_spec_stats_acceptance(const loom_spec_stats_t *s); /* accepted / drafted, 0 with none */
double loom_spec_stats_tokens_per_step(const loom_spec_stats_t *s);

#endif
