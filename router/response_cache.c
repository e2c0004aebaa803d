/* The router's response cache (response_cache.h).
 *
 * Entries live in a hash table (chained, by FNV-1a of the key) and on an
 * LRU list, most recently used first. An entry's bytes are its key, its
 * packed replies and ENTRY_OVERHEAD; the sum stays <= max_bytes: a commit
 * evicts from the LRU tail until the new entry fits, and an entry larger
 * than the whole cache is never stored. An entry older than the TTL is
 * dropped when it is next looked up (and counted as expired, and a miss). */
#include "router/response_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "proto/wire.h"
#include "proto/zapi.h"

#define N_BUCKETS      (1 << 14)
#define ENTRY_OVERHEAD 128 /* the entry struct and its arrays' bookkeeping, roughly */

typedef struct entry {
    struct entry *hnext, *prev, *next;
    uint64_t h;
    unsigned char *key;
    size_t key_len;
    int n;
    unsigned char **msg;
    size_t *len;
    size_t bytes;
    uint64_t expires_ns; /* 0: never */
} entry_t;

struct loom_rcache_rec {
    unsigned char *key;
    size_t key_len;
    int n, cap;
    unsigned char **msg;
    size_t *len;
    size_t bytes, max_bytes;
    int ok;      /* the final chunk came, with a status and finish reason worth keeping */
    int too_big; /* grew past the whole cache: nothing kept */
};

struct loom_rcache {
    entry_t *buckets[N_BUCKETS];
    entry_t *head, *tail; /* LRU: head most recent */
    size_t bytes, max_bytes;
    uint64_t ttl_ns;
    int entries;
    loom_rcache_stats_t st;
};

static uint64_t key_hash(const unsigned char *k, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ k[i]) * 0x100000001b3ull;
    return h;
}

loom_rcache_t *loom_rcache_create(size_t max_bytes, int ttl_ms) {
    loom_rcache_t *c = loom_xcalloc(1, sizeof *c);
    c->max_bytes = max_bytes;
    c->ttl_ns = ttl_ms > 0 ? (uint64_t)ttl_ms * 1000000ull : 0;
    return c;
}

static void entry_free(entry_t *e) {
    for (int i = 0; i < e->n; i++)
        free(e->msg[i]);
    free(e->msg);
    free(e->len);
    free(e->key);
    free(e);
}

static void entry_remove(loom_rcache_t *c, entry_t *e) {
    entry_t **pp = &c->buckets[e->h % N_BUCKETS];
    while (*pp != e)
        pp = &(*pp)->hnext;
    *pp = e->hnext;
    if (e->prev)
        e->prev->next = e->next;
    else
        c->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        c->tail = e->prev;
    c->bytes -= e->bytes;
    c->entries--;
    entry_free(e);
}

void loom_rcache_destroy(loom_rcache_t **c_p) {
    if (!c_p || !*c_p) return;
    loom_rcache_t *c = *c_p;
    *c_p = NULL;
    while (c->head)
        entry_remove(c, c->head);
    free(c);
}

int loom_rcache_cacheable(const Loom__V1__GenerateRequest *g) {
    const Loom__V1__SamplingParams *sp = g->sampling;
    if (g->no_cache || !sp) return 0; /* no sampling params: temperature 1, a server-picked seed */
    return sp->temperature == 0.0f || sp->has_seed;
}

unsigned char *loom_rcache_key(const Loom__V1__GenerateRequest *g, const char *served_model,
                               size_t *len) {
    Loom__V1__GenerateRequest k = *g;
    Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
    if (g->sampling) {
        sp = *g->sampling;
        if (sp.temperature == 0.0f) { /* greedy: the seed changes nothing */
            sp.seed = 0;
            sp.has_seed = 0;
        }
        k.sampling = &sp;
    }
    k.tag = (char *)"";
    k.session = (char *)"";
    k.priority = 0;
    k.no_cache = 0;
    k.gateway_tokenize_ns = 0; /* a timing, not part of what is asked */
    if (!k.model || !k.model[0]) k.model = (char *)(served_model ? served_model : "");
    size_t n = loom__v1__generate_request__get_packed_size(&k);
    unsigned char *buf = loom_xmalloc(n ? n : 1);
    loom__v1__generate_request__pack(&k, buf);
    *len = n;
    return buf;
}

static entry_t *find(loom_rcache_t *c, const unsigned char *key, size_t key_len, uint64_t h) {
    for (entry_t *e = c->buckets[h % N_BUCKETS]; e; e = e->hnext)
        if (e->h == h && e->key_len == key_len && !memcmp(e->key, key, key_len)) return e;
    return NULL;
}

int loom_rcache_get(loom_rcache_t *c, const unsigned char *key, size_t key_len, uint64_t now_ns,
                    loom_rcache_hit_t *hit) {
    uint64_t h = key_hash(key, key_len);
    entry_t *e = find(c, key, key_len, h);
    if (e && e->expires_ns && now_ns >= e->expires_ns) {
        entry_remove(c, e);
        c->st.expired++;
        e = NULL;
    }
    if (!e) {
        c->st.misses++;
        return 0;
    }
    c->st.hits++;
    if (e != c->head) { /* to the front of the LRU list */
        e->prev->next = e->next;
        if (e->next)
            e->next->prev = e->prev;
        else
            c->tail = e->prev;
        e->prev = NULL;
        e->next = c->head;
        c->head->prev = e;
        c->head = e;
    }
    hit->n = e->n;
    hit->msg = (const unsigned char *const *)e->msg;
    hit->len = e->len;
    return 1;
}

loom_rcache_rec_t *loom_rcache_rec_begin(loom_rcache_t *c, unsigned char *key, size_t key_len) {
    loom_rcache_rec_t *rec = loom_xcalloc(1, sizeof *rec);
    rec->key = key;
    rec->key_len = key_len;
    rec->bytes = key_len + ENTRY_OVERHEAD;
    rec->max_bytes = c->max_bytes;
    rec->too_big = rec->bytes > rec->max_bytes;
    return rec;
}

static void rec_drop_msgs(loom_rcache_rec_t *rec) {
    for (int i = 0; i < rec->n; i++)
        free(rec->msg[i]);
    rec->n = 0;
}

void loom_rcache_rec_add(loom_rcache_rec_t *rec, const Loom__V1__Reply *rep) {
    if (!rec) return;
    const Loom__V1__GenerateChunk *ch = rep->chunk;
    if (ch && ch->final)
        rec->ok = rep->code == LOOM__V1__STATUS_CODE__OK &&
                  (ch->finish_reason == LOOM__V1__FINISH_REASON__FINISH_STOP ||
                   ch->finish_reason == LOOM__V1__FINISH_REASON__FINISH_LENGTH);
    if (rec->too_big) return;
    Loom__V1__Reply r = *rep;
    Loom__V1__GenerateChunk c2;
    r.request_id = 0;
    if (ch) { /* another request's timings would mislead: a replay has none */
        c2 = *ch;
        c2.timings = NULL;
        r.chunk = &c2;
    }
    size_t len;
    unsigned char *buf = loom_wire_pack_reply(&r, &len);
    rec->bytes += len + 2 * sizeof(void *);
    if (rec->bytes > rec->max_bytes) {
        free(buf);
        rec_drop_msgs(rec);
        rec->too_big = 1;
        return;
    }
    if (rec->n == rec->cap) {
        rec->cap = rec->cap ? rec->cap * 2 : 16;
        rec->msg = loom_xrealloc(rec->msg, (size_t)rec->cap * sizeof *rec->msg);
        rec->len = loom_xrealloc(rec->len, (size_t)rec->cap * sizeof *rec->len);
    }
    rec->msg[rec->n] = buf;
    rec->len[rec->n++] = len;
}

void loom_rcache_rec_abort(loom_rcache_rec_t **rec_p) {
    if (!rec_p || !*rec_p) return;
    loom_rcache_rec_t *rec = *rec_p;
    *rec_p = NULL;
    rec_drop_msgs(rec);
    free(rec->msg);
    free(rec->len);
    free(rec->key);
    free(rec);
}

void loom_rcache_rec_commit(loom_rcache_t *c, loom_rcache_rec_t **rec_p, uint64_t now_ns) {
    loom_rcache_rec_t *rec = *rec_p;
    if (!rec) return;
    if (rec->too_big && rec->ok) c->st.too_big++;
    if (!rec->ok || rec->too_big || rec->n == 0) {
        loom_rcache_rec_abort(rec_p);
        return;
    }
    uint64_t h = key_hash(rec->key, rec->key_len);
    entry_t *old = find(c, rec->key, rec->key_len, h);
    if (old) entry_remove(c, old); /* the same request finished twice: keep the newer */
    while (c->tail && c->bytes + rec->bytes > c->max_bytes) {
        entry_remove(c, c->tail);
        c->st.evictions++;
    }
    entry_t *e = loom_xcalloc(1, sizeof *e);
    e->h = h;
    e->key = rec->key;
    e->key_len = rec->key_len;
    e->n = rec->n;
    e->msg = rec->msg;
    e->len = rec->len;
    e->bytes = rec->bytes;
    e->expires_ns = c->ttl_ns ? now_ns + c->ttl_ns : 0;
    e->hnext = c->buckets[h % N_BUCKETS];
    c->buckets[h % N_BUCKETS] = e;
    e->next = c->head;
    if (c->head) c->head->prev = e;
    c->head = e;
    if (!c->tail) c->tail = e;
    c->bytes += e->bytes;
    c->entries++;
    c->st.stored++;
    free(rec);
    *rec_p = NULL;
}

void loom_rcache_note_bypass(loom_rcache_t *c) {
    c->st.bypassed++;
}

loom_rcache_stats_t loom_rcache_stats(const loom_rcache_t *c) {
    loom_rcache_stats_t s = c->st;
    s.bytes = c->bytes;
    s.max_bytes = c->max_bytes;
    s.entries = c->entries;
    return s;
}

long long loom_rcache_replay(const loom_rcache_hit_t *hit, void *sock, const void *rid,
                             size_t rid_len, uint64_t request_id) {
    long long tokens = 0;
    for (int i = 0; i < hit->n; i++) {
        loom_err_t err = {0};
        Loom__V1__Reply *rep = loom_wire_unpack_reply(hit->msg[i], hit->len[i], &err);
        if (!rep) continue; /* packed here: cannot happen */
        rep->request_id = request_id;
        if (rep->chunk && rep->chunk->usage)
            tokens =
                (long long)rep->chunk->usage->prompt_tokens + rep->chunk->usage->completion_tokens;
        int rc = loom_zapi_send_reply(sock, rid, rid_len, rep);
        protobuf_c_message_free_unpacked(&rep->base, NULL);
        if (rc < 0) return -1;
    }
    return tokens;
}

char *loom_rcache_metrics_text(const loom_rcache_t *c) {
    loom_rcache_stats_t s = loom_rcache_stats(c);
    char *t = loom_xmalloc(2048);
    snprintf(
        t, 2048,
        "# HELP loom_router_response_cache_hits_total requests answered from the response cache\n"
        "# TYPE loom_router_response_cache_hits_total counter\n"
        "loom_router_response_cache_hits_total %llu\n"
        "# HELP loom_router_response_cache_misses_total cacheable requests not in the cache\n"
        "# TYPE loom_router_response_cache_misses_total counter\n"
        "loom_router_response_cache_misses_total %llu\n"
        "# HELP loom_router_response_cache_bypassed_total requests not cacheable (sampled without "
        "a "
        "seed, or opted out)\n"
        "# TYPE loom_router_response_cache_bypassed_total counter\n"
        "loom_router_response_cache_bypassed_total %llu\n"
        "# TYPE loom_router_response_cache_stored_total counter\n"
        "loom_router_response_cache_stored_total %llu\n"
        "# HELP loom_router_response_cache_evictions_total entries evicted to keep the byte bound\n"
        "# TYPE loom_router_response_cache_evictions_total counter\n"
        "loom_router_response_cache_evictions_total %llu\n"
        "# HELP loom_router_response_cache_expired_total entries dropped past their TTL\n"
        "# TYPE loom_router_response_cache_expired_total counter\n"
        "loom_router_response_cache_expired_total %llu\n"
        "# HELP loom_router_response_cache_too_big_total streams larger than the whole cache, not "
        "kept\n"
        "# TYPE loom_router_response_cache_too_big_total counter\n"
        "loom_router_response_cache_too_big_total %llu\n"
        "# TYPE loom_router_response_cache_bytes gauge\n"
        "loom_router_response_cache_bytes %zu\n"
        "# TYPE loom_router_response_cache_max_bytes gauge\n"
        "loom_router_response_cache_max_bytes %zu\n"
        "# TYPE loom_router_response_cache_entries gauge\n"
        "loom_router_response_cache_entries %d\n",
        (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.bypassed,
        (unsigned long long)s.stored, (unsigned long long)s.evictions,
        (unsigned long long)s.expired, (unsigned long long)s.too_big, s.bytes, s.max_bytes,
        s.entries);
    return t;
}
