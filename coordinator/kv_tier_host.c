/* The host-memory tier's coordinator half (kv_tier_host.h).
 *
 * State: n slots, each empty or holding one chain hash; an open-addressing
 * table hash -> slot (linear probing, deletion by backward shift); a
 * doubly linked list of the held slots, most recently used first; a stack
 * of the empty ones. A slot's `pin` is the step number it was matched in:
 * while it equals the step being planned, offer does not reuse it.
 * Invariants: used + free = n; a held slot is in the table and the list
 * exactly once; an empty one in neither. */
#include "coordinator/kv_tier_host.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

typedef struct {
    uint64_t hash;
    int prev, next; /* the LRU list (-1: none) */
    int held;
    uint64_t pin;
} slot_t;

typedef struct {
    loom_kv_connector_t base; /* first: the connector's address is the tier's */
    int n, used, n_free;
    slot_t *slots;
    int *free_stack;
    int head, tail;   /* most and least recently used held slots */
    int32_t *table;   /* (cap) slot index, -1 empty */
    uint32_t cap;     /* a power of two, >= 2n */
    uint64_t step;    /* the step being planned (pins equal to it hold) */
    /* with a lower tier: the slot of each save offered since the last
     * plan, in the order the scheduler lists them (a spill, block -1, then
     * the save that takes its slot); a save's block may leave its slot
     * again within the step, so the plan cannot ask the map */
    int32_t *log;
    int n_log, cap_log;
    uint64_t lower_queries; /* blocks the lower tier was asked beyond the host tier's run (hits, misses) */
} host_conn_t;

static uint32_t bucket(const host_conn_t *h, uint64_t hash) {
    hash ^= hash >> 33;
    hash *= 0xff51afd7ed558ccdull;
    hash ^= hash >> 33;
    return (uint32_t)hash & (h->cap - 1);
}

static int find(const host_conn_t *h, uint64_t hash) {
    if (!h->cap) return -1;
    for (uint32_t i = bucket(h, hash);; i = (i + 1) & (h->cap - 1)) {
        int s = h->table[i];
        if (s < 0) return -1;
        if (h->slots[s].hash == hash) return s;
    }
}

static void table_put(host_conn_t *h, int s) {
    uint32_t i = bucket(h, h->slots[s].hash);
    while (h->table[i] >= 0) i = (i + 1) & (h->cap - 1);
    h->table[i] = s;
}

/* Removes slot s's entry, shifting back the entries that probed past it. */
static void table_del(host_conn_t *h, int s) {
    uint32_t i = bucket(h, h->slots[s].hash);
    while (h->table[i] != s) i = (i + 1) & (h->cap - 1);
    for (uint32_t j = (i + 1) & (h->cap - 1); h->table[j] >= 0; j = (j + 1) & (h->cap - 1)) {
        uint32_t home = bucket(h, h->slots[h->table[j]].hash);
        /* the entry at j may fill the hole at i when its home is not in (i, j] */
        if (((j - home) & (h->cap - 1)) >= ((j - i) & (h->cap - 1))) {
            h->table[i] = h->table[j];
            i = j;
        }
    }
    h->table[i] = -1;
}

static void list_unlink(host_conn_t *h, int s) {
    slot_t *x = &h->slots[s];
    if (x->prev >= 0) h->slots[x->prev].next = x->next;
    else h->head = x->next;
    if (x->next >= 0) h->slots[x->next].prev = x->prev;
    else h->tail = x->prev;
    x->prev = x->next = -1;
}

static void list_front(host_conn_t *h, int s) {
    slot_t *x = &h->slots[s];
    x->prev = -1;
    x->next = h->head;
    if (h->head >= 0) h->slots[h->head].prev = s;
    h->head = s;
    if (h->tail < 0) h->tail = s;
}

static void touch(host_conn_t *h, int s) {
    list_unlink(h, s);
    list_front(h, s);
}

static int host_match(loom_kv_connector_t *c, const loom_kv_conn_req_t *r, int n_local, int *async) {
    host_conn_t *h = (host_conn_t *)c;
    *async = 0;
    int first = n_local / r->block_size, last = (r->n_tokens - 1) / r->block_size, n = 0;
    for (int i = first; i < last; i++) {
        int s = find(h, r->block_hashes[i]);
        if (s < 0) break;
        touch(h, s);
        h->slots[s].pin = h->step; /* it may be loaded by this step: not reused before its plan */
        n++;
    }
    if (c->lower && first + n < last) {
        /* the rest of the run from the tier below */
        int a = 0, got = loom_kv_connector_match(c->lower, r, (first + n) * r->block_size, &a) / r->block_size;
        h->lower_queries += (uint64_t)(got + (first + n + got < last)); /* those it had, and the miss it stopped at */
        n += got;
    }
    return n * r->block_size;
}

/* A slot for a new block: an empty one, else the least recently used one
 * not pinned by this step; -1 when every slot is pinned. */
static int take_slot(host_conn_t *h, uint64_t *displaced) {
    *displaced = 0;
    if (h->n_free > 0) return h->free_stack[--h->n_free];
    for (int s = h->tail; s >= 0; s = h->slots[s].prev)
        if (h->slots[s].pin != h->step) {
            *displaced = h->slots[s].hash;
            table_del(h, s);
            list_unlink(h, s);
            h->slots[s].held = 0;
            h->used--;
            return s;
        }
    return -1;
}

/* Puts hash in a slot: the slot, -1 when it is held already (refreshed) or
 * no slot is free of this step's pins; *displaced is the block the slot
 * held (0: none). */
static int put(host_conn_t *h, uint64_t hash, uint64_t *displaced) {
    *displaced = 0;
    int s = find(h, hash);
    if (s >= 0) {
        touch(h, s); /* going down again: the last to go */
        return -1;
    }
    if ((s = take_slot(h, displaced)) < 0) return -1;
    h->slots[s] = (slot_t){.hash = hash, .prev = -1, .next = -1, .held = 1, .pin = 0};
    table_put(h, s);
    list_front(h, s);
    h->used++;
    return s;
}

/* Write-back without a lower tier; with one, offer is write-through's
 * (a block as it is computed), which goes to the lower tier. */
static int host_offer(loom_kv_connector_t *c, uint64_t hash) {
    if (c->lower) return loom_kv_connector_offer(c->lower, hash);
    uint64_t displaced;
    return put((host_conn_t *)c, hash, &displaced) >= 0;
}

static void log_push(host_conn_t *h, int32_t slot) {
    if (h->n_log == h->cap_log) {
        h->cap_log = h->cap_log ? 2 * h->cap_log : 16;
        h->log = loom_xrealloc(h->log, (size_t)h->cap_log * sizeof *h->log);
    }
    h->log[h->n_log++] = slot;
}

/* Write-back with a lower tier: the block goes to a slot; the block that
 * slot held goes down first when the lower tier lacks it (the workers do
 * the plan's saves in order: the slot is written out before it is
 * overwritten). No slot free of this step's pins (or no slot at all):
 * the block goes down itself. */
static int host_evict(loom_kv_connector_t *c, uint64_t hash, uint64_t *spill) {
    host_conn_t *h = (host_conn_t *)c;
    *spill = 0;
    if (!c->lower) return c->write_through ? 0 : host_offer(c, hash);
    if (find(h, hash) >= 0) {
        touch(h, find(h, hash));
        return 0;
    }
    if (h->n_free == 0) {
        /* which slot put would take, before it is taken: its block goes down */
        int s = h->tail;
        while (s >= 0 && h->slots[s].pin == h->step) s = h->slots[s].prev;
        if (s < 0) {
            if (!loom_kv_connector_offer(c->lower, hash)) return 0;
            log_push(h, LOOM_KV_SLOT_LOWER);
            return 2;
        }
        if (loom_kv_connector_offer(c->lower, h->slots[s].hash)) {
            *spill = h->slots[s].hash;
            log_push(h, s);
        }
    }
    uint64_t displaced;
    int s = put(h, hash, &displaced);
    if (s < 0) return 0; /* (not reached: a slot was free of pins) */
    log_push(h, s);
    return 1;
}

static void slots_of(const host_conn_t *h, const uint64_t *hashes, int n, int32_t *out) {
    for (int i = 0; i < n; i++) out[i] = find(h, hashes[i]);
}

static void host_plan(loom_kv_connector_t *c, const uint64_t *save, int n_save, int32_t *save_slot,
                      const uint64_t *load, int n_load, int32_t *load_slot, const uint64_t *after, int n_after,
                      int32_t *after_slot) {
    host_conn_t *h = (host_conn_t *)c;
    if (c->lower) {
        /* every save keeps the slot it was offered (in order, a spill before
         * the save that reuses its slot); a load from a slot the map holds
         * (matched this step: pinned), else from the lower tier */
        for (int i = 0; i < n_save; i++)
            save_slot[i] = h->n_log == n_save ? h->log[i] : LOOM_KV_SLOT_DROP;
        h->n_log = 0;
        for (int i = 0; i < n_load; i++) {
            load_slot[i] = find(h, load[i]);
            if (load_slot[i] < 0) load_slot[i] = LOOM_KV_SLOT_LOWER;
        }
        for (int i = 0; i < n_after; i++) after_slot[i] = LOOM_KV_SLOT_LOWER; /* write-through: the directory */
        (void)after;
        h->step++;
        return;
    }
    /* a save whose slot a later save of the step took is dropped; the
     * later one, done after it, leaves the slot as the map says */
    for (int i = 0; i < n_save; i++) {
        int s = find(h, save[i]);
        for (int j = i + 1; j < n_save && s >= 0; j++)
            if (save[j] == save[i]) s = -1; /* the same block saved twice: once is enough */
        save_slot[i] = s >= 0 ? s : LOOM_KV_SLOT_DROP;
    }
    slots_of(h, load, n_load, load_slot);
    slots_of(h, after, n_after, after_slot);
    for (int i = 0; i < n_after; i++)
        if (after_slot[i] < 0) after_slot[i] = LOOM_KV_SLOT_DROP;
    h->step++; /* this step's pins are released */
}

static void host_destroy(loom_kv_connector_t *c) {
    host_conn_t *h = (host_conn_t *)c;
    free(h->slots);
    free(h->free_stack);
    free(h->table);
    free(h->log);
    free(h);
}

static const loom_kv_connector_ops_t host_ops = {
    .match = host_match, .offer = host_offer, .evict = host_evict, .plan = host_plan, .destroy = host_destroy};

loom_kv_connector_t *loom_kv_host_connector_create(loom_kv_connector_t *lower) {
    host_conn_t *h = loom_xcalloc(1, sizeof *h);
    h->base.ops = &host_ops;
    h->base.tier = "host";
    h->base.lower = lower;
    h->base.write_through = lower ? lower->write_through : 0;
    h->head = h->tail = -1;
    h->step = 1;
    return &h->base;
}

void loom_kv_host_connector_set_slots(loom_kv_connector_t *c, int n_slots) {
    host_conn_t *h = (host_conn_t *)c;
    if (n_slots < 0) n_slots = 0;
    free(h->slots);
    free(h->free_stack);
    free(h->table);
    h->n = n_slots;
    h->used = 0;
    h->head = h->tail = -1;
    h->slots = loom_xcalloc((size_t)(n_slots ? n_slots : 1), sizeof *h->slots);
    h->free_stack = loom_xcalloc((size_t)(n_slots ? n_slots : 1), sizeof *h->free_stack);
    for (int i = 0; i < n_slots; i++) {
        h->slots[i].prev = h->slots[i].next = -1;
        h->free_stack[i] = n_slots - 1 - i; /* slot 0 first */
    }
    h->n_free = n_slots;
    h->n_log = 0;
    h->cap = 0;
    h->table = NULL;
    if (n_slots > 0) {
        h->cap = 2;
        while (h->cap < 2u * (uint32_t)n_slots) h->cap <<= 1;
        h->table = loom_xmalloc((size_t)h->cap * sizeof *h->table);
        memset(h->table, 0xff, (size_t)h->cap * sizeof *h->table);
    }
}

int loom_kv_host_connector_used(const loom_kv_connector_t *c) { return ((const host_conn_t *)c)->used; }
int loom_kv_host_connector_slots(const loom_kv_connector_t *c) { return ((const host_conn_t *)c)->n; }

int loom_kv_host_connector_slot_of(const loom_kv_connector_t *c, uint64_t hash) {
    return find((const host_conn_t *)c, hash);
}

uint64_t loom_kv_host_connector_lower_queries(const loom_kv_connector_t *c) {
    return ((const host_conn_t *)c)->lower_queries;
}
