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
    return n * r->block_size;
}

/* A slot for a new block: an empty one, else the least recently used one
 * not pinned by this step; -1 when every slot is pinned. */
static int take_slot(host_conn_t *h) {
    if (h->n_free > 0) return h->free_stack[--h->n_free];
    for (int s = h->tail; s >= 0; s = h->slots[s].prev)
        if (h->slots[s].pin != h->step) {
            table_del(h, s);
            list_unlink(h, s);
            h->slots[s].held = 0;
            h->used--;
            return s;
        }
    return -1;
}

static int host_offer(loom_kv_connector_t *c, uint64_t hash) {
    host_conn_t *h = (host_conn_t *)c;
    int s = find(h, hash);
    if (s >= 0) {
        touch(h, s); /* going down again: the last to go */
        return 0;
    }
    if ((s = take_slot(h)) < 0) return 0;
    h->slots[s] = (slot_t){.hash = hash, .prev = -1, .next = -1, .held = 1, .pin = 0};
    table_put(h, s);
    list_front(h, s);
    h->used++;
    return 1;
}

static void slots_of(const host_conn_t *h, const uint64_t *hashes, int n, int32_t *out) {
    for (int i = 0; i < n; i++) out[i] = find(h, hashes[i]);
}

static void host_plan(loom_kv_connector_t *c, const uint64_t *save, int n_save, int32_t *save_slot,
                      const uint64_t *load, int n_load, int32_t *load_slot, const uint64_t *after, int n_after,
                      int32_t *after_slot) {
    host_conn_t *h = (host_conn_t *)c;
    /* a save whose slot a later save of the step took is dropped; the
     * later one, done after it, leaves the slot as the map says */
    for (int i = 0; i < n_save; i++) {
        int s = find(h, save[i]);
        save_slot[i] = s;
        for (int j = i + 1; j < n_save && s >= 0; j++)
            if (save[j] == save[i]) save_slot[i] = s = -1; /* the same block saved twice: once is enough */
    }
    slots_of(h, load, n_load, load_slot);
    slots_of(h, after, n_after, after_slot);
    h->step++; /* this step's pins are released */
}

static void host_destroy(loom_kv_connector_t *c) {
    host_conn_t *h = (host_conn_t *)c;
    free(h->slots);
    free(h->free_stack);
    free(h->table);
    free(h);
}

static const loom_kv_connector_ops_t host_ops = {
    .match = host_match, .offer = host_offer, .plan = host_plan, .destroy = host_destroy};

loom_kv_connector_t *loom_kv_host_connector_create(void) {
    host_conn_t *h = loom_xcalloc(1, sizeof *h);
    h->base.ops = &host_ops;
    h->base.tier = "host";
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
