/* Speculative decoding helpers: the ngram drafter, adaptive K and counters
 * (the rule and its derivation are at the top of spec.h). */
#include "common/spec.h"

#include <math.h>
#include <string.h>

#define SPEC_DECAY 0.95 /* weight of the past per verify step in the acceptance estimate */

void loom_spec_config_defaults(loom_spec_config_t *c) {
    memset(c, 0, sizeof *c);
    c->method = LOOM_SPEC_OFF;
    c->k = 4;
    c->ngram_min = 1;
    c->ngram_max = 4;
    c->verify_cost = 0.05;
    c->compute_knee = 32;
}

int loom_spec_method_parse(const char *s, loom_spec_method_t *out) {
    if (!s) return 0;
    if (!strcmp(s, "ngram")) *out = LOOM_SPEC_NGRAM;
    else if (!strcmp(s, "draft")) *out = LOOM_SPEC_DRAFT;
    else if (!strcmp(s, "mtp") || !strcmp(s, "deepseek_mtp")) *out = LOOM_SPEC_MTP;
    else if (!strcmp(s, "none") || !strcmp(s, "off")) *out = LOOM_SPEC_OFF;
    else return 0;
    return 1;
}

const char *loom_spec_method_name(loom_spec_method_t m) {
    switch (m) {
    case LOOM_SPEC_NGRAM: return "ngram";
    case LOOM_SPEC_DRAFT: return "draft";
    case LOOM_SPEC_MTP: return "mtp";
    default: return "none";
    }
}

loom_status_t loom_spec_config_check(const loom_spec_config_t *c, loom_err_t *err) {
    if (c->method == LOOM_SPEC_OFF) return LOOM_OK;
    if (c->k < 1 || c->k > LOOM_SPEC_MAX_K)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "num_speculative_tokens must be in 1..%d, got %d", LOOM_SPEC_MAX_K, c->k);
    if (c->ngram_min < 1 || c->ngram_max < c->ngram_min || c->ngram_max > 64)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "ngram lookup needs 1 <= ngram_min <= ngram_max <= 64, got %d..%d", c->ngram_min,
                            c->ngram_max);
    if (!(c->verify_cost >= 0) || c->compute_knee < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "speculative cost model out of range");
    return LOOM_OK;
}

int loom_spec_ngram_propose(const int32_t *hist, int n, int ngram_min, int ngram_max, int k, int32_t *out) {
    if (k <= 0 || n < 2) return 0;
    if (ngram_max > n - 1) ngram_max = n - 1;
    for (int len = ngram_max; len >= ngram_min; len--) {
        const int32_t *suf = hist + n - len;
        /* most recent earlier occurrence: start s with s + len <= n - 1 */
        for (int s = n - len - 1; s >= 0; s--) {
            if (hist[s] != suf[0] || memcmp(hist + s, suf, (size_t)len * sizeof *hist) != 0) continue;
            int from = s + len, m = 0;
            while (m < k && from + m < n) {
                out[m] = hist[from + m];
                m++;
            }
            if (m > 0) return m;
        }
    }
    return 0;
}

void loom_spec_adapt_init(loom_spec_adapt_t *a) {
    a->tried = a->accepted = 0;
    a->idle = 0;
}

double loom_spec_adapt_rate(const loom_spec_adapt_t *a) { return (a->accepted + 1.0) / (a->tried + 2.0); }

void loom_spec_adapt_update(loom_spec_adapt_t *a, int n, int j) {
    if (n <= 0) return;
    /* j successes, then one failure unless every draft was accepted */
    a->tried = SPEC_DECAY * a->tried + j + (j < n ? 1 : 0);
    a->accepted = SPEC_DECAY * a->accepted + j;
}

double loom_spec_expected_tokens(double a, int k) {
    if (a >= 1.0) return k + 1.0;
    return (1.0 - pow(a, k + 1)) / (1.0 - a);
}

#define COST_DECAY 0.98 /* weight of the past per observed step in the cost line */

void loom_spec_cost_observe(loom_spec_cost_t *c, int n_tokens, double seconds) {
    if (n_tokens <= 0 || !(seconds > 0)) return;
    double n = n_tokens;
    c->w = COST_DECAY * c->w + 1;
    c->sn = COST_DECAY * c->sn + n;
    c->snn = COST_DECAY * c->snn + n * n;
    c->st = COST_DECAY * c->st + seconds;
    c->snt = COST_DECAY * c->snt + n * seconds;
}

double loom_spec_cost_relative(const loom_spec_cost_t *c, int d, double fallback) {
    double var = c->w * c->snn - c->sn * c->sn;
    if (c->w < 4 || var <= 1e-9 * c->w * c->w) return fallback;
    double b = (c->w * c->snt - c->sn * c->st) / var, a = (c->st - b * c->sn) / c->w;
    if (b < 0) b = 0;
    if (a < 0) a = 0;
    double step = a + b * (d > 0 ? d : 1);
    return step > 0 ? b * (d > 0 ? d : 1) / step : fallback;
}

int loom_spec_adapt_k(loom_spec_adapt_t *a, const loom_spec_config_t *c, int step_tokens) {
    if (c->method == LOOM_SPEC_OFF) return 0;
    if (c->compute_knee > 0 && step_tokens >= c->compute_knee) return 0;
    int kmax = c->k;
    if (c->compute_knee > 0 && step_tokens + 1 + kmax > c->compute_knee) kmax = c->compute_knee - step_tokens - 1;
    if (kmax < 1) return 0;
    if (c->fixed_k) return kmax;
    double rate = loom_spec_adapt_rate(a), best = 1.0;
    int best_k = 0;
    for (int k = 1; k <= kmax; k++) {
        double v = loom_spec_expected_tokens(rate, k) / (1.0 + c->verify_cost * k);
        if (v > best) {
            best = v;
            best_k = k;
        }
    }
    if (best_k == 0 && ++a->idle >= 16) { /* probe now and then */
        a->idle = 0;
        return 1;
    }
    return best_k;
}

void loom_spec_stats_record(loom_spec_stats_t *s, int n_drafted, int n_accepted, int n_emitted) {
    s->target_steps++;
    s->emitted_tokens += n_emitted;
    if (n_drafted <= 0) return;
    s->num_drafts++;
    s->num_draft_tokens += n_drafted;
    s->num_accepted_tokens += n_accepted;
    for (int i = 0; i < n_accepted && i < LOOM_SPEC_MAX_K; i++) s->accepted_per_pos[i]++;
}

double loom_spec_stats_acceptance(const loom_spec_stats_t *s) {
    return s->num_draft_tokens ? (double)s->num_accepted_tokens / (double)s->num_draft_tokens : 0.0;
}

double loom_spec_stats_tokens_per_step(const loom_spec_stats_t *s) {
    return s->target_steps ? (double)s->emitted_tokens / (double)s->target_steps : 0.0;
}
