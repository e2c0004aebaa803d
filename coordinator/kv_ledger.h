/* The coordinator's logical KV cache: which block ids are free, who holds
 * them (reference counts), and the automatic prefix cache. Workers only ever
 * see block ids; this ledger decides them.
 *
 * Block states and transitions:
 *   FREE ──alloc──▶ HELD(ref ≥ 1) ──release to ref 0──▶ FREE        (never registered)
 *                       │ register (full block, keyed by its token chain)
 *                       ▼
 *                   HELD+CACHED ──release to ref 0──▶ CACHED (evictable, LRU)
 *   CACHED ──lookup hit──▶ HELD+CACHED;  CACHED ──evicted by alloc──▶ HELD (uncached)
 * Invariants: free + cached + held = n_blocks; a cached block's tokens and
 * hash never change while it is registered (writers copy-on-write first).
 *
 * Partitions (data-parallel attention, docs/architecture.md): the ids are
 * cut into n_parts equal ranges, partition p owning [p*P, (p+1)*P) with P =
 * n_blocks / n_parts (one TP rank's pool). Each has its own free list and
 * LRU: an allocation in p takes only p's blocks (evicting only p's cached
 * ones), a lookup in p hits only p's blocks, and a release returns a block
 * to its own partition. The same content may be cached in several
 * partitions; the observer hears of a hash when its first copy is cached
 * and when its last one is evicted. One partition is the whole pool, and
 * the calls without _in are partition 0's. */
#ifndef LOOM_KV_LEDGER_H
#define LOOM_KV_LEDGER_H

#include <stdint.h>

#include "common/block_hash.h"

typedef struct loom_kv_ledger loom_kv_ledger_t;

loom_kv_ledger_t *loom_kv_create(int n_blocks, int block_size, int prefix_cache);
/* n_parts partitions (n_blocks a multiple of n_parts, n_parts >= 1). */
loom_kv_ledger_t *loom_kv_create_parts(int n_blocks, int block_size, int prefix_cache, int n_parts);
void loom_kv_destroy(loom_kv_ledger_t **L_p);

int loom_kv_n_blocks(const loom_kv_ledger_t *L);
int loom_kv_block_size(const loom_kv_ledger_t *L);
int loom_kv_n_free(const loom_kv_ledger_t *L);   /* allocatable now: free + cached */
int loom_kv_n_cached(const loom_kv_ledger_t *L); /* unreferenced blocks kept for the prefix cache */
int loom_kv_n_held(const loom_kv_ledger_t *L);   /* referenced by some sequence */
int loom_kv_n_parts(const loom_kv_ledger_t *L);
int loom_kv_part_of(const loom_kv_ledger_t *L, int block);
int loom_kv_part_free(const loom_kv_ledger_t *L, int part); /* free + cached in the partition */
int loom_kv_part_held(const loom_kv_ledger_t *L, int part);

/* A block with ref 1, taken from the free list, else by evicting the least
 * recently used cached block; -1 when every block is held. */
int loom_kv_alloc(loom_kv_ledger_t *L);
int loom_kv_alloc_in(loom_kv_ledger_t *L, int part); /* the same within one partition */
/* Told of each chain hash the prefix cache registers (cached = 1) and
 * evicts (cached = 0), synchronously; the KV events publisher listens. */
typedef void (*loom_kv_observer_fn)(void *ctx, uint64_t hash, int cached);
void loom_kv_set_observer(loom_kv_ledger_t *L, loom_kv_observer_fn fn, void *ctx);
/* Told of each cached block alloc is about to evict, before it is reused:
 * its id and chain hash, while its KV is still intact (a tier saves it). */
typedef void (*loom_kv_evict_fn)(void *ctx, int block, uint64_t hash);
void loom_kv_set_evict_hook(loom_kv_ledger_t *L, loom_kv_evict_fn fn, void *ctx);
void loom_kv_retain(loom_kv_ledger_t *L, int block);
void loom_kv_release(loom_kv_ledger_t *L, int block);
int loom_kv_ref(const loom_kv_ledger_t *L, int block);

/* loom_kv_chain_hash (common/block_hash.h) names full blocks. */
/* Finds a cached block holding exactly these block_size tokens after `parent`
 * (hash and tokens both match); on a hit the block is retained and returned. */
int loom_kv_lookup(loom_kv_ledger_t *L, uint64_t hash, const int32_t *tokens);
/* A hit in one partition only; _peek_in finds it without retaining it. */
int loom_kv_lookup_in(loom_kv_ledger_t *L, int part, uint64_t hash, const int32_t *tokens);
int loom_kv_peek_in(const loom_kv_ledger_t *L, int part, uint64_t hash, const int32_t *tokens);
/* Registers a full, computed block under its chain hash (no-op when the
 * prefix cache is off or another block of its partition already has that
 * content). */
void loom_kv_register(loom_kv_ledger_t *L, int block, uint64_t hash, const int32_t *tokens);
int loom_kv_is_cached(const loom_kv_ledger_t *L, int block);

/* Checks every invariant (tests). Returns 0 when consistent. */
int loom_kv_check(const loom_kv_ledger_t *L);

#endif
