/* The scheduler with LoRA adapter slots: a sequence whose adapter is not
 * resident is passed over (the ones behind it run) and keeps its place; it
 * holds a pin on its slot while admitted, released on finish and
 * preemption; each batch names every sequence's slot; the prefix cache
 * never shares blocks across adapters or across a reload with other
 * weights, and the KV events carry the adapter-seeded hash. */
#include <stdint.h>
#include <string.h>

#include "coordinator/kv_ledger.h"
#include "coordinator/lora_slots.h"
#include "coordinator/sched.h"
#include "tests/test.h"

#define B 4

static uint8_t g_dig[4][32];

static loom_sched_t *make(int max_seqs) {
    loom_sched_config_t c = {.max_num_seqs = max_seqs, .max_batched_tokens = 64, .max_queue = 64,
                             .max_model_len = 64, .n_micro = 1, .block_size = B, .n_blocks = 64,
                             .prefix_cache = 1};
    return loom_sched_create(&c);
}

static loom_seq_t *add(loom_sched_t *s, uint64_t id, const int32_t *prompt, int n, int max_tokens) {
    loom_err_t err = {0};
    loom_sampling_t sp = {.temperature = 0};
    loom_seq_t *q = NULL;
    CHECK(loom_sched_add(s, id, prompt, n, max_tokens, 0, &sp, NULL, &q, &err) == LOOM_OK);
    return q;
}

static int batch_has(const loom_microbatch_t *mb, const loom_seq_t *q, int32_t *slot) {
    for (int i = 0; i < mb->n_seqs; i++)
        if (mb->seqs[i] == q) {
            if (slot) *slot = mb->seq_lora[i];
            return 1;
        }
    return 0;
}

/* Runs a batch with every logit row sampling token 7. */
static void complete(loom_sched_t *s, loom_microbatch_t *mb) {
    int32_t ids[64];
    for (int i = 0; i < mb->n_logits; i++) ids[i] = 7;
    loom_sched_complete(s, mb, ids, NULL, NULL);
}

static void test_admission_waits_for_adapter(void) {
    loom_err_t err = {0};
    loom_lora_slots_t *ls = NULL;
    REQUIRE(loom_lora_slots_create(1, 8, &ls, &err) == LOOM_OK);
    int a = loom_lora_slots_add(ls, "a", "/a", "", g_dig[0], 8, &err);
    int b = loom_lora_slots_add(ls, "b", "/b", "", g_dig[1], 8, &err);
    REQUIRE(a >= 0 && b >= 0);
    loom_sched_t *s = make(8);
    loom_sched_set_lora_slots(s, ls);
    int32_t p[6] = {1, 2, 3, 4, 5, 6};
    loom_seq_t *qa = add(s, 1, p, 6, 4), *qbase = add(s, 2, p, 6, 4), *qb = add(s, 3, p, 6, 4);
    loom_sched_seq_set_lora(s, qa, a, g_dig[0]);
    loom_sched_seq_set_lora(s, qb, b, g_dig[1]);

    /* adapter a claims the only slot and loads: the base row behind it runs */
    loom_microbatch_t *mb = loom_sched_schedule(s);
    REQUIRE(mb != NULL);
    int32_t slot = 99;
    CHECK(!batch_has(mb, qa, NULL) && !batch_has(mb, qb, NULL));
    CHECK(batch_has(mb, qbase, &slot) && slot == -1);
    CHECK(!mb->any_lora);
    int pend[4];
    CHECK(loom_lora_slots_pending(ls, pend, 4) == 1 && pend[0] == 0);
    complete(s, mb);
    /* the load lands: a is admitted with slot 0, b waits (the slot is pinned) */
    loom_lora_slots_loaded(ls, 0, LOOM_OK, 0.1);
    mb = loom_sched_schedule(s);
    REQUIRE(mb != NULL);
    CHECK(batch_has(mb, qa, &slot) && slot == 0);
    CHECK(mb->any_lora);
    CHECK(!batch_has(mb, qb, NULL));
    CHECK(loom_lora_slots_slot(ls, 0)->pins == 1);
    complete(s, mb);
    /* a finishes: its pin goes; b's turn evicts a and loads b */
    loom_sched_finish(s, qa);
    CHECK(loom_lora_slots_slot(ls, 0)->pins == 0);
    mb = loom_sched_schedule(s);
    CHECK(mb == NULL || !batch_has(mb, qb, NULL));
    if (mb) complete(s, mb);
    CHECK(loom_lora_slots_pending(ls, pend, 4) == 1 && pend[0] == 0);
    loom_lora_slots_loaded(ls, 0, LOOM_OK, 0.1);
    mb = loom_sched_schedule(s);
    REQUIRE(mb != NULL);
    CHECK(batch_has(mb, qb, &slot) && slot == 0);
    complete(s, mb);
    /* preemption (the grid lost its KV) releases the pin */
    loom_sched_reset_kv(s, 64);
    CHECK(loom_lora_slots_slot(ls, 0)->pins == 0);
    CHECK(qb->lora_slot == -1);
    loom_sched_destroy(&s);
    loom_lora_slots_destroy(&ls);
}

/* Blocks published to the KV events of one prompt under an adapter. */
typedef struct {
    uint64_t h[16];
    int n;
} events_t;

static void observe(void *ctx, uint64_t hash, int cached) {
    events_t *e = ctx;
    if (cached && e->n < 16) e->h[e->n++] = hash;
}

/* Runs one sequence of the prompt under adapter digest d (-1: base) to its end; returns the tokens the
 * prefix cache served and the first block's hash in the KV events. */
static int run_one(loom_sched_t *s, loom_lora_slots_t *ls, int id, int d, uint64_t *first_hash, events_t *ev) {
    int32_t p[9] = {11, 12, 13, 14, 15, 16, 17, 18, 19};
    loom_seq_t *q = add(s, (uint64_t)(100 + ev->n), p, 9, 2);
    if (id >= 0) loom_sched_seq_set_lora(s, q, id, g_dig[d]);
    int pend[4], np;
    loom_microbatch_t *mb;
    int cached = -1;
    ev->n = 0; /* the blocks it registers are published as it runs */
    for (int guard = 0; guard < 20 && q->n_tokens < 11; guard++) {
        while ((np = loom_lora_slots_pending(ls, pend, 4)) > 0)
            for (int i = 0; i < np; i++) loom_lora_slots_loaded(ls, pend[i], LOOM_OK, 0.01);
        mb = loom_sched_schedule(s);
        if (!mb) continue;
        if (cached < 0 && batch_has(mb, q, NULL)) cached = q->n_computed;
        complete(s, mb);
    }
    loom_sched_finish(s, q);
    *first_hash = ev->n ? ev->h[0] : 0; /* 0: it registered nothing new (every block was a hit) */
    return cached;
}

static void test_prefix_cache_per_adapter(void) {
    loom_err_t err = {0};
    loom_lora_slots_t *ls = NULL;
    REQUIRE(loom_lora_slots_create(2, 8, &ls, &err) == LOOM_OK);
    int a = loom_lora_slots_add(ls, "a", "/a", "", g_dig[0], 8, &err);
    REQUIRE(a >= 0);
    loom_sched_t *s = make(4);
    loom_sched_set_lora_slots(s, ls);
    events_t ev = {0};
    loom_kv_set_observer(loom_sched_ledger(s), observe, &ev);
    uint64_t h_base, h_a, h_a2, h_r, h;
    CHECK(run_one(s, ls, -1, 0, &h_base, &ev) == 0);
    CHECK(run_one(s, ls, -1, 0, &h, &ev) == 8); /* the base model hits its own blocks */
    CHECK(run_one(s, ls, a, 0, &h_a, &ev) == 0);  /* another adapter: no hit */
    CHECK(run_one(s, ls, a, 0, &h_a2, &ev) == 8); /* the same adapter hits */
    CHECKF(h_base != 0 && h_a != 0 && h_base != h_a && h_a2 == 0, "hashes base %llx a %llx a again %llx",
           (unsigned long long)h_base, (unsigned long long)h_a, (unsigned long long)h_a2);
    /* "a" reloaded with other weights: a new digest, a new identity, 0 hits */
    int a2 = loom_lora_slots_add(ls, "a", "/a2", "", g_dig[1], 8, &err);
    REQUIRE(a2 >= 0);
    CHECK(run_one(s, ls, a2, 1, &h_r, &ev) == 0);
    CHECK(h_r != 0 && h_r != h_a && h_r != h_base);
    loom_sched_destroy(&s);
    loom_lora_slots_destroy(&ls);
}

int main(void) {
    for (int i = 0; i < 4; i++) memset(g_dig[i], 0x31 + i, 32);
    RUN(test_admission_waits_for_adapter);
    RUN(test_prefix_cache_per_adapter);
    return test_summary();
}
