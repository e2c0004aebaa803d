/* The coordinator's draft model off the reactor (coordinator/draft.h), on
 * stories260K with the scheduler: the drafts a step gets back from the
 * draft's thread are the ids loom_local_propose gives for the same slots,
 * histories and K in the same order (so the steps are the ones a draft run
 * inside the scheduler built); a sequence that finds every slot taken
 * drafts nothing; a voided job comes back unwritten; and while the thread
 * drafts (the test hook's delay) the reactor's half has already returned. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model_config.h"
#include "common/spec.h"
#include "common/util.h"
#include "coordinator/draft.h"
#include "coordinator/sched.h"
#include "tests/test.h"
#include "worker/local.h"

#define CTX 128
#define SLOTS 2

static char g_dir[4096];

static const char *models_dir(void) {
    const char *d = getenv("LOOM_MODELS_DIR");
    return d && d[0] ? d : LOOM_MODELS_DIR_DEFAULT;
}

static loom_sched_t *make_sched(loom_coord_draft_t *d) {
    loom_sched_config_t sc = {.max_num_seqs = 8, .max_batched_tokens = 256, .max_queue = 100, .max_model_len = CTX,
                              .n_micro = 1, .block_size = 4, .n_blocks = 256};
    loom_sched_t *s = loom_sched_create(&sc);
    loom_spec_config_t c;
    loom_spec_config_defaults(&c);
    c.method = LOOM_SPEC_DRAFT;
    c.k = 3;
    c.fixed_k = 1;
    loom_sched_set_spec(s, &c);
    loom_coord_draft_attach(d, s);
    return s;
}

static loom_coord_draft_t *open_draft(void) {
    loom_model_config_t mc;
    loom_err_t err = {0};
    if (loom_model_config_load(g_dir, &mc, &err) < 0) return NULL;
    loom_coord_draft_options_t o = {.model_dir = g_dir, .max_seqs = SLOTS, .n_threads = 1, .ctx = CTX};
    loom_coord_draft_t *d = NULL;
    if (loom_coord_draft_open(&o, &mc, NULL, &d, &err) < 0) fprintf(stderr, "draft: %s\n", err.msg);
    return d;
}

static void add_seqs(loom_sched_t *s, int n) {
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    for (int i = 0; i < n; i++) {
        int32_t prompt[6] = {1, 40 + i, 70 + 3 * i, 200 - i, 91, 17 + i};
        loom_seq_t *q = NULL;
        loom_err_t err = {0};
        CHECKF(loom_sched_add(s, (uint64_t)(i + 1), prompt, 6, 60, 0, &greedy, NULL, &q, &err) == LOOM_OK, "%s",
               err.msg);
    }
}

/* Waits for the draft's fd and takes one job (1), or gives up after ms (0). */
static int wait_take(loom_coord_draft_t *d, loom_microbatch_t **mb, int ms) {
    uint64_t end = loom_now_ns() + (uint64_t)ms * 1000000ull;
    for (;;) {
        if (loom_coord_draft_take(d, mb)) return 1;
        if (loom_now_ns() > end) return 0;
        struct pollfd pf = {.fd = loom_coord_draft_fd(d), .events = POLLIN};
        poll(&pf, 1, 50);
    }
}

/* Sampled ids for a completed step: a speculating sequence's drafts are
 * accepted up to `reject_at` (then a different id), others get `other`. */
static void step_ids(const loom_microbatch_t *mb, int reject_at, int32_t *ids) {
    for (int r = 0; r < mb->n_logits; r++) ids[r] = 5;
    for (int si = 0; si < mb->n_seqs; si++) {
        int n = mb->spec_n[si], r0 = mb->spec_row0[si], t0 = mb->logit_rows[r0];
        for (int j = 0; j < n; j++) ids[r0 + j] = j == reject_at ? (mb->tokens[t0 + 1 + j] + 1) % 512 : mb->tokens[t0 + 1 + j];
        if (n) ids[r0 + n] = 9;
    }
}

static void test_drafts_as_in_the_scheduler(void) {
    loom_coord_draft_t *d = open_draft();
    REQUIRE(d);
    loom_local_options_t lo = {.model_dir = g_dir, .n_threads = 1, .ctx = CTX, .no_tokenizer = 1, .n_slots = SLOTS};
    loom_local_t *ref = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_local_open(&lo, &ref, &err) == LOOM_OK);
    loom_sched_t *s = make_sched(d);
    add_seqs(s, 3);
    uint64_t slot_of[SLOTS] = {0};
    int n_slots = 0, drafted = 0, undrafted = 0;
    for (int step = 0; step < 6; step++) {
        loom_microbatch_t *mb = loom_sched_schedule(s), *back = NULL;
        REQUIRE(mb);
        if (loom_coord_draft_submit(d, mb)) {
            REQUIRE(wait_take(d, &back, 60000));
            CHECK(back == mb);
        }
        for (int si = 0; si < mb->n_seqs; si++) {
            const loom_seq_t *q = mb->seqs[si];
            int n = mb->spec_n[si];
            if (q->n_tokens - q->n_computed != 1) continue; /* a prefill */
            if (!n) {
                undrafted++;
                continue;
            }
            /* the slot the draft gave it: the first free one, in the order asked */
            int slot = -1;
            for (int i = 0; i < n_slots; i++)
                if (slot_of[i] == q->id) slot = i;
            if (slot < 0) {
                REQUIRE(n_slots < SLOTS);
                slot_of[n_slots] = q->id;
                slot = n_slots++;
            }
            int32_t want[LOOM_SPEC_MAX_K];
            int m = loom_local_propose(ref, slot, q->tokens, q->n_tokens, n, want, &err);
            CHECKF(m == n, "seq %llu: %d drafts, the reference %d", (unsigned long long)q->id, n, m);
            const int32_t *got = mb->tokens + mb->logit_rows[mb->spec_row0[si]] + 1;
            CHECKF(memcmp(got, want, (size_t)n * sizeof *got) == 0, "seq %llu step %d: drafts differ",
                   (unsigned long long)q->id, step);
            drafted++;
        }
        int32_t ids[512];
        step_ids(mb, step % 2 ? 1 : -1, ids);
        loom_sched_complete(s, mb, ids, NULL, NULL);
    }
    CHECKF(drafted >= 8, "%d drafted decodes", drafted);
    CHECKF(undrafted >= 4, "%d decodes without a slot", undrafted); /* three sequences, two slots */
    CHECK(loom_coord_draft_busy(d) == SLOTS);
    CHECK(loom_coord_draft_errors(d) == 0);

    /* a step that fails before it is sent: its job comes back unwritten */
    loom_microbatch_t *mb = loom_sched_schedule(s), *back = mb;
    REQUIRE(mb && loom_coord_draft_submit(d, mb));
    loom_coord_draft_void(d, mb);
    loom_sched_fail(s, mb);
    REQUIRE(wait_take(d, &back, 60000));
    CHECK(back == NULL);
    /* the sequences go on: re-prefilled (no drafts), then drafted again */
    mb = loom_sched_schedule(s);
    REQUIRE(mb && !loom_coord_draft_submit(d, mb));
    int32_t ids[512];
    step_ids(mb, -1, ids);
    loom_sched_complete(s, mb, ids, NULL, NULL);
    mb = loom_sched_schedule(s);
    REQUIRE(mb && loom_coord_draft_submit(d, mb));
    REQUIRE(wait_take(d, &back, 60000));
    CHECK(back == mb);
    loom_sched_destroy(&s);
    CHECK(loom_coord_draft_busy(d) == 0); /* the freed sequences let their slots go */
    loom_coord_draft_destroy(&d);
    loom_local_close(&ref);
}

/* The scheduler's clock in the probe test: each batch 1 ms, each drafted
 * token 3 ms more (a draft that never pays). */
struct fake_clock {
    uint64_t ns;
};

static uint64_t fake_now(void *ctx) {
    return ((struct fake_clock *)ctx)->ns;
}

/* Finishes a sequence at its max_tokens (the server's part). */
static void finish_at_max(void *ctx, loom_seq_t *q, int32_t id) {
    (void)id;
    if (q->n_tokens - q->n_prompt >= q->max_tokens) loom_sched_finish(ctx, q);
}

/* A probe of the gate, off, drafts after a window of each sequence: a
 * sequence that arrived while the gate was off (its history longer than
 * the window, never read by the draft) has its catch-up read 64 tokens. */
static void test_probe_window(void) {
    loom_coord_draft_t *d = open_draft();
    REQUIRE(d);
    loom_sched_t *s = make_sched(d);
    loom_spec_config_t c;
    loom_spec_config_defaults(&c);
    c.method = LOOM_SPEC_DRAFT;
    c.k = 3; /* adaptive, with the gate */
    loom_sched_set_spec(s, &c);
    struct fake_clock clk = {.ns = 1};
    loom_sched_set_clock(s, fake_now, &clk);
    const loom_sampling_t greedy = {.temperature = 0.0f, .top_p = 1.0f};
    int32_t prompt[70] = {1, 40, 70, 200, 91, 17};
    for (int i = 6; i < 70; i++) prompt[i] = 3 + (i * 37) % 500;
    loom_seq_t *q = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_sched_add(s, 1, prompt, 6, 100, 0, &greedy, NULL, &q, &err) == LOOM_OK);
    int spec_steps = 0, first_read = -1, first_hist = 0, probes_b = 0;
    for (int step = 0; step < 100; step++) {
        if (step == 30) { /* the gate is off by now: the second sequence's drafts come at the probe */
            REQUIRE(loom_sched_add(s, 2, prompt, 70, 50, 0, &greedy, NULL, &q, &err) == LOOM_OK);
        }
        loom_microbatch_t *mb = loom_sched_schedule(s), *back = NULL;
        if (!mb) break;
        const int probing = loom_sched_spec_probing(s);
        int drafted = 0;
        if (loom_coord_draft_submit(d, mb)) {
            REQUIRE(wait_take(d, &back, 60000));
            CHECK(back == mb);
            for (int si = 0; si < mb->n_seqs; si++) {
                drafted += mb->spec_n[si];
                if (probing && mb->seqs[si]->id == 2 && mb->spec_n[si] > 0) probes_b++;
            }
            if (first_read < 0) {
                first_read = loom_coord_draft_counters(d).last_read;
                first_hist = mb->seqs[0]->n_tokens;
            }
            spec_steps++;
        }
        clk.ns += 1000000ull + 3000000ull * (uint64_t)drafted;
        int32_t ids[512];
        step_ids(mb, 0, ids); /* every first draft rejected */
        loom_sched_complete(s, mb, ids, finish_at_max, s);
    }
    /* the first drafts, not a probe: the whole sequence */
    CHECKF(first_read == first_hist && first_hist > 6, "the first drafts read %d of %d tokens", first_read,
           first_hist);
    CHECKF(spec_steps >= 2 && spec_steps <= 10, "%d drafting steps", spec_steps);
    CHECKF(probes_b >= 1, "the second sequence drafted in %d probe steps", probes_b);
    /* its history at the probe was over 100 tokens */
    CHECKF(loom_coord_draft_counters(d).max_read == LOOM_SPEC_GATE_PROBE_WINDOW, "a catch-up read %d tokens",
           loom_coord_draft_counters(d).max_read);
    loom_sched_destroy(&s);
    loom_coord_draft_destroy(&d);
}

static void test_reactor_half_returns_at_once(void) {
    setenv("LOOM_TEST_DRAFT_DELAY_MS", "1500", 1);
    loom_coord_draft_t *d = open_draft();
    unsetenv("LOOM_TEST_DRAFT_DELAY_MS");
    REQUIRE(d);
    loom_sched_t *s = make_sched(d);
    add_seqs(s, 1);
    int32_t ids[64];
    loom_microbatch_t *mb = loom_sched_schedule(s), *back = NULL; /* the prefill */
    REQUIRE(mb && !loom_coord_draft_submit(d, mb));
    step_ids(mb, -1, ids);
    loom_sched_complete(s, mb, ids, NULL, NULL);
    mb = loom_sched_schedule(s);
    REQUIRE(mb && loom_coord_draft_submit(d, mb));
    /* the thread sleeps 1.5 s before it drafts: nothing is done yet, and
     * the placeholders are valid ids */
    CHECK(loom_coord_draft_take(d, &back) == 0);
    int t0 = mb->logit_rows[mb->spec_row0[0]];
    CHECK(mb->spec_n[0] == 3 && mb->tokens[t0 + 1] == mb->seqs[0]->tokens[mb->seqs[0]->n_tokens - 1]);
    REQUIRE(wait_take(d, &back, 60000));
    CHECK(back == mb && mb->draft_s >= 1.0); /* the forwards' time (the delay included) is the step's */
    step_ids(mb, -1, ids);
    loom_sched_complete(s, mb, ids, NULL, NULL);
    /* destroyed with a job queued: the thread stops, the job is freed */
    mb = loom_sched_schedule(s);
    REQUIRE(mb && loom_coord_draft_submit(d, mb));
    loom_sched_destroy(&s);
    loom_coord_draft_destroy(&d);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "%s/stories260K", models_dir());
    char cfg[4200];
    snprintf(cfg, sizeof cfg, "%s/config.json", g_dir);
    FILE *f = fopen(cfg, "r");
    if (!f) {
        printf("skipped: no stories260K in %s\n", models_dir());
        return 0;
    }
    fclose(f);
    RUN(test_drafts_as_in_the_scheduler);
    RUN(test_probe_window);
    RUN(test_reactor_half_returns_at_once);
    return test_summary();
}
