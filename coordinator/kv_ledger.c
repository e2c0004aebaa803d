/* KV block ledger: free stacks, reference counts, LRUs of cached blocks (one
 * of each a partition) and an open-addressing table from chain hash to
 * block shared by the partitions (see kv_ledger.h). */
#include "coordinator/kv_ledger.h"

#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "common/util.h"

#define NONE (-1)

#define ANY_PART (-1)

/* One partition's free stack (its slice of free_stack) and LRU. */
typedef struct part {
    int n_free;
    int lru_head, lru_tail, n_lru; /* unreferenced cached blocks, head = oldest */
} part_t;

struct loom_kv_ledger {
    int n, B, prefix_cache;
    int n_parts, P;      /* partitions of P blocks each */
    part_t *parts;       /* (n_parts) */
    int *ref;            /* (n) */
    uint8_t *cached;     /* (n) registered in the table */
    uint64_t *hash;      /* (n) chain hash while cached */
    int32_t *tokens;     /* (n, B) tokens while cached, to verify hits */
    int *free_stack;     /* (n) partition p's stack is [p*P, p*P + parts[p].n_free) */
    int n_free, n_lru;   /* summed over the partitions */
    int *lru_prev, *lru_next; /* (n) */
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
    return loom_kv_create_parts(n_blocks, block_size, prefix_cache, 1);
}

loom_kv_ledger_t *loom_kv_create_parts(int n_blocks, int block_size, int prefix_cache, int n_parts) {
    LOOM_ASSERT(n_parts >= 1 && n_blocks % n_parts == 0);
    loom_kv_ledger_t *L = loom_xcalloc(1, sizeof *L);
    L->n = n_blocks;
    L->B = block_size;
    L->prefix_cache = prefix_cache;
    L->n_parts = n_parts;
    L->P = n_blocks / n_parts;
    L->parts = loom_xcalloc((size_t)n_parts, sizeof *L->parts);
    L->ref = loom_xcalloc((size_t)n_blocks, sizeof *L->ref);
    L->cached = loom_xcalloc((size_t)n_blocks, 1);
    L->hash = loom_xcalloc((size_t)n_blocks, sizeof *L->hash);
    L->tokens = loom_xcalloc((size_t)n_blocks * (size_t)block_size, sizeof *L->tokens);
    L->free_stack = loom_xmalloc((size_t)n_blocks * sizeof *L->free_stack);
    for (int p = 0; p < n_parts; p++) {
        part_t *pt = &L->parts[p];
        for (int i = 0; i < L->P; i++) L->free_stack[p * L->P + i] = (p + 1) * L->P - 1 - i; /* pop the lowest first */
        pt->n_free = L->P;
        pt->lru_head = pt->lru_tail = NONE;
    }
    L->n_free = n_blocks;
    L->lru_prev = loom_xmalloc((size_t)n_blocks * sizeof(int));
    L->lru_next = loom_xmalloc((size_t)n_blocks * sizeof(int));
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
    free(L->parts);
    free(L);
}

int loom_kv_n_blocks(const loom_kv_ledger_t *L) { return L->n; }
int loom_kv_block_size(const loom_kv_ledger_t *L) { return L->B; }
int loom_kv_n_free(const loom_kv_ledger_t *L) { return L->n_free + L->n_lru; }
int loom_kv_n_cached(const loom_kv_ledger_t *L) { return L->n_lru; }
int loom_kv_n_held(const loom_kv_ledger_t *L) { return L->n - L->n_free - L->n_lru; }
int loom_kv_ref(const loom_kv_ledger_t *L, int b) { return L->ref[b]; }
int loom_kv_n_parts(const loom_kv_ledger_t *L) { return L->n_parts; }
int loom_kv_part_of(const loom_kv_ledger_t *L, int b) { return b / L->P; }
int loom_kv_part_free(const loom_kv_ledger_t *L, int p) { return L->parts[p].n_free + L->parts[p].n_lru; }
int loom_kv_part_held(const loom_kv_ledger_t *L, int p) {
    return L->P - L->parts[p].n_free - L->parts[p].n_lru;
}
int loom_kv_is_cached(const loom_kv_ledger_t *L, int b) { return L->cached[b]; }

static void lru_unlink(loom_kv_ledger_t *L, int b) {
    part_t *pt = &L->parts[b / L->P];
    int p = L->lru_prev[b], q = L->lru_next[b];
    if (p != NONE) L->lru_next[p] = q;
    else pt->lru_head = q;
    if (q != NONE) L->lru_prev[q] = p;
    else pt->lru_tail = p;
    pt->n_lru--;
    L->n_lru--;
}

static void lru_push(loom_kv_ledger_t *L, int b) {
    part_t *pt = &L->parts[b / L->P];
    L->lru_prev[b] = pt->lru_tail;
    L->lru_next[b] = NONE;
    if (pt->lru_tail != NONE) L->lru_next[pt->lru_tail] = b;
    else pt->lru_head = b;
    pt->lru_tail = b;
    pt->n_lru++;
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

static int table_find(const loom_kv_ledger_t *L, int part, uint64_t hash, const int32_t *tokens);

int loom_kv_alloc(loom_kv_ledger_t *L) { return loom_kv_alloc_in(L, 0); }

int loom_kv_alloc_in(loom_kv_ledger_t *L, int part) {
    LOOM_ASSERT(part >= 0 && part < L->n_parts);
    part_t *pt = &L->parts[part];
    int b;
    if (pt->n_free > 0) {
        b = L->free_stack[part * L->P + --pt->n_free];
        L->n_free--;
    } else if (pt->lru_head != NONE) {
        b = pt->lru_head; /* evict the partition's least recently used cached block */
        lru_unlink(L, b);
        table_remove(L, b);
        L->cached[b] = 0;
        const int32_t *t = L->tokens + (size_t)b * L->B; /* the hash leaves with its last copy */
        if (L->observer && table_find(L, ANY_PART, L->hash[b], t) == NONE)
            L->observer(L->observer_ctx, L->hash[b], 0);
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
    if (L->cached[b]) {
        lru_push(L, b);
    } else {
        int p = b / L->P;
        L->free_stack[p * L->P + L->parts[p].n_free++] = b;
        L->n_free++;
    }
}

/* The cached block of partition part (ANY_PART: of any) holding these tokens under this hash. */
static int table_find(const loom_kv_ledger_t *L, int part, uint64_t hash, const int32_t *tokens) {
    size_t mask = (size_t)L->cap - 1, i = slot_of(L, hash);
    for (;;) {
        int b = L->table[i];
        if (b == NONE) return NONE;
        if (L->hash[b] == hash && (part == ANY_PART || b / L->P == part) &&
            !memcmp(L->tokens + (size_t)b * L->B, tokens, (size_t)L->B * sizeof *tokens))
            return b;
        i = (i + 1) & mask;
    }
}

int loom_kv_lookup(loom_kv_ledger_t *L, uint64_t hash, const int32_t *tokens) {
    return loom_kv_lookup_in(L, 0, hash, tokens);
}

int loom_kv_peek_in(const loom_kv_ledger_t *L, int part, uint64_t hash, const int32_t *tokens) {
    LOOM_ASSERT(part >= 0 && part < L->n_parts);
    return L->prefix_cache ? table_find(L, part, hash, tokens) : NONE;
}

int loom_kv_lookup_in(loom_kv_ledger_t *L, int part, uint64_t hash, const int32_t *tokens) {
    int b = loom_kv_peek_in(L, part, hash, tokens);
    if (b != NONE) loom_kv_retain(L, b);
    return b;
}

void loom_kv_register(loom_kv_ledger_t *L, int b, uint64_t hash, const int32_t *tokens) {
    if (!L->prefix_cache || L->cached[b]) return;
    if (table_find(L, b / L->P, hash, tokens) != NONE) return; /* same content already cached in its partition */
    int first = table_find(L, ANY_PART, hash, tokens) == NONE; /* no other partition has it either */
    L->cached[b] = 1;
    L->hash[b] = hash;
    memcpy(L->tokens + (size_t)b * L->B, tokens, (size_t)L->B * sizeof *tokens);
    size_t mask = (size_t)L->cap - 1, i = slot_of(L, hash);
    while (L->table[i] != NONE) i = (i + 1) & mask;
    L->table[i] = b;
    if (L->observer && first) L->observer(L->observer_ctx, hash, 1);
}

int loom_kv_check(const loom_kv_ledger_t *L) {
    int held = 0, lru = 0, in_table = 0;
    for (int b = 0; b < L->n; b++) {
        if (L->ref[b] < 0) return 1;
        if (L->ref[b] > 0) held++;
    }
    int n_free = 0;
    for (int p = 0; p < L->n_parts; p++) {
        const part_t *pt = &L->parts[p];
        int plru = 0;
        for (int b = pt->lru_head, prev = NONE; b != NONE; prev = b, b = L->lru_next[b]) {
            if (L->ref[b] != 0 || !L->cached[b] || L->lru_prev[b] != prev || b / L->P != p) return 2;
            if (++plru > L->P) return 3;
        }
        if (plru != pt->n_lru) return 4;
        lru += plru;
        for (int i = 0; i < pt->n_free; i++) {
            int b = L->free_stack[p * L->P + i];
            if (L->ref[b] != 0 || L->cached[b] || b / L->P != p) return 5;
        }
        n_free += pt->n_free;
    }
    if (lru != L->n_lru || n_free != L->n_free) return 4;
    if (held + lru + L->n_free != L->n) return 6;
    for (int i = 0; i < L->cap; i++) {
        int b = L->table[i];
        if (b == NONE) continue;
        in_table++;
        if (!L->cached[b] || table_find(L, b / L->P, L->hash[b], L->tokens + (size_t)b * L->B) != b) return 7;
    }
    int n_cached = 0;
    for (int b = 0; b < L->n; b++) n_cached += L->cached[b];
    if (in_table != n_cached) return 8;
    return 0;
}
