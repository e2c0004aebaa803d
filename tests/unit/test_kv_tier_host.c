/* The host tier's coordinator half (coordinator/kv_tier_host.c): the LRU of
 * chain hashes over n slots against a plain reference, match as the held
 * prefix, pins that keep a matched slot for its step, saves whose slot a
 * later save of the step took are dropped at plan time; and the scheduler
 * with it: saves get slots, a later prompt loads from the slots its blocks
 * were saved into. Over a lower tier (a stand-in for the directory): a
 * block the host tier gives up is written down before the save that
 * reuses its slot, in the plan's order (test_lower, test_sched_lower). */
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
    loom_kv_connector_t *c = loom_kv_host_connector_create(NULL);
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
    loom_kv_connector_t *c = loom_kv_host_connector_create(NULL);
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
    CHECK(save_slot[0] == LOOM_KV_SLOT_DROP && save_slot[1] == s3); /* 5's save is dropped: its slot went to 6 */
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

/* A stand-in for the directory: a set of hashes; offer adds (1 when new). */
typedef struct {
    loom_kv_connector_t base;
    uint64_t held[64];
    int n, offers;
} fake_lower_t;

static int fake_has(const fake_lower_t *f, uint64_t h) {
    for (int i = 0; i < f->n; i++)
        if (f->held[i] == h) return 1;
    return 0;
}

static int fake_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async) {
    fake_lower_t *f = (fake_lower_t *)c;
    *async = 0;
    int n = 0;
    for (int i = n_local / r->block_size; i < (r->n_tokens - 1) / r->block_size && fake_has(f, r->block_hashes[i]);
         i++)
        n++;
    return n * r->block_size;
}

static int fake_offer(loom_kv_connector_t *c, uint64_t h) {
    fake_lower_t *f = (fake_lower_t *)c;
    f->offers++;
    if (fake_has(f, h) || f->n == 64) return 0;
    f->held[f->n++] = h;
    return 1;
}

static void fake_destroy(loom_kv_connector_t *c) { free(c); }

static const loom_kv_connector_ops_t fake_ops = {.match = fake_match, .offer = fake_offer, .destroy = fake_destroy};

static fake_lower_t *fake_lower(int write_through) {
    fake_lower_t *f = calloc(1, sizeof *f);
    f->base.ops = &fake_ops;
    f->base.tier = "dir";
    f->base.write_through = write_through;
    return f;
}

/* The host tier over a lower one: the order of a step's saves when the
 * host tier gives blocks up, match across both, loads' slots. */
static void test_lower(void) {
    fake_lower_t *f = fake_lower(0);
    loom_kv_connector_t *c = loom_kv_host_connector_create(&f->base);
    CHECK(c->lower == &f->base && !c->write_through);
    loom_kv_host_connector_set_slots(c, 2);
    uint64_t spill = 99;
    CHECK(loom_kv_connector_evict(c, 1, &spill) == 1 && spill == 0);
    CHECK(loom_kv_connector_evict(c, 2, &spill) == 1 && spill == 0);
    CHECK(loom_kv_connector_evict(c, 2, &spill) == 0 && spill == 0); /* held: refreshed */
    uint64_t save[8];
    int32_t slot[8];
    save[0] = 1, save[1] = 2;
    loom_kv_connector_plan(c, save, 2, slot, NULL, 0, NULL, NULL, 0, NULL);
    int s1 = slot[0], s2 = slot[1];
    CHECK(s1 >= 0 && s2 >= 0 && s1 != s2 && f->n == 0); /* nothing went down yet */
    /* one step: 3, 4, 5 leave the pool. 3 takes 1's slot (1 goes down
     * first), 4 takes 2's (2 goes down), 5 takes 3's: 3 was saved into its
     * slot this step and goes down from it before 5 overwrites it */
    CHECK(loom_kv_connector_evict(c, 3, &spill) == 1 && spill == 1);
    CHECK(loom_kv_connector_evict(c, 4, &spill) == 1 && spill == 2);
    CHECK(loom_kv_connector_evict(c, 5, &spill) == 1 && spill == 3);
    CHECK(f->n == 3 && fake_has(f, 1) && fake_has(f, 2) && fake_has(f, 3));
    /* the scheduler's list, in that order: a spill (block -1) before the save that reuses its slot */
    uint64_t step[6] = {1, 3, 2, 4, 3, 5};
    loom_kv_connector_plan(c, step, 6, slot, NULL, 0, NULL, NULL, 0, NULL);
    CHECK(slot[0] == s1 && slot[1] == s1 && slot[2] == s2 && slot[3] == s2 && slot[4] == s1 && slot[5] == s1);
    CHECK(loom_kv_host_connector_slot_of(c, 5) == s1 && loom_kv_host_connector_slot_of(c, 4) == s2);
    /* a block the lower tier holds already is not written down again */
    CHECK(loom_kv_connector_evict(c, 6, &spill) == 1 && spill == 4); /* takes 4's slot */
    CHECK(loom_kv_connector_evict(c, 4, &spill) == 1 && spill == 5); /* takes 5's */
    CHECK(loom_kv_connector_evict(c, 5, &spill) == 1 && spill == 6); /* takes 6's */
    CHECK(loom_kv_connector_evict(c, 6, &spill) == 1 && spill == 0); /* takes 4's: below already */
    CHECK(f->n == 6);
    end_step(c);
    /* match: the host tier's run, then the lower tier's */
    int32_t toks[17] = {0};
    uint64_t hashes[4] = {5, 1, 2, 7};
    loom_kv_conn_req_t r = {.id = 1, .tokens = toks, .n_tokens = 17, .block_hashes = hashes, .block_size = 4};
    int async;
    CHECK(loom_kv_connector_match(c, &r, 0, &async) == 12); /* 5 in host memory, 1 and 2 below; 7 nowhere */
    /* every slot pinned (5 and 6 matched): a block leaving the pool goes straight down */
    hashes[1] = 6;
    CHECK(loom_kv_connector_match(c, &r, 0, &async) == 12);
    CHECK(loom_kv_connector_evict(c, 8, &spill) == 2 && spill == 0 && fake_has(f, 8));
    uint64_t load[3] = {5, 6, 1};
    int32_t load_slot[3], one_slot[1];
    uint64_t one[1] = {8};
    loom_kv_connector_plan(c, one, 1, one_slot, load, 3, load_slot, NULL, 0, NULL);
    CHECK(one_slot[0] == LOOM_KV_SLOT_LOWER);
    CHECK(load_slot[0] == loom_kv_host_connector_slot_of(c, 5) && load_slot[0] >= 0);
    CHECK(load_slot[1] == loom_kv_host_connector_slot_of(c, 6) && load_slot[1] >= 0);
    CHECK(load_slot[2] == LOOM_KV_SLOT_LOWER);
    /* offer (write-through's) goes to the lower tier */
    int offers = f->offers;
    CHECK(loom_kv_connector_offer(c, 9) && fake_has(f, 9) && f->offers == offers + 1);
    CHECK(loom_kv_host_connector_slot_of(c, 9) == -1);
    loom_kv_connector_destroy(&c); /* and the lower one (ASan: no leak) */
    /* no slots (a size that holds no block): blocks go straight down */
    f = fake_lower(0);
    c = loom_kv_host_connector_create(&f->base);
    loom_kv_host_connector_set_slots(c, 0);
    CHECK(loom_kv_connector_evict(c, 1, &spill) == 2 && spill == 0 && fake_has(f, 1));
    CHECK(loom_kv_connector_evict(c, 1, &spill) == 0);
    loom_kv_connector_plan(c, one, 1, one_slot, NULL, 0, NULL, NULL, 0, NULL);
    CHECK(one_slot[0] == LOOM_KV_SLOT_LOWER);
    loom_kv_connector_destroy(&c);
}

/* Write-through below: the lower tier has every block as computed; a
 * block leaving the pool still goes to the host tier, and one the host
 * tier gives up is not written down again. */
static void test_lower_write_through(void) {
    fake_lower_t *f = fake_lower(1);
    loom_kv_connector_t *c = loom_kv_host_connector_create(&f->base);
    CHECK(c->write_through);
    loom_kv_host_connector_set_slots(c, 1);
    for (uint64_t h = 1; h <= 3; h++) CHECK(loom_kv_connector_offer(c, h)); /* as computed: below */
    uint64_t spill = 99;
    CHECK(loom_kv_connector_evict(c, 1, &spill) == 1 && spill == 0);
    CHECK(loom_kv_connector_evict(c, 2, &spill) == 1 && spill == 0); /* 1 is below already */
    CHECK(loom_kv_host_connector_slot_of(c, 2) == 0 && loom_kv_host_connector_slot_of(c, 1) == -1);
    loom_kv_connector_destroy(&c);
}

/* Many offers and matches over colliding hashes against a plain LRU list. */
static void test_against_reference(void) {
    enum { N = 37, KEYS = 300, OPS = 20000 };
    loom_kv_connector_t *c = loom_kv_host_connector_create(NULL);
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
    loom_kv_connector_t *c = loom_kv_host_connector_create(NULL);
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

/* The scheduler with the host tier over a lower one: one slot, a pool of
 * four blocks. */
static void test_sched_lower(void) {
    loom_sched_config_t sc = {.max_num_seqs = 4, .max_batched_tokens = 64, .max_queue = 16, .max_model_len = 64,
                              .n_micro = 1, .block_size = TB, .n_blocks = 4, .prefix_cache = 1};
    loom_sched_t *s = loom_sched_create(&sc);
    fake_lower_t *f = fake_lower(0);
    loom_kv_connector_t *c = loom_kv_host_connector_create(&f->base);
    loom_kv_host_connector_set_slots(c, 1);
    loom_sched_set_connector(s, c);
    int32_t a[9], b[13];
    for (int i = 0; i < 9; i++) a[i] = 10 + i;
    for (int i = 0; i < 13; i++) b[i] = 50 + i;
    loom_microbatch_t *mb = run_prompt(s, a, 9);
    if (!mb) return;
    finish_mb(s, mb);
    /* b evicts a's two blocks: a0 into the slot, then a0 written down from
     * the slot before a1 is saved into it */
    mb = run_prompt(s, b, 13);
    if (!mb) return;
    CHECKF(mb->n_saves == 3, "%d saves", mb->n_saves);
    if (mb->n_saves != 3) return;
    uint64_t a0 = mb->save_hash[0], a1 = mb->save_hash[2];
    CHECK(mb->save_block[0] >= 0 && mb->save_slot[0] == 0);
    CHECK(mb->save_block[1] == -1 && mb->save_hash[1] == a0 && mb->save_slot[1] == 0);
    CHECK(mb->save_block[2] >= 0 && mb->save_slot[2] == 0 && a1 != a0);
    CHECK(fake_has(f, a0) && !fake_has(f, a1) && loom_kv_host_connector_slot_of(c, a1) == 0);
    finish_mb(s, mb);
    /* a again: a0 from below, a1 from the slot (pinned: b's blocks go straight down) */
    mb = run_prompt(s, a, 9);
    if (!mb) return;
    CHECK(mb->n_loads == 2 && mb->n_tokens == 1);
    if (mb->n_loads != 2) return;
    CHECK(mb->load_hash[0] == a0 && mb->load_slot[0] == LOOM_KV_SLOT_LOWER);
    CHECK(mb->load_hash[1] == a1 && mb->load_slot[1] == 0);
    CHECK(mb->n_saves == 2);
    for (int i = 0; i < mb->n_saves; i++)
        CHECK(mb->save_block[i] >= 0 && mb->save_slot[i] == LOOM_KV_SLOT_LOWER && fake_has(f, mb->save_hash[i]));
    loom_sched_stats_t st;
    loom_sched_get_stats(s, &st);
    CHECK(st.tier_hits == 2 && st.lower_hits == 1);
    CHECK(st.tier_saves == 5 && st.lower_saves == 3);
    finish_mb(s, mb);
    CHECK(loom_kv_check(loom_sched_ledger(s)) == 0);
    loom_sched_destroy(&s);
    loom_kv_connector_destroy(&c);
}

int main(void) {
    RUN(test_lru);
    RUN(test_match_and_pins);
    RUN(test_lower);
    RUN(test_lower_write_through);
    RUN(test_against_reference);
    RUN(test_sched);
    RUN(test_sched_lower);
    return test_summary();
}
