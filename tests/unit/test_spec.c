/* Speculative decoding helpers (common/spec.h): the ngram drafter, adaptive
 * K, the counters, and the verification rule's distribution: accepting a
 * point-mass draft d iff the row's sample equals d accepts with probability
 * p(d), rejected rows follow the residual p without d, and the emitted token
 * follows p (chi-square over thousands of draws). The wall-time gate
 * (common/spec_gate.h) against a cost model, its start-up estimate, and on
 * stories260K the draft's windowed catch-up and a gate that starts off. */
#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/spec.h"
#include "common/spec_gate.h"
#include "common/util.h"
#include "kernels/sampling.h"
#include "tests/test.h"
#include "worker/local.h"

static void test_ngram(void) {
    int32_t out[16];
    /* 5 6 7 ... 5 6 -> the 7 8 that followed "5 6" */
    const int32_t h1[] = {1, 5, 6, 7, 8, 9, 5, 6};
    int n = loom_spec_ngram_propose(h1, 8, 1, 4, 2, out);
    CHECK(n == 2 && out[0] == 7 && out[1] == 8);
    /* k larger than what follows: stops at the end of the history */
    n = loom_spec_ngram_propose(h1, 8, 1, 4, 16, out);
    CHECK(n == 5 && out[0] == 7 && out[4] == 6);
    /* the longest suffix wins over a more recent shorter match */
    const int32_t h2[] = {3, 4, 10, 2, 4, 11, 3, 4};
    n = loom_spec_ngram_propose(h2, 8, 1, 3, 1, out);
    CHECK(n == 1 && out[0] == 10);
    /* with ngram_min 2 a lone repeated token is not a match */
    const int32_t h3[] = {1, 2, 3, 9, 3};
    CHECK(loom_spec_ngram_propose(h3, 5, 2, 3, 4, out) == 0);
    CHECK(loom_spec_ngram_propose(h3, 5, 1, 3, 4, out) == 2 && out[0] == 9 && out[1] == 3);
    /* the most recent earlier occurrence of the suffix */
    const int32_t h4[] = {7, 1, 7, 2, 7};
    CHECK(loom_spec_ngram_propose(h4, 5, 1, 1, 1, out) == 1 && out[0] == 2);
    CHECK(loom_spec_ngram_propose(h4, 1, 1, 4, 4, out) == 0);
    CHECK(loom_spec_ngram_propose(h4, 5, 1, 4, 0, out) == 0);
}

static void test_config(void) {
    loom_spec_config_t c;
    loom_spec_config_defaults(&c);
    loom_err_t err = {0};
    CHECK(loom_spec_config_check(&c, &err) == LOOM_OK); /* OFF is always fine */
    loom_spec_method_t m;
    CHECK(loom_spec_method_parse("ngram", &m) && m == LOOM_SPEC_NGRAM);
    CHECK(!loom_spec_method_parse("eagle", &m));
    c.method = LOOM_SPEC_NGRAM;
    CHECK(loom_spec_config_check(&c, &err) == LOOM_OK);
    c.k = 0;
    CHECK(loom_spec_config_check(&c, &err) == LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "1..16"));
    c.k = 64;
    CHECK(loom_spec_config_check(&c, &err) == LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "64"));
    c.k = 16;
    c.ngram_min = 5;
    c.ngram_max = 3;
    CHECK(loom_spec_config_check(&c, &err) == LOOM_ERR_INVALID_ARGUMENT && strstr(err.msg, "ngram"));
}

static void test_adapt(void) {
    loom_spec_config_t c;
    loom_spec_config_defaults(&c);
    c.method = LOOM_SPEC_NGRAM;
    c.k = 8;
    loom_spec_adapt_t a;
    loom_spec_adapt_init(&a);
    for (int i = 0; i < 50; i++) loom_spec_adapt_update(&a, 8, 8); /* everything accepted */
    CHECK(loom_spec_adapt_rate(&a) > 0.95);
    CHECK(loom_spec_adapt_k(&a, &c, 0) == 8);
    loom_spec_adapt_init(&a);
    for (int i = 0; i < 50; i++) loom_spec_adapt_update(&a, 4, 0); /* nothing accepted */
    CHECK(loom_spec_adapt_rate(&a) < 0.05);
    int probes = 0, zeros = 0;
    for (int i = 0; i < 64; i++) {
        int k = loom_spec_adapt_k(&a, &c, 0);
        probes += k == 1;
        zeros += k == 0;
    }
    CHECKF(probes == 4 && zeros == 60, "probes %d zeros %d", probes, zeros); /* one draft every 16 steps */
    /* a middling rate picks a middling K, and a dearer verify a smaller one */
    loom_spec_adapt_init(&a);
    for (int i = 0; i < 50; i++) loom_spec_adapt_update(&a, 4, i % 2 ? 1 : 2);
    int k_cheap = loom_spec_adapt_k(&a, &c, 0);
    c.verify_cost = 0.4;
    int k_dear = loom_spec_adapt_k(&a, &c, 0);
    CHECKF(k_cheap > 1 && k_cheap < 8 && k_dear < k_cheap, "cheap %d dear %d", k_cheap, k_dear);
    /* the step is compute-bound: off; near the knee: only what fits */
    c.verify_cost = 0.05;
    c.fixed_k = 1;
    CHECK(loom_spec_adapt_k(&a, &c, 32) == 0);
    CHECK(loom_spec_adapt_k(&a, &c, 28) == 3);
    CHECK(loom_spec_adapt_k(&a, &c, 0) == 8);
    c.method = LOOM_SPEC_OFF;
    CHECK(loom_spec_adapt_k(&a, &c, 0) == 0);
    CHECK(fabs(loom_spec_expected_tokens(0.5, 3) - 1.875) < 1e-12);
    CHECK(loom_spec_expected_tokens(1.0, 3) == 4.0);
}

static void test_cost(void) {
    loom_spec_cost_t c = {0};
    CHECK(loom_spec_cost_relative(&c, 1, 0.25) == 0.25); /* nothing seen */
    for (int i = 0; i < 20; i++) loom_spec_cost_observe(&c, 1, 0.010);
    CHECK(loom_spec_cost_relative(&c, 1, 0.25) == 0.25); /* one size only: no slope */
    /* memory-bound: 10 ms + 0.1 ms per token */
    for (int i = 0; i < 40; i++) loom_spec_cost_observe(&c, 1 + i % 9, 0.010 + 0.0001 * (1 + i % 9));
    double r1 = loom_spec_cost_relative(&c, 1, 0.25), r32 = loom_spec_cost_relative(&c, 32, 0.25);
    CHECKF(fabs(r1 - 0.0001 / 0.0101) < 1e-3, "relative cost %g", r1);
    CHECKF(r32 > 5 * r1 && r32 < 1, "at 32 decodes %g", r32);
    /* compute-bound (every token costs 1 ms, no fixed part): c ~ 1, no K pays */
    loom_spec_cost_t d = {0};
    for (int i = 0; i < 60; i++) loom_spec_cost_observe(&d, 1 + i % 5, 0.001 * (1 + i % 5));
    double r = loom_spec_cost_relative(&d, 1, 0.05);
    CHECKF(r > 0.95, "compute-bound relative cost %g", r);
    loom_spec_config_t cfg;
    loom_spec_config_defaults(&cfg);
    cfg.method = LOOM_SPEC_NGRAM;
    cfg.verify_cost = r;
    loom_spec_adapt_t a;
    loom_spec_adapt_init(&a);
    for (int i = 0; i < 50; i++) loom_spec_adapt_update(&a, 4, i % 2 ? 1 : 2); /* acceptance ~0.6 */
    CHECK(loom_spec_adapt_k(&a, &cfg, 1) == 0);
}

static void test_stats(void) {
    loom_spec_stats_t s = {0};
    loom_spec_stats_record(&s, 0, 0, 1); /* a plain step */
    loom_spec_stats_record(&s, 4, 2, 3);
    loom_spec_stats_record(&s, 4, 4, 5);
    CHECK(s.num_drafts == 2 && s.num_draft_tokens == 8 && s.num_accepted_tokens == 6);
    CHECK(s.accepted_per_pos[0] == 2 && s.accepted_per_pos[1] == 2 && s.accepted_per_pos[2] == 1 &&
          s.accepted_per_pos[3] == 1 && s.accepted_per_pos[4] == 0);
    CHECK(s.target_steps == 3 && s.emitted_tokens == 9);
    CHECK(fabs(loom_spec_stats_tokens_per_step(&s) - 3.0) < 1e-12);
    CHECK(fabs(loom_spec_stats_acceptance(&s) - 0.75) < 1e-12);
}

static int32_t sample_row(const float *logits, int vocab, const loom_sampling_t *s, uint64_t step) {
    int32_t ids[LOOM_SAMPLE_MAX_CAND];
    float keys[LOOM_SAMPLE_MAX_CAND];
    loom_sample_part_t part = {.ids = ids, .keys = keys};
    int k = loom_sample_k(s, vocab);
    loom_sample_shard(logits, vocab, 0, vocab, s, step, k, &part);
    return loom_sample_merge(&part, 1, vocab, s, step);
}

/* 0.999 quantiles of chi-square, df = 1..9 */
static const double k_chi999[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88};

/* The verification rule on one row, thousands of times (steps and seeds vary
 * the noise): a draft d is accepted iff the row's sample is d. */
static void check_rule(const float *logits, int vocab, const loom_sampling_t *base, const double *p, int d) {
    enum { DRAWS = 6000 };
    int acc = 0, n_rej = 0, emitted[16] = {0}, rejected[16] = {0};
    for (int i = 0; i < DRAWS; i++) {
        loom_sampling_t s = *base;
        s.seed = base->seed + (uint64_t)(i / 1000);
        int32_t x = sample_row(logits, vocab, &s, (uint64_t)(i % 1000));
        REQUIRE(x >= 0 && x < vocab);
        emitted[x]++;
        if (x == d) acc++;
        else {
            rejected[x]++;
            n_rej++;
        }
    }
    /* acceptance ~ Binomial(DRAWS, p(d)) */
    double mean = DRAWS * p[d], sd = sqrt(DRAWS * p[d] * (1 - p[d]));
    CHECKF(fabs(acc - mean) < 4.5 * sd + 1, "accepted %d of %d, expected %.1f", acc, DRAWS, mean);
    /* rejected draws follow the residual p(x) / (1 - p(d)), x != d; emitted ones follow p */
    double chi_r = 0, chi_e = 0;
    int df_r = -1, df_e = -1;
    for (int x = 0; x < vocab; x++) {
        if (p[x] <= 0) {
            CHECKF(emitted[x] == 0, "token %d has probability 0 but was drawn", x);
            continue;
        }
        double e = p[x] * DRAWS;
        chi_e += (emitted[x] - e) * (emitted[x] - e) / e;
        df_e++;
        if (x == d) continue;
        double er = p[x] / (1 - p[d]) * n_rej;
        chi_r += (rejected[x] - er) * (rejected[x] - er) / er;
        df_r++;
    }
    CHECKF(chi_e < k_chi999[df_e], "emitted chi-square %.2f (df %d)", chi_e, df_e);
    CHECKF(chi_r < k_chi999[df_r], "residual chi-square %.2f (df %d)", chi_r, df_r);
}

static void test_rule_distribution(void) {
    const float logits[8] = {1.0f, 0.4f, -0.3f, 1.6f, 0.0f, 1.1f, -1.0f, 0.7f};
    const int vocab = 8;
    /* plain temperature sampling (Gumbel-max) */
    loom_sampling_t s = {.temperature = 0.9f, .top_p = 1.0f, .seed = 101};
    double p[8], z = 0, m = 1.6 / 0.9;
    for (int i = 0; i < vocab; i++) z += exp(logits[i] / 0.9 - m);
    for (int i = 0; i < vocab; i++) p[i] = exp(logits[i] / 0.9 - m) / z;
    check_rule(logits, vocab, &s, p, 3); /* the likeliest token drafted */
    check_rule(logits, vocab, &s, p, 6); /* an unlikely one */
    /* top-k 4: the target is p over the 4 best, renormalised */
    loom_sampling_t sk = {.temperature = 1.0f, .top_k = 4, .top_p = 1.0f, .seed = 202};
    const int best4[4] = {3, 5, 0, 7};
    double pk[8] = {0}, zk = 0;
    for (int i = 0; i < 4; i++) zk += exp(logits[best4[i]]);
    for (int i = 0; i < 4; i++) pk[best4[i]] = exp(logits[best4[i]]) / zk;
    check_rule(logits, vocab, &sk, pk, 5);
    /* a draft outside the top-k is never accepted */
    int acc = 0;
    for (uint64_t st = 0; st < 500; st++) acc += sample_row(logits, vocab, &sk, st) == 6;
    CHECK(acc == 0);
}

/* A decode loop against a deterministic cost model: a plain step costs
 * target_s; one with k drafts target_s · (1 + verify_c · k) plus k draft
 * steps of draft_s, and emits 1 + accepted tokens; every time is scaled by
 * a fixed ±3 % jitter sequence (a shared machine). */
struct gate_model {
    double target_s, verify_c, draft_s;
    int k, accepted;
    const int *emit; /* when set: the tokens speculative steps emit, in turn (`accepted` unused) */
    int emit_n;
    int stall_every;  /* when set: every this many steps, one takes stall_s more (the OS descheduled it) */
    double stall_s;
};

struct gate_run {
    double seconds, tokens;
    int spec_steps;
    int unprobed_spec_steps; /* steps with drafts while the gate was OFF and not probing */
    int64_t draft_forwards;  /* k a step with drafts */
};

static void gate_simulate(loom_spec_gate_t *g, const struct gate_model *m, int steps, struct gate_run *out) {
    static uint32_t jitter_state = 12345;
    for (int i = 0; i < steps; i++) {
        jitter_state = jitter_state * 1664525u + 1013904223u;
        const double jitter = 1.0 + 0.03 * ((double)(jitter_state >> 8) / (double)(1u << 24) * 2.0 - 1.0);
        const int k = loom_spec_gate_step(g) ? m->k : 0;
        if (k && g->state == LOOM_SPEC_GATE_S_OFF && !loom_spec_gate_probing(g)) out->unprobed_spec_steps++;
        out->draft_forwards += k;
        const int emitted = !k ? 1 : m->emit ? m->emit[out->spec_steps % m->emit_n] : 1 + m->accepted;
        double sec = jitter * (m->target_s * (1.0 + m->verify_c * k) + k * m->draft_s);
        if (m->stall_every && i % m->stall_every == m->stall_every - 1) sec += m->stall_s;
        loom_spec_gate_observe(g, k, emitted, 1, sec);
        out->seconds += sec;
        out->tokens += emitted;
        out->spec_steps += k > 0;
    }
}

/* Speed against plain decoding (1 token per target_s). */
static double gate_speedup(const struct gate_model *m, const struct gate_run *r) {
    return (r->tokens / r->seconds) / (1.0 / m->target_s);
}

static void test_gate_zero_acceptance(void) {
    loom_spec_gate_t g;
    loom_spec_gate_init(&g);
    const struct gate_model m = {.target_s = 1e-3, .verify_c = 0.2, .k = 4, .accepted = 0};
    struct gate_run r = {0};
    gate_simulate(&g, &m, LOOM_SPEC_GATE_WARMUP + LOOM_SPEC_GATE_MIN_SPEC + 2, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF); /* off within a few steps */
    gate_simulate(&g, &m, 2000, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF);
    CHECK(g.turned_on == 0);
    CHECK(r.spec_steps < 40); /* probes at doubling intervals only */
    CHECK(gate_speedup(&m, &r) >= 0.99);
    CHECK(g.probe_every == LOOM_SPEC_GATE_MAX_PROBE || g.probe_every > 256);
}

static void test_gate_high_acceptance(void) {
    loom_spec_gate_t g;
    loom_spec_gate_init(&g);
    const struct gate_model m = {.target_s = 1e-3, .verify_c = 0.05, .draft_s = 0.05e-3, .k = 4, .accepted = 4};
    struct gate_run r = {0};
    gate_simulate(&g, &m, 500, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_ON);
    CHECK(g.turned_off == 0);
    CHECK(gate_speedup(&m, &r) > 3.0); /* 5 tokens for 1.4 steps, less the plain baseline steps */
}

/* A draft as expensive as its target (stories260K's self-draft in one
 * process): every draft accepted, and still slower than plain decoding. */
static void test_gate_expensive_draft(void) {
    loom_spec_gate_t g;
    loom_spec_gate_init(&g);
    const struct gate_model m = {.target_s = 1e-3, .verify_c = 0.05, .draft_s = 1e-3, .k = 4, .accepted = 4};
    struct gate_run r = {0};
    gate_simulate(&g, &m, 10, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF);
    gate_simulate(&g, &m, 1000, &r);
    CHECK(g.turned_on == 0);
    CHECK(gate_speedup(&m, &r) >= 0.97);
}

/* Off on a prompt that drafts nothing useful, back on at the next probe
 * once drafts pay; and off again when they stop paying. */
static void test_gate_recovers(void) {
    loom_spec_gate_t g;
    loom_spec_gate_init(&g);
    const struct gate_model bad = {.target_s = 1e-3, .verify_c = 0.2, .k = 4, .accepted = 0};
    const struct gate_model good = {.target_s = 1e-3, .verify_c = 0.05, .k = 4, .accepted = 3};
    struct gate_run r = {0};
    gate_simulate(&g, &bad, 12, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF);
    gate_simulate(&g, &good, LOOM_SPEC_GATE_FIRST_PROBE + LOOM_SPEC_GATE_PROBE + 1, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_ON);
    CHECK(g.turned_on == 1);
    gate_simulate(&g, &bad, 30, &r); /* the decayed estimate forgets the good steps */
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF);
    CHECK(g.turned_off == 2);
    CHECK(loom_spec_gate_plain_rate(&g) > 0.9e-3 && loom_spec_gate_plain_rate(&g) < 1.1e-3);
}

/* Drafts that pay on the mean and not on the median (the random 28M
 * model's int8 self-draft, K = 4, ~75 % acceptance): a speculative step
 * costs 2.5 plain ones and emits 1, 2, 5, 5, 2 tokens in turn, 3 on
 * average: 0.83 of a plain step's time a token, while the median step's
 * token costs 1.25. The gate stays on and keeps what drafting gives. Then
 * the same at random, each draft accepted with p = 0.84 (3.7 tokens a step
 * for 3 plain steps' time): a run of short acceptances does not turn it
 * off for good. And a step the OS descheduled does not either. */
static void test_gate_varying_tokens(void) {
    static const int cycle[5] = {1, 2, 5, 5, 2};
    const struct gate_model m = {.target_s = 1e-3, .verify_c = 0.05, .draft_s = 0.325e-3, .k = 4,
                                 .emit = cycle, .emit_n = 5};
    loom_spec_gate_t g;
    loom_spec_gate_init(&g);
    struct gate_run r = {0};
    gate_simulate(&g, &m, 2000, &r);
    CHECKF(g.turned_off == 0, "turned off %lld times", (long long)g.turned_off);
    CHECK(g.state == LOOM_SPEC_GATE_S_ON);
    const double fixed = 3.0 / 2.5; /* drafting every step */
    CHECKF(gate_speedup(&m, &r) > 0.95 * fixed, "%.3fx plain, drafting every step %.3fx", gate_speedup(&m, &r), fixed);

    int emit[1009]; /* a prime length: no period shared with the plain steps */
    uint32_t st = 7;
    double sum = 0;
    for (int i = 0; i < 1009; i++) {
        int e = 1;
        for (; e <= m.k; e++) {
            st = st * 1664525u + 1013904223u;
            if ((double)(st >> 8) / (double)(1u << 24) >= 0.84) break;
        }
        emit[i] = e;
        sum += e;
    }
    const struct gate_model mr = {.target_s = 1e-3, .verify_c = 0.05, .draft_s = 0.45e-3, .k = 4,
                                  .emit = emit, .emit_n = 1009};
    const double fixed_r = sum / 1009 / 3.0;
    loom_spec_gate_init(&g);
    r = (struct gate_run){0};
    gate_simulate(&g, &mr, 4000, &r);
    CHECKF(gate_speedup(&mr, &r) > 0.9 * fixed_r, "%.3fx plain, drafting every step %.3fx (turned off %lld times)",
           gate_speedup(&mr, &r), fixed_r, (long long)g.turned_off);
    CHECK(g.state == LOOM_SPEC_GATE_S_ON);

    /* every step 3 tokens for 2.5 plain steps' time, and one step in 29
     * descheduled for 10 more: that step is left out of its window (with
     * it, 12 steps would cost 1.11 plain a token) */
    const struct gate_model ms = {.target_s = 1e-3, .verify_c = 0.05, .draft_s = 0.325e-3, .k = 4, .accepted = 2,
                                  .stall_every = 29, .stall_s = 10e-3};
    loom_spec_gate_init(&g);
    r = (struct gate_run){0};
    gate_simulate(&g, &ms, 2000, &r);
    CHECKF(g.turned_off == 0, "a descheduled step turned it off %lld times", (long long)g.turned_off);
    CHECK(g.state == LOOM_SPEC_GATE_S_ON);
    CHECK(loom_spec_gate_spec_rate(&g) < 0.9e-3);
}

/* The best case of the start-up estimate: (K+1) t_plain / (t_verify(K+1) +
 * K t_draft) at its best K. */
static void test_gate_best_case(void) {
    /* a verify of K+1 tokens that costs K+1 decodes never pays */
    CHECK(fabs(loom_spec_gate_best_case(1e-3, 5e-3, 4, 0) - 1.0) < 1e-9);
    /* free drafts, a verify that costs one decode: K+1 tokens a step */
    CHECK(fabs(loom_spec_gate_best_case(1e-3, 1e-3, 4, 0) - 5.0) < 1e-9);
    /* no verify timed: taken as t_plain, the least it can cost */
    CHECK(fabs(loom_spec_gate_best_case(1e-3, 0, 4, 1e-3) - 1.0) < 1e-9);
    /* a draft as expensive as its target: 5 / (1.2 + 4) at K = 4, 2 / (1.05 + 1) at K = 1 */
    CHECK(fabs(loom_spec_gate_best_case(1e-3, 1.2e-3, 4, 1e-3) - 2.0 / 2.05) < 1e-9);
    /* a cheap draft: the largest K is best */
    CHECK(fabs(loom_spec_gate_best_case(1e-3, 1.2e-3, 4, 0.1e-3) - 5.0 / 1.6) < 1e-9);
    CHECK(loom_spec_gate_best_case(0, 1e-3, 4, 0) == 0.0);
}

/* Plays WARMUP's plain steps, then gives the estimate of the model's costs. */
static void gate_start(loom_spec_gate_t *g, const struct gate_model *m, struct gate_run *r) {
    loom_spec_gate_init(g);
    CHECK(!loom_spec_gate_wants_estimate(g));
    gate_simulate(g, m, LOOM_SPEC_GATE_WARMUP, r);
    CHECK(r->spec_steps == 0);
    CHECK(loom_spec_gate_wants_estimate(g));
    loom_spec_gate_estimate(g, m->target_s, m->target_s * (1.0 + m->verify_c * m->k), m->k, m->draft_s);
    CHECK(!loom_spec_gate_wants_estimate(g));
}

/* A draft as expensive as its target starts off and stays off: no draft
 * forward at all but the probes', which come late enough to cost at most
 * LOOM_SPEC_GATE_PROBE_BUDGET of the time. */
static void test_gate_estimate_expensive(void) {
    loom_spec_gate_t g;
    const struct gate_model m = {.target_s = 1e-3, .verify_c = 0.05, .draft_s = 1e-3, .k = 4, .accepted = 4};
    struct gate_run r = {0};
    gate_start(&g, &m, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF && g.started_off && g.best_case < 1.0);
    CHECK(g.turned_off == 0);
    /* a probe: 64 tokens of catch-up and 3 steps of 4 drafts, each a target's
     * cost, plus 3 x 0.2 of verify, is 2 % of 3830 plain steps */
    CHECKF(g.probe_every >= 3000, "probe every %d steps", g.probe_every);
    gate_simulate(&g, &m, 2000, &r);
    CHECK(r.spec_steps == 0 && r.draft_forwards == 0);
    CHECK(gate_speedup(&m, &r) >= 0.99);
    gate_simulate(&g, &m, 20000, &r); /* a probe of LOOM_SPEC_GATE_PROBE steps at most every 3000 */
    CHECKF(r.spec_steps > 0 && r.spec_steps <= (22000 / 3000) * LOOM_SPEC_GATE_PROBE, "%d drafting steps",
           r.spec_steps);
    CHECK(r.unprobed_spec_steps == 0);
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF && g.turned_on == 0);
    CHECK(gate_speedup(&m, &r) >= 0.99);
}

/* A cheap draft starts on (WARMUP goes ON as without an estimate) and drafts. */
static void test_gate_estimate_cheap(void) {
    loom_spec_gate_t g;
    const struct gate_model m = {.target_s = 1e-3, .verify_c = 0.05, .draft_s = 0.05e-3, .k = 4, .accepted = 4};
    struct gate_run r = {0};
    gate_start(&g, &m, &r);
    CHECK(!g.started_off && g.best_case > 3.0);
    gate_simulate(&g, &m, 500, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_ON && g.turned_off == 0);
    CHECK(gate_speedup(&m, &r) > 3.0);
    /* the estimate is a best case: drafts that are never accepted still turn it off */
    const struct gate_model bad = {.target_s = 1e-3, .verify_c = 0.2, .draft_s = 0.05e-3, .k = 4, .accepted = 0};
    r = (struct gate_run){0};
    gate_start(&g, &bad, &r);
    CHECK(!g.started_off);
    gate_simulate(&g, &bad, 20, &r);
    CHECK(g.state == LOOM_SPEC_GATE_S_OFF && g.turned_off == 1);
}

static char g_stories[4096];

static int have_stories(void) {
    const char *d = getenv("LOOM_MODELS_DIR");
    snprintf(g_stories, sizeof g_stories, "%s/stories260K", d && d[0] ? d : LOOM_MODELS_DIR_DEFAULT);
    char cfg[4200];
    snprintf(cfg, sizeof cfg, "%s/config.json", g_stories);
    FILE *f = fopen(cfg, "r");
    if (!f) {
        fprintf(stderr, "skipped: no stories260K at %s\n", g_stories);
        return 0;
    }
    fclose(f);
    return 1;
}

static loom_local_t *open_stories(loom_spec_method_t method) {
    loom_local_options_t o = {.model_dir = g_stories, .n_threads = 1, .ctx = 512};
    if (method != LOOM_SPEC_OFF) {
        loom_spec_config_defaults(&o.spec);
        o.spec.method = method;
        o.draft_quant.quant = LOOM_QUANT_INT8;
    }
    loom_local_t *l = NULL;
    loom_err_t err = {0};
    CHECKF(loom_local_open(&o, &l, &err) == LOOM_OK, "%s", err.msg);
    return l;
}

/* A probe's catch-up reads a window of the latest tokens: drafting from
 * them as a sequence of their own, and continuing it after. */
static void test_propose_window(void) {
    if (!have_stories()) return;
    loom_local_t *l = open_stories(LOOM_SPEC_OFF);
    if (!l) return;
    enum { N = 300, W = LOOM_SPEC_GATE_PROBE_WINDOW };
    int32_t hist[N + 8], out[4], ref[4];
    uint32_t x = 7;
    for (int i = 0; i < N; i++) {
        x = x * 1664525u + 1013904223u;
        hist[i] = (int32_t)(3 + (x >> 8) % 500);
    }
    loom_err_t err = {0};
    loom_local_counters_t c0 = loom_local_counters(l);
    CHECK(loom_local_propose_window(l, 0, hist, N, 4, W, out, &err) == 4);
    loom_local_counters_t c1 = loom_local_counters(l);
    CHECKF(c1.last_read == W, "the catch-up read %d tokens", c1.last_read);
    CHECK(c1.tokens - c0.tokens == W + 3 && c1.forwards - c0.forwards == 1 + 3); /* one chunk, 3 drafting steps */
    /* the same drafts as the window run as a sequence from the start */
    loom_local_forget(l, 0);
    CHECK(loom_local_propose(l, 0, hist + N - W, W, 4, ref, &err) == 4);
    CHECK(memcmp(out, ref, sizeof out) == 0);
    loom_local_forget(l, 0);
    CHECK(loom_local_propose_window(l, 0, hist, N, 4, W, out, &err) == 4);
    /* the next step: the first draft accepted and another id; the slot
     * continues its window (windowed or not) and reads only what is new */
    hist[N] = out[0];
    hist[N + 1] = out[1] == 5 ? 6 : 5;
    CHECK(loom_local_propose_window(l, 0, hist, N + 2, 4, W, out, &err) == 4);
    CHECKF(loom_local_counters(l).last_read <= 2, "read %d", loom_local_counters(l).last_read);
    hist[N + 2] = out[0];
    CHECK(loom_local_propose(l, 0, hist, N + 3, 4, out, &err) == 4);
    CHECKF(loom_local_counters(l).last_read <= 2, "read %d", loom_local_counters(l).last_read);
    /* no window: another history is read whole */
    loom_local_forget(l, 0);
    CHECK(loom_local_propose(l, 0, hist, N, 4, out, &err) == 4);
    CHECK(loom_local_counters(l).last_read == N);
    loom_local_close(&l);
}

struct ids {
    int32_t v[128];
    int n;
};

static int keep_id(void *ctx, int32_t id) {
    struct ids *o = ctx;
    if (o->n < 128) o->v[o->n++] = id;
    return 0;
}

static void generate(loom_local_t *l, int max_new, struct ids *o, loom_gen_stats_t *st) {
    const int32_t prompt[] = {1, 403, 407, 261, 378, 263, 498, 22, 365};
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    loom_err_t err = {0};
    o->n = 0;
    CHECKF(loom_local_generate(l, prompt, 9, max_new, &greedy, 1, keep_id, o, NULL, st, &err) == LOOM_OK, "%s",
           err.msg);
}

/* loom run's loop with the int8 self-draft made expensive (the test hook's
 * delay in every draft forward): the gate starts off, the draft runs no
 * forward but the estimate's; without the estimate (the other hook) the
 * gate turns off after drafting and its probe, 64 plain steps later,
 * catches up with a window of 64 tokens. The ids are plain decoding's. */
static void test_generate_gate(void) {
    if (!have_stories()) return;
    loom_local_t *plain = open_stories(LOOM_SPEC_OFF), *spec = open_stories(LOOM_SPEC_DRAFT);
    if (!plain || !spec) goto done;
    struct ids base, ids;
    loom_gen_stats_t st;
    generate(plain, 120, &base, &st);
    CHECK(base.n == 120);
    setenv("LOOM_TEST_DRAFT_DELAY_MS", "3", 1);
    generate(spec, 120, &ids, &st);
    CHECK(ids.n == base.n && memcmp(ids.v, base.v, sizeof(int32_t) * (size_t)base.n) == 0);
    CHECKF(st.gate.started_off && st.gate.state == LOOM_SPEC_GATE_S_OFF, "gate %s, started off %d",
           loom_spec_gate_state_name(st.gate.state), st.gate.started_off);
    CHECK(st.spec.num_drafts == 0);
    CHECKF(st.draft_forwards == 3 && st.draft_tokens == 3, "%lld draft forwards, %lld tokens",
           (long long)st.draft_forwards, (long long)st.draft_tokens);
    setenv("LOOM_TEST_SPEC_NO_ESTIMATE", "1", 1);
    generate(spec, 120, &ids, &st);
    unsetenv("LOOM_TEST_SPEC_NO_ESTIMATE");
    unsetenv("LOOM_TEST_DRAFT_DELAY_MS");
    CHECK(ids.n == base.n && memcmp(ids.v, base.v, sizeof(int32_t) * (size_t)base.n) == 0);
    CHECK(!st.gate.started_off && st.gate.turned_off >= 1);
    /* the probe came after 64 plain steps: it missed more than its window */
    CHECKF(st.draft_probe_read == LOOM_SPEC_GATE_PROBE_WINDOW, "a probe's catch-up read %d", st.draft_probe_read);
done:
    loom_local_close(&plain);
    loom_local_close(&spec);
}

int main(void) {
    RUN(test_ngram);
    RUN(test_config);
    RUN(test_adapt);
    RUN(test_cost);
    RUN(test_stats);
    RUN(test_rule_distribution);
    RUN(test_gate_zero_acceptance);
    RUN(test_gate_high_acceptance);
    RUN(test_gate_expensive_draft);
    RUN(test_gate_recovers);
    RUN(test_gate_varying_tokens);
    RUN(test_gate_best_case);
    RUN(test_gate_estimate_expensive);
    RUN(test_gate_estimate_cheap);
    RUN(test_propose_window);
    RUN(test_generate_gate);
    return test_summary();
}
