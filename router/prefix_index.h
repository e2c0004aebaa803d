/* The router's prefix index and replica scoring: which replica holds which
 * prompt blocks (chain hashes, the same as the coordinators' prefix cache:
 * loom_kv_chain_hash over full blocks), fed by the router's own routing
 * history, and the cost that picks a replica for a prompt. Pure logic, no
 * sockets; see docs/scale-out.md for the score. */
#ifndef LOOM_PREFIX_INDEX_H
#define LOOM_PREFIX_INDEX_H

#include <stdint.h>

#define LOOM_PREFIX_MAX_REPLICAS 64 /* a replica is one bit of an entry's mask */

typedef struct loom_prefix_index loom_prefix_index_t;

/* Holds at most `capacity` block hashes; beyond it the least recently
 * touched are forgotten first. */
loom_prefix_index_t *loom_prefix_index_create(int capacity);
void loom_prefix_index_destroy(loom_prefix_index_t **ix_p); /* safe on NULL and twice */

/* Replica `rep` now holds blocks hashes[0..n) (a chain: each hash covers
 * the blocks before it). */
void loom_prefix_index_insert(loom_prefix_index_t *ix, const uint64_t *hashes, int n, int rep);
/* Replica `rep` no longer holds this block (evicted). */
void loom_prefix_index_remove(loom_prefix_index_t *ix, uint64_t hash, int rep);
/* Replica `rep` left or restarted: it holds nothing (O(1); its stale bits
 * are cleared lazily, and their entries age out). */
void loom_prefix_index_drop_replica(loom_prefix_index_t *ix, int rep);
/* match[r] = how many leading blocks of hashes[0..n) replica r holds, for
 * r < n_reps. */
void loom_prefix_index_match(const loom_prefix_index_t *ix, const uint64_t *hashes, int n,
                             int *match, int n_reps);
int loom_prefix_index_size(const loom_prefix_index_t *ix);

/* The chain hashes of the full blocks of ids[0..n) (at most max). Returns
 * the count. */
int loom_prefix_hashes(const int32_t *ids, int n, int block_size, uint64_t *out, int max);
/* The same for a request of a LoRA adapter: the chain starts at SEED (the
 * adapter's content digest's first 8 bytes, little-endian, as the
 * coordinator seeds it; 0 is the base model), so the hashes match the KV
 * events of that adapter's blocks only. */
int loom_prefix_hashes_seeded(const int32_t *ids, int n, int block_size, uint64_t seed, uint64_t *out, int max);

/* One replica as the scorer sees it. */
typedef struct loom_route_cand {
    int usable;                /* 0: down, refused, leaving: never picked */
    int matched_blocks;        /* leading prompt blocks it holds */
    int tier_blocks;           /* of those, the ones only its KV offload tier holds */
    double tier_cost;          /* a tier token's cost against computing it (0..1) */
    int inflight;              /* requests the router has running there */
    long long inflight_tokens; /* their prompt + generated tokens */
    int waiting;               /* its queue, from its last Stats */
    double kv_usage;           /* used / total KV blocks, from its last Stats */
} loom_route_cand_t;

/* cost = uncached prompt tokens + tier_cost * tokens read from the tier
 *        + lambda * (inflight_tokens + LOOM_WAITING_TOKENS * waiting)
 *        + (kv_usage > 0.9 ? n_prompt * 10 * (kv_usage - 0.9) : 0)
 * lowest cost wins; ties go to fewer requests in flight, then to the first
 * at or after `rr` (round robin). -1 when none is usable. */
#define LOOM_WAITING_TOKENS 64
double loom_route_cost(const loom_route_cand_t *c, int n_prompt, int block_size, double lambda);
int loom_route_pick_prefix(const loom_route_cand_t *c, int n, int n_prompt, int block_size,
                           double lambda, unsigned rr);
/* Fewest requests in flight plus waiting; ties round robin from rr. */
int loom_route_pick_least_loaded(const loom_route_cand_t *c, int n, unsigned rr);
/* The first usable at or after rr. */
int loom_route_pick_round_robin(const loom_route_cand_t *c, int n, unsigned rr);

#endif
