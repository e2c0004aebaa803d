/* KV events: the coordinator's prefix-cache changes (block hashes cached
 * and evicted) and its load, published on a ZeroMQ PUB socket
 * (--kv-events) as loom.v1.KvEvents for routers (docs/scale-out.md). The
 * reactor calls loom_kv_events_publish once per loop turn; the ledger's
 * observer fills the buffers in between. */
#ifndef LOOM_KV_EVENTS_H
#define LOOM_KV_EVENTS_H

#include <stddef.h>

#include "common/status.h"
#include "coordinator/sched.h"

typedef struct loom_kv_events loom_kv_events_t;

/* A PUB socket for `bind` (tcp://HOST:PORT, port 0: any), not bound yet:
 * key it first (loom_kv_events_socket, loom_zap_secure) when the client API
 * is keyed, then loom_kv_events_bind. The address it advertises has
 * advertise_host in place of a wildcard host (NULL: keep). */
loom_status_t loom_kv_events_create(void *zctx, const char *bind, const char *advertise_host,
                                    loom_kv_events_t **out, loom_err_t *err);
void *loom_kv_events_socket(loom_kv_events_t *ev); /* NULL on NULL */
loom_status_t loom_kv_events_bind(loom_kv_events_t *ev, loom_err_t *err);
void loom_kv_events_destroy(loom_kv_events_t **ev_p); /* safe on NULL and twice */
/* The address routers dial ("" on NULL). */
const char *loom_kv_events_addr(const loom_kv_events_t *ev);
/* Watches sched's current ledger (a new one after a grid change is a
 * `cleared`) and sends what changed, and the load at least every 100 ms.
 * Safe on NULL ev or sched. */
void loom_kv_events_publish(loom_kv_events_t *ev, loom_sched_t *sched);
/* The KV offload tier's identity, published with every message, and the
 * blocks sched sends to it (0: no tier). Safe on NULL ev. */
void loom_kv_events_set_tier(loom_kv_events_t *ev, uint64_t tier_id);

#endif
