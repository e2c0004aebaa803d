/* The host tier's coordinator half (coordinator/kv_tier_host.c): the LRU of
 * chain hashes over n slots against a plain reference, match as the held
 * prefix, pins that keep a matched slot for its step, saves whose slot a
 * later save of the step took are dropped at plan time; and the scheduler
 * with it: saves get slots, a later prompt loads from the slots its blocks
 * were saved into. */
#include "coordinator/kv_tier_host.h"
#include "coordinator/sched.h"
#include "tests/test.h"

#include <stdlib.h>
#include <string.h>

/* Releases the step's pins (what the scheduler does once a plan is built). */
static void end_step(loom_kv_connector_t *c) {
    loom_kv_connector_plan(c, NULL, 0, NULL, NULL, 0, NULL, NULL, 0, NULL);
}

static void test_lru(void) {
    loom_kv_connector_t *c = loom_kv_host_connector_create();
    CHECK(loom_kv_connector_has_slots(c) && !strcmp(c->tier, "host"));
    CHECK(!loom_kv_connector_offer(c, 1)); /* no slots yet: nothing saved */
    loom_kv_host_connector_set_slots(c, 3);
    CHECK(loom_kv_connector_offer(c, 11) && loom_kv_connector_offer(c, 12) && loom_kv_connector_offer(c, 13));
    CHECK(loom_kv_host_connector_used(c) == 3 && loom_kv_host_connector_slots(c) == 3);
    CHECK(!loom_kv_connector_offer(c, 11)); /* held: not saved again, used again */
    int s12 = loom_kv_host_connector_slot_of(c, 12);
    CHECK(s12 >= 0 && s12 < 3);
    CHECK(loom_kv_connector_offer(c, 14)); /* 12 is the least recently used */
    CHECK(loom_kv_host_connector_slot_of(c, 12) == -1 && loom_kv_host_connector_slot_of(c, 14) == s12);
    CHECK(loom_kv_host_connector_slot_of(c, 11) >= 0 && loom_kv_host_connector_slot_of(c, 13) >= 0);
    loom_kv_host_connector_set_slots(c, 0); /* a grid without the tier: empty */
    CHECK(loom_kv_host_connector_slot_of(c, 11) == -1 && !loom_kv_connector_offer(c, 11));
    loom_kv_connector_destroy(&c);
}

/* match: the consecutive held blocks from n_local, never the last
 * position's; the matched slots are not reused until the step's plan. */
static void test_match_and_pins(void) {
    loom_kv_connector_t *c = loom_kv_host_connector_create();
    loom_kv_host_connector_set_slots(c, 3);
    for (uint64_t h = 1; h <= 3; h++) CHECK(loom_kv_connector_offer(c, h));
    end_step(c);
    int32_t toks[17] = {0};
    uint64_t hashes[4] = {1, 2, 9, 3};
    loom_kv_conn_req_t r = {.id = 1, .tokens = toks, .n_tokens = 17, .block_hashes = hashes, .block_size = 4};
    int async = 1;
    CHECK(loom_kv_connector_match(c, &r, 0, &async) == 8 && async == 0); /* 1, 2; 9 is not there */
    CHECK(loom_kv_connector_match(c, &r, 4, &async) == 4);
    hashes[2] = 3;
    r.n_tokens = 16; /* 4 full blocks; the last position's block runs: 3 at most */
    CHECK(loom_kv_connector_match(c, &r, 0, &async) == 12);
    r.n_tokens = 17;
    end_step(c);
    hashes[2] = 9;
    CHECK(loom_kv_connector_match(c, &r, 0, &async) == 8); /* pins 1 and 2 for this step */
    int s1 = loom_kv_host_connector_slot_of(c, 1), s2 = loom_kv_host_connector_slot_of(c, 2);
    int s3 = loom_kv_host_connector_slot_of(c, 3);
    CHECK(loom_kv_connector_offer(c, 5));  /* takes 3's slot, the only one not pinned */
    CHECK(loom_kv_connector_offer(c, 6));  /* takes 5's: saved this step, but not pinned */
    CHECK(loom_kv_host_connector_slot_of(c, 6) == s3 && loom_kv_host_connector_slot_of(c, 5) == -1);
    CHECK(loom_kv_host_connector_slot_of(c, 1) == s1 && loom_kv_host_connector_slot_of(c, 2) == s2);
    uint64_t save[2] = {5, 6}, load[2] = {1, 2};
    int32_t save_slot[2], load_slot[2];
    loom_kv_connector_plan(c, save, 2, save_slot, load, 2, load_slot, NULL, 0, NULL);
    CHECK(save_slot[0] == -1 && save_slot[1] == s3); /* 5's save is dropped: its slot went to 6 */
    CHECK(load_slot[0] == s1 && load_slot[1] == s2);
    /* the next step: the pins are gone, 1 (least recently used) goes first */
    CHECK(loom_kv_connector_offer(c, 7));
    CHECK(loom_kv_host_connector_slot_of(c, 7) == s1 && loom_kv_host_connector_slot_of(c, 1) == -1);
    /* every slot pinned: nothing is saved */
    hashes[0] = 7, hashes[1] = 2, hashes[2] = 6;
    CHECK(loom_kv_connector_match(c, &r, 0, &async) == 12);
    CHECK(!loom_kv_connector_offer(c, 8) && loom_kv_host_connector_slot_of(c, 8) == -1);
    loom_kv_connector_destroy(&c);
}

/* Many offers and matches over colliding hashes against a plain LRU list. */
static void test_against_reference(void) {
    enum { N = 37, KEYS = 300, OPS = 20000 };
    loom_kv_connector_t *c = loom_kv_host_connector_create();
    loom_kv_host_connector_set_slots(c, N);
    uint64_t ref[N]; /* most recently used first */
    int n_ref = 0;
    uint32_t rng = 12345;
    int32_t toks[8] = {0};
    for (int op = 0; op < OPS; op++) {
        rng = rng * 1103515245u + 12345u;
        uint64_t h = ((uint64_t)((rng >> 8) % KEYS) << 40) | 1; /* same low bits: the table collides */
        int at = -1;
        for (int i = 0; i < n_ref; i++)
            if (ref[i] == h) at = i;
        if ((rng >> 4) & 1) { /* a match of one block (touches it) */
            uint64_t hs[1] = {h};
            loom_kv_conn_req_t r = {.tokens = toks, .n_tokens = 8, .block_hashes = hs, .block_size = 4};
            int async;
            CHECK(loom_kv_connector_match(c, &r, 0, &async) == (at >= 0 ? 4 : 0));
            if (at < 0) {
                end_step(c);
                continue;
            }
        } else {
            CHECK(loom_kv_connector_offer(c, h) == (at < 0));
            if (at < 0) {
                at = n_ref < N ? n_ref++ : N - 1; /* the last one goes */
                ref[at] = h;
            }
        }
        memmove(ref + 1, ref, (size_t)at * sizeof *ref);
        ref[0] = h;
        end_step(c);
    }
    CHECK(loom_kv_host_connector_used(c) == n_ref);
    int seen[N] = {0};
    for (int k = 0; k < KEYS; k++) {
        uint64_t h = ((uint64_t)k << 40) | 1;
        int in = 0;
        for (int i = 0; i < n_ref; i++) in |= ref[i] == h;
        int s = loom_kv_host_connector_slot_of(c, h);
        CHECKF((s >= 0) == in, "key %d: slot %d, in the reference %d", k, s, in);
        if (s >= 0) CHECK(!seen[s]++);
    }
    loom_kv_connector_destroy(&c);
}

/* ---- the scheduler with the host tier --------------------------------- */

enum { TB = 4 };

static loom_microbatch_t *run_prompt(loom_sched_t *s, const int32_t *p, int n) {
    loom_sampling_t sp = {0};
    loom_err_t err = {0};
    loom_seq_t *q = NULL;
    CHECK(loom_sched_add(s, (uint64_t)p[0], p, n, 1, 0, &sp, NULL, &q, &err) == LOOM_OK);
    return loom_sched_schedule(s);
}

static void finish_mb(loom_sched_t *s, loom_microbatch_t *mb) {
    int32_t ids[8] = {0};
    loom_seq_t *seqs[8];
    int n = mb->n_seqs;
    memcpy(seqs, mb->seqs, (size_t)n * sizeof *seqs);
    loom_sched_complete(s, mb, ids, NULL, NULL);
    for (int i = 0; i < n; i++) loom_sched_finish(s, seqs[i]);
}

static void test_sched(void) {
    loom_sched_config_t sc = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 16, .max_model_len = 64,
                              .n_micro = 1, .block_size = TB, .n_blocks = 4, .prefix_cache = 1};
    loom_sched_t *s = loom_sched_create(&sc);
    loom_kv_connector_t *c = loom_kv_host_connector_create();
    loom_kv_host_connector_set_slots(c, 8);
    loom_sched_set_connector(s, c);
    int32_t a[9], b[13];
    for (int i = 0; i < 9; i++) a[i] = 10 + i;
    for (int i = 0; i < 13; i++) b[i] = 50 + i;
    loom_microbatch_t *mb = run_prompt(s, a, 9);
    if (!mb) return;
    CHECK(mb->n_saves == 0 && mb->n_loads == 0 && mb->save_slot != NULL);
    finish_mb(s, mb);
    mb = run_prompt(s, b, 13); /* a's two blocks evicted: saved into slots */
    if (!mb) return;
    CHECK(mb->n_saves == 2);
    int32_t a_slot[2] = {mb->save_slot[0], mb->save_slot[1]};
    CHECK(a_slot[0] >= 0 && a_slot[0] < 8 && a_slot[1] >= 0 && a_slot[1] < 8 && a_slot[0] != a_slot[1]);
    CHECK(loom_kv_host_connector_slot_of(c, mb->save_hash[0]) == a_slot[0]);
    uint64_t a_hash[2] = {mb->save_hash[0], mb->save_hash[1]};
    finish_mb(s, mb);
    mb = run_prompt(s, a, 9); /* a again: loaded from those slots; b's blocks saved into others */
    if (!mb) return;
    CHECK(mb->n_loads == 2 && mb->n_tokens == 1);
    for (int i = 0; i < 2; i++) CHECK(mb->load_hash[i] == a_hash[i] && mb->load_slot[i] == a_slot[i]);
    CHECK(mb->n_saves > 0);
    for (int i = 0; i < mb->n_saves; i++) CHECK(mb->save_slot[i] != a_slot[0] && mb->save_slot[i] != a_slot[1]);
    loom_sched_stats_t st;
    loom_sched_get_stats(s, &st);
    CHECK(st.tier_hits == 2 && st.tier_saves == 2 + (uint64_t)mb->n_saves);
    finish_mb(s, mb);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    loom_sched_destroy(&s);
    loom_kv_connector_destroy(&c);
}

int main(void) {
    RUN(test_lru);
    RUN(test_match_and_pins);
    RUN(test_against_reference);
    RUN(test_sched);
    return test_summary();
}
