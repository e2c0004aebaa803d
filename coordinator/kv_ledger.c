/* KV block ledger: free stack, reference counts, LRU of cached blocks and an
 * open-addressing table from chain hash to block (see kv_ledger.h). */
#include "coordinator/kv_ledger.h"

#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "common/util.h"

#define NONE (-1)

struct loom_kv_ledger {
    int n, B, prefix_cache;
    int *ref;            /* (n) */
    uint8_t *cached;     /* (n) registered in the table */
    uint64_t *hash;      /* (n) chain hash while cached */
    int32_t *tokens;     /* (n, B) tokens while cached, to verify hits */
    int *free_stack;     /* (n) */
    int n_free;
    int *lru_prev, *lru_next; /* (n) unreferenced cached blocks, head = oldest */
    int lru_head, lru_tail, n_lru;
    int *table;          /* (cap) block ids or NONE; linear probing on hash */
    int cap;
    loom_kv_observer_fn observer; /* told of every hash cached and evicted (NULL: none) */
    void *observer_ctx;
    loom_kv_evict_fn evict;       /* told of each cached block alloc reuses (NULL: none) */
    void *evict_ctx;
};

void loom_kv_set_evict_hook(loom_kv_ledger_t *L, loom_kv_evict_fn fn, void *ctx) {
    L->evict = fn;
    L->evict_ctx = ctx;
}


void loom_kv_set_observer(loom_kv_ledger_t *L, loom_kv_observer_fn fn, void *ctx) {
    L->observer = fn;
    L->observer_ctx = ctx;
}

loom_kv_ledger_t *loom_kv_create(int n_blocks, int block_size, int prefix_cache) {
    loom_kv_ledger_t *L = loom_xcalloc(1, sizeof *L);
    L->n = n_blocks;
    L->B = block_size;
    L->prefix_cache = prefix_cache;
    L->ref = loom_xcalloc((size_t)n_blocks, sizeof *L->ref);
    L->cached = loom_xcalloc((size_t)n_blocks, 1);
    L->hash = loom_xcalloc((size_t)n_blocks, sizeof *L->hash);
    L->tokens = loom_xcalloc((size_t)n_blocks * (size_t)block_size, sizeof *L->tokens);
    L->free_stack = loom_xmalloc((size_t)n_blocks * sizeof *L->free_stack);
    for (int i = 0; i < n_blocks; i++) L->free_stack[i] = n_blocks - 1 - i; /* pop 0 first */
    L->n_free = n_blocks;
    L->lru_prev = loom_xmalloc((size_t)n_blocks * sizeof(int));
    L->lru_next = loom_xmalloc((size_t)n_blocks * sizeof(int));
    L->lru_head = L->lru_tail = NONE;
    L->cap = 16;
    while (L->cap < 2 * n_blocks) L->cap *= 2;
    L->table = loom_xmalloc((size_t)L->cap * sizeof *L->table);
    for (int i = 0; i < L->cap; i++) L->table[i] = NONE;
    return L;
}

void loom_kv_destroy(loom_kv_ledger_t **L_p) {
    if (!L_p || !*L_p) return;
    loom_kv_ledger_t *L = *L_p;
    *L_p = NULL;
    free(L->ref);
    free(L->cached);
    free(L->hash);
    free(L->tokens);
    free(L->free_stack);
    free(L->lru_prev);
    free(L->lru_next);
    free(L->table);
    free(L);
}

int loom_kv_n_blocks(const loom_kv_ledger_t *L) { return L->n; }
int loom_kv_block_size(const loom_kv_ledger_t *L) { return L->B; }
int loom_kv_n_free(const loom_kv_ledger_t *L) { return L->n_free + L->n_lru; }
int loom_kv_n_cached(const loom_kv_ledger_t *L) { return L->n_lru; }
int loom_kv_n_held(const loom_kv_ledger_t *L) { return L->n - L->n_free - L->n_lru; }
int loom_kv_ref(const loom_kv_ledger_t *L, int b) { return L->ref[b]; }
int loom_kv_is_cached(const loom_kv_ledger_t *L, int b) { return L->cached[b]; }

static void lru_unlink(loom_kv_ledger_t *L, int b) {
    int p = L->lru_prev[b], q = L->lru_next[b];
    if (p != NONE) L->lru_next[p] = q;
    else L->lru_head = q;
    if (q != NONE) L->lru_prev[q] = p;
    else L->lru_tail = p;
    L->n_lru--;
}

static void lru_push(loom_kv_ledger_t *L, int b) {
    L->lru_prev[b] = L->lru_tail;
    L->lru_next[b] = NONE;
    if (L->lru_tail != NONE) L->lru_next[L->lru_tail] = b;
    else L->lru_head = b;
    L->lru_tail = b;
    L->n_lru++;
}

static size_t slot_of(const loom_kv_ledger_t *L, uint64_t h) {
    return (size_t)(h ^ (h >> 29)) & (size_t)(L->cap - 1);
}

/* Removes block b from the table (backward-shift deletion keeps probes valid). */
static void table_remove(loom_kv_ledger_t *L, int b) {
    size_t mask = (size_t)L->cap - 1, i = slot_of(L, L->hash[b]);
    while (L->table[i] != b) {
        LOOM_ASSERT(L->table[i] != NONE);
        i = (i + 1) & mask;
    }
    for (;;) {
        L->table[i] = NONE;
        size_t j = i;
        for (;;) {
            j = (j + 1) & mask;
            int e = L->table[j];
            if (e == NONE) return;
            size_t home = slot_of(L, L->hash[e]);
            /* e may move to i if its home is not in (i, j] cyclically */
            int movable = i <= j ? (home <= i || home > j) : (home <= i && home > j);
            if (movable) {
                L->table[i] = e;
                i = j;
                break;
            }
        }
    }
}

int loom_kv_alloc(loom_kv_ledger_t *L) {
    int b;
    if (L->n_free > 0) {
        b = L->free_stack[--L->n_free];
    } else if (L->lru_head != NONE) {
        b = L->lru_head; /* evict the least recently used cached block */
        lru_unlink(L, b);
        table_remove(L, b);
        L->cached[b] = 0;
        if (L->observer) L->observer(L->observer_ctx, L->hash[b], 0);
        if (L->evict) L->evict(L->evict_ctx, b, L->hash[b]);
    } else {
        return NONE;
    }
    L->ref[b] = 1;
    return b;
}

void loom_kv_retain(loom_kv_ledger_t *L, int b) {
    LOOM_ASSERT(b >= 0 && b < L->n);
    if (L->ref[b] == 0) {
        LOOM_ASSERT(L->cached[b]);
        lru_unlink(L, b);
    }
    L->ref[b]++;
}

void loom_kv_release(loom_kv_ledger_t *L, int b) {
    LOOM_ASSERT(b >= 0 && b < L->n && L->ref[b] > 0);
    if (--L->ref[b] > 0) return;
    if (L->cached[b]) lru_push(L, b);
    else L->free_stack[L->n_free++] = b;
}

static int table_find(const loom_kv_ledger_t *L, uint64_t hash, const int32_t *tokens) {
    size_t mask = (size_t)L->cap - 1, i = slot_of(L, hash);
    for (;;) {
        int b = L->table[i];
        if (b == NONE) return NONE;
        if (L->hash[b] == hash && !memcmp(L->tokens + (size_t)b * L->B, tokens, (size_t)L->B * sizeof *tokens))
            return b;
        i = (i + 1) & mask;
    }
}

int loom_kv_lookup(loom_kv_ledger_t *L, uint64_t hash, const int32_t *tokens) {
    if (!L->prefix_cache) return NONE;
    int b = table_find(L, hash, tokens);
    if (b != NONE) loom_kv_retain(L, b);
    return b;
}

void loom_kv_register(loom_kv_ledger_t *L, int b, uint64_t hash, const int32_t *tokens) {
    if (!L->prefix_cache || L->cached[b]) return;
    if (table_find(L, hash, tokens) != NONE) return; /* same content already cached elsewhere */
    L->cached[b] = 1;
    L->hash[b] = hash;
    memcpy(L->tokens + (size_t)b * L->B, tokens, (size_t)L->B * sizeof *tokens);
    size_t mask = (size_t)L->cap - 1, i = slot_of(L, hash);
    while (L->table[i] != NONE) i = (i + 1) & mask;
    L->table[i] = b;
    if (L->observer) L->observer(L->observer_ctx, hash, 1);
}

int loom_kv_check(const loom_kv_ledger_t *L) {
    int held = 0, lru = 0, in_table = 0;
    for (int b = 0; b < L->n; b++) {
        if (L->ref[b] < 0) return 1;
        if (L->ref[b] > 0) held++;
    }
    for (int b = L->lru_head, prev = NONE; b != NONE; prev = b, b = L->lru_next[b]) {
        if (L->ref[b] != 0 || !L->cached[b] || L->lru_prev[b] != prev) return 2;
        if (++lru > L->n) return 3;
    }
    if (lru != L->n_lru) return 4;
    for (int i = 0; i < L->n_free; i++) {
        int b = L->free_stack[i];
        if (L->ref[b] != 0 || L->cached[b]) return 5;
    }
    if (held + lru + L->n_free != L->n) return 6;
    for (int i = 0; i < L->cap; i++) {
        int b = L->table[i];
        if (b == NONE) continue;
        in_table++;
        if (!L->cached[b] || table_find(L, L->hash[b], L->tokens + (size_t)b * L->B) != b) return 7;
    }
    int n_cached = 0;
    for (int b = 0; b < L->n; b++) n_cached += L->cached[b];
    if (in_table != n_cached) return 8;
    return 0;
}
