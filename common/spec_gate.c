/* The speculation gate (see spec_gate.h): a per-engine wall-time check
 * that drafts pay for themselves. */
#include "common/spec_gate.h"

#include <math.h>
#include <string.h>

#include "common/util.h"

#define GATE_FAST_OFF 2.0 /* tokens this many times dearer turn drafts off after two steps */

#define GATE_OUTLIER 2.0 /* a step this many times the window's median time was descheduled */

void loom_spec_gate_init(loom_spec_gate_t *g) {
    *g = (loom_spec_gate_t){.state = LOOM_SPEC_GATE_S_WARMUP, .margin = 0.02,
                            .probe_every = LOOM_SPEC_GATE_FIRST_PROBE,
                            .plain = {.cap = LOOM_SPEC_GATE_PLAIN_WINDOW},
                            .spec = {.cap = LOOM_SPEC_GATE_SPEC_WINDOW}};
}

static void ring_push(loom_spec_gate_ring_t *r, double sec, double tok) {
    r->sec[r->next] = sec;
    r->tok[r->next] = tok;
    r->next = (r->next + 1) % r->cap;
    if (r->n < r->cap) r->n++;
}

/* The ring's steps are [0, n) while it fills, then all of it: either way
 * the first n. */
static double ring_median_sec(const loom_spec_gate_ring_t *r) {
    double v[LOOM_SPEC_GATE_WINDOW];
    memcpy(v, r->sec, (size_t)r->n * sizeof *v);
    for (int i = 1; i < r->n; i++) /* insertion sort: a handful of values */
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return r->n % 2 ? v[r->n / 2] : 0.5 * (v[r->n / 2 - 1] + v[r->n / 2]);
}

/* Seconds per token over the ring's steps, those over GATE_OUTLIER times
 * the median time left out, with `spread` standard deviations of the kept
 * steps' token count added to their tokens (0: the plain estimate). */
static double ring_rate(const loom_spec_gate_ring_t *r, double spread) {
    if (r->n == 0) return 0.0;
    const double cut = GATE_OUTLIER * ring_median_sec(r);
    double sec = 0, tok = 0, tok2 = 0;
    int n = 0;
    for (int i = 0; i < r->n; i++) {
        if (r->sec[i] > cut) continue;
        sec += r->sec[i];
        tok += r->tok[i];
        tok2 += r->tok[i] * r->tok[i];
        n++;
    }
    /* the variance of the sum of n token counts: n times theirs */
    const double var = n > 1 ? tok2 - tok * tok / n : 0.0;
    return sec / (tok + (var > 0 ? spread * sqrt(var) : 0.0));
}

static double ring_min_rate(const loom_spec_gate_ring_t *r) {
    double m = 0.0;
    for (int i = 0; i < r->n; i++)
        if (i == 0 || r->sec[i] / r->tok[i] < m) m = r->sec[i] / r->tok[i];
    return m;
}

double loom_spec_gate_plain_rate(const loom_spec_gate_t *g) {
    return ring_rate(&g->plain, 0.0);
}

double loom_spec_gate_spec_rate(const loom_spec_gate_t *g) {
    return ring_rate(&g->spec, 0.0);
}

const char *loom_spec_gate_state_name(loom_spec_gate_state_t s) {
    switch (s) {
    case LOOM_SPEC_GATE_S_WARMUP: return "warmup";
    case LOOM_SPEC_GATE_S_ON: return "on";
    default: return "off";
    }
}

int loom_spec_gate_step(loom_spec_gate_t *g) {
    switch (g->state) {
    case LOOM_SPEC_GATE_S_WARMUP:
        if (g->steps < LOOM_SPEC_GATE_WARMUP) {
            g->steps++;
            return g->allowed = 0;
        }
        g->state = LOOM_SPEC_GATE_S_ON;
        g->steps = 0;
        /* the drafter's first step also catches up with the tokens it did
         * not see (a draft model's prefill): not a fair sample */
        g->skip_next = 1;
        /* fall through */
    case LOOM_SPEC_GATE_S_ON:
        g->steps++;
        return g->allowed = g->steps % LOOM_SPEC_GATE_PLAIN_EVERY != 0;
    case LOOM_SPEC_GATE_S_OFF:
        if (g->probe_left > 0) {
            g->probe_left--;
            return g->allowed = 1;
        }
        if (++g->steps < g->probe_every) return g->allowed = 0;
        /* a probe: its steps replace the stale speculative estimate */
        g->steps = 0;
        g->probe_left = LOOM_SPEC_GATE_PROBE - 1;
        g->spec.n = g->spec.next = 0;
        g->skip_next = 1;
        return g->allowed = 1;
    }
    return g->allowed = 0;
}

static void decided(loom_spec_gate_t *g) {
    g->decided_spec = loom_spec_gate_spec_rate(g);
    g->decided_plain = loom_spec_gate_plain_rate(g);
}

double loom_spec_gate_best_case(double t_plain, double t_verify, int k, double t_draft) {
    if (!(t_plain > 0) || k < 1) return 0.0;
    if (t_draft < 0) t_draft = 0;
    /* t_verify(K+1) = t_plain + K b: each token a step carries costs b more */
    const double b = t_verify > t_plain ? (t_verify - t_plain) / k : 0.0;
    /* (K+1) t_plain / (t_plain + K (b + t_draft)) moves one way in K: its
     * largest value is at K = 1 or K = k */
    double best = 0.0;
    const int ks[2] = {1, k};
    for (int i = 0; i < 2; i++) {
        const double s = (ks[i] + 1) * t_plain / (t_plain + ks[i] * (b + t_draft));
        if (s > best) best = s;
    }
    return best;
}

int loom_spec_gate_wants_estimate(const loom_spec_gate_t *g) {
    return g->state == LOOM_SPEC_GATE_S_WARMUP && g->steps >= LOOM_SPEC_GATE_WARMUP && !g->estimated;
}

int loom_spec_gate_probing(const loom_spec_gate_t *g) {
    return g->state == LOOM_SPEC_GATE_S_OFF && g->allowed;
}

double loom_spec_gate_estimate(loom_spec_gate_t *g, double t_plain, double t_verify, int k, double t_draft) {
    g->estimated = 1;
    const double best = loom_spec_gate_best_case(t_plain, t_verify, k, t_draft);
    g->best_case = best;
    if (!(best > 0) || best >= 1.0 + LOOM_SPEC_GATE_START_MARGIN || g->state != LOOM_SPEC_GATE_S_WARMUP)
        return best;
    /* what a probe could cost beyond the plain steps it replaces: the
     * drafter's catch-up of a window and the probe's steps of k drafts */
    const double tv = t_verify > t_plain ? t_verify : t_plain;
    const double probe = (LOOM_SPEC_GATE_PROBE_WINDOW + LOOM_SPEC_GATE_PROBE * k) * (t_draft > 0 ? t_draft : 0) +
                         LOOM_SPEC_GATE_PROBE * (tv - t_plain);
    const double every = probe / (LOOM_SPEC_GATE_PROBE_BUDGET * t_plain);
    g->state = LOOM_SPEC_GATE_S_OFF;
    g->steps = 0;
    g->probe_left = 0;
    g->probe_every = every >= LOOM_SPEC_GATE_MAX_PROBE ? LOOM_SPEC_GATE_MAX_PROBE
                     : every <= LOOM_SPEC_GATE_FIRST_PROBE ? LOOM_SPEC_GATE_FIRST_PROBE
                                                           : (int)every;
    g->started_off = 1;
    g->decided_plain = t_plain;
    g->decided_spec = t_plain / best;
    return best;
}

static void turn_off(loom_spec_gate_t *g) {
    decided(g);
    g->state = LOOM_SPEC_GATE_S_OFF;
    g->steps = 0;
    g->probe_left = 0;
    g->probe_every = LOOM_SPEC_GATE_FIRST_PROBE;
    g->turned_off++;
}

void loom_spec_gate_observe(loom_spec_gate_t *g, int drafted, int emitted, int seqs, double seconds) {
    if (emitted <= 0 || seqs <= 0 || !(seconds > 0)) return;
    const double tokens = (double)emitted / seqs; /* of one sequence */
    if (drafted <= 0) {
        ring_push(&g->plain, seconds, tokens);
    } else if (g->skip_next) {
        g->skip_next = 0;
    } else {
        ring_push(&g->spec, seconds, tokens);
    }
    const double plain = loom_spec_gate_plain_rate(g), spec = loom_spec_gate_spec_rate(g);
    if (g->state == LOOM_SPEC_GATE_S_ON) {
        /* dearer even with the tokens LOOM_SPEC_GATE_SPREAD standard deviations up */
        if (plain > 0 && g->spec.n >= LOOM_SPEC_GATE_MIN_SPEC &&
            ring_rate(&g->spec, LOOM_SPEC_GATE_SPREAD) > plain * (1 + g->margin))
            turn_off(g);
        else if (plain > 0 && g->spec.n >= 2 && ring_min_rate(&g->spec) > GATE_FAST_OFF * plain)
            turn_off(g); /* far dearer: no need for more samples */
    } else if (g->state == LOOM_SPEC_GATE_S_OFF && g->allowed && g->probe_left == 0) {
        /* the probe's last step: keep speculating only if it paid */
        decided(g);
        if (plain > 0 && spec > 0 && spec < plain * (1 - g->margin)) {
            g->state = LOOM_SPEC_GATE_S_ON;
            g->steps = 0;
            g->turned_on++;
        } else if (g->probe_every < LOOM_SPEC_GATE_MAX_PROBE) {
            g->probe_every = LOOM_MIN(g->probe_every * 8, LOOM_SPEC_GATE_MAX_PROBE);
        }
        g->allowed = 0;
    }
}
