/* Scheduler + KV ledger tests with a simulated model: the "KV cache" stores
 * each token id at its slot, and the next token of a sequence is a hash of the
 * context read back through its block table. Any mistake in slots, block
 * tables, prefix sharing, copy-on-write or preemption changes the tokens. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/kv_ledger.h"
#include "coordinator/sched.h"
#include "tests/test.h"

#define VOCAB 1000

/* Speculation tests: an order-1 model over a few ids, perturbed at every 23rd position (repetitive, so ngram
 * drafts are often right) and the scheduler's speculation config. */
static int g_markov;
static const loom_spec_config_t *g_spec;
static loom_spec_stats_t g_spec_stats;
static int
    g_drafter; /* method DRAFT: a drafter that knows the model but gets every third draft wrong */
/* >= 0: each step takes 1 ms plus this many seconds per drafted token on the
 * scheduler's clock (the speculation gate's deterministic cost model) */
static double g_draft_cost_s = -1;
static uint64_t g_clock_ns;
/* data-parallel attention: the ledger's partitions (0: one), the sequences each rank ran, and blocks seen
 * outside the partition of their sequence's rank */
static int g_n_dp;
static int g_dp_seqs[4], g_dp_cross;

/* Every block a micro-batch names lies in the partition of its sequence's rank. */
static void check_dp_partitions(const loom_microbatch_t *mb, int n_blocks) {
    const int P = n_blocks / g_n_dp, B = 4;
    for (int i = 0; i < mb->n_seqs; i++) {
        int r = mb->seq_dp_rank[i];
        if (r < 0 || r >= g_n_dp) {
            g_dp_cross++;
            continue;
        }
        g_dp_seqs[r]++;
        for (int j = 0; j < mb->max_blocks; j++) {
            int b = mb->block_tables[(size_t)i * mb->max_blocks + j];
            if (b >= 0 && b / P != r) g_dp_cross++;
        }
    }
    for (int t = 0; t < mb->n_tokens; t++)
        if (mb->slots[t] / B / P != mb->seq_dp_rank[mb->tok_seq[t]]) g_dp_cross++;
    for (int i = 0; i < mb->n_copies; i++)
        if (mb->copy_src[i] / P != mb->copy_dst[i] / P) g_dp_cross++;
}

/* overlapped scheduling: g_ahead micro-batches planned ahead of the one in
 * flight, each of the one before, as the coordinator's --async-scheduling
 * plans them (the sequences with
 * id % 5 == 2 refused by its predicate), and every g_fail_every-th step
 * both in flight fail; g_after_done counts tokens emitted for a sequence
 * after it finished */
static int g_ahead, g_fail_every, g_after_done;

static int ahead_ok(void *ctx, const loom_seq_t *q) {
    (void)ctx;
    return q->id % 5 != 2;
}

static uint64_t test_clock(void *ctx) {
    (void)ctx;
    return g_clock_ns;
}

static int32_t next_token(const int32_t *ctx, int n) {
    if (g_markov && n >= 2) return (int32_t)(3 + ((uint32_t)ctx[n - 1] * 3u + (uint32_t)(n % 23 == 0)) % 7u);
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)ctx[i]) * 1099511628211ull;
    return (int32_t)(3 + h % (VOCAB - 3));
}

typedef struct sim {
    int32_t *kv_tok; /* (n_blocks * B) token at each slot */
    int32_t *kv_pos; /* position written at each slot */
    int B, n_slots;
    int window;      /* a sliding-window model: position p reads (p - window, p] only */
    int bad;
} sim_t;

/* The first position a query at `pos` reads. */
static int first_seen(int pos, int window) { return window > 0 && pos + 1 > window ? pos + 1 - window : 0; }

/* Runs a micro-batch on the simulated model; returns the sampled ids. */
static void sim_run(sim_t *sm, const loom_microbatch_t *mb, int32_t *ids) {
    for (int i = 0; i < mb->n_copies; i++)
        for (int j = 0; j < sm->B; j++) {
            sm->kv_tok[mb->copy_dst[i] * sm->B + j] = sm->kv_tok[mb->copy_src[i] * sm->B + j];
            sm->kv_pos[mb->copy_dst[i] * sm->B + j] = sm->kv_pos[mb->copy_src[i] * sm->B + j];
        }
    for (int t = 0; t < mb->n_tokens; t++) {
        if (mb->slots[t] < 0 || mb->slots[t] >= sm->n_slots) sm->bad++;
        sm->kv_tok[mb->slots[t]] = mb->tokens[t];
        sm->kv_pos[mb->slots[t]] = mb->pos[t];
    }
    int32_t ctx[4096];
    for (int r = 0; r < mb->n_logits; r++) {
        int row = mb->logit_rows[r], si = mb->tok_seq[row], pos = mb->pos[row];
        const int32_t *bt = mb->block_tables + (size_t)si * mb->max_blocks;
        int p0 = first_seen(pos, sm->window);
        for (int p = p0; p <= pos; p++) {
            int b = bt[p / sm->B];
            if (b < 0) {
                sm->bad++;
                ctx[p] = -1;
                continue;
            }
            int slot = b * sm->B + p % sm->B;
            if (sm->kv_pos[slot] != p) sm->bad++;
            ctx[p] = sm->kv_tok[slot];
        }
        ids[r] = next_token(ctx + p0, pos + 1 - p0);
    }
}

typedef struct req {
    int32_t prompt[512];
    int n_prompt, max_tokens;
    int32_t out[512];
    int n_out, done, cancel_at;
    loom_seq_t *seq;
} req_t;

typedef struct ctx {
    loom_sched_t *s;
    req_t *reqs;
    int finished;
} ctx_t;

static void on_token(void *p, loom_seq_t *q, int32_t id) {
    ctx_t *c = p;
    req_t *r = q->user;
    if (r->done) {
        g_after_done++;
        return;
    }
    r->out[r->n_out++] = id;
    if (r->n_out >= r->max_tokens || (r->cancel_at && r->n_out >= r->cancel_at)) {
        r->done = 1;
        r->seq = NULL;
        c->finished++;
        loom_sched_finish(c->s, q);
    }
}

/* Reference: what the sequence must produce, from its tokens alone. */
static int check_outputs(const req_t *r, int window) {
    int32_t ctx[1024];
    memcpy(ctx, r->prompt, (size_t)r->n_prompt * 4);
    int n = r->n_prompt;
    for (int i = 0; i < r->n_out; i++) {
        int p0 = first_seen(n - 1, window);
        int32_t want = next_token(ctx + p0, n - p0);
        if (r->out[i] != want) return 0;
        ctx[n++] = want;
    }
    return 1;
}

typedef struct drafter {
    uint64_t live[256]; /* sequence ids it drafted for and was not told of yet */
    int n_live, calls, bad;
} drafter_t;

static int drafter_propose(void *ctx, const loom_seq_t *q, int k, int32_t *out) {
    drafter_t *d = ctx;
    d->calls++;
    int i = 0;
    while (i < d->n_live && d->live[i] != q->id)
        i++;
    if (i == d->n_live) {
        if (d->n_live == 256) return 0;
        d->live[d->n_live++] = q->id;
    }
    int32_t ctxt[600];
    int n = q->n_tokens;
    if (n + k > 600 || k > LOOM_SPEC_MAX_K) {
        d->bad++;
        return 0;
    }
    memcpy(ctxt, q->tokens, (size_t)n * sizeof *ctxt);
    for (int j = 0; j < k; j++) {
        int32_t t = next_token(ctxt, n);
        out[j] = (n + q->id) % 3 == 0 ? 3 + (t + 1) % 7 : t; /* wrong now and then */
        ctxt[n++] = out[j];
    }
    return k;
}

static void drafter_forget(void *ctx, const loom_seq_t *q) {
    drafter_t *d = ctx;
    for (int i = 0; i < d->n_live; i++)
        if (d->live[i] == q->id) {
            d->live[i] = d->live[--d->n_live];
            return;
        }
}

/* Runs n requests to completion with n_micro micro-batches in flight,
 * completing the oldest first as a pipeline does. */
static void run_load_window(int n_reqs, int n_blocks, int n_micro, int max_seqs, int max_tokens_step,
                            int shared_prefix, int cancel, uint64_t seed, int window, loom_sched_stats_t *out_stats) {
    loom_sched_config_t cfg = {.max_num_seqs = max_seqs, .max_batched_tokens = max_tokens_step,
                               .max_queue = 1000, .max_model_len = 512, .n_micro = n_micro,
                               .block_size = 4, .n_blocks = n_blocks, .prefix_cache = 1, .window = window,
                               .n_dp = g_n_dp, .ahead = g_ahead};
    LOOM_ASSERT(!g_ahead || n_micro == 1);
    loom_sched_t *s = loom_sched_create(&cfg);
    if (g_spec) loom_sched_set_spec(s, g_spec);
    if (g_draft_cost_s >= 0) loom_sched_set_clock(s, test_clock, NULL);
    drafter_t dr = {0};
    if (g_drafter) loom_sched_set_drafter(s, drafter_propose, drafter_forget, &dr);
    sim_t sm = {.B = 4, .n_slots = n_blocks * 4, .window = window};
    sm.kv_tok = calloc((size_t)sm.n_slots, 4);
    sm.kv_pos = malloc((size_t)sm.n_slots * 4);
    memset(sm.kv_pos, 0xff, (size_t)sm.n_slots * 4);
    req_t *reqs = calloc((size_t)n_reqs, sizeof *reqs);
    ctx_t c = {.s = s, .reqs = reqs};
    unsigned long long rng = seed;
    for (int i = 0; i < n_reqs; i++) {
        req_t *r = &reqs[i];
        r->n_prompt = 1 + (int)((test_randf(&rng, 0.5f) + 0.5f) * 40);
        r->max_tokens = 1 + (int)((test_randf(&rng, 0.5f) + 0.5f) * 30);
        int shared = shared_prefix ? (r->n_prompt < 17 ? r->n_prompt : 17) : 0;
        for (int j = 0; j < r->n_prompt; j++)
            r->prompt[j] = j < shared ? 100 + j : 3 + (int)((test_randf(&rng, 0.5f) + 0.5f) * 990);
        if (cancel && i % 5 == 3) r->cancel_at = 1 + i % 4;
        loom_sampling_t sp = {0};
        loom_err_t err;
        loom_status_t st = loom_sched_add(s, (uint64_t)i, r->prompt, r->n_prompt, r->max_tokens, 0, &sp, r, &r->seq, &err);
        CHECKF(st == LOOM_OK, "add %d: %s", i, err.msg);
    }
    loom_microbatch_t *inflight[8];
    int n_in = 0, iters = 0;
    int32_t last_ids[1024]; /* the ids the latest step sampled, as a worker keeps them */
    uint64_t last_step = 0;
    /* (a step planned ahead may still be in flight after the last finish) */
    while ((c.finished < n_reqs || n_in > 0) && iters++ < 100000) {
        loom_microbatch_t *mb;
        if (g_ahead) { /* as the coordinator: a fresh batch, then up to g_ahead planned ahead, each of the last */
            if (n_in == 0 && (mb = loom_sched_schedule(s))) inflight[n_in++] = mb;
            while (n_in > 0 && n_in <= g_ahead &&
                   (mb = loom_sched_schedule_ahead(s, inflight[n_in - 1], ahead_ok, NULL)))
                inflight[n_in++] = mb;
        } else {
            while (n_in < n_micro && (mb = loom_sched_schedule(s))) {
                inflight[n_in++] = mb;
                if (g_n_dp > 1) check_dp_partitions(mb, n_blocks);
            }
        }
        if (n_in == 0) {
            CHECKF(c.finished == n_reqs, "scheduler stalled with %d of %d finished", c.finished, n_reqs);
            break;
        }
        if (g_fail_every && iters % g_fail_every == 0) { /* a lost worker: every step in flight fails */
            for (int i = 0; i < n_in; i++) loom_sched_fail(s, inflight[i]);
            n_in = 0;
            last_step = 0;
            CHECK(loom_sched_in_flight(s) == 0 && loom_kv_check(loom_sched_ledger(s)) == 0);
            continue;
        }
        mb = inflight[0]; /* a pipeline completes micro-batches in order */
        int32_t ids[1024];
        if (mb->n_prev) { /* planned ahead: its first n_prev tokens are what the last step sampled */
            CHECKF(mb->prev_step == last_step && last_step, "step %llu reads step %llu's ids, the last was %llu",
                   (unsigned long long)mb->id, (unsigned long long)mb->prev_step, (unsigned long long)last_step);
            for (int t = 0; t < mb->n_tokens; t++) {
                CHECK((t < mb->n_prev) == (mb->prev_rows[t] >= 0));
                if (mb->prev_rows[t] >= 0) mb->tokens[t] = last_ids[mb->prev_rows[t]];
            }
        }
        sim_run(&sm, mb, ids);
        memcpy(last_ids, ids, (size_t)mb->n_logits * sizeof *ids);
        last_step = mb->id;
        if (g_draft_cost_s >= 0) {
            int drafted = 0;
            for (int i = 0; i < mb->n_seqs; i++) drafted += mb->spec_n[i];
            const double step_s = 1e-3 + g_draft_cost_s * drafted;
            g_clock_ns += (uint64_t)(step_s * 1e9);
            loom_sched_observe_step(s, mb->n_tokens, step_s);
        }
        loom_sched_complete(s, mb, ids, on_token, &c);
        memmove(inflight, inflight + 1, (size_t)(n_in - 1) * sizeof *inflight);
        n_in--;
        for (int i = 0; i < loom_sched_n_seqs(s); i++) { /* no block held past the tokens (drafts rolled back) */
            const loom_seq_t *q = loom_sched_seq_at(s, i);
            if (!q->in_flight) CHECK(q->n_blocks <= (q->n_tokens + 3) / 4);
        }
        int bad = loom_kv_check(loom_sched_ledger(s));
        CHECKF(bad == 0, "ledger inconsistent (%d)", bad);
        if (bad) break;
    }
    CHECK(sm.bad == 0);
    int wrong = 0;
    for (int i = 0; i < n_reqs; i++) {
        CHECK(reqs[i].done);
        if (!check_outputs(&reqs[i], window)) wrong++;
        if (!reqs[i].cancel_at) CHECK(reqs[i].n_out == reqs[i].max_tokens);
    }
    CHECKF(wrong == 0, "%d of %d sequences produced wrong tokens", wrong, n_reqs);
    CHECKF(loom_kv_n_held(loom_sched_ledger(s)) == 0, "%d blocks held at the end (seed %llu)",
           loom_kv_n_held(loom_sched_ledger(s)), (unsigned long long)seed);
    loom_sched_get_stats(s, out_stats);
    g_spec_stats = *loom_sched_spec_stats(s);
    loom_sched_destroy(&s);
    if (g_drafter) { /* every sequence that was asked for drafts was forgotten once, as it went */
        CHECKF(dr.n_live == 0 && dr.bad == 0 && dr.calls > 0, "drafter: %d live, %d bad, %d calls",
               dr.n_live, dr.bad, dr.calls);
    }
    free(sm.kv_tok);
    free(sm.kv_pos);
    free(reqs);
}

static void test_ledger_basics(void) {
    loom_kv_ledger_t *L = loom_kv_create(8, 4, 1);
    int b[8];
    for (int i = 0; i < 8; i++) b[i] = loom_kv_alloc(L);
    CHECK(loom_kv_alloc(L) == -1);
    int32_t t1[4] = {1, 2, 3, 4}, t2[4] = {5, 6, 7, 8};
    uint64_t h1 = loom_kv_chain_hash(0, t1, 4), h2 = loom_kv_chain_hash(h1, t2, 4);
    CHECK(h1 != h2 && h1 != loom_kv_chain_hash(0, t2, 4));
    loom_kv_register(L, b[0], h1, t1);
    loom_kv_register(L, b[1], h2, t2);
    loom_kv_register(L, b[2], h1, t1); /* duplicate content: ignored */
    CHECK(loom_kv_is_cached(L, b[0]) && !loom_kv_is_cached(L, b[2]));
    for (int i = 0; i < 8; i++) loom_kv_release(L, b[i]);
    CHECK(loom_kv_n_free(L) == 8 && loom_kv_n_cached(L) == 2 && loom_kv_check(L) == 0);
    CHECK(loom_kv_lookup(L, h1, t1) == b[0]);
    CHECK(loom_kv_lookup(L, h1, t2) == -1); /* same hash, other tokens: no hit */
    CHECK(loom_kv_ref(L, b[0]) == 1 && loom_kv_n_cached(L) == 1);
    /* allocating everything evicts the remaining cached block (b[1]) */
    int got = 0;
    while (loom_kv_alloc(L) >= 0) got++;
    CHECK(got == 7);
    CHECK(loom_kv_lookup(L, h2, t2) == -1);
    CHECK(loom_kv_check(L) == 0);
    loom_kv_destroy(&L);
    loom_kv_destroy(&L); /* twice is safe */
}

static int g_obs_cached, g_obs_evicted;
static void count_obs(void *ctx, uint64_t hash, int cached) {
    (void)ctx;
    (void)hash;
    if (cached) g_obs_cached++;
    else g_obs_evicted++;
}

/* Two partitions of 4 blocks: allocation, eviction, lookups and releases stay in one; the same content
 * cached in both is one hash to the observer until its last copy goes. */
static void test_ledger_partitions(void) {
    loom_kv_ledger_t *L = loom_kv_create_parts(8, 4, 1, 2);
    loom_kv_set_observer(L, count_obs, NULL);
    CHECK(loom_kv_n_parts(L) == 2 && loom_kv_part_of(L, 3) == 0 && loom_kv_part_of(L, 4) == 1);
    int a[4], b[4];
    for (int i = 0; i < 4; i++) a[i] = loom_kv_alloc_in(L, 0);
    for (int i = 0; i < 4; i++) CHECK(a[i] >= 0 && a[i] < 4);
    CHECK(loom_kv_alloc_in(L, 0) == -1); /* partition 0 is full, partition 1 untouched */
    CHECK(loom_kv_part_free(L, 0) == 0 && loom_kv_part_free(L, 1) == 4 && loom_kv_n_free(L) == 4);
    for (int i = 0; i < 4; i++) b[i] = loom_kv_alloc_in(L, 1);
    for (int i = 0; i < 4; i++) CHECK(b[i] >= 4 && b[i] < 8);
    CHECK(loom_kv_part_held(L, 0) == 4 && loom_kv_part_held(L, 1) == 4 && loom_kv_check(L) == 0);
    int32_t t1[4] = {1, 2, 3, 4}, t2[4] = {5, 6, 7, 8};
    uint64_t h1 = loom_kv_chain_hash(0, t1, 4), h2 = loom_kv_chain_hash(h1, t2, 4);
    loom_kv_register(L, a[0], h1, t1);
    loom_kv_register(L, b[0], h1, t1); /* the same content in the other partition: cached there too */
    loom_kv_register(L, a[1], h2, t2);
    loom_kv_register(L, a[2], h1, t1); /* a duplicate within partition 0: ignored */
    CHECK(loom_kv_is_cached(L, a[0]) && loom_kv_is_cached(L, b[0]) && !loom_kv_is_cached(L, a[2]));
    CHECK(g_obs_cached == 2); /* h1 once, h2 once */
    for (int i = 0; i < 4; i++) loom_kv_release(L, a[i]), loom_kv_release(L, b[i]);
    CHECK(loom_kv_check(L) == 0 && loom_kv_n_cached(L) == 3);
    /* lookups hit their own partition's copy only */
    CHECK(loom_kv_peek_in(L, 0, h1, t1) == a[0] && loom_kv_peek_in(L, 1, h1, t1) == b[0]);
    CHECK(loom_kv_peek_in(L, 1, h2, t2) == -1 && loom_kv_lookup_in(L, 1, h2, t2) == -1);
    CHECK(loom_kv_lookup_in(L, 0, h2, t2) == a[1] && loom_kv_ref(L, a[1]) == 1);
    loom_kv_release(L, a[1]);
    /* filling partition 1 evicts only its cached block (b[0]); h1 stays cached in partition 0 */
    int got = 0;
    while (loom_kv_alloc_in(L, 1) >= 0) got++;
    CHECK(got == 4 && !loom_kv_is_cached(L, b[0]) && loom_kv_is_cached(L, a[0]) && loom_kv_is_cached(L, a[1]));
    CHECK(g_obs_evicted == 0 && loom_kv_part_free(L, 0) == 4 && loom_kv_check(L) == 0);
    /* filling partition 0 evicts h1's last copy and h2 */
    got = 0;
    while (loom_kv_alloc_in(L, 0) >= 0) got++;
    CHECK(got == 4 && g_obs_evicted == 2 && loom_kv_n_cached(L) == 0 && loom_kv_check(L) == 0);
    /* a release goes back to its block's partition */
    loom_kv_release(L, 6);
    CHECK(loom_kv_part_free(L, 1) == 1 && loom_kv_part_free(L, 0) == 0 && loom_kv_alloc_in(L, 0) == -1);
    CHECK(loom_kv_alloc_in(L, 1) == 6 && loom_kv_check(L) == 0);
    loom_kv_destroy(&L);
}

/* Data-parallel attention's ledger under load: two and three partitions, the simulated model's tokens
 * right through prefix sharing, cancellations, pipelining and preemption; every block a sequence's plan
 * names in its rank's partition; both ranks given sequences. */
static void run_load(int n_reqs, int n_blocks, int n_micro, int max_seqs, int max_tokens_step, int shared_prefix,
                     int cancel, uint64_t seed, loom_sched_stats_t *out_stats);
static void test_dp_partitions(void) {
    loom_sched_stats_t st;
    for (int n_dp = 2; n_dp <= 3; n_dp++) {
        g_n_dp = n_dp;
        memset(g_dp_seqs, 0, sizeof g_dp_seqs);
        g_dp_cross = 0;
        run_load(60, 24 * n_dp, 1, 12, 48, 1, 1, 4, &st); /* 24 blocks a rank: preemptions */
        CHECKF(st.preemptions > 0 && st.prefix_hits > 0, "%d ranks: %llu preemptions, %llu prefix hits", n_dp,
               (unsigned long long)st.preemptions, (unsigned long long)st.prefix_hits);
        run_load(50, 4096 * n_dp, 2, 16, 64, 1, 1, 5, &st);
        run_load(50, 30 * n_dp, 3, 16, 32, 1, 0, 6, &st);
        CHECKF(g_dp_cross == 0, "%d ranks: %d blocks outside their sequence's partition", n_dp, g_dp_cross);
        for (int r = 0; r < n_dp; r++) CHECKF(g_dp_seqs[r] > 0, "rank %d of %d ran no sequence", r, n_dp);
    }
    g_n_dp = 0;
    /* binding: a prompt whose prefix one rank caches goes to that rank, though both have as many free
     * blocks; an unrelated one to the other rank (round robin) */
    {
        loom_sched_config_t cfg = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 10,
                                   .max_model_len = 64, .n_micro = 1, .block_size = 4, .n_blocks = 32,
                                   .prefix_cache = 1, .n_dp = 2};
        loom_sched_t *s = loom_sched_create(&cfg);
        int32_t a[12] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, b[10] = {5, 6, 7, 8, 9, 10, 11, 12, 40, 41};
        int32_t c[10] = {90, 91, 92, 93, 94, 95, 96, 97, 98, 99}, id = 3;
        loom_sampling_t sp = {0};
        loom_seq_t *q;
        loom_err_t err;
        int rank[3] = {-1, -1, -1};
        const int32_t *prompts[3] = {a, b, c};
        const int lens[3] = {12, 10, 10};
        for (int r = 0; r < 3; r++) {
            CHECK(loom_sched_add(s, (uint64_t)r, prompts[r], lens[r], 1, 0, &sp, NULL, &q, &err) == LOOM_OK);
            loom_microbatch_t *mb = loom_sched_schedule(s);
            CHECK(mb && mb->n_seqs == 1);
            if (!mb) break;
            rank[r] = mb->seq_dp_rank[0];
            loom_sched_complete(s, mb, &id, NULL, NULL);
            loom_sched_finish(s, q);
        }
        loom_sched_get_stats(s, &st);
        CHECKF(rank[1] == rank[0] && rank[2] != rank[0], "ranks %d %d %d", rank[0], rank[1], rank[2]);
        CHECKF(st.prefix_hits == 2, "%llu prefix hits", (unsigned long long)st.prefix_hits);
        CHECK(st.dp_admissions[0] + st.dp_admissions[1] == 3 && loom_kv_check(loom_sched_ledger(s)) == 0);
        loom_sched_destroy(&s);
    }
    /* a request larger than one rank's partition is refused though the whole pool holds it */
    loom_sched_config_t cfg = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 10, .max_model_len = 512,
                               .n_micro = 1, .block_size = 4, .n_blocks = 16, .prefix_cache = 1, .n_dp = 2};
    loom_sched_t *s = loom_sched_create(&cfg);
    int32_t prompt[40] = {0};
    loom_sampling_t sp = {0};
    loom_seq_t *q;
    loom_err_t err;
    CHECK(loom_sched_add(s, 1, prompt, 30, 4, 0, &sp, NULL, &q, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strstr(err.msg, "data-parallel attention rank") != NULL, "%s", err.msg);
    CHECK(loom_sched_add(s, 2, prompt, 28, 4, 0, &sp, NULL, &q, &err) == LOOM_OK);
    loom_sched_destroy(&s);
}

static void run_load(int n_reqs, int n_blocks, int n_micro, int max_seqs, int max_tokens_step, int shared_prefix,
                     int cancel, uint64_t seed, loom_sched_stats_t *out_stats) {
    run_load_window(n_reqs, n_blocks, n_micro, max_seqs, max_tokens_step, shared_prefix, cancel, seed, 0, out_stats);
}

/* A model whose every layer has a window of 8 positions: blocks behind it
 * are released (the simulated model counts a read of a released block as a
 * failure) and the outputs are those of the windowed model, through chunked
 * prefill, prefix sharing, cancellations, pipelining and preemption; the
 * same pool preempts less than without the window. */
static void test_sliding_window_frees_blocks(void) {
    loom_sched_stats_t plain, win;
    run_load_window(48, 40, 1, 16, 64, 0, 0, 2, 0, &plain);
    run_load_window(48, 40, 1, 16, 64, 0, 0, 2, 8, &win);
    CHECKF(win.preemptions < plain.preemptions, "window 8: %llu preemptions, without: %llu",
           (unsigned long long)win.preemptions, (unsigned long long)plain.preemptions);
    run_load_window(60, 48, 1, 12, 7, 1, 1, 4, 8, &win); /* 7-token chunks, shared prefixes, cancels */
    CHECK(win.prefix_hits > 0);
    run_load_window(50, 60, 3, 16, 32, 1, 0, 6, 5, &win); /* three micro-batches, window not a block multiple */
    run_load_window(30, 4096, 1, 8, 128, 1, 0, 7, 13, &win);
    CHECK(win.preemptions == 0);
}

static void test_plenty_of_memory(void) {
    loom_sched_stats_t st;
    run_load(64, 4096, 1, 32, 256, 0, 0, 1, &st);
    CHECK(st.preemptions == 0);
}

static void test_small_pool_preempts(void) {
    loom_sched_stats_t st;
    run_load(48, 40, 1, 16, 64, 0, 0, 2, &st);
    CHECKF(st.preemptions > 0, "no preemption with a 40-block pool");
}

static void test_prefix_sharing(void) {
    loom_sched_stats_t st;
    run_load(40, 4096, 1, 8, 128, 1, 0, 3, &st);
    CHECKF(st.prefix_hits > 0, "no prefix cache hits with shared prefixes");
    /* and with memory pressure, sharing and cancellations at once */
    run_load(60, 48, 1, 12, 48, 1, 1, 4, &st);
    CHECK(st.preemptions > 0);
}

static void test_pipeline_micro_batches(void) {
    loom_sched_stats_t st;
    run_load(50, 4096, 2, 16, 64, 1, 1, 5, &st);
    run_load(50, 60, 3, 16, 32, 1, 0, 6, &st);
}

static void test_full_prompt_hit_copy_on_write(void) {
    /* A prompt of exactly 2 blocks, run twice: the second time every block
     * is cached, the last token is recomputed into a copied block. */
    loom_sched_config_t cfg = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 8,
                               .max_model_len = 64, .n_micro = 1, .block_size = 4, .n_blocks = 16,
                               .prefix_cache = 1};
    loom_sched_t *s = loom_sched_create(&cfg);
    sim_t sm = {.B = 4, .n_slots = 64};
    sm.kv_tok = calloc(64, 4);
    sm.kv_pos = malloc(64 * 4);
    memset(sm.kv_pos, 0xff, 64 * 4);
    int32_t prompt[8] = {10, 11, 12, 13, 14, 15, 16, 17};
    int32_t first = -1;
    for (int round = 0; round < 2; round++) {
        req_t r = {.n_prompt = 8, .max_tokens = 3};
        memcpy(r.prompt, prompt, sizeof prompt);
        ctx_t c = {.s = s};
        loom_sampling_t sp = {0};
        loom_err_t err;
        REQUIRE(loom_sched_add(s, 1, prompt, 8, 3, 0, &sp, &r, &r.seq, &err) == LOOM_OK);
        loom_microbatch_t *mb = loom_sched_schedule(s);
        REQUIRE(mb != NULL);
        if (round == 1) {
            CHECK(mb->n_copies == 1);
            CHECK(mb->n_tokens == 1 && mb->pos[0] == 7);
            CHECK(r.seq->cached_tokens == 7);
        }
        int32_t ids[8];
        sim_run(&sm, mb, ids);
        loom_sched_complete(s, mb, ids, on_token, &c);
        while (!r.done && (mb = loom_sched_schedule(s))) {
            sim_run(&sm, mb, ids);
            loom_sched_complete(s, mb, ids, on_token, &c);
        }
        CHECK(r.done && check_outputs(&r, 0));
        if (round == 0) first = r.out[0];
        else CHECK(r.out[0] == first);
        CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    }
    CHECK(sm.bad == 0);
    loom_sched_destroy(&s);
    free(sm.kv_tok);
    free(sm.kv_pos);
}

static void test_admission_errors(void) {
    loom_sched_config_t cfg = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 2,
                               .max_model_len = 100, .n_micro = 1, .block_size = 4, .n_blocks = 20,
                               .prefix_cache = 1};
    loom_sched_t *s = loom_sched_create(&cfg);
    int32_t p[200] = {0};
    loom_sampling_t sp = {0};
    loom_seq_t *q;
    loom_err_t err;
    CHECK(loom_sched_add(s, 1, p, 0, 10, 0, &sp, NULL, &q, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_sched_add(s, 1, p, 100, 1, 0, &sp, NULL, &q, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_sched_add(s, 1, p, 60, 50, 0, &sp, NULL, &q, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECKF(strstr(err.msg, "60") && strstr(err.msg, "50") && strstr(err.msg, "100"), "message: %s", err.msg);
    CHECK(loom_sched_add(s, 1, p, 50, 40, 0, &sp, NULL, &q, &err) == LOOM_ERR_INVALID_ARGUMENT); /* 23 blocks > 20 */
    CHECK(loom_sched_add(s, 1, p, 10, 10, 0, &sp, NULL, &q, &err) == LOOM_OK);
    CHECK(loom_sched_add(s, 2, p, 10, 10, 0, &sp, NULL, &q, &err) == LOOM_OK);
    CHECK(loom_sched_add(s, 3, p, 10, 10, 0, &sp, NULL, &q, &err) == LOOM_ERR_RESOURCE_EXHAUSTED);
    /* max_tokens 0 means "up to the context" */
    loom_sched_destroy(&s);
}

static void test_priority_order(void) {
    loom_sched_config_t cfg = {.max_num_seqs = 1, .max_batched_tokens = 64, .max_queue = 8,
                               .max_model_len = 64, .n_micro = 1, .block_size = 4, .n_blocks = 64,
                               .prefix_cache = 0};
    loom_sched_t *s = loom_sched_create(&cfg);
    int32_t p[4] = {5, 6, 7, 8};
    loom_sampling_t sp = {0};
    loom_seq_t *a, *b, *c2;
    loom_err_t err;
    loom_sched_add(s, 1, p, 4, 2, 0, &sp, NULL, &a, &err);
    loom_sched_add(s, 2, p, 4, 2, 5, &sp, NULL, &b, &err);
    loom_sched_add(s, 3, p, 4, 2, 5, &sp, NULL, &c2, &err);
    loom_microbatch_t *mb = loom_sched_schedule(s);
    REQUIRE(mb && mb->n_seqs == 1);
    CHECK(mb->seqs[0] == b); /* highest priority, then first come */
    loom_sched_fail(s, mb);
    loom_sched_finish(s, b);
    mb = loom_sched_schedule(s);
    REQUIRE(mb);
    CHECK(mb->seqs[0] == c2);
    loom_sched_finish(s, c2); /* finish while in flight: freed on completion */
    int32_t ids[1] = {9};
    loom_sched_complete(s, mb, ids, NULL, NULL);
    mb = loom_sched_schedule(s);
    REQUIRE(mb);
    CHECK(mb->seqs[0] == a);
    loom_sched_destroy(&s);
}

/* Runs a micro-batch that has no logit rows (embeddings only). */
static void complete_embeds(loom_sched_t *s, loom_microbatch_t *mb) {
    CHECK(mb->n_logits == 0);
    loom_sched_complete(s, mb, NULL, NULL, NULL);
}

static void test_embedding_ranges(void) {
    /* Embedding sequences are prefilled in chunks and never sampled: mean
     * pooling asks for every token of every chunk, last pooling for the
     * last prompt token once; last pooling uses the prefix cache, mean
     * pooling does not. */
    loom_sched_config_t cfg = {.max_num_seqs = 4, .max_batched_tokens = 5, .max_queue = 8,
                               .max_model_len = 64, .n_micro = 1, .block_size = 4, .n_blocks = 32,
                               .prefix_cache = 1};
    loom_sched_t *s = loom_sched_create(&cfg);
    int32_t p[12] = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21};
    loom_seq_t *mean, *last;
    loom_err_t err;
    CHECK(loom_sched_add_embed(s, 1, p, 12, LOOM_POOL_NONE, 0, NULL, &mean, &err) == LOOM_ERR_INVALID_ARGUMENT);
    REQUIRE(loom_sched_add_embed(s, 1, p, 12, LOOM_POOL_MEAN, 0, NULL, &mean, &err) == LOOM_OK);
    int want_pos[3] = {0, 5, 10}, want_len[3] = {5, 5, 2};
    for (int k = 0; k < 3; k++) {
        loom_microbatch_t *mb = loom_sched_schedule(s);
        REQUIRE(mb && mb->n_embeds == 1);
        CHECK(mb->embed_seq[0] == mean && mb->embed_pos[0] == want_pos[k]);
        CHECK(mb->embed_end[0] - mb->embed_begin[0] == want_len[k] && mb->embed_final[0] == (k == 2));
        CHECK(mb->pos[mb->embed_begin[0]] == want_pos[k]);
        complete_embeds(s, mb);
    }
    CHECK(mean->n_computed == 12 && mean->n_tokens == 12);
    CHECK(loom_sched_schedule(s) == NULL); /* done: nothing more runs until it is finished */
    loom_sched_finish(s, mean);
    /* last pooling of an 8-token prefix: the full blocks are cached now */
    REQUIRE(loom_sched_add_embed(s, 2, p, 8, LOOM_POOL_LAST, 0, NULL, &last, &err) == LOOM_OK);
    loom_microbatch_t *mb = loom_sched_schedule(s);
    REQUIRE(mb);
    CHECK(last->cached_tokens == 7 && mb->n_copies == 1 && mb->n_tokens == 1);
    REQUIRE(mb->n_embeds == 1);
    CHECK(mb->embed_pos[0] == 7 && mb->embed_end[0] - mb->embed_begin[0] == 1 && mb->embed_final[0]);
    complete_embeds(s, mb);
    loom_sched_finish(s, last);
    /* mean pooling never takes cached blocks: every token's hidden state is needed */
    REQUIRE(loom_sched_add_embed(s, 3, p, 8, LOOM_POOL_MEAN, 0, NULL, &mean, &err) == LOOM_OK);
    mb = loom_sched_schedule(s);
    REQUIRE(mb && mb->n_embeds == 1);
    CHECK(mean->cached_tokens == 0 && mb->embed_pos[0] == 0 && mb->n_copies == 0);
    /* preempted (a failed step): its ranges start again at position 0 */
    loom_sched_fail(s, mb);
    mb = loom_sched_schedule(s);
    REQUIRE(mb && mb->n_embeds == 1 && mb->embed_pos[0] == 0);
    complete_embeds(s, mb);
    mb = loom_sched_schedule(s);
    REQUIRE(mb && mb->n_embeds == 1 && mb->embed_pos[0] == 5 && mb->embed_final[0]);
    /* a generation batched with it gets its logit row, the embedding none */
    loom_sampling_t sp = {0};
    loom_seq_t *gen;
    complete_embeds(s, mb);
    loom_sched_finish(s, mean);
    REQUIRE(loom_sched_add(s, 4, p, 3, 2, 0, &sp, NULL, &gen, &err) == LOOM_OK);
    REQUIRE(loom_sched_add_embed(s, 5, p + 4, 2, LOOM_POOL_LAST, 0, NULL, &last, &err) == LOOM_OK);
    mb = loom_sched_schedule(s);
    REQUIRE(mb && mb->n_seqs == 2);
    CHECK(mb->n_logits == 1 && mb->logit_seq[0] == gen && mb->n_embeds == 1 && mb->embed_seq[0] == last);
    CHECK(mb->embed_begin[0] == 4 && mb->embed_end[0] == 5);
    int32_t ids[1] = {7};
    loom_sched_complete(s, mb, ids, NULL, NULL);
    loom_sched_finish(s, gen);
    loom_sched_finish(s, last);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    loom_sched_destroy(&s);
}

/* Speculative decoding: every load above, with ngram drafts verified in the
 * same steps, gives exactly the sequential tokens (check_outputs), never more
 * than max_tokens, a consistent ledger with every block back at the end
 * (rejected drafts' blocks released), and more than one token per step. */
static void test_speculative(void) {
    loom_spec_config_t c;
    loom_spec_config_defaults(&c);
    c.method = LOOM_SPEC_NGRAM;
    c.k = 8;
    g_spec = &c;
    loom_sched_stats_t st;
    for (int markov = 1; markov >= 0; markov--) {
        g_markov = markov;
        run_load(64, 4096, 1, 32, 256, 0, 0, 11, &st);
        if (markov) {
            CHECKF(g_spec_stats.num_accepted_tokens > 0 && loom_spec_stats_tokens_per_step(&g_spec_stats) > 1.5,
                   "accepted %lld, %.2f tokens per step", (long long)g_spec_stats.num_accepted_tokens,
                   loom_spec_stats_tokens_per_step(&g_spec_stats));
            CHECK(g_spec_stats.accepted_per_pos[0] >= g_spec_stats.accepted_per_pos[1]);
        }
        run_load(48, 40, 1, 16, 64, 0, 0, 12, &st); /* preemption */
        CHECK(st.preemptions > 0);
        run_load(60, 48, 1, 12, 48, 1, 1, 13, &st); /* prefix sharing, cancellations */
        run_load(50, 60, 3, 16, 32, 1, 0, 14, &st); /* pipeline micro-batches */
        run_load(20, 4096, 1, 4, 8, 0, 0, 15, &st); /* tiny token budget and few logit rows */
    }
    /* fixed K, 16 drafts */
    c.k = 16;
    c.fixed_k = 1;
    g_markov = 1;
    run_load(30, 4096, 2, 8, 128, 1, 1, 16, &st);
    CHECK(g_spec_stats.num_drafts > 0);
    /* a step at the compute knee carries no drafts */
    c.fixed_k = 0;
    c.compute_knee = 1;
    run_load(10, 4096, 1, 8, 128, 0, 0, 17, &st);
    CHECK(g_spec_stats.num_draft_tokens == 0);
    /* method DRAFT with a drafter: right most of the time, never wrong output */
    loom_spec_config_defaults(&c);
    c.method = LOOM_SPEC_DRAFT;
    c.k = 6;
    g_drafter = 1;
    for (int markov = 1; markov >= 0; markov--) {
        g_markov = markov;
        run_load(40, 4096, 1, 16, 256, 0, 1, 18, &st);
        CHECKF(g_spec_stats.num_accepted_tokens > 0 &&
                   loom_spec_stats_tokens_per_step(&g_spec_stats) > 1.5,
               "drafter: accepted %lld, %.2f tokens per step",
               (long long)g_spec_stats.num_accepted_tokens,
               loom_spec_stats_tokens_per_step(&g_spec_stats));
        CHECK(g_spec_stats.num_accepted_tokens <
              g_spec_stats.num_draft_tokens);       /* some were rejected */
        run_load(48, 40, 1, 16, 64, 0, 0, 19, &st); /* preemption */
        CHECK(st.preemptions > 0);
        run_load(50, 60, 3, 16, 32, 1, 1, 20,
                 &st); /* pipeline micro-batches, prefix sharing, cancellations */
    }
    /* the wall-time gate: drafts that cost a whole step each never pay, and
     * the scheduler stops drafting after a few steps; cheap ones keep going.
     * The output is right either way (run_load checks every token). */
    g_markov = 1;
    g_draft_cost_s = 2e-3;
    run_load(24, 4096, 1, 8, 64, 0, 0, 22, &st);
    CHECKF(g_spec_stats.num_drafts > 0 && g_spec_stats.num_drafts * 10 < (long long)st.batches,
           "dear drafts: %lld drafting steps of %llu", (long long)g_spec_stats.num_drafts,
           (unsigned long long)st.batches);
    g_draft_cost_s = 1e-5;
    run_load(24, 4096, 1, 8, 64, 0, 0, 22, &st);
    CHECKF(loom_spec_stats_tokens_per_step(&g_spec_stats) > 1.5, "cheap drafts: %.2f tokens per step",
           loom_spec_stats_tokens_per_step(&g_spec_stats));
    g_draft_cost_s = -1;
    /* method DRAFT without a drafter drafts nothing */
    g_drafter = 0;
    run_load(10, 4096, 1, 8, 128, 0, 0, 21, &st);
    CHECK(g_spec_stats.num_draft_tokens == 0);
    g_spec = NULL;
    g_markov = 0;
}

/* Every block's reference count equals the number of tables holding it. */
static int refs_match_tables(loom_sched_t *s) {
    loom_kv_ledger_t *L = loom_sched_ledger(s);
    int bad = 0;
    for (int b = 0; b < loom_kv_n_blocks(L); b++) {
        int n = 0;
        for (int i = 0; i < loom_sched_n_seqs(s); i++) {
            const loom_seq_t *q = loom_sched_seq_at(s, i);
            for (int j = q->n_dropped; j < q->n_blocks; j++) n += q->blocks[j] == b;
        }
        if (loom_kv_ref(L, b) != n) bad++;
    }
    return bad;
}

/* n siblings with one prompt (an n > 1 request): the first prefills it, the
 * others are parked, then forked: they share its full prompt blocks, get the
 * block of the last prompt position copied, and run that position only.
 * cancel_leader: the leader is cancelled during its prefill (the siblings
 * fall back: the next one prefills and leads the rest); fail_first: the
 * prefill step fails (the leader is preempted and prefills again). */
static void run_siblings(int n_sib, int n_prompt, int n_blocks, int max_tokens, int prefix_cache, int cancel_leader,
                         int fail_first, loom_sched_stats_t *out) {
    loom_sched_config_t cfg = {.max_num_seqs = 8, .max_batched_tokens = 64, .max_queue = 16,
                               .max_model_len = 128, .n_micro = 1, .block_size = 4, .n_blocks = n_blocks,
                               .prefix_cache = prefix_cache};
    loom_sched_t *s = loom_sched_create(&cfg);
    sim_t sm = {.B = 4, .n_slots = n_blocks * 4};
    sm.kv_tok = calloc((size_t)sm.n_slots, 4);
    sm.kv_pos = malloc((size_t)sm.n_slots * 4);
    memset(sm.kv_pos, 0xff, (size_t)sm.n_slots * 4);
    req_t r[8] = {0};
    ctx_t c = {.s = s, .reqs = r};
    loom_err_t err;
    for (int i = 0; i < n_sib; i++) {
        r[i].n_prompt = n_prompt;
        r[i].max_tokens = max_tokens;
        for (int j = 0; j < n_prompt; j++) r[i].prompt[j] = 50 + j * 7;
        loom_sampling_t sp = {0};
        REQUIRE(loom_sched_add(s, (uint64_t)i, r[i].prompt, n_prompt, max_tokens, 0, &sp, &r[i], &r[i].seq, &err) ==
                LOOM_OK);
    }
    loom_microbatch_t *mb = loom_sched_schedule(s);
    REQUIRE(mb != NULL);
    CHECKF(mb->n_seqs == 1 && mb->n_tokens == n_prompt, "first step: %d seqs, %d tokens", mb->n_seqs, mb->n_tokens);
    int32_t ids[64];
    int leader = 0, forks = 0;
    if (fail_first) {
        loom_sched_fail(s, mb);
        mb = loom_sched_schedule(s);
        REQUIRE(mb != NULL);
        CHECK(mb->n_seqs == 1 && mb->seqs[0] == r[0].seq && mb->n_tokens == n_prompt);
    }
    if (cancel_leader) {
        loom_sched_finish(s, r[0].seq); /* in flight: freed when the step completes */
        r[0].done = 1;
        r[0].seq = NULL;
        c.finished++;
        leader = 1;
    }
    sim_run(&sm, mb, ids);
    loom_sched_complete(s, mb, ids, on_token, &c);
    if (cancel_leader) { /* the next sibling prefills on its own (nothing cached: the leader never finished a step) */
        mb = loom_sched_schedule(s);
        REQUIRE(mb != NULL);
        CHECK(mb->n_seqs == 1 && mb->seqs[0] == r[1].seq && mb->n_tokens == n_prompt);
        sim_run(&sm, mb, ids);
        loom_sched_complete(s, mb, ids, on_token, &c);
    }
    int iters = 0;
    while (c.finished < n_sib && iters++ < 1000) {
        mb = loom_sched_schedule(s);
        if (!mb) {
            CHECKF(0, "stalled with %d of %d finished", c.finished, n_sib);
            break;
        }
        for (int i = 0; i < mb->n_seqs; i++) {
            loom_seq_t *q = mb->seqs[i];
            if (!q->forked || q->n_steps > 0 || q->n_computed != n_prompt - 1) continue;
            /* a fork's first step: the last prompt position, on the leader's full blocks and a copied one */
            loom_seq_t *l = r[leader].seq;
            int last = (n_prompt - 1) / 4;
            CHECK(mb->chunk[i] == 1 && q->n_blocks == last + 1 && q->cached_tokens == n_prompt - 1);
            if (l)
                for (int j = 0; j < last; j++) CHECK(q->blocks[j] == l->blocks[j]);
            int copied = 0;
            for (int k = 0; k < mb->n_copies; k++)
                copied += mb->copy_dst[k] == q->blocks[last] && (!l || mb->copy_src[k] == l->blocks[last]);
            CHECK(copied == 1);
            forks++;
        }
        sim_run(&sm, mb, ids);
        loom_sched_complete(s, mb, ids, on_token, &c);
        CHECK(refs_match_tables(s) == 0);
        CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    }
    CHECK(sm.bad == 0);
    for (int i = leader; i < n_sib; i++) {
        CHECK(r[i].done && r[i].n_out == max_tokens && check_outputs(&r[i], 0));
        CHECK(!memcmp(r[i].out, r[leader].out, (size_t)max_tokens * sizeof *r[i].out)); /* greedy: all alike */
    }
    CHECK(loom_kv_n_held(loom_sched_ledger(s)) == 0);
    loom_sched_get_stats(s, out);
    CHECKF(out->forks == (uint64_t)forks, "%llu forks counted, %d seen", (unsigned long long)out->forks, forks);
    loom_sched_destroy(&s);
    free(sm.kv_tok);
    free(sm.kv_pos);
}

static void test_fork_siblings(void) {
    loom_sched_stats_t st;
    for (int cache = 0; cache <= 1; cache++)
        for (int np = 8; np <= 11; np++) { /* the last prompt block full, or holding 1..3 positions */
            run_siblings(4, np, 64, 6, cache, 0, 0, &st);
            CHECKF(st.forks == 3 && st.fork_tokens == 3u * (uint64_t)(np - 1), "prompt %d: %llu forks, %llu tokens",
                   np, (unsigned long long)st.forks, (unsigned long long)st.fork_tokens);
            /* the prompt is run once, then the last position once per sibling */
            CHECKF(st.prompt_tokens_computed == (uint64_t)np + 3, "prompt %d: %llu prompt tokens computed", np,
                   (unsigned long long)st.prompt_tokens_computed);
            CHECK(st.preemptions == 0);
        }
}

static void test_fork_leader_gone(void) {
    loom_sched_stats_t st;
    run_siblings(4, 10, 64, 6, 1, 1, 0, &st); /* cancelled: the second prefills, two fork from it */
    CHECK(st.forks == 2 && st.prompt_tokens_computed == 10 + 10 + 2);
    run_siblings(4, 10, 64, 6, 0, 0, 1, &st); /* preempted by a failed step: prefilled again, then forked */
    CHECK(st.forks == 3 && st.prompt_tokens_computed == 10 + 10 + 3);
}

/* A pool too small for every sibling's decode: forks are preempted and
 * readmitted, each preemption releasing only its own references (checked
 * against the tables after every step), and the outputs stay right. */
static void test_fork_preempted(void) {
    loom_sched_stats_t st;
    run_siblings(4, 10, 11, 10, 1, 0, 0, &st);
    CHECK(st.preemptions > 0 && st.forks >= 3);
    run_siblings(6, 9, 12, 12, 0, 0, 0, &st);
    CHECK(st.preemptions > 0 && st.forks >= 5);
}

/* Overlapped scheduling: the scenarios above (plenty of memory, a small
 * pool that preempts, shared prefixes with cancellations, a sliding
 * window, speculation) with a micro-batch planned ahead of each one in
 * flight: every output is the model's, none follows a finish (cancel_at:
 * the caller ends the sequence as an EOS or a stop string would, so the
 * row planned ahead is dropped), the ledger stays consistent, and no block
 * is held at the end. */
static void run_plan_ahead(int depth);

static void test_plan_ahead(void) {
    for (int depth = 1; depth <= 3; depth += 2) {
        run_plan_ahead(depth);
        CHECKF(g_after_done == 0, "%d steps ahead: %d tokens emitted after their sequence finished", depth,
               g_after_done);
    }
}

static void run_plan_ahead(int depth) {
    loom_sched_stats_t st;
    g_ahead = depth;
    g_after_done = 0;
    run_load(64, 4096, 1, 32, 256, 0, 0, 1, &st);
    CHECKF(st.ahead_tokens > 0 && st.preemptions == 0 && st.ahead_dropped == 0,
           "%llu planned ahead, %llu dropped, %llu preemptions", (unsigned long long)st.ahead_tokens,
           (unsigned long long)st.ahead_dropped, (unsigned long long)st.preemptions);
    run_load(48, 40, 1, 16, 64, 0, 0, 2, &st);
    CHECK(st.ahead_tokens > 0 && st.preemptions > 0);
    run_load(60, 48, 1, 12, 48, 1, 1, 4, &st);
    CHECK(st.ahead_tokens > 0 && st.prefix_hits > 0);
    CHECKF(st.ahead_dropped > 0, "no row planned ahead was dropped with cancellations");
    run_load(64, 4096, 1, 1, 256, 0, 1, 21, &st); /* one sequence at a time: every decode is planned ahead */
    CHECK(st.ahead_tokens > 0 && st.ahead_dropped > 0);
    run_load_window(60, 48, 1, 12, 7, 1, 1, 4, 8, &st); /* 7-token chunks, a window of 8 */
    CHECK(st.ahead_tokens > 0);
    g_fail_every = 7; /* both steps in flight fail now and then: recomputed, same outputs */
    run_load(40, 64, 1, 8, 64, 1, 1, 22, &st);
    CHECK(st.ahead_tokens > 0 && st.preemptions > 0);
    g_fail_every = 0;
    loom_spec_config_t c;
    loom_spec_config_defaults(&c);
    c.method = LOOM_SPEC_NGRAM;
    g_spec = &c;
    g_markov = 1;
    run_load(40, 4096, 1, 16, 256, 0, 1, 23, &st); /* speculating sequences wait for their tokens */
    CHECK(g_spec_stats.num_drafts > 0);
    g_spec = NULL;
    g_markov = 0;
    g_ahead = 0;
}

int main(void) {
    RUN(test_ledger_basics);
    RUN(test_ledger_partitions);
    RUN(test_dp_partitions);
    RUN(test_admission_errors);
    RUN(test_priority_order);
    RUN(test_plenty_of_memory);
    RUN(test_small_pool_preempts);
    RUN(test_prefix_sharing);
    RUN(test_pipeline_micro_batches);
    RUN(test_full_prompt_hit_copy_on_write);
    RUN(test_sliding_window_frees_blocks);
    RUN(test_embedding_ranges);
    RUN(test_speculative);
    RUN(test_fork_siblings);
    RUN(test_fork_leader_gone);
    RUN(test_fork_preempted);
    RUN(test_plan_ahead);
    return test_summary();
}
