/* Tests of the reference sampling (kernels/sampling.c): greedy ties, shard
 * merging equal to one shard for every mode, the empirical distribution of
 * Gumbel-max draws against softmax(logits / T) and of filtered draws against
 * the renormalised top-k / nucleus, and determinism in (seed, step). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/sampling.h"
#include "tests/test.h"

#define MAX_SHARDS 4

/* Samples one token with the vocabulary cut into shards at cuts[0..n_shards-1)
 * (shard s covers [cuts[s-1], cuts[s]) with cuts[-1] = 0, cuts[n-1] = vocab). */
static int32_t sample_split(const float *logits, int vocab, const int *cuts, int n_shards,
                            const loom_sampling_t *s, uint64_t step) {
    static int32_t ids[MAX_SHARDS][LOOM_SAMPLE_MAX_CAND];
    static float keys[MAX_SHARDS][LOOM_SAMPLE_MAX_CAND];
    loom_sample_part_t parts[MAX_SHARDS];
    int k = loom_sample_k(s, vocab);
    int lo = 0;
    for (int p = 0; p < n_shards; p++) {
        int hi = p == n_shards - 1 ? vocab : cuts[p];
        parts[p] = (loom_sample_part_t){.ids = ids[p], .keys = keys[p]};
        loom_sample_shard(logits + lo, hi - lo, lo, vocab, s, step, k, &parts[p]);
        lo = hi;
    }
    return loom_sample_merge(parts, n_shards, vocab, s, step);
}

static int32_t sample_one(const float *logits, int vocab, const loom_sampling_t *s, uint64_t step) {
    return sample_split(logits, vocab, NULL, 1, s, step);
}

static void test_modes(void) {
    loom_sampling_t g = {.temperature = 0.0f, .top_p = 1.0f};
    CHECK(loom_sample_mode(&g, 100) == LOOM_SAMPLE_GREEDY && loom_sample_k(&g, 100) == 1);
    loom_sampling_t u = {.temperature = 1.0f, .top_p = 1.0f};
    CHECK(loom_sample_mode(&u, 100) == LOOM_SAMPLE_GUMBEL && loom_sample_k(&u, 100) == 1);
    loom_sampling_t kk = {.temperature = 1.0f, .top_k = 5, .top_p = 1.0f};
    CHECK(loom_sample_mode(&kk, 100) == LOOM_SAMPLE_FILTERED && loom_sample_k(&kk, 100) == 5);
    kk.top_k = 100; /* top-k over the whole vocabulary is no filter */
    CHECK(loom_sample_mode(&kk, 100) == LOOM_SAMPLE_GUMBEL);
    loom_sampling_t pp = {.temperature = 1.0f, .top_p = 0.9f};
    CHECK(loom_sample_mode(&pp, 5000) == LOOM_SAMPLE_FILTERED);
    CHECK(loom_sample_k(&pp, 5000) == LOOM_SAMPLE_MAX_CAND && loom_sample_k(&pp, 10) == 10);
    for (int i = 0; i < 1000; i++) {
        double v = loom_sample_uniform(1, 2, (uint64_t)i);
        CHECK(v > 0.0 && v < 1.0);
    }
}

static void test_greedy(void) {
    loom_sampling_t s = {.temperature = 0.0f, .top_p = 1.0f, .seed = 5};
    float a[7] = {-3.0f, 2.0f, -1.0f, 2.0f, 1.5f, -INFINITY, 2.0f};
    CHECK(sample_one(a, 7, &s, 0) == 1); /* ties: the smallest id */
    float b[5] = {-5.0f, -4.0f, -2.5f, -2.5f, -9.0f};
    CHECK(sample_one(b, 5, &s, 3) == 2);
    float c[1] = {0.25f};
    CHECK(sample_one(c, 1, &s, 0) == 0);
    /* A tie across a shard boundary still goes to the smaller id. */
    int cuts[2] = {3, 7};
    CHECK(sample_split(a, 7, cuts, 2, &s, 0) == 1);
    int cuts2[3] = {2, 4, 7};
    float d[7] = {0, 1, 0, 0, 0, 0, 1};
    CHECK(sample_split(d, 7, cuts2, 3, &s, 0) == 1);
    /* Negative temperature is greedy too, and the step does not matter. */
    s.temperature = -1.0f;
    for (uint64_t st = 0; st < 20; st++)
        CHECK(sample_one(a, 7, &s, st) == 1);
}

/* Random logits with a few exact ties at the top. */
static void make_logits(float *l, int vocab, unsigned long long *st, float scale) {
    for (int i = 0; i < vocab; i++)
        l[i] = test_randf(st, scale);
    l[vocab / 3] = l[vocab - 2] = scale + 1.0f;
}

static void test_shard_merge_equals_one_shard(void) {
    const int vocab = 1000;
    float logits[1000];
    unsigned long long st = 99;
    make_logits(logits, vocab, &st, 4.0f);
    static const int splits[][3] = {{0, 0, 0}, {123, 0, 0}, {700, 701, 0}, {1, 450, 999}};
    const loom_sampling_t modes[] = {
        {.temperature = 0.0f, .top_p = 1.0f},               /* greedy */
        {.temperature = 0.8f, .top_p = 1.0f},               /* gumbel */
        {.temperature = 1.3f, .top_p = 1.0f},               /* gumbel */
        {.temperature = 1.0f, .top_k = 40, .top_p = 1.0f},  /* top-k */
        {.temperature = 0.7f, .top_p = 0.9f},               /* top-p */
        {.temperature = 1.5f, .top_k = 300, .top_p = 0.6f}, /* both */
        {.temperature = 2.0f, .top_k = 1, .top_p = 1.0f},   /* top-1 */
        {.temperature = 1.0f, .top_p = 1.0f, .min_p = 0.05f}, /* min-p */
        {.temperature = 0.9f, .top_k = 50, .top_p = 0.8f, .min_p = 0.1f}, /* all three */
    };
    int bad = 0, checks = 0;
    for (size_t m = 0; m < LOOM_ARRAY_LEN(modes); m++)
        for (uint64_t seed = 1; seed <= 4; seed++)
            for (uint64_t step = 0; step < 12; step++) {
                loom_sampling_t s = modes[m];
                s.seed = seed * 7919;
                int32_t want = sample_one(logits, vocab, &s, step);
                for (int n_shards = 2; n_shards <= MAX_SHARDS; n_shards++) {
                    int32_t got =
                        sample_split(logits, vocab, splits[n_shards - 1], n_shards, &s, step);
                    checks++;
                    if (got != want && bad++ < 5)
                        fprintf(stderr, "  mode %zu seed %llu step %llu shards %d: %d != %d\n", m,
                                (unsigned long long)seed, (unsigned long long)step, n_shards, got,
                                want);
                }
            }
    CHECKF(bad == 0, "%d of %d split samples differ from one shard", bad, checks);
}

static void test_determinism(void) {
    const int vocab = 500;
    float logits[500];
    unsigned long long st = 5;
    make_logits(logits, vocab, &st, 3.0f);
    loom_sampling_t s = {.temperature = 1.0f, .top_p = 1.0f, .seed = 1234};
    loom_sampling_t f = {.temperature = 1.0f, .top_k = 50, .top_p = 0.95f, .seed = 1234};
    int differ_step = 0, differ_seed = 0;
    for (uint64_t step = 0; step < 50; step++) {
        int32_t a = sample_one(logits, vocab, &s, step);
        CHECK(a == sample_one(logits, vocab, &s, step));
        CHECK(sample_one(logits, vocab, &f, step) == sample_one(logits, vocab, &f, step));
        differ_step += a != sample_one(logits, vocab, &s, step + 1);
        loom_sampling_t s2 = s;
        s2.seed = 4321;
        differ_seed += a != sample_one(logits, vocab, &s2, step);
    }
    /* Different steps and seeds give different noise: most draws change. */
    CHECKF(differ_step > 25 && differ_seed > 25, "step %d seed %d", differ_step, differ_seed);
}

/* Pearson chi-square of counts against probabilities over cells with p > 0;
 * any draw in a p == 0 cell returns infinity. */
static double chi_square(const int *counts, const double *p, int n_cells, int n_draws) {
    double chi = 0;
    for (int i = 0; i < n_cells; i++) {
        if (p[i] <= 0) {
            if (counts[i]) return INFINITY;
            continue;
        }
        double e = p[i] * n_draws;
        chi += (counts[i] - e) * (counts[i] - e) / e;
    }
    return chi;
}

/* 0.999 quantiles of chi-square with df = 1..9 degrees of freedom. */
static const double k_chi999[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88};

static void draw_counts(const float *logits, int vocab, const loom_sampling_t *s, int n_draws,
                        int *counts) {
    memset(counts, 0, sizeof(int) * (size_t)vocab);
    for (int d = 0; d < n_draws; d++) {
        int32_t id = sample_one(logits, vocab, s, (uint64_t)d);
        if (id >= 0 && id < vocab) counts[id]++;
    }
}

static void test_gumbel_distribution(void) {
    const float logits[10] = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, 1.2f, -1.5f, 0.8f, 1.9f, -0.7f};
    const int draws = 4000;
    const float temps[] = {0.7f, 1.0f, 2.5f};
    for (size_t t = 0; t < LOOM_ARRAY_LEN(temps); t++)
        for (uint64_t seed = 11; seed <= 13; seed++) {
            loom_sampling_t s = {.temperature = temps[t], .top_p = 1.0f, .seed = seed};
            double p[10], z = 0;
            for (int i = 0; i < 10; i++)
                z += (p[i] = exp(logits[i] / temps[t]));
            for (int i = 0; i < 10; i++)
                p[i] /= z;
            int counts[10];
            draw_counts(logits, 10, &s, draws, counts);
            double chi = chi_square(counts, p, 10, draws);
            CHECKF(chi < k_chi999[9], "T=%.1f seed %llu: chi2 %.1f", (double)temps[t],
                   (unsigned long long)seed, chi);
        }
}

/* Probabilities of the filtered modes as the header defines them: top-k by
 * logit, then the smallest prefix whose mass (normalised over the whole
 * vocabulary) reaches top_p, renormalised. */
static int filtered_probs(const float *logits, int vocab, const loom_sampling_t *s, double *p) {
    int order[64];
    for (int i = 0; i < vocab; i++)
        order[i] = i;
    for (int i = 0; i < vocab; i++) /* selection sort, larger logit first, ties to smaller id */
        for (int j = i + 1; j < vocab; j++)
            if (logits[order[j]] > logits[order[i]]) {
                int tmp = order[i];
                order[i] = order[j];
                order[j] = tmp;
            }
    double full[64], z = 0;
    for (int i = 0; i < vocab; i++)
        z += (full[i] = exp(logits[i] / s->temperature));
    int keep = s->top_k > 0 && s->top_k < vocab ? s->top_k : vocab;
    if (s->min_p > 0) { /* p_i >= min_p * p_max survive */
        int j = 1;
        while (j < keep && full[order[j]] >= s->min_p * full[order[0]]) j++;
        keep = j;
    }
    int renorm = keep < vocab; /* top-k or min-p cut something: renormalise over the survivors */
    if (s->top_p > 0 && s->top_p < 1) {
        /* the nucleus is cut on probabilities renormalised over the top-k (HF, vLLM) */
        double zt = 0, cum = 0;
        for (int j = 0; j < keep; j++)
            zt += full[order[j]];
        if (!renorm) zt = z;
        for (int j = 0; j < keep; j++) {
            cum += full[order[j]] / zt;
            if (cum >= s->top_p) {
                keep = j + 1;
                break;
            }
        }
    }
    double zk = 0;
    for (int i = 0; i < vocab; i++)
        p[i] = 0;
    for (int j = 0; j < keep; j++)
        zk += full[order[j]];
    for (int j = 0; j < keep; j++)
        p[order[j]] = full[order[j]] / zk;
    return keep;
}

static void test_filtered_distribution(void) {
    const float logits[10] = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, 1.2f, -1.5f, 0.8f, 1.9f, -0.7f};
    const int draws = 4000;
    const loom_sampling_t cases[] = {
        {.temperature = 1.0f, .top_k = 3, .top_p = 1.0f, .seed = 21},
        {.temperature = 1.0f, .top_k = 6, .top_p = 1.0f, .seed = 22},
        {.temperature = 1.0f, .top_p = 0.7f, .seed = 23},
        {.temperature = 0.5f, .top_p = 0.9f, .seed = 24},
        {.temperature = 2.0f, .top_k = 5, .top_p = 0.5f, .seed = 25},
        {.temperature = 1.0f, .top_p = 1.0f, .seed = 26, .min_p = 0.3f},
        {.temperature = 0.7f, .top_p = 0.9f, .seed = 27, .min_p = 0.1f},
        {.temperature = 1.5f, .top_k = 4, .top_p = 1.0f, .seed = 28, .min_p = 0.5f},
    };
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cases); c++) {
        double p[10];
        int keep = filtered_probs(logits, 10, &cases[c], p);
        int counts[10];
        draw_counts(logits, 10, &cases[c], draws, counts);
        /* infinite when a token outside the kept set was ever drawn */
        double chi = chi_square(counts, p, 10, draws);
        CHECKF(chi < k_chi999[keep > 1 ? keep - 1 : 1], "case %zu (keep %d): chi2 %.1f", c, keep,
               chi);
    }
}

static void test_top_k1_is_greedy(void) {
    const int vocab = 300;
    float logits[300];
    unsigned long long st = 77;
    for (int trial = 0; trial < 5; trial++) {
        make_logits(logits, vocab, &st, 2.0f + (float)trial);
        loom_sampling_t g = {.temperature = 0.0f, .top_p = 1.0f};
        int32_t want = sample_one(logits, vocab, &g, 0);
        int bad = 0;
        for (uint64_t step = 0; step < 40; step++) {
            loom_sampling_t s = {.temperature = 0.3f + 0.5f * (float)trial,
                                 .top_k = 1,
                                 .top_p = step % 2 ? 0.5f : 1.0f,
                                 .seed = step * 31 + 1};
            bad += sample_one(logits, vocab, &s, step) != want;
        }
        CHECKF(bad == 0, "trial %d: %d top-1 draws were not the argmax %d", trial, bad, want);
    }
}

/* A token outside the nucleus is never drawn, over many steps and seeds. */
static void test_top_p_nucleus(void) {
    const int vocab = 2000;
    float *logits = malloc(sizeof(float) * vocab);
    unsigned long long st = 31;
    for (int i = 0; i < vocab; i++)
        logits[i] = test_randf(&st, 1.0f) - 8.0f; /* a flat tail */
    logits[10] = 3.0f;
    logits[500] = 2.5f;
    logits[1500] = 2.0f;
    /* With T = 1: e^3, e^2.5, e^2 against ~2000 * e^-8 ≈ 0.7 of tail mass. */
    double z = 0;
    for (int i = 0; i < vocab; i++)
        z += exp(logits[i]);
    double top2 = (exp(3.0) + exp(2.5)) / z;
    loom_sampling_t s = {.temperature = 1.0f, .top_p = (float)(top2 - 0.01), .seed = 3};
    int outside = 0, seen10 = 0, seen500 = 0;
    for (uint64_t step = 0; step < 3000; step++) {
        s.seed = 3 + step / 1000;
        int32_t id = sample_one(logits, vocab, &s, step);
        outside += id != 10 && id != 500;
        seen10 += id == 10;
        seen500 += id == 500;
    }
    CHECKF(outside == 0, "%d draws outside the nucleus {10, 500}", outside);
    CHECK(seen10 > 0 && seen500 > 0);
    /* And split across shards the nucleus is the same. */
    int cuts[3] = {400, 1200, 2000};
    outside = 0;
    for (uint64_t step = 0; step < 500; step++) {
        int32_t id = sample_split(logits, vocab, cuts, 3, &s, step);
        outside += id != 10 && id != 500;
    }
    CHECKF(outside == 0, "split: %d draws outside the nucleus", outside);
    free(logits);
}

/* The header says K = top_k; loom_sample_k caps it at LOOM_SAMPLE_MAX_CAND,
 * so a top_k above 1024 acts as top-1024. Reported, not failed, until the
 * integrator decides which one is meant. */
static void test_large_top_k(void) {
    const int vocab = 3000;
    loom_sampling_t s = {.temperature = 1.0f, .top_k = 2000, .top_p = 1.0f};
    /* top_k above LOOM_SAMPLE_MAX_CAND is capped there (sampling.h) */
    CHECK(loom_sample_k(&s, vocab) == LOOM_SAMPLE_MAX_CAND);
    s.top_k = 700;
    CHECK(loom_sample_k(&s, vocab) == 700);
    s.top_k = 5000; /* at least the vocabulary: no top-k at all */
    CHECK(loom_sample_k(&s, vocab) == 1);
}

/* The logit edits against a plain reference of their formulas (vLLM's), and
 * applied shard by shard equal to applied once over the whole row. */
static void test_logit_edits(void) {
    const int vocab = 600;
    float base[600], want[600], got[600];
    unsigned long long st = 5;
    make_logits(base, vocab, &st, 3.0f);
    const int32_t allowed[] = {3, 17, 250, 251, 400, 599};
    const int32_t banned[] = {17, 401};
    const int32_t bias_ids[] = {250, 9, 599};
    const float bias[] = {5.0f, -2.0f, -100.0f};
    const int32_t seen[] = {3, 9, 250, 300, 598};
    const int32_t counts[] = {2, 0, 1, 4, 0};
    for (int variant = 0; variant < 3; variant++) {
        loom_logit_edits_t e = {.banned = banned, .n_banned = 2, .bias_ids = bias_ids, .bias = bias, .n_bias = 3,
                                .seen_ids = seen, .out_counts = counts, .n_seen = 5, .repetition = 1.3f,
                                .frequency = 0.4f, .presence = 0.25f};
        if (variant == 1) e.allowed = allowed, e.n_allowed = 6;
        if (variant == 2) e.repetition = 0.0f, e.n_banned = 0;
        CHECK(loom_logits_edits_active(&e));
        /* reference: allow-list, bans, bias, repetition, frequency + presence */
        for (int i = 0; i < vocab; i++) {
            double x = base[i];
            int ok = 1;
            if (e.n_allowed) {
                ok = 0;
                for (int j = 0; j < e.n_allowed; j++) ok |= allowed[j] == i;
            }
            for (int j = 0; j < e.n_banned; j++) ok &= banned[j] != i;
            for (int j = 0; j < 3; j++)
                if (bias_ids[j] == i) x += bias[j];
            for (int j = 0; j < 5; j++)
                if (seen[j] == i) {
                    if (e.repetition > 0.0f) x = x > 0 ? x / e.repetition : x * e.repetition;
                    x -= e.frequency * counts[j] + (counts[j] > 0 ? e.presence : 0.0);
                }
            want[i] = ok ? (float)x : -INFINITY;
        }
        static const int cuts[][3] = {{600, 0, 0}, {250, 600, 0}, {1, 300, 600}, {251, 252, 600}};
        for (size_t c = 0; c < LOOM_ARRAY_LEN(cuts); c++) {
            memcpy(got, base, sizeof got);
            int lo = 0;
            for (int p = 0; p < 3 && lo < vocab; p++) {
                int hi = cuts[c][p];
                loom_logits_edit(got + lo, hi - lo, lo, &e);
                lo = hi;
            }
            int bad = 0;
            for (int i = 0; i < vocab; i++) {
                int same = (isinf(want[i]) && isinf(got[i])) || fabsf(want[i] - got[i]) <= 1e-5f * (1 + fabsf(want[i]));
                if (!same && bad++ < 4) printf("  variant %d cut %zu: id %d want %g got %g\n", variant, c, i,
                                               (double)want[i], (double)got[i]);
            }
            CHECKF(bad == 0, "variant %d cut %zu: %d logits differ", variant, c, bad);
        }
    }
    loom_logit_edits_t off = {.seen_ids = seen, .out_counts = counts, .n_seen = 5, .repetition = 1.0f};
    CHECK(!loom_logits_edits_active(&off));
    /* Greedy over edited logits: a banned argmax is never picked, the bias moves the winner. */
    loom_sampling_t g = {.temperature = 0.0f, .top_p = 1.0f};
    memcpy(got, base, sizeof got);
    int32_t top = sample_one(got, vocab, &g, 0);
    loom_logit_edits_t ban = {.banned = &top, .n_banned = 1};
    loom_logits_edit(got, vocab, 0, &ban);
    CHECK(sample_one(got, vocab, &g, 0) != top);
    int32_t pick = 123;
    float plus = 100.0f;
    loom_logit_edits_t b2 = {.bias_ids = &pick, .bias = &plus, .n_bias = 1};
    loom_logits_edit(got, vocab, 0, &b2);
    CHECK(sample_one(got, vocab, &g, 0) == 123);
}

/* Log probabilities merged over shards equal log_softmax over the whole row
 * (double reference), with the top-n in order, ties to the smaller id. */
static void test_logprobs(void) {
    const int vocab = 777;
    float logits[777];
    unsigned long long st = 11;
    make_logits(logits, vocab, &st, 6.0f);
    logits[5] = logits[600] = 9.0f; /* a tie at the top */
    logits[42] = -INFINITY;         /* a masked token */
    double m = -INFINITY, z = 0;
    for (int i = 0; i < vocab; i++) m = logits[i] > m ? logits[i] : m;
    for (int i = 0; i < vocab; i++) z += exp((double)logits[i] - m);
    double log_z = m + log(z);
    static const int cuts[][4] = {{777, 0, 0, 0}, {300, 777, 0, 0}, {1, 5, 601, 777}, {6, 600, 700, 777}};
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cuts); c++) {
        int32_t ids[4][LOOM_MAX_TOP_LOGPROBS];
        float vals[4][LOOM_MAX_TOP_LOGPROBS];
        loom_lp_part_t parts[4];
        int lo = 0, np = 0;
        for (; np < 4 && lo < vocab; np++) {
            int hi = cuts[c][np];
            parts[np] = (loom_lp_part_t){.ids = ids[np], .vals = vals[np]};
            loom_logprob_shard(logits + lo, hi - lo, lo, 20, &parts[np]);
            lo = hi;
        }
        double got_z = loom_logprob_log_z(parts, np);
        CHECKF(fabs(got_z - log_z) < 1e-5, "cut %zu: log Z %.9g, want %.9g", c, got_z, log_z);
        int32_t top[20];
        float lps[20];
        int n = loom_logprob_top(parts, np, 20, got_z, top, lps);
        CHECK(n == 20 && top[0] == 5 && top[1] == 600);
        for (int j = 0; j < n; j++) {
            CHECKF(fabs(lps[j] - ((double)logits[top[j]] - log_z)) < 1e-5, "cut %zu: top %d", c, j);
            if (j) CHECK(lps[j] <= lps[j - 1]);
            for (int i = 0; i < vocab; i++) /* nothing outside the top beats its last entry */
                if (logits[i] > logits[top[n - 1]]) {
                    int in = 0;
                    for (int k = 0; k < n; k++) in |= top[k] == i;
                    CHECKF(in, "cut %zu: id %d missing from the top", c, i);
                }
        }
    }
}

int main(void) {
    RUN(test_modes);
    RUN(test_greedy);
    RUN(test_shard_merge_equals_one_shard);
    RUN(test_determinism);
    RUN(test_gumbel_distribution);
    RUN(test_filtered_distribution);
    RUN(test_top_k1_is_greedy);
    RUN(test_top_p_nucleus);
    RUN(test_large_top_k);
    RUN(test_logit_edits);
    RUN(test_logprobs);
    return test_summary();
}
