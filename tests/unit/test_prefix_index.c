/* The router's prefix index (block hash -> replicas, bounded, LRU-ish) and
 * the scores that pick a replica: prefix, least loaded, round robin. */
#include <stdint.h>
#include <stdlib.h>

#include "coordinator/kv_ledger.h"
#include "router/prefix_index.h"
#include "tests/test.h"

/* The same hashes as the coordinators' prefix cache, block by block. */
static void test_hashes_match_the_ledger(void) {
    int32_t ids[70];
    for (int i = 0; i < 70; i++)
        ids[i] = (i * 37 + 5) % 512;
    uint64_t h[8];
    int n = loom_prefix_hashes(ids, 70, 16, h, 8);
    CHECKF(n == 4, "70 tokens in blocks of 16: %d full blocks", n);
    uint64_t parent = 0;
    for (int k = 0; k < n; k++) {
        parent = loom_kv_chain_hash(parent, ids + k * 16, 16);
        CHECKF(h[k] == parent, "block %d", k);
    }
    CHECK(loom_prefix_hashes(ids, 70, 16, h, 2) == 2); /* bounded by max */
    CHECK(loom_prefix_hashes(ids, 15, 16, h, 8) == 0);
    /* a different first block changes every later hash (a chain) */
    uint64_t h2[8];
    ids[0]++;
    loom_prefix_hashes(ids, 70, 16, h2, 8);
    for (int k = 0; k < 4; k++)
        CHECKF(h2[k] != h[k], "block %d after a change in block 0", k);
}

static void test_match_counts_leading_blocks(void) {
    loom_prefix_index_t *ix = loom_prefix_index_create(1024);
    uint64_t a[5] = {11, 12, 13, 14, 15}, b[5] = {11, 12, 99, 98, 97};
    loom_prefix_index_insert(ix, a, 5, 0); /* replica 0 holds a */
    loom_prefix_index_insert(ix, b, 3, 2); /* replica 2 holds the first three of b */
    int m[4];
    loom_prefix_index_match(ix, a, 5, m, 4);
    CHECKF(m[0] == 5 && m[1] == 0 && m[2] == 2 && m[3] == 0, "a: %d %d %d %d", m[0], m[1], m[2],
           m[3]);
    loom_prefix_index_match(ix, b, 5, m, 4);
    CHECKF(m[0] == 2 && m[2] == 3, "b: %d %d", m[0], m[2]);
    /* a hole ends the match: block 13 evicted from replica 0 */
    loom_prefix_index_remove(ix, 13, 0);
    loom_prefix_index_match(ix, a, 5, m, 4);
    CHECKF(m[0] == 2, "after removing block 3: %d", m[0]);
    /* a replica that leaves holds nothing; the others keep theirs */
    loom_prefix_index_drop_replica(ix, 2);
    loom_prefix_index_match(ix, b, 5, m, 4);
    CHECKF(m[2] == 0 && m[0] == 2, "after dropping replica 2: %d %d", m[0], m[2]);
    /* dropping is lazy: entries stay until touched or aged out, but the bit never comes back */
    CHECKF(loom_prefix_index_size(ix) == 5, "entries left: %d",
           loom_prefix_index_size(ix)); /* 11 12 14 15 99 */
    uint64_t b0[3] = {11, 12, 99};
    loom_prefix_index_insert(ix, b0, 3, 0); /* another replica touches the entries replica 2 had */
    loom_prefix_index_match(ix, b, 5, m, 4);
    CHECKF(m[0] == 3 && m[2] == 0, "after replica 0 took b's blocks: %d %d", m[0], m[2]);
    loom_prefix_index_insert(ix, b, 1, 2); /* replica 2 comes back with block 11 only */
    loom_prefix_index_match(ix, b, 5, m, 4);
    CHECKF(m[2] == 1, "replica 2 again: %d", m[2]);
    loom_prefix_index_remove(ix, 99, 0); /* the last holder gone: the entry goes */
    CHECKF(loom_prefix_index_size(ix) == 4, "entries left: %d", loom_prefix_index_size(ix));
    loom_prefix_index_destroy(&ix);
    loom_prefix_index_destroy(&ix); /* twice is safe */
    CHECK(ix == NULL);
}

static void test_bounded_and_recent_first(void) {
    loom_prefix_index_t *ix = loom_prefix_index_create(64);
    uint64_t hot = 0xabcdef;
    for (uint64_t k = 1; k <= 10000; k++) {
        uint64_t h = k * 2654435761u + 1;
        loom_prefix_index_insert(ix, &h, 1, (int)(k % 3));
        if (k % 8 == 0) loom_prefix_index_insert(ix, &hot, 1, 1); /* touched often: kept */
        CHECKF(loom_prefix_index_size(ix) <= 64, "size %d at %llu", loom_prefix_index_size(ix),
               (unsigned long long)k);
    }
    int m[3];
    loom_prefix_index_match(ix, &hot, 1, m, 3);
    CHECKF(m[1] == 1, "the hot block was forgotten");
    uint64_t old = 1 * 2654435761u + 1, recent = 10000ull * 2654435761u + 1;
    loom_prefix_index_match(ix, &old, 1, m, 3);
    CHECK(m[1] == 0 && m[0] == 0 && m[2] == 0);
    loom_prefix_index_match(ix, &recent, 1, m, 3);
    CHECK(m[10000 % 3] == 1);
    /* every entry still findable after all the deletions (probe chains intact) */
    int found = 0;
    for (uint64_t k = 9000; k <= 10000; k++) {
        uint64_t h = k * 2654435761u + 1;
        loom_prefix_index_match(ix, &h, 1, m, 3);
        found += m[k % 3];
    }
    CHECKF(found >= 40 && found <= 64, "recent entries found: %d", found);
    loom_prefix_index_destroy(&ix);
}

static void test_prefix_score(void) {
    /* 128-token prompt, blocks of 16: replica 1 holds 6 blocks (96 tokens) */
    loom_route_cand_t c[3] = {
        {.usable = 1, .matched_blocks = 0},
        {.usable = 1, .matched_blocks = 6},
        {.usable = 1, .matched_blocks = 2},
    };
    CHECK(loom_route_cost(&c[1], 128, 16, 1.0) == 32.0);
    CHECK(loom_route_pick_prefix(c, 3, 128, 16, 1.0, 0) == 1);
    /* load outweighs the cache: 200 tokens in flight on replica 1 cost more than 96 uncached */
    c[1].inflight = 1;
    c[1].inflight_tokens = 200;
    CHECK(loom_route_cost(&c[1], 128, 16, 1.0) == 232.0);
    CHECK(loom_route_pick_prefix(c, 3, 128, 16, 1.0, 0) == 2); /* 96 uncached, idle */
    /* ... unless load counts for less */
    CHECK(loom_route_pick_prefix(c, 3, 128, 16, 0.1, 0) == 1);
    /* queued requests count LOOM_WAITING_TOKENS each; a nearly full KV cache is penalised */
    loom_route_cand_t w = {.usable = 1, .waiting = 2, .kv_usage = 0.95};
    double want = 128 + 2 * LOOM_WAITING_TOKENS + 128 * 10 * 0.05;
    CHECKF(loom_route_cost(&w, 128, 16, 1.0) - want < 1e-9 &&
               want - loom_route_cost(&w, 128, 16, 1.0) < 1e-9,
           "cost %g, want %g", loom_route_cost(&w, 128, 16, 1.0), want);
    /* blocks only a replica's KV tier holds cost their read: a pool hit wins
     * at equal load, a tier hit beats computing, and load still decides */
    loom_route_cand_t t[3] = {
        {.usable = 1, .matched_blocks = 6, .tier_blocks = 6, .tier_cost = 0.05},
        {.usable = 1, .matched_blocks = 6},
        {.usable = 1},
    };
    CHECK(loom_route_cost(&t[0], 128, 16, 1.0) == 32.0 + 0.05 * 96);
    CHECK(loom_route_pick_prefix(t, 3, 128, 16, 1.0, 0) == 1);
    t[1].usable = 0;
    CHECK(loom_route_pick_prefix(t, 3, 128, 16, 1.0, 0) == 0);
    t[1].usable = 1;
    t[1].inflight = 1;
    t[1].inflight_tokens = 10;
    CHECK(loom_route_pick_prefix(t, 3, 128, 16, 1.0, 0) == 0);
    t[0].tier_blocks = 2; /* 4 of its 6 blocks in its pool: only 2 read */
    CHECK(loom_route_cost(&t[0], 128, 16, 1.0) == 32.0 + 0.05 * 32);
    t[0].tier_blocks = 9; /* never more than the tokens matched */
    CHECK(loom_route_cost(&t[0], 64, 16, 1.0) == 0.05 * 64);
    /* matched blocks never count past the prompt */
    loom_route_cand_t big = {.usable = 1, .matched_blocks = 100};
    CHECK(loom_route_cost(&big, 40, 16, 1.0) == 0.0);
    /* unusable replicas are never picked; none usable: -1 */
    c[1].usable = c[2].usable = 0;
    CHECK(loom_route_pick_prefix(c, 3, 128, 16, 1.0, 0) == 0);
    c[0].usable = 0;
    CHECK(loom_route_pick_prefix(c, 3, 128, 16, 1.0, 0) == -1);
    CHECK(loom_route_pick_least_loaded(c, 3, 0) == -1);
    CHECK(loom_route_pick_round_robin(c, 3, 0) == -1);
}

static void test_ties_and_round_robin(void) {
    loom_route_cand_t c[3] = {{.usable = 1}, {.usable = 1}, {.usable = 1}};
    /* equal costs: round robin from rr */
    CHECK(loom_route_pick_prefix(c, 3, 64, 16, 1.0, 0) == 0);
    CHECK(loom_route_pick_prefix(c, 3, 64, 16, 1.0, 1) == 1);
    CHECK(loom_route_pick_prefix(c, 3, 64, 16, 1.0, 5) == 2);
    for (unsigned rr = 0; rr < 6; rr++)
        CHECK(loom_route_pick_round_robin(c, 3, rr) == (int)(rr % 3));
    c[1].usable = 0;
    CHECK(loom_route_pick_round_robin(c, 3, 1) == 2);
    c[1].usable = 1;
    /* least loaded: in flight plus waiting */
    c[0].inflight = 2;
    c[1].waiting = 1;
    c[2].inflight = 1;
    c[2].waiting = 1;
    CHECK(loom_route_pick_least_loaded(c, 3, 0) == 1);
    c[1].waiting = 3;
    CHECK(loom_route_pick_least_loaded(c, 3, 0) == 0 || loom_route_pick_least_loaded(c, 3, 0) == 2);
    CHECK(loom_route_pick_least_loaded(c, 3, 2) == 2); /* the tie goes to the first from rr */
}

typedef struct seen {
    uint64_t cached[8], evicted[8];
    int n_cached, n_evicted;
} seen_t;

static void observe(void *ctx, uint64_t hash, int cached) {
    seen_t *s = ctx;
    if (cached && s->n_cached < 8) s->cached[s->n_cached++] = hash;
    if (!cached && s->n_evicted < 8) s->evicted[s->n_evicted++] = hash;
}

/* The ledger tells its observer (the coordinator's KV events) of every
 * block hash it caches and evicts: what feeds a router's index. */
static void test_ledger_observer(void) {
    loom_kv_ledger_t *L = loom_kv_create(2, 4, 1);
    seen_t s = {0};
    loom_kv_set_observer(L, observe, &s);
    int32_t t1[4] = {1, 2, 3, 4}, t2[4] = {5, 6, 7, 8};
    uint64_t h1 = loom_kv_chain_hash(0, t1, 4), h2 = loom_kv_chain_hash(h1, t2, 4);
    int b1 = loom_kv_alloc(L), b2 = loom_kv_alloc(L);
    loom_kv_register(L, b1, h1, t1);
    loom_kv_register(L, b2, h2, t2);
    loom_kv_register(L, b2, h2, t2); /* again: no second event */
    CHECKF(s.n_cached == 2 && s.cached[0] == h1 && s.cached[1] == h2, "cached events: %d",
           s.n_cached);
    loom_kv_release(L, b1);
    loom_kv_release(L, b2);
    CHECK(s.n_evicted == 0);  /* released but still cached */
    int b = loom_kv_alloc(L); /* evicts the least recently used: b1 */
    CHECK(b == b1);
    CHECKF(s.n_evicted == 1 && s.evicted[0] == h1, "evicted events: %d", s.n_evicted);
    loom_kv_set_observer(L, NULL, NULL);
    loom_kv_alloc(L);
    CHECK(s.n_evicted == 1); /* no observer: nothing told */
    loom_kv_destroy(&L);
}

int main(void) {
    RUN(test_ledger_observer);
    RUN(test_hashes_match_the_ledger);
    RUN(test_match_counts_leading_blocks);
    RUN(test_bounded_and_recent_first);
    RUN(test_prefix_score);
    RUN(test_ties_and_round_robin);
    return test_summary();
}
