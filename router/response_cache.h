/* The router's response cache: whole streams of deterministic Generate
 * requests (temperature 0, or a fixed seed), keyed by everything that
 * affects their output, kept in a byte-bounded LRU with a TTL, and replayed
 * chunk by chunk so a hit reads like a live stream. Used by the reactor
 * only (no locking). See docs/scale-out.md, "Response cache". */
#ifndef LOOM_RESPONSE_CACHE_H
#define LOOM_RESPONSE_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "loom/v1/api.pb-c.h"

typedef struct loom_rcache loom_rcache_t;
typedef struct loom_rcache_rec loom_rcache_rec_t; /* a stream being recorded */

typedef struct loom_rcache_stats {
    uint64_t hits, misses, stored, evictions, expired, bypassed, too_big;
    size_t bytes, max_bytes;
    int entries;
} loom_rcache_stats_t;

/* max_bytes > 0; ttl_ms 0: entries never expire (only evicted). */
loom_rcache_t *loom_rcache_create(size_t max_bytes, int ttl_ms);
void loom_rcache_destroy(loom_rcache_t **c_p);

/* Whether g's output is a function of the request alone: greedy
 * (temperature 0) or seeded, and not opted out with no_cache. */
int loom_rcache_cacheable(const Loom__V1__GenerateRequest *g);

/* The cache key of a cacheable request for the served model (g->model empty
 * means it): g packed without the fields that do not change the output
 * (tag, session, priority, no_cache; the seed of a greedy request). malloc'ed. */
unsigned char *loom_rcache_key(const Loom__V1__GenerateRequest *g, const char *served_model,
                               size_t *len);

/* A stored stream: n packed loom.v1.Reply messages (request_id 0), the
 * last one final. Valid until the next call that changes the cache. */
typedef struct loom_rcache_hit {
    int n;
    const unsigned char *const *msg;
    const size_t *len;
} loom_rcache_hit_t;

/* Looks the key up (counting a hit or a miss); 1 with *hit filled, 0 when absent or expired. */
int loom_rcache_get(loom_rcache_t *c, const unsigned char *key, size_t key_len, uint64_t now_ns,
                    loom_rcache_hit_t *hit);

/* Recording a live stream: begin (takes the key), add each chunk as it goes
 * to the client, then commit after the final one (stored only when the stream
 * ended OK with STOP or LENGTH and fits the cache) or abort. Both free the
 * record and NULL the pointer; abort is safe on NULL. */
loom_rcache_rec_t *loom_rcache_rec_begin(loom_rcache_t *c, unsigned char *key, size_t key_len);
void loom_rcache_rec_add(loom_rcache_rec_t *rec, const Loom__V1__Reply *rep);
void loom_rcache_rec_commit(loom_rcache_t *c, loom_rcache_rec_t **rec_p, uint64_t now_ns);
void loom_rcache_rec_abort(loom_rcache_rec_t **rec_p);

/* Sends a stored stream on a ROUTER socket as request_id's replies. Returns
 * the tokens its final usage counts (prompt + completion), -1 when the
 * client is gone (a send failed). */
long long loom_rcache_replay(const loom_rcache_hit_t *hit, void *sock, const void *rid,
                             size_t rid_len, uint64_t request_id);

void loom_rcache_note_bypass(loom_rcache_t *c); /* a request not cacheable */
/* Prometheus text of the counters (malloc'ed). */
char *loom_rcache_metrics_text(const loom_rcache_t *c);
loom_rcache_stats_t loom_rcache_stats(const loom_rcache_t *c);

#endif
