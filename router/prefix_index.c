/* The router's prefix index (an open-addressing table from block hash to a
 * mask of replicas, with an approximate LRU through a ring of touches) and
 * the replica scores. See prefix_index.h. */
#include "router/prefix_index.h"

#include <stdlib.h>
#include <string.h>

#include "common/block_hash.h"
#include "common/util.h"

typedef struct entry {
    uint64_t hash;  /* 0: empty (chain hashes are never 0) */
    uint64_t mask;  /* replicas holding the block */
    uint64_t stamp; /* last touch */
} entry_t;

typedef struct touch {
    uint64_t hash, stamp;
} touch_t;

struct loom_prefix_index {
    entry_t *t;
    size_t cap; /* power of two, >= 2 * capacity */
    int n, capacity;
    touch_t *ring; /* touches, oldest at head */
    size_t ring_cap, head, len;
    uint64_t clock;
    /* drop_replica(r) in O(1): a bit r set in an entry last touched before
     * dropped[r] is stale (cleared when the entry is next touched). */
    uint64_t dropped[LOOM_PREFIX_MAX_REPLICAS];
};

/* The entry's mask without the bits of replicas dropped since its last touch. */
static uint64_t live_mask(const loom_prefix_index_t *ix, const entry_t *e) {
    uint64_t m = e->mask;
    for (uint64_t bits = m; bits; bits &= bits - 1) {
        int r = __builtin_ctzll(bits);
        if (ix->dropped[r] > e->stamp) m &= ~(1ull << r);
    }
    return m;
}

static size_t slot_of(const loom_prefix_index_t *ix, uint64_t h) {
    return (size_t)(h * 0x9e3779b97f4a7c15ull) & (ix->cap - 1);
}

loom_prefix_index_t *loom_prefix_index_create(int capacity) {
    if (capacity < 16) capacity = 16;
    loom_prefix_index_t *ix = loom_xcalloc(1, sizeof *ix);
    ix->capacity = capacity;
    ix->cap = 32;
    while (ix->cap < (size_t)capacity * 2)
        ix->cap <<= 1;
    ix->t = loom_xcalloc(ix->cap, sizeof *ix->t);
    ix->ring_cap = (size_t)capacity * 4;
    ix->ring = loom_xcalloc(ix->ring_cap, sizeof *ix->ring);
    return ix;
}

void loom_prefix_index_destroy(loom_prefix_index_t **ix_p) {
    if (!ix_p || !*ix_p) return;
    free((*ix_p)->t);
    free((*ix_p)->ring);
    free(*ix_p);
    *ix_p = NULL;
}

static entry_t *find(const loom_prefix_index_t *ix, uint64_t h) {
    for (size_t i = slot_of(ix, h);; i = (i + 1) & (ix->cap - 1)) {
        if (ix->t[i].hash == h) return &ix->t[i];
        if (!ix->t[i].hash) return NULL;
    }
}

/* Deletes the entry at slot i, shifting later entries of its run back. */
static void erase_at(loom_prefix_index_t *ix, size_t i) {
    size_t mask = ix->cap - 1;
    ix->t[i].hash = 0;
    ix->n--;
    for (size_t j = (i + 1) & mask; ix->t[j].hash; j = (j + 1) & mask) {
        size_t home = slot_of(ix, ix->t[j].hash);
        /* move j to i when home is not cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            ix->t[i] = ix->t[j];
            ix->t[j].hash = 0;
            i = j;
        }
    }
}

static void erase(loom_prefix_index_t *ix, entry_t *e) {
    erase_at(ix, (size_t)(e - ix->t));
}

/* Forgets the least recently touched entry (skipping stale touches). */
static void evict_one(loom_prefix_index_t *ix) {
    while (ix->len) {
        touch_t t = ix->ring[ix->head];
        ix->head = (ix->head + 1) % ix->ring_cap;
        ix->len--;
        entry_t *e = find(ix, t.hash);
        if (e && e->stamp == t.stamp) {
            erase(ix, e);
            return;
        }
    }
}

static void push_touch(loom_prefix_index_t *ix, uint64_t h, uint64_t stamp) {
    if (ix->len == ix->ring_cap) { /* the oldest touch goes; its entry, if still that old, too */
        touch_t t = ix->ring[ix->head];
        ix->head = (ix->head + 1) % ix->ring_cap;
        ix->len--;
        entry_t *e = find(ix, t.hash);
        if (e && e->stamp == t.stamp) erase(ix, e);
    }
    ix->ring[(ix->head + ix->len) % ix->ring_cap] = (touch_t){h, stamp};
    ix->len++;
}

void loom_prefix_index_insert(loom_prefix_index_t *ix, const uint64_t *hashes, int n, int rep) {
    LOOM_ASSERT(rep >= 0 && rep < LOOM_PREFIX_MAX_REPLICAS);
    for (int k = 0; k < n; k++) {
        uint64_t h = hashes[k];
        if (!h) continue;
        entry_t *e = find(ix, h);
        if (!e) {
            if (ix->n >= ix->capacity) evict_one(ix);
            size_t i = slot_of(ix, h);
            while (ix->t[i].hash)
                i = (i + 1) & (ix->cap - 1);
            e = &ix->t[i];
            e->hash = h;
            e->mask = 0;
            ix->n++;
        }
        e->mask = live_mask(ix, e) | 1ull << rep;
        e->stamp = ++ix->clock;
        push_touch(ix, h, e->stamp);
    }
}

void loom_prefix_index_remove(loom_prefix_index_t *ix, uint64_t hash, int rep) {
    entry_t *e = hash ? find(ix, hash) : NULL;
    if (!e) return;
    e->mask = live_mask(ix, e) & ~(1ull << rep);
    if (!e->mask) erase(ix, e);
}

void loom_prefix_index_drop_replica(loom_prefix_index_t *ix, int rep) {
    LOOM_ASSERT(rep >= 0 && rep < LOOM_PREFIX_MAX_REPLICAS);
    ix->dropped[rep] = ++ix->clock; /* O(1): the reactor calls this when a replica fails */
}

void loom_prefix_index_match(const loom_prefix_index_t *ix, const uint64_t *hashes, int n,
                             int *match, int n_reps) {
    uint64_t alive = n_reps >= 64 ? ~0ull : (1ull << n_reps) - 1;
    for (int r = 0; r < n_reps; r++)
        match[r] = 0;
    for (int k = 0; k < n && alive; k++) {
        const entry_t *e = find(ix, hashes[k]);
        alive &= e ? live_mask(ix, e) : 0;
        for (int r = 0; r < n_reps; r++)
            if (alive & (1ull << r)) match[r] = k + 1;
    }
}

int loom_prefix_index_size(const loom_prefix_index_t *ix) {
    return ix->n;
}

int loom_prefix_hashes(const int32_t *ids, int n, int block_size, uint64_t *out, int max) {
    return loom_prefix_hashes_seeded(ids, n, block_size, 0, out, max);
}

int loom_prefix_hashes_seeded(const int32_t *ids, int n, int block_size, uint64_t seed, uint64_t *out, int max) {
    if (block_size <= 0) return 0;
    int nb = n / block_size, k = 0;
    uint64_t parent = seed;
    for (; k < nb && k < max; k++) {
        parent = loom_kv_chain_hash(parent, ids + (size_t)k * (size_t)block_size, block_size);
        out[k] = parent;
    }
    return k;
}

double loom_route_cost(const loom_route_cand_t *c, int n_prompt, int block_size, double lambda) {
    double cached = (double)c->matched_blocks * block_size;
    if (cached > n_prompt) cached = n_prompt;
    double from_tier = (double)c->tier_blocks * block_size;
    if (from_tier > cached) from_tier = cached;
    double cost = (double)n_prompt - cached + c->tier_cost * from_tier +
                  lambda * ((double)c->inflight_tokens + LOOM_WAITING_TOKENS * (double)c->waiting);
    if (c->kv_usage > 0.9) cost += (double)n_prompt * 10.0 * (c->kv_usage - 0.9);
    return cost;
}

int loom_route_pick_prefix(const loom_route_cand_t *c, int n, int n_prompt, int block_size,
                           double lambda, unsigned rr) {
    int best = -1;
    double best_cost = 0;
    for (int k = 0; k < n; k++) {
        int i = (int)((rr + (unsigned)k) % (unsigned)n);
        if (!c[i].usable) continue;
        double cost = loom_route_cost(&c[i], n_prompt, block_size, lambda);
        if (best < 0 || cost < best_cost ||
            (cost == best_cost && c[i].inflight < c[best].inflight)) {
            best = i;
            best_cost = cost;
        }
    }
    return best;
}

int loom_route_pick_least_loaded(const loom_route_cand_t *c, int n, unsigned rr) {
    int best = -1;
    for (int k = 0; k < n; k++) {
        int i = (int)((rr + (unsigned)k) % (unsigned)n);
        if (!c[i].usable) continue;
        if (best < 0 || c[i].inflight + c[i].waiting < c[best].inflight + c[best].waiting) best = i;
    }
    return best;
}

int loom_route_pick_round_robin(const loom_route_cand_t *c, int n, unsigned rr) {
    for (int k = 0; k < n; k++) {
        int i = (int)((rr + (unsigned)k) % (unsigned)n);
        if (c[i].usable) return i;
    }
    return -1;
}
