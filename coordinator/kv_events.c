/* The KV events publisher (see kv_events.h): buffers the ledger's cached
 * and evicted hashes and sends them, with the load, as loom.v1.KvEvents. */
#include "coordinator/kv_events.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/log.h"
#include "common/util.h"
#include "coordinator/kv_ledger.h"
#include "proto/wire.h"

#define PUBLISH_EVERY_NS 100000000ull /* load at least this often */
#define MAX_PENDING      (1 << 16)    /* more changes in one turn: send cleared instead */

struct loom_kv_events {
    void *pub;
    char bind[256], advertise_host[256];
    char addr[300];           /* what routers dial ("" until bound) */
    loom_kv_ledger_t *ledger; /* the ledger observed (NULL: none yet) */
    uint64_t *cached, *evicted, *stored;
    size_t n_cached, n_evicted, n_stored;
    loom_sched_t *sched;      /* the scheduler whose tier saves are observed (NULL: none yet) */
    uint64_t tier_id;
    int overflow, cleared;
    uint64_t seq, last_ns;
};

static void on_change(void *ctx, uint64_t hash, int cached) {
    loom_kv_events_t *ev = ctx;
    if (ev->n_cached + ev->n_evicted >= MAX_PENDING) {
        ev->overflow = 1;
        return;
    }
    if (cached)
        ev->cached[ev->n_cached++] = hash;
    else
        ev->evicted[ev->n_evicted++] = hash;
}

static void on_tier(void *ctx, uint64_t hash) {
    loom_kv_events_t *ev = ctx;
    if (ev->n_stored >= MAX_PENDING) return; /* routers learn fewer tier blocks: only a worse score */
    ev->stored[ev->n_stored++] = hash;
}

void loom_kv_events_set_tier(loom_kv_events_t *ev, uint64_t tier_id) {
    if (ev) ev->tier_id = tier_id;
}

loom_status_t loom_kv_events_create(void *zctx, const char *bind, const char *advertise_host,
                                    loom_kv_events_t **out, loom_err_t *err) {
    *out = NULL;
    void *pub = zmq_socket(zctx, ZMQ_PUB);
    if (!pub)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot make the --kv-events socket: %s",
                            zmq_strerror(errno));
    int zero = 0;
    zmq_setsockopt(pub, ZMQ_LINGER, &zero, sizeof zero);
    loom_kv_events_t *ev = loom_xcalloc(1, sizeof *ev);
    ev->pub = pub;
    snprintf(ev->bind, sizeof ev->bind, "%s", bind);
    snprintf(ev->advertise_host, sizeof ev->advertise_host, "%s",
             advertise_host ? advertise_host : "");
    ev->cached = loom_xmalloc(MAX_PENDING * sizeof *ev->cached);
    ev->evicted = loom_xmalloc(MAX_PENDING * sizeof *ev->evicted);
    ev->stored = loom_xmalloc(MAX_PENDING * sizeof *ev->stored);
    *out = ev;
    return LOOM_OK;
}

void *loom_kv_events_socket(loom_kv_events_t *ev) {
    return ev ? ev->pub : NULL;
}

loom_status_t loom_kv_events_bind(loom_kv_events_t *ev, loom_err_t *err) {
    if (zmq_bind(ev->pub, ev->bind) != 0)
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cannot bind --kv-events %s: %s", ev->bind,
                            zmq_strerror(errno));
    char last[256];
    size_t l = sizeof last;
    zmq_getsockopt(ev->pub, ZMQ_LAST_ENDPOINT, last, &l);
    const char *colon = strrchr(last, ':');
    if (ev->advertise_host[0] && colon && !strncmp(last, "tcp://", 6))
        snprintf(ev->addr, sizeof ev->addr, "tcp://%s%s", ev->advertise_host, colon);
    else
        snprintf(ev->addr, sizeof ev->addr, "%s", last);
    LOOM_INFO("KV events on %s", ev->addr);
    return LOOM_OK;
}

void loom_kv_events_destroy(loom_kv_events_t **ev_p) {
    if (!ev_p || !*ev_p) return;
    loom_kv_events_t *ev = *ev_p;
    if (ev->ledger) loom_kv_set_observer(ev->ledger, NULL, NULL);
    if (ev->sched) loom_sched_set_tier_observer(ev->sched, NULL, NULL);
    zmq_close(ev->pub);
    free(ev->cached);
    free(ev->evicted);
    free(ev->stored);
    free(ev);
    *ev_p = NULL;
}

const char *loom_kv_events_addr(const loom_kv_events_t *ev) {
    return ev ? ev->addr : "";
}

void loom_kv_events_publish(loom_kv_events_t *ev, loom_sched_t *sched) {
    if (!ev || !sched) return;
    loom_kv_ledger_t *L = loom_sched_ledger(sched);
    if (L != ev->ledger) { /* a new grid's empty cache */
        ev->ledger = L;
        loom_kv_set_observer(L, on_change, ev);
        ev->cleared = 1;
        ev->n_cached = ev->n_evicted = 0;
    }
    if (sched != ev->sched) {
        ev->sched = sched;
        loom_sched_set_tier_observer(sched, on_tier, ev);
    }
    uint64_t now = loom_now_ns();
    int changed = ev->n_cached || ev->n_evicted || ev->n_stored || ev->cleared || ev->overflow;
    if (!changed && now - ev->last_ns < PUBLISH_EVERY_NS) return;
    ev->last_ns = now;
    if (ev->overflow) { /* too much at once: start over (routers forget, and learn again) */
        ev->cleared = 1;
        ev->n_cached = ev->n_evicted = 0;
        ev->overflow = 0;
    }
    loom_sched_stats_t ss;
    loom_sched_get_stats(sched, &ss);
    Loom__V1__KvEvents m = LOOM__V1__KV_EVENTS__INIT;
    m.magic = LOOM_PROTO_MAGIC;
    m.version = LOOM_PROTO_VERSION;
    m.seq = ++ev->seq;
    m.cleared = ev->cleared;
    m.cached = ev->cached;
    m.n_cached = ev->n_cached;
    m.evicted = ev->evicted;
    m.n_evicted = ev->n_evicted;
    m.running = (uint32_t)ss.running;
    m.waiting = (uint32_t)ss.waiting;
    m.kv_blocks_used = (uint32_t)loom_kv_n_held(L);
    m.kv_blocks_total = (uint32_t)loom_kv_n_blocks(L);
    m.block_size = (uint32_t)loom_kv_block_size(L);
    m.tier_id = ev->tier_id;
    m.tier_stored = ev->stored;
    m.n_tier_stored = ev->tier_id ? ev->n_stored : 0;
    size_t len = loom__v1__kv_events__get_packed_size(&m);
    uint8_t *buf = loom_xmalloc(len ? len : 1);
    loom__v1__kv_events__pack(&m, buf);
    zmq_send(ev->pub, buf, len,
             ZMQ_DONTWAIT); /* no subscriber, or a slow one: dropped (it sees the seq gap) */
    free(buf);
    ev->cleared = 0;
    ev->n_cached = ev->n_evicted = ev->n_stored = 0;
}
