/* loom-router's reactor: the client API (ROUTER), one DEALER per replica,
 * the etcd discovery thread's pipe, the probes and the request table.
 *
 * Replica lifecycle:
 *   JOINING  --ListModels matches the reference model--> UP
 *   JOINING  --another model, vocabulary or context--> REFUSED (never used; logged naming the
 * difference) UP       --no answer for replica_timeout_ms, a send that fails, or garbage--> DOWN
 *   DOWN     --circuit open for a backoff (0.5 s doubling to 8 s), then probed;
 *              a Health that says ready--> UP (a failure doubles the backoff)
 *   any      --removed from etcd--> LEAVING: takes no new request, closed once idle
 * Only UP replicas are picked. A replica's bit in the prefix index is
 * cleared when it goes DOWN or leaves (a restarted coordinator has an empty
 * cache).
 *
 * Request lifecycle: a client Generate is tokenized (with --model; without
 * it the replica is asked for the prompt's ids, return_prompt_ids, which its
 * first chunk brings), scored and sent to one replica under a fresh upstream id; chunks come back under
 * that id and go to the client under its own id, their ids kept. When the
 * replica goes DOWN, stalls (no chunk for stall_timeout_ms) or refuses with
 * UNAVAILABLE / RESOURCE_EXHAUSTED, the request is re-sent to another UP
 * replica as prompt_ids = prompt + the ids streamed so far and max_tokens
 * reduced by them, under a new upstream id (late chunks of the old one are
 * dropped), at most max_retries times; then it ends with UNAVAILABLE. A
 * chunk with a token id outside the vocabulary, or an empty final chunk, is
 * the replica's fault: not relayed, the replica goes DOWN and its streams
 * move on. A stream that moves is cancelled on the replica it leaves. A
 * refusal that is the request's own fault (INVALID_ARGUMENT, ...) is relayed,
 * never failed over, and so is a decode replica's failure to load the KV its
 * kv_transfer_params name under kv_load_failure_policy fail. A client that
 * cancels or vanishes (ROUTER_MANDATORY: EHOSTUNREACH) gets its upstream
 * request cancelled. No request outlives
 * request_timeout_ms. */
#include "router/router.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>
#include <zmq.h>

#include <cjson/cJSON.h>

#include "common/etcd.h"
#include "common/keys.h"
#include "common/log.h"
#include "common/model_digest.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "common/zap.h"
#include "proto/wire.h"
#include "proto/zapi.h"
#include "router/lathist.h"
#include "router/prefix_index.h"
#include "router/response_cache.h"
#include "router/tenants.h"

#define MAX_REPLICAS   LOOM_PREFIX_MAX_REPLICAS
#define MAX_HASHES     4096         /* prompt blocks hashed for routing (64k tokens at block 16) */
#define CTL_BIT        (1ull << 63) /* upstream ids of the router's own probes */
#define TTFT_RING      128
#define ROUTE_BUCKETS  4096
#define SESSION_SLOTS  4096
#define DEFAULT_BLOCK  16
#define BACKOFF_MIN_MS 500
#define BACKOFF_MAX_MS 8000
#define ETCD_POLL_MS   1000

typedef enum { REP_JOINING, REP_UP, REP_DOWN, REP_REFUSED, REP_LEAVING } rep_state_t;

/* A LoRA adapter a replica serves (its ListModels, docs/lora.md). */
typedef struct rep_adapter {
    char name[128];
    char root[1024];
    char digest[65]; /* hex; "" when the replica did not say */
    uint64_t seed;   /* the prefix-cache chain's seed (0: unknown) */
    int resident;    /* in its engines' slots now */
} rep_adapter_t;
static const char *rep_state_name[] = {"joining", "up", "down", "refused", "leaving"};

typedef struct replica {
    int used; /* this slot holds a replica */
    char addr[256];
    void *sock;          /* DEALER */
    void *events;        /* SUB to its KV events (NULL: it publishes none) */
    uint64_t events_seq; /* the last KvEvents seq seen */
    rep_state_t state;
    int from_etcd, listed;  /* discovered in etcd; still listed there */
    char why[320];          /* the last state change's reason */
    int join_warned;        /* said why a replica that never answered may be refusing us */
    uint64_t last_reply_ns; /* any answer */
    uint64_t probe_sent_ns; /* the oldest unanswered probe (0: none) */
    uint64_t open_until_ns; /* DOWN: the next probe after this */
    int backoff_ms;
    /* from the last Stats */
    int running, waiting, kv_total, kv_used, block_size;
    int preparing; /* from its last Stats reply */
    uint64_t prefix_queries, prefix_hits, finished, rejected, prompt_tokens, gen_tokens,
        preemptions, steps;
    double gen_tps;
    rep_adapter_t *adapters; /* from its last ListModels */
    int n_adapters;
    /* the router's own view */
    int dirty;       /* sent on since it was last read to EAGAIN (the reactor's watch) */
    int probe_retry; /* a join probe found no connection yet: send it when the socket stirs */
    int inflight;
    long long inflight_tokens;
    uint64_t routed, failovers, failures;
    double ttft_ms[TTFT_RING];
    int n_ttft, ttft_pos;
    int prefill; /* a prefill replica (--prefill-replica, or kv_producer in etcd): only the first phase of a
                    disaggregated request */
    uint64_t tier_id; /* its KV offload tier, from its KV events (0: none) */
} replica_t;

typedef struct route {
    struct route *next, *prev; /* all requests */
    struct route *hnext;       /* bucket by up_id */
    uint64_t up_id;
    unsigned char rid[256];
    size_t rid_len;
    uint64_t client_id;
    Loom__V1__Request *rq; /* the client's request, kept for re-sending */
    int32_t *prompt;       /* tokenized prompt (NULL without a tokenizer) */
    int n_prompt;
    int32_t *gen; /* ids streamed to the client so far */
    int n_gen, cap_gen;
    int rep;        /* current replica (-1: none) */
    uint64_t tried; /* replicas tried (bits) */
    int attempts;
    loom_policy_t policy;
    uint64_t t_arrival, t_sent, t_last, deadline;
    uint64_t inside_ns; /* arrival to its first send upstream (0: not yet sent) */
    int got_first;      /* a chunk came from the current replica */
    int delivered;      /* a chunk reached the client */
    int hit_blocks; /* prefix blocks the chosen replica held, per the index */
    int strip_pids; /* the client did not ask for the prompt's ids: the router asked for them, for itself */
    /* After a failover the router writes the text itself, from the ids, with
     * a detokenizer primed with the ids already streamed: the new replica's
     * detokenizer starts empty and would lose a character split across the
     * failover point. (Not with stop strings: the replica's text holds those
     * back.) */
    int own_text;
    loom_detok_t detok;
    char *text;
    size_t text_cap;
    int tokenizing; /* its prompt is on a tokenizer thread (keyed by up_id) */
    int tenant;     /* admitted for this tenant (-1: no --tenants) */
    loom_rcache_rec_t *crec; /* its stream, recorded for the response cache (NULL: not cached) */
    /* prefill/decode disaggregation: 1 while at a prefill replica (its
     * chunks are not relayed), then 2 at a decode replica with kv_params
     * (NULL: the prefill failed, or was skipped: the decode computes it) */
    int pd_phase;
    char *kv_params;
} route_t;

/* A prompt to tokenize, handed to a tokenizer thread by pointer over inproc. */
typedef struct tok_job {
    uint64_t key; /* the waiting route's up_id */
    char *text;
    int raw;
    int32_t *ids;
    int n;
    loom_status_t st;
    loom_err_t err;
} tok_job_t;

#define MAX_TOK_THREADS 16

typedef struct etcd_thread {
    pthread_t th;
    int started;
    volatile int stop;
    char url[256], cluster[128];
    char pipe_addr[64];
    void *zctx;
} etcd_thread_t;

struct loom_router {
    loom_router_config_t cfg;
    void *zctx, *api, *pipe;
    loom_zap_t *zap; /* NULL: the client API is not keyed */
    int rep_keyed;   /* replica sockets are CURVE clients with these keys */
    char rep_server[LOOM_KEY_Z85 + 1];
    loom_keypair_t rep_kp;
    char api_addr[256], inproc_addr[64];
    volatile sig_atomic_t stop;
    loom_tokenizer_t *tok;
    loom_prefix_index_t *index;
    /* blocks in the replicas' shared KV tiers, a tier being one "replica"
     * of this index (tier_ids[slot]): a replica that shares a tier holds
     * them whenever it learned its tier, and through its restarts */
    loom_prefix_index_t *tier_index;
    uint64_t tier_ids[MAX_REPLICAS];
    int n_tiers;
    loom_rcache_t *rcache;     /* NULL: no response cache */
    loom_tenants_t *tenants;   /* NULL: no tenant limits */
    replica_t reps[MAX_REPLICAS];
    int have_ref; /* the reference model (first replica that joined) */
    char ref_model[256];
    int ref_vocab, ref_ctx, ref_tp, ref_pp;
    /* the reference model's digests (common/model_digest.h): the --model
     * directory's, else the first replica's that published them; "": none */
    char ref_weights[LOOM_DIGEST_HEX], ref_tokenizer[LOOM_DIGEST_HEX];
    char ref_digest_from[300];
    route_t *routes;
    route_t *buckets[ROUTE_BUCKETS];
    int n_routes;
    uint64_t next_up, next_ctl;
    unsigned rr;
    struct {
        uint64_t key;
        int rep;
    } sessions[SESSION_SLOTS];
    /* counters */
    uint64_t routed[LOOM_POLICY_COUNT], failovers, failover_gave_up, unplaceable, cancels,
        disconnects;
    uint64_t deadline_exceeded, garbage, index_hit_blocks, index_query_blocks, refused_joins;
    uint64_t bad_chunks, relayed_errors; /* replica faults in a stream; request faults passed on */
    uint64_t kv_events, kv_event_gaps, kv_blocks_cached, kv_blocks_evicted, kv_tier_blocks;
    etcd_thread_t etcd;
    void *tok_jobs, *tok_results; /* PUSH to and PULL from the tokenizer threads */
    pthread_t tok_th[MAX_TOK_THREADS];
    int n_tok_th;
    volatile int tok_stop;
    pthread_mutex_t mu; /* guards metrics_text */
    char *metrics_text;
    size_t metrics_len;
    uint64_t last_tick, last_metrics;
    /* for the probe listener's thread (loom_router_probe_state) */
    _Atomic uint64_t beat_ns; /* the reactor's last tick */
    _Atomic int n_up, n_used;
    uint64_t t_recv; /* when the message being handled was received */
    int api_dirty;   /* sent on since it was last read to EAGAIN (the reactor's watch) */
    /* Per request, the time spent inside the router before its first token
     * reached the client: arrival to the request sent upstream (tokenizing
     * and the decision included), plus the first chunk's arrival to its send
     * to the client. Requests that failed over are left out (their wait on
     * the lost replica is not the router's). */
    loom_lathist_t overhead;
};

static const char *policy_names[] = {"prefix", "round-robin", "least-loaded", "session"};
const char *loom_policy_name(loom_policy_t p) {
    return p < LOOM_POLICY_COUNT ? policy_names[p] : "?";
}
int loom_policy_parse(const char *name) {
    for (int i = 0; i < LOOM_POLICY_COUNT; i++)
        if (!strcmp(name, policy_names[i])) return i;
    return -1;
}

/* ---- small helpers --------------------------------------------------------------------------- */

/* The client socket for a send: marks it for the reactor to read again (a
 * send may consume its read signal; see the reactor below). */
static void *api_out(loom_router_t *r) {
    r->api_dirty = 1;
    return r->api;
}

static int send_client(loom_router_t *r, const void *rid, size_t rid_len, Loom__V1__Reply *rep) {
    return loom_zapi_send_reply(api_out(r), rid, rid_len, rep);
}

static int client_error(loom_router_t *r, const void *rid, size_t rid_len, uint64_t id, loom_status_t code,
                        const char *msg) {
    return loom_zapi_reply_error(api_out(r), rid, rid_len, id, code, msg);
}

static int send_replica(loom_router_t *r, int i, Loom__V1__Request *rq) {
    replica_t *p = &r->reps[i];
    rq->api_key = (char *)(r->cfg.replica_api_key ? r->cfg.replica_api_key : "");
    size_t len;
    void *buf = loom_wire_pack_request(rq, &len);
    const char *method = loom_wire_method(rq->body_case);
    p->dirty = 1;
    int rc = zmq_send(p->sock, method, strlen(method), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    if (rc >= 0) rc = zmq_send(p->sock, buf, len, ZMQ_DONTWAIT);
    free(buf);
    return rc < 0 ? -1 : 0;
}

static void set_state(loom_router_t *r, int i, rep_state_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void set_state(loom_router_t *r, int i, rep_state_t st, const char *fmt, ...) {
    replica_t *p = &r->reps[i];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->why, sizeof p->why, fmt, ap);
    va_end(ap);
    if (p->state != st) {
        if (st == REP_REFUSED)
            LOOM_ERROR("replica %s refused: %s", p->addr, p->why);
        else
            LOOM_INFO("replica %s: %s -> %s (%s)", p->addr, rep_state_name[p->state],
                      rep_state_name[st], p->why);
    }
    p->state = st;
    if (st != REP_UP) loom_prefix_index_drop_replica(r->index, i);
}

/* ---- the request table ----------------------------------------------------------------------- */

static route_t *route_find(loom_router_t *r, uint64_t up_id) {
    route_t *q = r->buckets[up_id % ROUTE_BUCKETS];
    while (q && q->up_id != up_id)
        q = q->hnext;
    return q;
}

static void route_unhash(loom_router_t *r, route_t *q) {
    route_t **pp = &r->buckets[q->up_id % ROUTE_BUCKETS];
    while (*pp && *pp != q)
        pp = &(*pp)->hnext;
    if (*pp) *pp = q->hnext;
    q->hnext = NULL;
}

static void route_rehash(loom_router_t *r, route_t *q) {
    route_unhash(r, q);
    q->up_id = ++r->next_up;
    q->hnext = r->buckets[q->up_id % ROUTE_BUCKETS];
    r->buckets[q->up_id % ROUTE_BUCKETS] = q;
}

static void route_detach(loom_router_t *r, route_t *q) {
    if (q->rep >= 0) {
        r->reps[q->rep].inflight--;
        r->reps[q->rep].inflight_tokens -= q->n_prompt + q->n_gen;
        q->rep = -1;
    }
}

static void route_free(loom_router_t *r, route_t *q) {
    if (q->tenant >= 0) loom_tenants_release(r->tenants, q->tenant, q->n_prompt + q->n_gen, loom_now_ns());
    loom_rcache_rec_abort(&q->crec);
    route_detach(r, q);
    route_unhash(r, q);
    if (q->prev)
        q->prev->next = q->next;
    else
        r->routes = q->next;
    if (q->next) q->next->prev = q->prev;
    r->n_routes--;
    protobuf_c_message_free_unpacked(&q->rq->base, NULL);
    free(q->prompt);
    free(q->gen);
    free(q->text);
    free(q->kv_params);
    free(q);
}

/* Cancels the request's stream on its current replica: when the client is
 * gone, and whenever the stream moves away (a stall, a fault, the replica
 * found down), so a replica that is only slow stops spending on it. */
static void cancel_upstream(loom_router_t *r, route_t *q) {
    if (q->rep < 0 || !r->reps[q->rep].sock || r->reps[q->rep].state == REP_REFUSED) return;
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    Loom__V1__CancelRequest c = LOOM__V1__CANCEL_REQUEST__INIT;
    c.target_request_id = q->up_id;
    rq.request_id = CTL_BIT | ++r->next_ctl;
    rq.body_case = LOOM__V1__REQUEST__BODY_CANCEL;
    rq.cancel = &c;
    send_replica(r, q->rep, &rq);
}

/* ---- picking a replica ---------------------------------------------------------------------- */

static uint64_t str_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h | 1;
}

static int block_size(const loom_router_t *r) {
    for (int i = 0; i < MAX_REPLICAS; i++)
        if (r->reps[i].used && r->reps[i].state == REP_UP && r->reps[i].block_size > 0)
            return r->reps[i].block_size;
    return DEFAULT_BLOCK;
}

/* The LoRA adapter a request names (its model, or SGLang's base:adapter),
 * or NULL for the served model. */
static const char *adapter_name(const loom_router_t *r, const Loom__V1__GenerateRequest *g) {
    const char *m = g->model;
    if (!m || !m[0] || !strcmp(m, r->ref_model)) return NULL;
    size_t bl = strlen(r->ref_model);
    if (bl && !strncmp(m, r->ref_model, bl) && m[bl] == ':' && m[bl + 1]) return m + bl + 1;
    return m;
}

static const rep_adapter_t *rep_adapter(const replica_t *p, const char *name) {
    for (int k = 0; k < p->n_adapters; k++)
        if (!strcmp(p->adapters[k].name, name)) return &p->adapters[k];
    return NULL;
}

/* NAME as an UP replica lists it (one with its digest first), or NULL. */
static const rep_adapter_t *any_adapter(const loom_router_t *r, const char *name) {
    const rep_adapter_t *found = NULL;
    for (int i = 0; i < MAX_REPLICAS; i++) {
        const rep_adapter_t *a = r->reps[i].used && r->reps[i].state == REP_UP ? rep_adapter(&r->reps[i], name) : NULL;
        if (a && (!found || (!found->digest[0] && a->digest[0]))) found = a;
    }
    return found;
}

/* A request for a LoRA adapter goes only to replicas that serve it (when
 * some do; else anywhere, whose answer names the problem), and among those
 * to the ones that hold it in their engines now, if any: it then starts
 * without a load and other adapters are not evicted for it. */
static void adapter_preference(const loom_router_t *r, const char *name, const int *slot,
                               loom_route_cand_t *c, int n) {
    int serving = 0, resident = 0;
    for (int j = 0; j < n; j++) {
        const rep_adapter_t *a = c[j].usable ? rep_adapter(&r->reps[slot[j]], name) : NULL;
        serving += a != NULL;
        resident += a && a->resident;
    }
    for (int j = 0; j < n && serving; j++) {
        const rep_adapter_t *a = rep_adapter(&r->reps[slot[j]], name);
        if (!a || (resident && !a->resident)) c[j].usable = 0;
    }
}

/* The routing key's block hashes: token blocks with a tokenizer (the
 * coordinators' own hashes), else blocks of 4 bytes per token of the text
 * (the router's history only). */
static int route_hashes(const loom_router_t *r, const route_t *q, uint64_t *h) {
    int B = block_size(r);
    const char *ad = adapter_name(r, q->rq->generate);
    const rep_adapter_t *a = ad ? any_adapter(r, ad) : NULL;
    /* an adapter's blocks are keyed by its content digest (the coordinator's seeded chain) */
    if (q->prompt) return loom_prefix_hashes_seeded(q->prompt, q->n_prompt, B, a ? a->seed : 0, h, MAX_HASHES);
    const char *text = q->rq->generate->prompt;
    size_t n = text ? strlen(text) : 0, bb = (size_t)B * 4;
    int k = 0;
    uint64_t parent = 0;
    for (size_t off = 0; off + bb <= n && k < MAX_HASHES; off += bb) {
        uint64_t x = parent ^ 0x84222325cbf29ce4ull;
        for (size_t j = 0; j < bb; j++)
            x = (x ^ (unsigned char)text[off + j]) * 0x100000001b3ull;
        parent = h[k++] = x | 1;
    }
    return k;
}

static const char *session_key(const route_t *q) {
    const Loom__V1__GenerateRequest *g = q->rq->generate;
    if (g->session && g->session[0]) return g->session;
    return g->tag && g->tag[0] ? g->tag : NULL;
}

/* The slot of KV tier `id` in tier_index (a new one when `add`); -1: none. */
static int tier_slot(loom_router_t *r, uint64_t id, int add) {
    for (int t = 0; t < r->n_tiers; t++)
        if (r->tier_ids[t] == id) return t;
    if (!add || !id || r->n_tiers == MAX_REPLICAS) return -1;
    r->tier_ids[r->n_tiers] = id;
    return r->n_tiers++;
}

/* match[i]: the leading blocks of hashes[0..n) replica i holds, in its pool
 * or in the KV tier it shares (whichever reaches further); tier[i] (when
 * asked): how many of them only the tier holds. */
static void match_blocks(loom_router_t *r, const uint64_t *hashes, int n, int *match, int *tier) {
    loom_prefix_index_match(r->index, hashes, n, match, MAX_REPLICAS);
    if (tier) memset(tier, 0, MAX_REPLICAS * sizeof *tier);
    if (!r->n_tiers) return;
    int in_tier[MAX_REPLICAS] = {0};
    loom_prefix_index_match(r->tier_index, hashes, n, in_tier, r->n_tiers);
    for (int i = 0; i < MAX_REPLICAS; i++) {
        int t = r->reps[i].used && r->reps[i].tier_id ? tier_slot(r, r->reps[i].tier_id, 0) : -1;
        if (t < 0 || in_tier[t] <= match[i]) continue;
        if (tier) tier[i] = in_tier[t] - match[i];
        match[i] = in_tier[t];
    }
}

/* Picks an UP replica not in `exclude`, by the request's policy; -1: none. */
static int pick(loom_router_t *r, route_t *q, uint64_t exclude, uint64_t *hashes, int n_hashes) {
    loom_route_cand_t c[MAX_REPLICAS];
    int slot[MAX_REPLICAS],
        n = 0; /* candidates in slot order (round robin over the replicas that exist) */
    int match[MAX_REPLICAS] = {0}, tier[MAX_REPLICAS] = {0};
    if (n_hashes) match_blocks(r, hashes, n_hashes, match, tier);
    int any = 0;
    for (int i = 0; i < MAX_REPLICAS; i++) {
        const replica_t *p = &r->reps[i];
        if (!p->used) continue;
        slot[n] = i;
        int role_ok = !r->cfg.pd || p->prefill == (q->pd_phase == 1);
        c[n] =
            (loom_route_cand_t){.usable = p->state == REP_UP && !(exclude & (1ull << i)) && role_ok,
                                .matched_blocks = match[i],
                                .tier_blocks = tier[i],
                                .tier_cost = r->cfg.tier_token_cost,
                                .inflight = p->inflight,
                                .inflight_tokens = p->inflight_tokens,
                                .waiting = p->waiting,
                                .kv_usage = p->kv_total ? (double)p->kv_used / p->kv_total : 0.0};
        any |= c[n++].usable;
    }
    if (!any) return -1;
    const char *ad = adapter_name(r, q->rq->generate);
    if (ad) adapter_preference(r, ad, slot, c, n);
    unsigned rr = r->rr++;
    int n_tokens = q->prompt ? q->n_prompt : n_hashes * block_size(r), k;
    switch (q->policy) {
    case LOOM_POLICY_ROUND_ROBIN:
        k = loom_route_pick_round_robin(c, n, rr);
        break;
    case LOOM_POLICY_LEAST_LOADED:
        k = loom_route_pick_least_loaded(c, n, rr);
        break;
    case LOOM_POLICY_SESSION: {
        const char *key = session_key(q);
        uint64_t h = key ? str_hash(key) : 0;
        int s = (int)(h % SESSION_SLOTS);
        if (key && r->sessions[s].key == h) {
            int i = r->sessions[s].rep;
            for (int j = 0; j < n; j++)
                if (slot[j] == i && c[j].usable) return i;
        }
        k = loom_route_pick_least_loaded(c, n, rr);
        if (key && k >= 0) {
            r->sessions[s].key = h;
            r->sessions[s].rep = slot[k];
        }
        break;
    }
    default:
        k = loom_route_pick_prefix(c, n, n_tokens, block_size(r), r->cfg.lambda, rr);
        break;
    }
    return k < 0 ? -1 : slot[k];
}

/* Sends q (again) to a replica other than those tried; on failure ends it.
 * Returns 0 when sent, -1 when q was ended and freed. */
static int place(loom_router_t *r, route_t *q, const char *why) {
    uint64_t hashes[MAX_HASHES];
    int nh = q->policy == LOOM_POLICY_PREFIX ? route_hashes(r, q, hashes) : 0;
    const Loom__V1__GenerateRequest *cg = q->rq->generate;
    if (r->cfg.pd && q->pd_phase == 0) /* a client's own kv_transfer_params go through as they are */
        q->pd_phase = (cg->kv_transfer_params && cg->kv_transfer_params[0]) ||
                              (q->prompt && q->n_prompt < r->cfg.pd_min_prompt_tokens)
                          ? 2
                          : 1;
    for (;;) {
        uint64_t now = loom_now_ns();
        if (now >= q->deadline) {
            r->deadline_exceeded++;
            client_error(r, q->rid, q->rid_len, q->client_id, LOOM_ERR_DEADLINE_EXCEEDED,
                         "the request ran past the router's --request-timeout-ms");
            route_free(r, q);
            return -1;
        }
        if (q->attempts > r->cfg.max_retries) {
            char msg[600];
            snprintf(msg, sizeof msg,
                     "no replica could complete the request after %d attempts (last: %s)",
                     q->attempts, why);
            r->failover_gave_up++;
            client_error(r, q->rid, q->rid_len, q->client_id, LOOM_ERR_UNAVAILABLE, msg);
            route_free(r, q);
            return -1;
        }
        int i = pick(r, q, q->tried, hashes, nh);
        if (i < 0 && q->tried)
            i = pick(r, q, 0, hashes, nh); /* every replica tried: any UP one again */
        if (i < 0 && q->pd_phase == 1) { /* no prefill replica: the decode side computes it all */
            q->pd_phase = 2;
            continue;
        }
        if (i < 0) {
            char msg[600];
            snprintf(msg, sizeof msg, "no replica is available to serve the request%s%s",
                     why ? ": " : "", why ? why : "");
            r->unplaceable++;
            client_error(r, q->rid, q->rid_len, q->client_id, LOOM_ERR_UNAVAILABLE, msg);
            route_free(r, q);
            return -1;
        }
        route_detach(r, q);
        route_rehash(r, q);
        Loom__V1__Request rq = *q->rq;
        Loom__V1__GenerateRequest g = *q->rq->generate;
        rq.generate = &g;
        rq.request_id = q->up_id;
        if (!q->prompt) g.return_prompt_ids = 1; /* no tokenizer: the replica tells us the prompt's ids */
        if (q->pd_phase == 1) { /* the prefill: one token, its blocks written for the decode */
            g.max_tokens = 1;
            g.kv_transfer_params = (char *)"{\"do_remote_decode\":true}";
            g.no_cache = 1;
        } else if (q->kv_params) {
            g.kv_transfer_params = q->kv_params;
        }
        int32_t *ids = NULL;
        if (q->n_gen > 0) { /* continue from the tokens already streamed */
            ids = loom_xmalloc((size_t)(q->n_prompt + q->n_gen) * sizeof *ids);
            memcpy(ids, q->prompt, (size_t)q->n_prompt * sizeof *ids);
            memcpy(ids + q->n_prompt, q->gen, (size_t)q->n_gen * sizeof *ids);
            g.prompt = (char *)"";
            g.prompt_ids = ids;
            g.n_prompt_ids = (size_t)(q->n_prompt + q->n_gen);
            if (g.max_tokens) g.max_tokens -= (uint32_t)q->n_gen;
            g.sample_step_offset += (uint32_t)q->n_gen; /* seeded sampling goes on where it was */
        }
        if (q->n_gen > 0 && !q->own_text && r->tok && g.n_stop == 0 && g.n_stop_token_ids == 0) {
            char scratch[1024];
            loom_detok_init(&q->detok, r->tok, !g.keep_special, 0);
            loom_detok_keep(&q->detok, q->rq->generate->keep_special_ids, (int)q->rq->generate->n_keep_special_ids);
            for (int k = 0; k < q->n_gen; k++)
                loom_detok_push(&q->detok, q->gen[k], scratch, sizeof scratch);
            q->own_text = 1; /* what it holds is what the old replica never sent */
        }
        int rc = send_replica(r, i, &rq);
        free(ids);
        q->attempts++;
        q->tried |= 1ull << i;
        if (rc < 0) { /* its other requests move at the next tick */
            replica_t *d = &r->reps[i];
            d->failures++;
            d->backoff_ms = BACKOFF_MIN_MS;
            d->open_until_ns = now + (uint64_t)d->backoff_ms * 1000000ull;
            d->probe_sent_ns = 0;
            set_state(r, i, REP_DOWN, "cannot send to it: %s", zmq_strerror(errno));
            continue;
        }
        replica_t *p = &r->reps[i];
        if (q->attempts == 1) q->inside_ns = loom_now_ns() - q->t_arrival;
        q->rep = i;
        q->got_first = 0;
        q->t_sent = q->t_last = now;
        p->inflight++;
        p->inflight_tokens += q->n_prompt + q->n_gen;
        p->routed++;
        if (q->attempts == 1) r->routed[q->policy]++;
        if (nh) { /* routing history: this replica will hold these blocks */
            int match[MAX_REPLICAS];
            match_blocks(r, hashes, nh, match, NULL);
            q->hit_blocks = match[i];
            r->index_hit_blocks += (uint64_t)match[i];
            r->index_query_blocks += (uint64_t)nh;
            loom_prefix_index_insert(r->index, hashes, nh, i);
        }
        return 0;
    }
}

/* The request lost its replica (why): continue it elsewhere. */
static void fail_over(loom_router_t *r, route_t *q, const char *why) {
    cancel_upstream(r, q); /* the old replica may still be streaming it */
    if (q->rep >= 0) r->reps[q->rep].failovers++;
    if (q->n_gen > 0 &&
        !q->prompt) { /* without the tokenizer the prompt cannot be continued as ids */
        char msg[600];
        snprintf(msg, sizeof msg,
                 "the replica serving the request failed mid-stream (%s) before it sent the prompt's "
                 "ids, and the router has no tokenizer (--model) to continue it elsewhere",
                 why);
        client_error(r, q->rid, q->rid_len, q->client_id, LOOM_ERR_UNAVAILABLE, msg);
        route_free(r, q);
        return;
    }
    uint32_t max = q->rq->generate->max_tokens;
    if (max &&
        (uint32_t)q->n_gen >= max) { /* every token was streamed; only the final chunk was lost */
        Loom__V1__Reply fin = LOOM__V1__REPLY__INIT;
        Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
        Loom__V1__Usage u = LOOM__V1__USAGE__INIT;
        u.prompt_tokens = (uint32_t)q->n_prompt;
        u.completion_tokens = (uint32_t)q->n_gen;
        fin.request_id = q->client_id;
        ch.final = 1;
        ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_LENGTH;
        ch.usage = &u;
        char *tail = NULL;
        if (q->own_text) { /* what the detokenizer still holds */
            size_t per = loom_tokenizer_max_piece_len(r->tok) + 256;
            tail = loom_xmalloc(per + 1);
            tail[loom_detok_flush(&q->detok, tail, per)] = 0;
            ch.text = tail;
        }
        fin.body_case = LOOM__V1__REPLY__BODY_CHUNK;
        fin.chunk = &ch;
        send_client(r, q->rid, q->rid_len, &fin);
        free(tail);
        route_free(r, q);
        return;
    }
    r->failovers++;
    /* named by the router-wide id (and the caller's tag): client ids count per
     * connection, so every gateway connection's first request is "request 1" */
    const char *tag = q->rq && q->rq->generate && q->rq->generate->tag ? q->rq->generate->tag : "";
    for (const char *c = tag; *c; c++)
        if (*c < 0x20 || *c > 0x7e || c - tag >= 128) tag = ""; /* only a printable tag is logged */
    LOOM_INFO("request r%llu%s%.128s%s: moving to another replica after %d streamed tokens (%s)",
              (unsigned long long)q->up_id, tag[0] ? " (" : "", tag, tag[0] ? ")" : "", q->n_gen, why);
    place(r, q, why);
}

static void replica_down(loom_router_t *r, int i, const char *why) {
    replica_t *p = &r->reps[i];
    p->failures++;
    p->backoff_ms = p->backoff_ms ? p->backoff_ms * 2 : BACKOFF_MIN_MS;
    if (p->backoff_ms > BACKOFF_MAX_MS) p->backoff_ms = BACKOFF_MAX_MS;
    p->open_until_ns = loom_now_ns() + (uint64_t)p->backoff_ms * 1000000ull;
    p->probe_sent_ns = 0;
    if (p->events) { /* a restarted replica may publish elsewhere: its next Stats says where */
        zmq_close(p->events);
        p->events = NULL;
    }
    set_state(r, i, REP_DOWN, "%s", why);
    for (route_t *q = r->routes, *nx; q; q = nx) {
        nx = q->next;
        if (q->rep == i) fail_over(r, q, why);
    }
}

/* ---- client requests ------------------------------------------------------------------------- */

/* Tenant limits and the response cache, before a request is routed: 1 when
 * it was answered here (refused, or replayed from the cache), else 0 with
 * *crec the recording of its stream (NULL: not cached). */
static int front_door(loom_router_t *r, const void *rid, size_t rid_len, Loom__V1__Request *rq,
                      int tenant, loom_rcache_rec_t **crec) {
    uint64_t now = loom_now_ns();
    *crec = NULL;
    if (tenant >= 0) {
        char msg[300];
        int retry_ms = 0;
        if (loom_tenants_admit(r->tenants, tenant, now, &retry_ms, msg, sizeof msg) < 0) {
            loom_zapi_reply_error_retry(api_out(r), rid, rid_len, rq->request_id,
                                        LOOM_ERR_RESOURCE_EXHAUSTED, msg, (uint32_t)retry_ms);
            return 1;
        }
    }
    if (!r->rcache) return 0;
    if (!loom_rcache_cacheable(rq->generate)) {
        loom_rcache_note_bypass(r->rcache);
        return 0;
    }
    /* an adapter's output is a function of its content, not its name: the
     * key holds its digest (a reload under the name with other weights is
     * another key); an adapter no replica lists with a digest is not cached */
    Loom__V1__GenerateRequest keyed = *rq->generate;
    char lora_key[80];
    const char *ad = adapter_name(r, rq->generate);
    if (ad) {
        const rep_adapter_t *a = any_adapter(r, ad);
        if (!a || !a->digest[0]) {
            loom_rcache_note_bypass(r->rcache);
            return 0;
        }
        snprintf(lora_key, sizeof lora_key, "lora:%s", a->digest);
        keyed.model = lora_key;
    }
    size_t kl;
    unsigned char *key = loom_rcache_key(&keyed, r->ref_model, &kl);
    loom_rcache_hit_t hit;
    if (loom_rcache_get(r->rcache, key, kl, now, &hit)) {
        long long tokens = loom_rcache_replay(&hit, api_out(r), rid, rid_len, rq->request_id);
        if (tokens < 0) r->disconnects++;
        if (tenant >= 0) loom_tenants_release(r->tenants, tenant, tokens > 0 ? tokens : 0, now);
        free(key);
        return 1;
    }
    *crec = loom_rcache_rec_begin(r->rcache, key, kl);
    return 0;
}

static void on_generate(loom_router_t *r, const void *rid, size_t rid_len, Loom__V1__Request *rq,
                        int tenant) {
    Loom__V1__GenerateRequest *g = rq->generate;
    int has_text = g->prompt && g->prompt[0];
    if (!has_text && g->n_prompt_ids == 0) {
        client_error(r, rid, rid_len, rq->request_id, LOOM_ERR_INVALID_ARGUMENT,
                     "the request has neither a prompt nor prompt_ids");
        protobuf_c_message_free_unpacked(&rq->base, NULL);
        return;
    }
    loom_rcache_rec_t *crec;
    if (front_door(r, rid, rid_len, rq, tenant, &crec)) {
        protobuf_c_message_free_unpacked(&rq->base, NULL);
        return;
    }
    route_t *q = loom_xcalloc(1, sizeof *q);
    q->tenant = tenant;
    q->crec = crec;
    memcpy(q->rid, rid, rid_len);
    q->rid_len = rid_len;
    q->client_id = rq->request_id;
    q->rq = rq;
    q->rep = -1;
    q->policy = r->cfg.policy;
    q->t_arrival = r->t_recv;
    q->deadline = q->t_arrival + (uint64_t)r->cfg.request_timeout_ms * 1000000ull;
    if (has_text && r->tok && r->n_tok_th > 0) { /* off the reactor: it waits as `tokenizing` */
        tok_job_t *job = loom_xcalloc(1, sizeof *job);
        job->text = loom_xstrdup(g->prompt);
        job->raw = g->raw_prompt;
        route_rehash(r, q);
        job->key = q->up_id;
        if (zmq_send(r->tok_jobs, &job, sizeof job, ZMQ_DONTWAIT) == (int)sizeof job) {
            q->tokenizing = 1;
            q->next = r->routes;
            if (r->routes) r->routes->prev = q;
            r->routes = q;
            r->n_routes++;
            return;
        }
        route_unhash(r, q); /* the threads' queue is full: tokenize here */
        free(job->text);
        free(job);
    }
    if (has_text && r->tok) {
        int cap = 0;
        loom_err_t err = {0};
        int raw = g->raw_prompt;
        if (loom_tokenizer_encode(r->tok, g->prompt, strlen(g->prompt), !raw, raw, &q->prompt,
                                  &q->n_prompt, &cap, &err) < 0) {
            char msg[600];
            snprintf(msg, sizeof msg, "cannot tokenize the prompt: %s", err.msg);
            client_error(r, rid, rid_len, rq->request_id, LOOM_ERR_INVALID_ARGUMENT, msg);
            if (q->tenant >= 0) loom_tenants_release(r->tenants, q->tenant, 0, loom_now_ns());
            loom_rcache_rec_abort(&q->crec);
            free(q->prompt);
            free(q);
            protobuf_c_message_free_unpacked(&rq->base, NULL);
            return;
        }
    } else if (!has_text) {
        q->n_prompt = (int)g->n_prompt_ids;
        q->prompt = loom_xmalloc((size_t)q->n_prompt * sizeof *q->prompt);
        memcpy(q->prompt, g->prompt_ids, (size_t)q->n_prompt * sizeof *q->prompt);
    }
    q->strip_pids = !g->return_prompt_ids && !g->prompt_logprobs;
    q->next = r->routes;
    if (r->routes) r->routes->prev = q;
    r->routes = q;
    r->n_routes++;
    place(r, q, NULL);
}

static void *tok_main(void *arg) {
    loom_router_t *r = arg;
    void *in = zmq_socket(r->zctx, ZMQ_PULL), *out = zmq_socket(r->zctx, ZMQ_PUSH);
    int zero = 0, slice = 100;
    zmq_setsockopt(in, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(out, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(in, ZMQ_RCVTIMEO, &slice, sizeof slice);
    zmq_connect(in, "inproc://loom-router-tok-jobs");
    zmq_connect(out, "inproc://loom-router-tok-results");
    while (!r->tok_stop) {
        tok_job_t *job;
        if (zmq_recv(in, &job, sizeof job, 0) != (int)sizeof job) continue;
        int cap = 0;
        job->st = loom_tokenizer_encode(r->tok, job->text, strlen(job->text), !job->raw, job->raw,
                                        &job->ids, &job->n, &cap, &job->err);
        zmq_send(out, &job, sizeof job, 0);
    }
    zmq_close(in);
    zmq_close(out);
    return NULL;
}

/* A tokenizer thread is done with a prompt: route its request, unless it
 * ended meanwhile (cancelled, client gone, deadline). */
static void on_tokenized(loom_router_t *r, tok_job_t *job) {
    route_t *q = route_find(r, job->key);
    if (q && q->tokenizing) {
        q->tokenizing = 0;
        if (job->st < 0) {
            char msg[600];
            snprintf(msg, sizeof msg, "cannot tokenize the prompt: %s", job->err.msg);
            client_error(r, q->rid, q->rid_len, q->client_id, LOOM_ERR_INVALID_ARGUMENT, msg);
            route_free(r, q);
        } else {
            q->prompt = job->ids;
            q->n_prompt = job->n;
            job->ids = NULL;
            place(r, q, NULL);
        }
    }
    free(job->ids);
    free(job->text);
    free(job);
}

static route_t *route_of_client(loom_router_t *r, const void *rid, size_t rid_len, uint64_t id) {
    for (route_t *q = r->routes; q; q = q->next)
        if (q->client_id == id && q->rid_len == rid_len && !memcmp(q->rid, rid, rid_len)) return q;
    return NULL;
}

static void on_cancel(loom_router_t *r, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    route_t *q = route_of_client(r, rid, rid_len, rq->cancel->target_request_id);
    Loom__V1__CancelReply cr = LOOM__V1__CANCEL_REPLY__INIT;
    cr.found = q != NULL;
    Loom__V1__Reply rep = LOOM__V1__REPLY__INIT;
    rep.request_id = rq->request_id;
    rep.body_case = LOOM__V1__REPLY__BODY_CANCEL;
    rep.cancel = &cr;
    send_client(r, rid, rid_len, &rep);
    if (!q) return;
    r->cancels++;
    cancel_upstream(r, q);
    /* the replica's final chunk (CANCELLED) ends the stream; without a replica, end it here */
    if (q->rep < 0 || r->reps[q->rep].state != REP_UP) {
        Loom__V1__Reply fin = LOOM__V1__REPLY__INIT;
        Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
        fin.request_id = q->client_id;
        fin.code = loom_wire_status_code(LOOM_ERR_CANCELLED);
        fin.message = (char *)"cancelled by the client";
        ch.final = 1;
        ch.finish_reason = LOOM__V1__FINISH_REASON__FINISH_CANCELLED;
        fin.body_case = LOOM__V1__REPLY__BODY_CHUNK;
        fin.chunk = &ch;
        send_client(r, q->rid, q->rid_len, &fin);
        route_free(r, q);
    }
}

static int n_state(const loom_router_t *r, rep_state_t st) {
    int n = 0;
    for (int i = 0; i < MAX_REPLICAS; i++)
        n += r->reps[i].used && r->reps[i].state == st;
    return n;
}

static int n_known(const loom_router_t *r) {
    int n = 0;
    for (int i = 0; i < MAX_REPLICAS; i++)
        n += r->reps[i].used && r->reps[i].state != REP_REFUSED;
    return n;
}

static void on_health(loom_router_t *r, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    Loom__V1__HealthReply h = LOOM__V1__HEALTH_REPLY__INIT;
    int up = n_state(r, REP_UP), known = n_known(r);
    char msg[600];
    h.ready = up > 0;
    h.state = (char *)(up == 0 ? "waiting_for_workers" : up < known ? "degraded" : "ready");
    h.workers_ready = (uint32_t)up;
    h.workers_expected = (uint32_t)known;
    if (up)
        snprintf(msg, sizeof msg, "routing %s to %d of %d replica(s) (policy %s)", r->ref_model, up,
                 known, loom_policy_name(r->cfg.policy));
    else
        snprintf(msg, sizeof msg, "no replica is up (%d known, %d refused)", known,
                 n_state(r, REP_REFUSED));
    h.message = msg;
    Loom__V1__Reply rep = LOOM__V1__REPLY__INIT;
    rep.request_id = rq->request_id;
    rep.body_case = LOOM__V1__REPLY__BODY_HEALTH;
    rep.health = &h;
    send_client(r, rid, rid_len, &rep);
}

/* The served model, then every LoRA adapter an UP replica serves (once,
 * resident when some replica holds it). */
static void on_list_models(loom_router_t *r, const void *rid, size_t rid_len,
                           Loom__V1__Request *rq) {
    int cap = 1;
    for (int i = 0; i < MAX_REPLICAS; i++) cap += r->reps[i].n_adapters;
    Loom__V1__ModelInfo *infos = loom_xcalloc((size_t)cap, sizeof *infos);
    Loom__V1__ModelInfo **mp = loom_xcalloc((size_t)cap, sizeof *mp);
    Loom__V1__ModelInfo mi = LOOM__V1__MODEL_INFO__INIT;
    Loom__V1__ListModelsReply lm = LOOM__V1__LIST_MODELS_REPLY__INIT;
    if (r->have_ref) {
        mi.id = r->ref_model;
        mi.context_length = (uint32_t)r->ref_ctx;
        mi.vocab_size = (uint32_t)r->ref_vocab;
        mi.tp = (uint32_t)r->ref_tp;
        mi.pp = (uint32_t)r->ref_pp;
        infos[0] = mi;
        mp[0] = &infos[0];
        size_t n = 1;
        for (int i = 0; i < MAX_REPLICAS; i++) {
            const replica_t *p = &r->reps[i];
            if (!p->used || p->state != REP_UP) continue;
            for (int k = 0; k < p->n_adapters; k++) {
                const rep_adapter_t *a = &p->adapters[k];
                size_t j = 1;
                while (j < n && strcmp(infos[j].id, a->name)) j++;
                if (j == n) {
                    infos[n] = mi;
                    infos[n].id = (char *)a->name;
                    infos[n].parent = r->ref_model;
                    infos[n].root = (char *)a->root;
                    infos[n].adapter_digest = (char *)a->digest;
                    mp[n] = &infos[n];
                    n++;
                }
                infos[j].resident |= a->resident;
            }
        }
        lm.models = mp;
        lm.n_models = n;
    }
    Loom__V1__Reply rep = LOOM__V1__REPLY__INIT;
    rep.request_id = rq->request_id;
    if (!r->have_ref) {
        rep.code = loom_wire_status_code(LOOM_ERR_UNAVAILABLE);
        rep.message = (char *)"no replica has joined yet";
    }
    rep.body_case = LOOM__V1__REPLY__BODY_MODELS;
    rep.models = &lm;
    send_client(r, rid, rid_len, &rep);
    free(mp);
    free(infos);
}

/* Sums of the UP replicas' last Stats. */
static void on_stats(loom_router_t *r, const void *rid, size_t rid_len, Loom__V1__Request *rq) {
    Loom__V1__StatsReply st = LOOM__V1__STATS_REPLY__INIT;
    for (int i = 0; i < MAX_REPLICAS; i++) {
        const replica_t *p = &r->reps[i];
        if (!p->used || p->state != REP_UP) continue;
        st.running += (uint32_t)p->running;
        st.waiting += (uint32_t)p->waiting;
        st.preparing += (uint32_t)p->preparing;
        st.kv_blocks_total += (uint32_t)p->kv_total;
        st.kv_blocks_used += (uint32_t)p->kv_used;
        st.prefix_cache_queries += p->prefix_queries;
        st.prefix_cache_hits += p->prefix_hits;
        st.gen_tokens_per_s += p->gen_tps;
        st.requests_finished += p->finished;
        st.requests_rejected += p->rejected;
        st.preemptions += p->preemptions;
        st.prompt_tokens_total += p->prompt_tokens;
        st.gen_tokens_total += p->gen_tokens;
        st.steps += p->steps;
    }
    st.kv_blocks_free = st.kv_blocks_total - st.kv_blocks_used;
    st.prefix_cache_hit_rate = st.prefix_cache_queries
                                   ? (double)st.prefix_cache_hits / (double)st.prefix_cache_queries
                                   : 0.0;
    st.kv_block_size = (uint32_t)block_size(r);
    st.kv_cache_dtype = (char *)"";
    Loom__V1__Reply rep = LOOM__V1__REPLY__INIT;
    rep.request_id = rq->request_id;
    rep.body_case = LOOM__V1__REPLY__BODY_STATS;
    rep.stats = &st;
    send_client(r, rid, rid_len, &rep);
}

static void on_api(loom_router_t *r, zmq_msg_t *frames, int n) {
    const void *rid = zmq_msg_data(&frames[0]);
    size_t rid_len = zmq_msg_size(&frames[0]);
    if (n != 3 || rid_len > sizeof((route_t *)0)->rid) {
        client_error(
            r, rid, rid_len, 0, LOOM_ERR_INVALID_ARGUMENT,
            "malformed request: expected two frames, the method name and a loom.v1.Request");
        return;
    }
    loom_err_t err = {0};
    Loom__V1__Request *rq =
        loom_wire_unpack_request(zmq_msg_data(&frames[2]), zmq_msg_size(&frames[2]), &err);
    if (!rq) {
        LOOM_WARN("refused a client request: %s", err.msg);
        client_error(r, rid, rid_len, 0, LOOM_ERR_INVALID_ARGUMENT, err.msg);
        return;
    }
    const char *method = loom_wire_method(rq->body_case);
    size_t ml = zmq_msg_size(&frames[1]);
    const char *key = r->cfg.api_key;
    int listed = 0, tenant = r->tenants ? loom_tenants_find(r->tenants, rq->api_key, &listed) : -1;
    if (listed) key = NULL; /* a key the tenants file names is a key the router takes */
    if (strlen(method) != ml || memcmp(method, zmq_msg_data(&frames[1]), ml) != 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "the method frame does not name the request's body (%s)", method);
        client_error(r, rid, rid_len, rq->request_id, LOOM_ERR_INVALID_ARGUMENT, msg);
    } else if (key && !(rq->api_key &&
                        loom_secret_equal(key, strlen(key), rq->api_key, strlen(rq->api_key)))) {
        client_error(r, rid, rid_len, rq->request_id, LOOM_ERR_UNAUTHENTICATED,
                     "missing or wrong API key");
    } else {
        switch (rq->body_case) {
        case LOOM__V1__REQUEST__BODY_GENERATE:
            on_generate(r, rid, rid_len, rq, tenant);
            return; /* keeps rq */
        case LOOM__V1__REQUEST__BODY_CANCEL:
            on_cancel(r, rid, rid_len, rq);
            break;
        case LOOM__V1__REQUEST__BODY_HEALTH:
            on_health(r, rid, rid_len, rq);
            break;
        case LOOM__V1__REQUEST__BODY_LIST_MODELS:
            on_list_models(r, rid, rid_len, rq);
            break;
        case LOOM__V1__REQUEST__BODY_STATS:
            on_stats(r, rid, rid_len, rq);
            break;
        case LOOM__V1__REQUEST__BODY_LOAD_LORA_ADAPTER:
        case LOOM__V1__REQUEST__BODY_UNLOAD_LORA_ADAPTER:
            client_error(r, rid, rid_len, rq->request_id, LOOM_ERR_INVALID_ARGUMENT,
                         "the router does not load LoRA adapters: load or unload them on each replica "
                         "(its coordinator's /v1/load_lora_adapter); the router lists and routes to what "
                         "they serve");
            break;
        default:
            break;
        }
    }
    protobuf_c_message_free_unpacked(&rq->base, NULL);
}

/* ---- replica replies ------------------------------------------------------------------------- */

static void send_probe(loom_router_t *r, int i, Loom__V1__Request__BodyCase body);

/* The LoRA adapters of a ListModels reply (every entry with a parent). */
static void take_adapters(replica_t *p, const Loom__V1__ListModelsReply *lm) {
    free(p->adapters);
    p->adapters = NULL;
    p->n_adapters = 0;
    int n = 0;
    for (size_t k = 0; k < lm->n_models; k++) n += lm->models[k]->parent && lm->models[k]->parent[0];
    if (!n) return;
    p->adapters = loom_xcalloc((size_t)n, sizeof *p->adapters);
    for (size_t k = 0; k < lm->n_models; k++) {
        const Loom__V1__ModelInfo *m = lm->models[k];
        if (!m->parent || !m->parent[0]) continue;
        rep_adapter_t *a = &p->adapters[p->n_adapters++];
        snprintf(a->name, sizeof a->name, "%s", m->id);
        snprintf(a->root, sizeof a->root, "%s", m->root ? m->root : "");
        a->resident = m->resident;
        const char *d = m->adapter_digest ? m->adapter_digest : "";
        if (strlen(d) == 64) {
            uint8_t lo[8];
            for (int b = 0; b < 8; b++) {
                unsigned v = 0;
                sscanf(d + 2 * b, "%2x", &v);
                lo[b] = (uint8_t)v;
            }
            memcpy(&a->seed, lo, sizeof a->seed); /* as the coordinator's scheduler seeds it */
            if (a->seed == 0) a->seed = 1;
            snprintf(a->digest, sizeof a->digest, "%s", d);
        }
    }
}

static void on_models(loom_router_t *r, int i, const Loom__V1__Reply *rep) {
    replica_t *p = &r->reps[i];
    int ok = rep->code == LOOM__V1__STATUS_CODE__OK && rep->models && rep->models->n_models >= 1;
    if (p->state == REP_UP && ok) take_adapters(p, rep->models); /* its adapters now */
    if (p->state != REP_JOINING) return;
    if (rep->code != LOOM__V1__STATUS_CODE__OK || !rep->models || rep->models->n_models < 1) {
        snprintf(p->why, sizeof p->why, "ListModels failed: %s",
                 rep->message ? rep->message : "no model");
        return; /* asked again at the next probe */
    }
    const Loom__V1__ModelInfo *m = rep->models->models[0];
    int tok_vocab = r->tok ? loom_tokenizer_vocab_size(r->tok) : 0;
    if (tok_vocab && (int)m->vocab_size < tok_vocab) {
        set_state(
            r, i, REP_REFUSED,
            "its model '%s' has a vocabulary of %u tokens; the router's tokenizer (--model) has %d",
            m->id, m->vocab_size, tok_vocab);
        r->refused_joins++;
        return;
    }
    if (!r->have_ref && r->ref_model[0] && strcmp(m->id, r->ref_model)) {
        set_state(r, i, REP_REFUSED,
                  "it serves model '%s' (vocabulary %u) but the router serves '%s'", m->id,
                  m->vocab_size, r->ref_model);
        r->refused_joins++;
        return;
    }
    const char *wd = m->weights_digest ? m->weights_digest : "", *td = m->tokenizer_digest ? m->tokenizer_digest : "";
    if ((r->ref_weights[0] && wd[0] && strcmp(wd, r->ref_weights)) ||
        (r->ref_tokenizer[0] && td[0] && strcmp(td, r->ref_tokenizer))) {
        int w = r->ref_weights[0] && wd[0] && strcmp(wd, r->ref_weights);
        set_state(r, i, REP_REFUSED, "it serves '%s' with other %s (digest %s; the reference, from %s, is %s)", m->id,
                  w ? "weights" : "tokenizer files", w ? wd : td, r->ref_digest_from,
                  w ? r->ref_weights : r->ref_tokenizer);
        r->refused_joins++;
        return;
    }
    if (!r->ref_weights[0] && wd[0]) { /* the first to publish them sets the reference */
        snprintf(r->ref_weights, sizeof r->ref_weights, "%s", wd);
        snprintf(r->ref_digest_from, sizeof r->ref_digest_from, "replica %s", p->addr);
    }
    if (!r->ref_tokenizer[0] && td[0]) snprintf(r->ref_tokenizer, sizeof r->ref_tokenizer, "%s", td);
    if (!r->have_ref) {
        r->have_ref = 1;
        snprintf(r->ref_model, sizeof r->ref_model, "%s", m->id);
        r->ref_vocab = (int)m->vocab_size;
        r->ref_ctx = (int)m->context_length;
        r->ref_tp = (int)m->tp;
        r->ref_pp = (int)m->pp;
        LOOM_INFO("serving model '%s' (vocabulary %d, context %d), as replica %s does",
                  r->ref_model, r->ref_vocab, r->ref_ctx, p->addr);
    } else if (strcmp(m->id, r->ref_model) || (int)m->vocab_size != r->ref_vocab ||
               (int)m->context_length != r->ref_ctx) {
        set_state(r, i, REP_REFUSED,
                  "it serves model '%s' (vocabulary %u, context %u) but the router serves '%s' "
                  "(vocabulary %d, context %d)",
                  m->id, m->vocab_size, m->context_length, r->ref_model, r->ref_vocab, r->ref_ctx);
        r->refused_joins++;
        return;
    }
    take_adapters(p, rep->models);
    set_state(r, i, REP_UP, "serves %s", m->id);
    p->backoff_ms = 0;
    send_probe(r, i,
               LOOM__V1__REQUEST__BODY_STATS); /* its load and KV events now, not a tick later */
}

static void events_open(loom_router_t *r, int i, const char *addr);

static void on_probe_reply(loom_router_t *r, int i, const Loom__V1__Reply *rep) {
    replica_t *p = &r->reps[i];
    p->probe_sent_ns = 0;
    if (rep->body_case == LOOM__V1__REPLY__BODY_MODELS) {
        on_models(r, i, rep);
    } else if (rep->body_case == LOOM__V1__REPLY__BODY_STATS && rep->stats) {
        const Loom__V1__StatsReply *s = rep->stats;
        p->running = (int)s->running;
        p->waiting = (int)s->waiting;
        p->preparing = (int)s->preparing;
        p->kv_total = (int)s->kv_blocks_total;
        p->kv_used = (int)s->kv_blocks_used;
        if (s->kv_block_size) p->block_size = (int)s->kv_block_size;
        p->prefix_queries = s->prefix_cache_queries;
        p->prefix_hits = s->prefix_cache_hits;
        p->finished = s->requests_finished;
        p->rejected = s->requests_rejected;
        p->preemptions = s->preemptions;
        p->prompt_tokens = s->prompt_tokens_total;
        p->gen_tokens = s->gen_tokens_total;
        p->steps = s->steps;
        p->gen_tps = s->gen_tokens_per_s;
        if (s->kv_events && s->kv_events[0] && !p->events && p->state == REP_UP)
            events_open(r, i, s->kv_events);
    } else if (rep->body_case == LOOM__V1__REPLY__BODY_HEALTH && rep->health) {
        if (p->state == REP_DOWN && rep->health->ready && loom_now_ns() >= p->open_until_ns) {
            p->state = REP_JOINING; /* probed back: check its model again, then UP */
            snprintf(p->why, sizeof p->why, "answers again");
        } else if (p->state == REP_UP && !rep->health->ready) {
            replica_down(r, i,
                         rep->health->message && rep->health->message[0] ? rep->health->message
                                                                         : "not ready");
        }
    }
}

/* ---- KV events: what the replicas' prefix caches really hold ------------------------------------
 */

/* Makes a socket towards a replica a CURVE client, when the router has
 * replica keys. */
static int replica_curve(const loom_router_t *r, void *s) {
    if (!r->rep_keyed) return 0;
    if (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, r->rep_server, LOOM_KEY_Z85) != 0) return -1;
    if (zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, r->rep_kp.public_z85, LOOM_KEY_Z85) != 0) return -1;
    return zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, r->rep_kp.secret_z85, LOOM_KEY_Z85) != 0 ? -1 : 0;
}

static void events_open(loom_router_t *r, int i, const char *addr) {
    replica_t *p = &r->reps[i];
    void *s = zmq_socket(r->zctx, ZMQ_SUB);
    int zero = 0;
    if (replica_curve(r, s) < 0) {
        LOOM_WARN("replica %s: cannot key its KV events socket: %s", p->addr, zmq_strerror(errno));
        zmq_close(s);
        return;
    }
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    int64_t maxmsg = LOOM_MAX_MSG_BYTES;
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
    if (zmq_connect(s, addr) != 0) {
        LOOM_WARN("replica %s: cannot subscribe to its KV events at %s: %s", p->addr, addr,
                  zmq_strerror(errno));
        zmq_close(s);
        return;
    }
    p->events = s;
    p->events_seq = 0;
    LOOM_INFO("replica %s: following its KV events at %s", p->addr, addr);
}

static void on_events(loom_router_t *r, int i, const void *data, size_t len) {
    replica_t *p = &r->reps[i];
    Loom__V1__KvEvents *m = loom__v1__kv_events__unpack(NULL, len, data);
    if (!m || m->magic != LOOM_PROTO_MAGIC || m->version != LOOM_PROTO_VERSION) {
        r->garbage++;
        if (m) loom__v1__kv_events__free_unpacked(m, NULL);
        return;
    }
    r->kv_events++;
    int gap = p->events_seq && m->seq != p->events_seq + 1;
    if (gap) r->kv_event_gaps++;
    if (m->cleared || gap)
        loom_prefix_index_drop_replica(r->index, i); /* what we knew may be wrong */
    p->events_seq = m->seq;
    p->tier_id = m->tier_id;
    if (p->state == REP_UP) {
        loom_prefix_index_insert(r->index, m->cached, (int)m->n_cached, i);
        /* with a tier below its pool an evicted block goes down to the tier, and stays a hit */
        for (size_t k = 0; k < m->n_evicted && !m->tier_id; k++)
            loom_prefix_index_remove(r->index, m->evicted[k], i);
        /* a block in a shared tier is a hit for every replica that shares it */
        int t = m->n_tier_stored ? tier_slot(r, m->tier_id, 1) : -1;
        if (t >= 0) loom_prefix_index_insert(r->tier_index, m->tier_stored, (int)m->n_tier_stored, t);
        r->kv_tier_blocks += m->n_tier_stored;
        r->kv_blocks_cached += m->n_cached;
        r->kv_blocks_evicted += m->n_evicted;
        p->running = (int)m->running;
        p->waiting = (int)m->waiting;
        p->kv_used = (int)m->kv_blocks_used;
        p->kv_total = (int)m->kv_blocks_total;
        if (m->block_size) p->block_size = (int)m->block_size;
    }
    loom__v1__kv_events__free_unpacked(m, NULL);
}

static void ttft_record(replica_t *p, double ms) {
    p->ttft_ms[p->ttft_pos] = ms;
    p->ttft_pos = (p->ttft_pos + 1) % TTFT_RING;
    if (p->n_ttft < TTFT_RING) p->n_ttft++;
}

/* A chunk no healthy replica sends: a token id outside the vocabulary, or a
 * final chunk that is empty (no finish reason, or no usage). Writes what is
 * wrong to why; 0 when the chunk is fine. */
static int chunk_fault(const loom_router_t *r, const Loom__V1__Reply *rep, char *why, size_t cap) {
    const Loom__V1__GenerateChunk *ch = rep->chunk;
    if (!ch) return 0;
    for (size_t k = 0; k < ch->n_ids; k++)
        if (ch->ids[k] < 0 || (r->ref_vocab > 0 && ch->ids[k] >= r->ref_vocab)) {
            snprintf(why, cap, "token id %d, outside the vocabulary of %d", (int)ch->ids[k], r->ref_vocab);
            return 1;
        }
    if (ch->final && rep->code == LOOM__V1__STATUS_CODE__OK &&
        (ch->finish_reason == LOOM__V1__FINISH_REASON__FINISH_NONE || !ch->usage)) {
        snprintf(why, cap, "an empty final chunk (%s)",
                 ch->finish_reason == LOOM__V1__FINISH_REASON__FINISH_NONE ? "no finish reason" : "no usage");
        return 1;
    }
    return 0;
}

/* The request's own fault (a bad argument, a prompt too long, a missing
 * permission): every replica would say the same, so the error goes to the
 * client instead of failing over. */
static int request_fault(loom_status_t st) {
    return st == LOOM_ERR_INVALID_ARGUMENT || st == LOOM_ERR_NOT_FOUND || st == LOOM_ERR_UNAUTHENTICATED ||
           st == LOOM_ERR_FORMAT || st == LOOM_ERR_UNSUPPORTED;
}

/* A decode replica could not load the KV its kv_transfer_params name and
 * its kv_load_failure_policy is fail (the coordinator's message says so,
 * coordinator/server.c): the operator asked for the error, and another try
 * would load from the same source, so it is relayed, not failed over. */
static int kv_load_refused(loom_status_t st, const Loom__V1__Reply *rep) {
    return st == LOOM_ERR_UNAVAILABLE && rep->message && strncmp(rep->message, "kv_transfer_params:", 19) == 0 &&
           strstr(rep->message, "(kv_load_failure_policy fail)");
}

/* A chunk of a disaggregated request's prefill: nothing goes to the
 * client; its end sends the request to a decode replica, with the params
 * the prefill answered (without them when it failed: recomputed there). */
static void on_prefill_chunk(loom_router_t *r, route_t *q, const Loom__V1__Reply *rep) {
    const Loom__V1__GenerateChunk *ch = rep->chunk;
    int ok = rep->code == LOOM__V1__STATUS_CODE__OK;
    q->t_last = loom_now_ns();
    if (ok && !(ch && ch->final)) return;
    if (ok && ch->kv_transfer_params && ch->kv_transfer_params[0]) q->kv_params = loom_xstrdup(ch->kv_transfer_params);
    else
        LOOM_INFO("request r%llu: the prefill replica %s answered %s: the decode side computes the prompt",
                  (unsigned long long)q->up_id, r->reps[q->rep].addr,
                  ok ? "no kv_transfer_params" : (rep->message && rep->message[0] ? rep->message : "an error"));
    if (!ok) cancel_upstream(r, q);
    route_detach(r, q);
    q->pd_phase = 2;
    q->tried = 0;
    q->attempts = 0;
    place(r, q, NULL);
}

static void on_chunk(loom_router_t *r, int i, route_t *q, Loom__V1__Reply *rep) {
    replica_t *p = &r->reps[i];
    Loom__V1__GenerateChunk *ch = rep->chunk;
    uint64_t now = loom_now_ns();
    if (q->pd_phase == 1) {
        on_prefill_chunk(r, q, rep);
        return;
    }
    if (rep->code != LOOM__V1__STATUS_CODE__OK) {
        loom_status_t st = loom_wire_status_from_code(rep->code);
        if ((st == LOOM_ERR_UNAVAILABLE || st == LOOM_ERR_RESOURCE_EXHAUSTED || st == LOOM_ERR_INTERNAL) &&
            !kv_load_refused(st, rep)) {
            char why[400];
            snprintf(why, sizeof why, "replica %s: %s", p->addr,
                     rep->message ? rep->message : loom_wire_code_name(rep->code));
            fail_over(r, q, why);
            return;
        }
        if (request_fault(st)) r->relayed_errors++; /* relayed below: every replica would say the same */
    }
    char fault[300];
    if (chunk_fault(r, rep, fault, sizeof fault)) {
        char why[600];
        snprintf(why, sizeof why, "it sent %s (request %llu): not relayed", fault,
                 (unsigned long long)q->client_id);
        LOOM_WARN("replica %s: %s", p->addr, why);
        r->bad_chunks++;
        replica_down(r, i, why); /* circuit-broken; its streams, this one included, move on */
        return;
    }
    if (ch && ch->n_prompt_ids && !q->prompt) { /* what a failover continues from, without a tokenizer */
        q->n_prompt = (int)ch->n_prompt_ids;
        q->prompt = loom_xmalloc(ch->n_prompt_ids * sizeof *q->prompt);
        memcpy(q->prompt, ch->prompt_ids, ch->n_prompt_ids * sizeof *q->prompt);
    }
    q->t_last = now;
    if (!q->got_first) {
        q->got_first = 1;
        ttft_record(p, (double)(now - q->t_sent) / 1e6);
    }
    if (ch && ch->n_ids) {
        if (q->n_gen + (int)ch->n_ids > q->cap_gen) {
            q->cap_gen = (q->n_gen + (int)ch->n_ids) * 2 + 16;
            q->gen = loom_xrealloc(q->gen, (size_t)q->cap_gen * sizeof *q->gen);
        }
        memcpy(q->gen + q->n_gen, ch->ids, ch->n_ids * sizeof *ch->ids);
        q->n_gen += (int)ch->n_ids;
        p->inflight_tokens += (long long)ch->n_ids;
    }
    int final = ch && ch->final;
    char *replica_text = ch ? ch->text : NULL; /* put back before rep is freed */
    if (ch && q->own_text) {
        size_t per = loom_tokenizer_max_piece_len(r->tok) + 256, need = per * (ch->n_ids + 1) + 1,
               len = 0;
        if (need > q->text_cap) q->text = loom_xrealloc(q->text, q->text_cap = need);
        for (size_t k = 0; k < ch->n_ids; k++)
            len += loom_detok_push(&q->detok, ch->ids[k], q->text + len, per);
        if (final) len += loom_detok_flush(&q->detok, q->text + len, per);
        q->text[len] = 0;
        ch->text = q->text;
    }
    if (final && ch->usage && q->attempts > 1 &&
        q->prompt) { /* the client's view, not the last attempt's */
        ch->usage->prompt_tokens = (uint32_t)q->n_prompt;
        ch->usage->completion_tokens = (uint32_t)q->n_gen;
    }
    rep->request_id = q->client_id;
    int32_t *pids = ch ? ch->prompt_ids : NULL; /* put back before rep is freed */
    size_t n_pids = ch ? ch->n_prompt_ids : 0;
    if (ch && q->strip_pids) { /* asked for by the router, not by the client */
        ch->prompt_ids = NULL;
        ch->n_prompt_ids = 0;
    }
    if (q->crec) loom_rcache_rec_add(q->crec, rep);
    int sent = send_client(r, q->rid, q->rid_len, rep);
    if (ch) {
        ch->text = replica_text;
        ch->prompt_ids = pids;
        ch->n_prompt_ids = n_pids;
    }
    if (sent >= 0 && !q->delivered) {
        q->delivered = 1;
        if (q->attempts == 1)
            loom_lathist_add(&r->overhead, q->inside_ns + (loom_now_ns() - p->last_reply_ns));
    }
    if (sent < 0) { /* the client is gone */
        r->disconnects++;
        if (!final) cancel_upstream(r, q);
        route_free(r, q);
        return;
    }
    if (final) {
        if (q->crec) loom_rcache_rec_commit(r->rcache, &q->crec, now);
        route_free(r, q);
    }
}

static void on_replica(loom_router_t *r, int i, zmq_msg_t *frames, int n) {
    replica_t *p = &r->reps[i];
    loom_err_t err = {0};
    Loom__V1__Reply *rep =
        n == 1 ? loom_wire_unpack_reply(zmq_msg_data(&frames[0]), zmq_msg_size(&frames[0]), &err)
               : NULL;
    if (!rep) {
        r->garbage++;
        char why[600];
        snprintf(why, sizeof why, "it sent a malformed reply (%s)",
                 n == 1 ? err.msg : "wrong frame count");
        LOOM_WARN("replica %s: %s", p->addr, why);
        if (p->state == REP_UP || p->state == REP_JOINING) replica_down(r, i, why);
        return;
    }
    p->last_reply_ns = r->t_recv;
    if (rep->request_id & CTL_BIT) {
        on_probe_reply(r, i, rep);
    } else {
        route_t *q = route_find(r, rep->request_id);
        if (q && q->rep == i) {
            if (rep->body_case == LOOM__V1__REPLY__BODY_CHUNK && rep->chunk) {
                on_chunk(r, i, q, rep);
            } else if (rep->code != LOOM__V1__STATUS_CODE__OK &&
                       request_fault(loom_wire_status_from_code(rep->code))) {
                r->relayed_errors++; /* the request's own fault: every replica would refuse it */
                client_error(r, q->rid, q->rid_len, q->client_id, loom_wire_status_from_code(rep->code),
                             rep->message && rep->message[0] ? rep->message : loom_wire_code_name(rep->code));
                route_free(r, q);
            } else if (rep->code != LOOM__V1__STATUS_CODE__OK) {
                fail_over(r, q, rep->message ? rep->message : "error");
            }
        } /* else: a late chunk of a request that moved on or ended */
    }
    protobuf_c_message_free_unpacked(&rep->base, NULL);
}

/* ---- replicas come and go ----------------------------------------------------------------------
 */

static int replica_find(const loom_router_t *r, const char *addr) {
    for (int i = 0; i < MAX_REPLICAS; i++)
        if (r->reps[i].used && !strcmp(r->reps[i].addr, addr)) return i;
    return -1;
}

static int replica_open(loom_router_t *r, const char *addr, int from_etcd) {
    int i = 0;
    while (i < MAX_REPLICAS && r->reps[i].used)
        i++;
    if (i == MAX_REPLICAS) {
        LOOM_WARN("replica %s ignored: the router holds at most %d", addr, MAX_REPLICAS);
        return -1;
    }
    void *s = zmq_socket(r->zctx, ZMQ_DEALER);
    int zero = 0, one = 1, ivl = 100;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_IMMEDIATE, &one, sizeof one); /* no queueing towards a dead peer */
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    int64_t maxmsg = LOOM_MAX_MSG_BYTES;
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    if (replica_curve(r, s) < 0) {
        LOOM_WARN("replica %s ignored: cannot set its CURVE keys: %s", addr, zmq_strerror(errno));
        zmq_close(s);
        return -1;
    }
    if (zmq_connect(s, addr) != 0) {
        LOOM_WARN("replica %s ignored: cannot connect: %s", addr, zmq_strerror(errno));
        zmq_close(s);
        return -1;
    }
    replica_t *p = &r->reps[i];
    memset(p, 0, sizeof *p);
    p->used = 1;
    p->sock = s;
    p->from_etcd = from_etcd;
    p->listed = 1;
    p->state = REP_JOINING;
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    snprintf(p->why, sizeof p->why, "joining");
    p->last_reply_ns = loom_now_ns();
    LOOM_INFO("replica %s added%s", addr, from_etcd ? " (etcd)" : "");
    return i;
}

static void replica_close(loom_router_t *r, int i) {
    replica_t *p = &r->reps[i];
    for (route_t *q = r->routes, *nx; q; q = nx) {
        nx = q->next;
        if (q->rep == i) fail_over(r, q, "its replica left");
    }
    loom_prefix_index_drop_replica(r->index, i);
    zmq_close(p->sock);
    if (p->events) zmq_close(p->events);
    LOOM_INFO("replica %s removed", p->addr);
    free(p->adapters);
    memset(p, 0, sizeof *p);
}

static void send_probe(loom_router_t *r, int i, Loom__V1__Request__BodyCase body) {
    Loom__V1__Request rq = LOOM__V1__REQUEST__INIT;
    Loom__V1__HealthRequest h = LOOM__V1__HEALTH_REQUEST__INIT;
    Loom__V1__StatsRequest s = LOOM__V1__STATS_REQUEST__INIT;
    Loom__V1__ListModelsRequest m = LOOM__V1__LIST_MODELS_REQUEST__INIT;
    rq.request_id = CTL_BIT | ++r->next_ctl;
    rq.body_case = body;
    if (body == LOOM__V1__REQUEST__BODY_HEALTH)
        rq.health = &h;
    else if (body == LOOM__V1__REQUEST__BODY_STATS)
        rq.stats = &s;
    else
        rq.list_models = &m;
    if (send_replica(r, i, &rq) == 0) {
        if (!r->reps[i].probe_sent_ns) r->reps[i].probe_sent_ns = loom_now_ns();
    } else if (r->reps[i].state == REP_UP) { /* ZMQ_IMMEDIATE: no connection to it any more */
        replica_down(r, i, "connection lost");
    } else if (r->reps[i].state == REP_JOINING) {
        r->reps[i].probe_retry = 1;
    }
}

/* Probes, stalls, deadlines; every probe_interval_ms. */
static void tick(loom_router_t *r) {
    uint64_t now = loom_now_ns(), timeout = (uint64_t)r->cfg.replica_timeout_ms * 1000000ull;
    for (int i = 0; i < MAX_REPLICAS; i++) {
        replica_t *p = &r->reps[i];
        if (!p->used) continue;
        if (p->state == REP_LEAVING) {
            if (!p->inflight) replica_close(r, i);
            continue;
        }
        if (p->state == REP_REFUSED) continue;
        if (p->state == REP_JOINING && !p->join_warned && now - p->last_reply_ns > timeout) {
            p->join_warned = 1;
            snprintf(p->why, sizeof p->why, "%s",
                     r->rep_keyed ? "no answer: refused our CURVE key?"
                                  : "no answer: does it require CURVE keys?");
            if (r->rep_keyed)
                LOOM_WARN("replica %s: no answer for %d ms; if it is up, it refuses the router's "
                          "CURVE keys: is --replica-server-key its coordinator's public key, and "
                          "the router's public key %.8s... in its --client-keys?",
                          p->addr, r->cfg.replica_timeout_ms, r->rep_kp.public_z85);
            else
                LOOM_WARN(
                    "replica %s: no answer for %d ms; if it is up, it may require CURVE keys: give "
                    "--replica-server-key and --replica-secret",
                    p->addr, r->cfg.replica_timeout_ms);
        }
        if (p->state == REP_UP && p->probe_sent_ns && now - p->probe_sent_ns > timeout) {
            char why[128];
            snprintf(why, sizeof why, "no answer for %d ms", r->cfg.replica_timeout_ms);
            replica_down(r, i, why);
            continue;
        }
        if (p->state == REP_DOWN && now < p->open_until_ns) continue;
        if (p->state == REP_DOWN && p->probe_sent_ns &&
            now - p->probe_sent_ns > timeout) { /* probe failed: stay open longer */
            p->backoff_ms = p->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : p->backoff_ms * 2;
            p->open_until_ns = now + (uint64_t)p->backoff_ms * 1000000ull;
            p->probe_sent_ns = 0;
            continue;
        }
        if (p->state == REP_JOINING) send_probe(r, i, LOOM__V1__REQUEST__BODY_LIST_MODELS);
        send_probe(r, i, LOOM__V1__REQUEST__BODY_HEALTH);
        if (p->used && p->state == REP_UP) send_probe(r, i, LOOM__V1__REQUEST__BODY_STATS);
        /* the LoRA adapters it serves and holds now (they change at run time) */
        if (p->used && p->state == REP_UP) send_probe(r, i, LOOM__V1__REQUEST__BODY_LIST_MODELS);
    }
    uint64_t stall = (uint64_t)r->cfg.stall_timeout_ms * 1000000ull;
    for (route_t *q = r->routes, *nx; q; q = nx) {
        nx = q->next;
        if (now >= q->deadline) {
            r->deadline_exceeded++;
            cancel_upstream(r, q);
            client_error(r, q->rid, q->rid_len, q->client_id, LOOM_ERR_DEADLINE_EXCEEDED,
                         "the request ran past the router's --request-timeout-ms");
            route_free(r, q);
        } else if (q->rep >= 0 && r->reps[q->rep].state != REP_UP &&
                   r->reps[q->rep].state != REP_LEAVING) {
            fail_over(r, q, r->reps[q->rep].why);
        } else if (q->rep >= 0 && now > q->t_last && now - q->t_last > stall) {
            char why[400];
            snprintf(why, sizeof why, "replica %s sent nothing for %d ms", r->reps[q->rep].addr,
                     r->cfg.stall_timeout_ms);
            fail_over(r, q, why); /* cancels it there */
        }
    }
}

/* ---- etcd discovery (its own thread: etcd calls block) ------------------------------------------
 */

/* Is key /loom/<cluster>/coordinator with cluster NAME, NAME-x or NAME/x? */
static int replica_key(const char *key, const char *name) {
    size_t nl = strlen(name), kl = strlen(key);
    const char *tail = "/coordinator";
    size_t tl = strlen(tail);
    if (strncmp(key, "/loom/", 6) || kl < 6 + nl + tl || strcmp(key + kl - tl, tail)) return 0;
    const char *c = key + 6;
    if (strncmp(c, name, nl)) return 0;
    return c + nl == key + kl - tl || c[nl] == '-' || c[nl] == '/';
}

static void *etcd_main(void *arg) {
    etcd_thread_t *t = arg;
    void *pipe = zmq_socket(t->zctx, ZMQ_PAIR);
    int zero = 0;
    zmq_setsockopt(pipe, ZMQ_LINGER, &zero, sizeof zero);
    zmq_connect(pipe, t->pipe_addr);
    loom_etcd_t *e = NULL;
    int warned = 0;
    while (!t->stop) {
        loom_err_t err = {0};
        if (!e && loom_etcd_open(t->url, 2000, &e, &err) < 0) e = NULL;
        loom_etcd_kv_t *kvs = NULL;
        int n = 0;
        if (e && loom_etcd_range_prefix(e, "/loom/", &kvs, &n, NULL, &err) == 0) {
            warned = 0;
            size_t cap = 4096, len = 0;
            char *list = loom_xmalloc(cap);
            list[0] = 0;
            for (int k = 0; k < n; k++) {
                if (!replica_key(kvs[k].key, t->cluster)) continue;
                cJSON *j = cJSON_ParseWithLength(kvs[k].value, kvs[k].value_len);
                const cJSON *api = j ? cJSON_GetObjectItemCaseSensitive(j, "api") : NULL;
                const cJSON *role = j ? cJSON_GetObjectItemCaseSensitive(j, "kv_role") : NULL;
                if (cJSON_IsString(api)) { /* a line "API ROLE" (P: kv_producer, D: anything else) */
                    size_t l = strlen(api->valuestring);
                    if (len + l + 4 > cap) list = loom_xrealloc(list, cap = (len + l + 4) * 2);
                    memcpy(list + len, api->valuestring, l);
                    len += l;
                    list[len++] = ' ';
                    list[len++] = cJSON_IsString(role) && !strcmp(role->valuestring, "kv_producer") ? 'P' : 'D';
                    list[len++] = '\n';
                    list[len] = 0;
                }
                cJSON_Delete(j);
            }
            loom_etcd_kvs_free(kvs, n);
            zmq_send(pipe, list, len, ZMQ_DONTWAIT);
            free(list);
        } else if (!warned) { /* routing goes on with the last known set */
            LOOM_WARN("etcd %s: %s; keeping the last known replicas", t->url,
                      err.msg[0] ? err.msg : "unreachable");
            warned = 1;
            loom_etcd_close(&e);
        }
        for (int k = 0; k < ETCD_POLL_MS / 50 && !t->stop; k++)
            usleep(50000);
    }
    loom_etcd_close(&e);
    zmq_close(pipe);
    return NULL;
}

static void on_etcd_list(loom_router_t *r, char *list) {
    for (int i = 0; i < MAX_REPLICAS; i++)
        if (r->reps[i].used && r->reps[i].from_etcd) r->reps[i].listed = 0;
    for (char *save = NULL, *a = strtok_r(list, "\n", &save); a; a = strtok_r(NULL, "\n", &save)) {
        char *sp = strrchr(a, ' ');
        int prefill = sp && sp[1] == 'P';
        if (sp) *sp = 0;
        int i = replica_find(r, a);
        if (i >= 0)
            r->reps[i].listed = 1;
        else
            i = replica_open(r, a, 1);
        if (i >= 0 && r->reps[i].from_etcd && r->reps[i].prefill != prefill) {
            if (r->cfg.pd) LOOM_INFO("replica %s %s (kv_role in etcd)", a, prefill ? "prefills" : "decodes");
            r->reps[i].prefill = prefill;
        }
    }
    for (int i = 0; i < MAX_REPLICAS; i++) {
        replica_t *p = &r->reps[i];
        if (p->used && p->from_etcd && !p->listed && p->state != REP_LEAVING) {
            LOOM_INFO("replica %s left etcd: draining it", p->addr);
            p->state = REP_LEAVING;
            loom_prefix_index_drop_replica(r->index, i);
        }
    }
}

/* ---- metrics ------------------------------------------------------------------------------------
 */

typedef struct sbuf {
    char *p;
    size_t len, cap;
} sbuf_t;

static void sb_printf(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf_t *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n >= 0 && (size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        b->cap = b->cap * 2 + (size_t)(n > 0 ? n : 256);
        b->p = loom_xrealloc(b->p, b->cap);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double ttft_p90(const replica_t *p) {
    if (!p->n_ttft) return 0.0;
    double v[TTFT_RING];
    memcpy(v, p->ttft_ms, (size_t)p->n_ttft * sizeof *v);
    qsort(v, (size_t)p->n_ttft, sizeof *v, cmp_double);
    return v[(int)(0.9 * (p->n_ttft - 1) + 0.5)] / 1e3;
}

static void render_metrics(loom_router_t *r) {
    sbuf_t b = {loom_xmalloc(8192), 0, 8192};
    b.p[0] = 0;
    static const struct {
        const char *name, *help;
    } per[] = {
        {"loom_router_replica_up", "1 when the replica takes requests"},
        {"loom_router_replica_running", "requests running on the replica (its Stats)"},
        {"loom_router_replica_waiting",
         "requests queued on the replica (its Stats): the queue depth"},
        {"loom_router_replica_kv_usage", "fraction of the replica's KV blocks in use"},
        {"loom_router_replica_inflight", "requests the router has on the replica"},
        {"loom_router_replica_ttft_p90_seconds",
         "p90 time to first token through the router, last 128 requests"},
        {"loom_router_replica_prefix_cache_hit_rate",
         "the replica's prefix-cache hits per queried block"},
    };
    for (size_t m = 0; m < LOOM_ARRAY_LEN(per); m++) {
        sb_printf(&b, "# HELP %s %s\n# TYPE %s gauge\n", per[m].name, per[m].help, per[m].name);
        for (int i = 0; i < MAX_REPLICAS; i++) {
            const replica_t *p = &r->reps[i];
            if (!p->used) continue;
            double v = 0;
            switch (m) {
            case 0:
                v = p->state == REP_UP;
                break;
            case 1:
                v = p->running;
                break;
            case 2:
                v = p->waiting;
                break;
            case 3:
                v = p->kv_total ? (double)p->kv_used / p->kv_total : 0;
                break;
            case 4:
                v = p->inflight;
                break;
            case 5:
                v = ttft_p90(p);
                break;
            default:
                v = p->prefix_queries ? (double)p->prefix_hits / (double)p->prefix_queries : 0;
                break;
            }
            sb_printf(&b, "%s{replica=\"%s\",state=\"%s\"} %g\n", per[m].name, p->addr,
                      rep_state_name[p->state], v);
        }
    }
    sb_printf(&b, "# HELP loom_router_replica_routed_total requests sent to the replica (failovers "
                  "included)\n"
                  "# TYPE loom_router_replica_routed_total counter\n");
    for (int i = 0; i < MAX_REPLICAS; i++)
        if (r->reps[i].used)
            sb_printf(&b, "loom_router_replica_routed_total{replica=\"%s\"} %llu\n",
                      r->reps[i].addr, (unsigned long long)r->reps[i].routed);
    sb_printf(&b, "# HELP loom_router_requests_total requests routed, by policy\n# TYPE "
                  "loom_router_requests_total counter\n");
    for (int k = 0; k < LOOM_POLICY_COUNT; k++)
        sb_printf(&b, "loom_router_requests_total{policy=\"%s\"} %llu\n", policy_names[k],
                  (unsigned long long)r->routed[k]);
    static const char *cn[] = {"failovers",
                               "failover_gave_up",
                               "unplaceable",
                               "cancels",
                               "client_disconnects",
                               "deadline_exceeded",
                               "garbage_replies",
                               "refused_joins",
                               "prefix_index_hit_blocks",
                               "prefix_index_query_blocks",
                               "kv_events",
                               "kv_event_gaps",
                               "kv_events_blocks_cached",
                               "kv_events_blocks_evicted",
                               "kv_events_tier_blocks",
                               "bad_chunks",
                               "relayed_errors"};
    uint64_t cv[] = {r->failovers,        r->failover_gave_up,   r->unplaceable, r->cancels,
                     r->disconnects,      r->deadline_exceeded,  r->garbage,     r->refused_joins,
                     r->index_hit_blocks, r->index_query_blocks, r->kv_events,   r->kv_event_gaps,
                     r->kv_blocks_cached, r->kv_blocks_evicted, r->kv_tier_blocks, r->bad_chunks,
                     r->relayed_errors};
    for (size_t k = 0; k < LOOM_ARRAY_LEN(cn); k++)
        sb_printf(&b, "# TYPE loom_router_%s_total counter\nloom_router_%s_total %llu\n", cn[k],
                  cn[k], (unsigned long long)cv[k]);
    sb_printf(&b, "# TYPE loom_router_requests_inflight gauge\nloom_router_requests_inflight %d\n",
              r->n_routes);
    sb_printf(&b, "# HELP loom_router_overhead_seconds time a request spent inside the router "
                  "before its first token reached the client (request in to request out, plus "
                  "first chunk in to first chunk out; failed-over requests not counted)\n"
                  "# TYPE loom_router_overhead_seconds summary\n");
    static const double oq[] = {0.5, 0.9, 0.99, 0.999};
    for (size_t k = 0; k < LOOM_ARRAY_LEN(oq); k++)
        sb_printf(&b, "loom_router_overhead_seconds{quantile=\"%g\"} %.9f\n", oq[k],
                  loom_lathist_quantile(&r->overhead, oq[k]) / 1e9);
    sb_printf(&b,
              "loom_router_overhead_seconds_sum %.9f\nloom_router_overhead_seconds_count %llu\n",
              (double)r->overhead.sum_ns / 1e9, (unsigned long long)r->overhead.n);
    sb_printf(&b,
              "# TYPE loom_router_prefix_index_blocks gauge\nloom_router_prefix_index_blocks %d\n",
              loom_prefix_index_size(r->index));
    if (r->rcache) {
        char *t = loom_rcache_metrics_text(r->rcache);
        sb_printf(&b, "%s", t);
        free(t);
    }
    if (r->tenants) {
        char *t = loom_tenants_metrics_text(r->tenants);
        sb_printf(&b, "%s", t);
        free(t);
    }
    pthread_mutex_lock(&r->mu);
    free(r->metrics_text);
    r->metrics_text = b.p;
    r->metrics_len = b.len;
    pthread_mutex_unlock(&r->mu);
}

char *loom_router_metrics(void *router, size_t *len) {
    loom_router_t *r = router;
    pthread_mutex_lock(&r->mu);
    char *t = NULL;
    if (r->metrics_text) {
        t = loom_xmalloc(r->metrics_len + 1);
        memcpy(t, r->metrics_text, r->metrics_len + 1);
        *len = r->metrics_len;
    }
    pthread_mutex_unlock(&r->mu);
    return t;
}

/* ---- the loop -----------------------------------------------------------------------------------
 */

/* The reactor waits in epoll on the sockets' ZMQ_FDs instead of zmq_poll,
 * which rebuilds its poll set and asks every socket for ZMQ_EVENTS (two
 * system calls each) on every call. A ZMQ_FD only says that the socket's
 * state may have changed, and any operation on the socket can consume that
 * signal (libzmq reads its mailbox on a send too), so a socket is read to
 * EAGAIN when its fd fires, when the router has sent on it since it was
 * last read to EAGAIN (`dirty`: the client API and the replicas), or when
 * a pass stopped at DRAIN_MAX with messages left; the reactor sleeps only
 * after a pass that moved nothing and left nothing dirty. Each read that
 * ends in EAGAIN costs libzmq two system calls, so only those sockets are
 * read. */
enum { W_API, W_PIPE, W_TOK, W_REP, W_EVENTS };
#define W_TAG(kind, i) (((uint64_t)(kind) << 32) | (uint32_t)(i))
#define DRAIN_MAX      256 /* messages per socket per pass: the others get their turn */

typedef struct watch {
    int ep;
    void *rep[MAX_REPLICAS], *events[MAX_REPLICAS]; /* the sockets registered per slot */
    int fd_rep[MAX_REPLICAS], fd_events[MAX_REPLICAS];
    uint64_t pending_events, pending_rep; /* to read in the next pass (bits by slot) */
    int pending_api, pending_pipe, pending_tok;
} watch_t;

static int zmq_fd(void *sock) {
    int fd = -1;
    size_t len = sizeof fd;
    return zmq_getsockopt(sock, ZMQ_FD, &fd, &len) == 0 ? fd : -1;
}

static void watch_add(watch_t *w, void *sock, uint64_t tag, int *fd_out) {
    int fd = zmq_fd(sock);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = tag};
    if (fd >= 0 && epoll_ctl(w->ep, EPOLL_CTL_ADD, fd, &ev) != 0 && errno == EEXIST)
        epoll_ctl(w->ep, EPOLL_CTL_MOD, fd, &ev);
    if (fd_out) *fd_out = fd;
}

/* Replicas and their event streams come and go between passes: register
 * the new sockets (a closed one's fd leaves the epoll set with it; the stale
 * ones are removed first, so an fd number reused by a new socket is added
 * after). 1 when it added one, to be read in the next pass. */
static int watch_sync(loom_router_t *r, watch_t *w) {
    int added = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < MAX_REPLICAS; i++) {
            void *sock = r->reps[i].used ? r->reps[i].sock : NULL;
            void *evs = r->reps[i].used ? r->reps[i].events : NULL;
            if (pass == 0) {
                if (w->rep[i] && w->rep[i] != sock)
                    epoll_ctl(w->ep, EPOLL_CTL_DEL, w->fd_rep[i], NULL);
                if (w->events[i] && w->events[i] != evs)
                    epoll_ctl(w->ep, EPOLL_CTL_DEL, w->fd_events[i], NULL);
                continue;
            }
            if (sock && w->rep[i] != sock) {
                watch_add(w, sock, W_TAG(W_REP, i), &w->fd_rep[i]);
                w->pending_rep |= 1ull << i;
                added = 1;
            }
            if (evs && w->events[i] != evs) {
                watch_add(w, evs, W_TAG(W_EVENTS, i), &w->fd_events[i]);
                w->pending_events |= 1ull << i; /* it may hold messages already */
                added = 1;
            }
            w->rep[i] = sock;
            w->events[i] = evs;
        }
    return added;
}

/* Reads the client socket (i < 0) or replica i's DEALER, which a handler
 * may close or replace, to EAGAIN or DRAIN_MAX; the number read. */
static int drain_frames(loom_router_t *r, int i) {
    void *s = i < 0 ? r->api : r->reps[i].sock;
    zmq_msg_t f[4];
    int k = 0;
    for (; k < DRAIN_MAX && (i < 0 || (r->reps[i].used && r->reps[i].sock == s)); k++) {
        int nf = loom_zapi_recv_frames(s, f, 4);
        if (!nf) break;
        r->t_recv = loom_now_ns();
        if (i < 0)
            on_api(r, f, nf);
        else
            on_replica(r, i, f, nf);
        for (int j = 0; j < nf; j++)
            zmq_msg_close(&f[j]);
    }
    return k;
}

static int drain_pipe(loom_router_t *r) {
    zmq_msg_t m;
    int k = 0;
    zmq_msg_init(&m);
    for (; k < DRAIN_MAX && zmq_msg_recv(&m, r->pipe, ZMQ_DONTWAIT) >= 0; k++) {
        char *list = loom_xmalloc(zmq_msg_size(&m) + 1);
        memcpy(list, zmq_msg_data(&m), zmq_msg_size(&m));
        list[zmq_msg_size(&m)] = 0;
        on_etcd_list(r, list);
        free(list);
    }
    zmq_msg_close(&m);
    return k;
}

static int drain_tok(loom_router_t *r) {
    tok_job_t *job;
    int k = 0;
    for (; k < DRAIN_MAX &&
           zmq_recv(r->tok_results, &job, sizeof job, ZMQ_DONTWAIT) == (int)sizeof job;
         k++)
        on_tokenized(r, job);
    return k;
}

static int drain_events(loom_router_t *r, int i) {
    void *s = r->reps[i].events;
    zmq_msg_t m;
    int k = 0;
    zmq_msg_init(&m);
    for (; k < DRAIN_MAX && r->reps[i].used && r->reps[i].events == s &&
           zmq_msg_recv(&m, s, ZMQ_DONTWAIT) >= 0;
         k++)
        on_events(r, i, zmq_msg_data(&m), zmq_msg_size(&m));
    zmq_msg_close(&m);
    return k;
}

/* One pass over what may hold messages; the number moved. A socket cut
 * short at DRAIN_MAX stays pending. */
static int reactor_pass(loom_router_t *r, watch_t *w) {
    int moved = 0, k;
    if (w->pending_api || r->api_dirty) {
        moved += k = drain_frames(r, -1);
        w->pending_api = k == DRAIN_MAX;
        r->api_dirty = 0; /* what its handlers sent came before the EAGAIN */
    }
    if (w->pending_pipe) {
        moved += k = drain_pipe(r);
        w->pending_pipe = k == DRAIN_MAX;
    }
    if (w->pending_tok) {
        moved += k = drain_tok(r);
        w->pending_tok = k == DRAIN_MAX;
    }
    for (int i = 0; i < MAX_REPLICAS; i++) {
        replica_t *p = &r->reps[i];
        if (!p->used) continue;
        if (p->probe_retry && p->state == REP_JOINING && ((w->pending_rep >> i) & 1)) {
            p->probe_retry = 0; /* its connection may be up: join now, not a tick later */
            send_probe(r, i, LOOM__V1__REQUEST__BODY_LIST_MODELS);
            send_probe(r, i, LOOM__V1__REQUEST__BODY_HEALTH);
        }
        if (p->dirty || ((w->pending_rep >> i) & 1)) {
            moved += k = drain_frames(r, i);
            p->dirty = 0; /* its handlers' sends came before the EAGAIN */
            if (k < DRAIN_MAX)
                w->pending_rep &= ~(1ull << i);
            else
                w->pending_rep |= 1ull << i;
        }
        if ((w->pending_events >> i) & 1) {
            moved += k = r->reps[i].events ? drain_events(r, i) : 0;
            if (k < DRAIN_MAX) w->pending_events &= ~(1ull << i);
        }
    }
    return moved;
}

int loom_router_run(loom_router_t *r) {
    LOOM_INFO("router on %s: policy %s, %d static replica(s)%s", r->api_addr,
              loom_policy_name(r->cfg.policy), r->cfg.n_replicas,
              r->cfg.etcd_url ? ", more from etcd" : "");
    watch_t w = {
        .ep = epoll_create1(EPOLL_CLOEXEC), .pending_api = 1, .pending_pipe = 1, .pending_tok = 1};
    if (w.ep < 0) {
        LOOM_ERROR("epoll_create1: %s", strerror(errno));
        return 1;
    }
    watch_add(&w, r->api, W_TAG(W_API, 0), NULL);
    watch_add(&w, r->pipe, W_TAG(W_PIPE, 0), NULL);
    watch_add(&w, r->tok_results, W_TAG(W_TOK, 0), NULL);
    while (!r->stop) {
        uint64_t now = loom_now_ns();
        if (now - r->last_tick >= (uint64_t)r->cfg.probe_interval_ms * 1000000ull) {
            r->last_tick = now; /* before the pass, which reads what its sends touched */
            tick(r);
            atomic_store(&r->n_up, n_state(r, REP_UP));
            atomic_store(&r->n_used, n_known(r));
            atomic_store(&r->beat_ns, now);
        }
        if (now - r->last_metrics >= 250000000ull) {
            r->last_metrics = now;
            render_metrics(r);
            atomic_store(&r->n_up, n_state(r, REP_UP)); /* the probes agree with /metrics */
            atomic_store(&r->n_used, n_known(r));
        }
        int moved = reactor_pass(r, &w);
        for (int i = 0; i < MAX_REPLICAS && !moved; i++)
            moved = r->reps[i].used && r->reps[i].dirty; /* sent on after its read */
        if (r->api_dirty) moved = 1;
        /* Register what the tick and the pass opened, then, after a pass
         * that moved messages or left a socket dirty, look without waiting
         * (a send may have consumed a hot socket's signal; the idle ones
         * must not starve under load). */
        if (watch_sync(r, &w)) moved = 1;
        struct epoll_event evs[16];
        int n = epoll_wait(w.ep, evs, (int)LOOM_ARRAY_LEN(evs), moved ? 0 : 20);
        if (n < 0 && errno != EINTR) {
            LOOM_ERROR("epoll_wait: %s", strerror(errno));
            close(w.ep);
            return 1;
        }
        for (int k = 0; k < n; k++) {
            uint32_t kind = (uint32_t)(evs[k].data.u64 >> 32), i = (uint32_t)evs[k].data.u64;
            if (kind == W_API)
                w.pending_api = 1;
            else if (kind == W_REP && i < MAX_REPLICAS)
                w.pending_rep |= 1ull << i;
            else if (kind == W_PIPE)
                w.pending_pipe = 1;
            else if (kind == W_TOK)
                w.pending_tok = 1;
            else if (kind == W_EVENTS && i < MAX_REPLICAS)
                w.pending_events |= 1ull << i;
        }
    }
    close(w.ep);
    LOOM_INFO("router stopping: %d request(s) in flight end", r->n_routes);
    while (r->routes) {
        route_t *q = r->routes;
        cancel_upstream(r, q);
        client_error(r, q->rid, q->rid_len, q->client_id, LOOM_ERR_UNAVAILABLE,
                     "the router is shutting down");
        route_free(r, q);
    }
    return 0;
}

void loom_router_probe_state(void *router, int *live, int *ready, char *msg, size_t cap) {
    loom_router_t *r = router;
    uint64_t beat = atomic_load(&r->beat_ns), now = loom_now_ns();
    /* the reactor ticks every probe interval: alive while it did so lately */
    uint64_t limit = (uint64_t)LOOM_MAX(5000, 10 * r->cfg.probe_interval_ms) * 1000000ull;
    int up = atomic_load(&r->n_up), known = atomic_load(&r->n_used);
    *live = beat && now - beat < limit;
    *ready = *live && up > 0;
    if (!*live)
        snprintf(msg, cap, "the router's reactor has not turned for %.1f s", beat ? (double)(now - beat) / 1e9 : 0.0);
    else
        snprintf(msg, cap, "%d of %d replica(s) up", up, known);
}

void loom_router_stop(loom_router_t *r) {
    r->stop = 1;
}

/* CURVE: the router as a client of its replicas (--replica-server-key,
 * --replica-secret) and as a server of its own API (--curve-secret,
 * --client-keys), with the coordinator's rule for a client API other hosts
 * can reach (loom_zap_api_rule). Before the API socket binds. */
static loom_status_t router_keys(loom_router_t *r, loom_err_t *err) {
    const loom_router_config_t *c = &r->cfg;
    const char *server = loom_key_source(c->replica_server_key, "LOOM_REPLICA_SERVER_KEY");
    const char *rsecret = loom_key_source(c->replica_secret, "LOOM_REPLICA_SECRET");
    if (!server != !rsecret)
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "keyed replicas need both --replica-server-key (their coordinator's public key) and "
            "--replica-secret (the router's own secret key); only --%s was given",
            server ? "replica-server-key" : "replica-secret");
    if (server) {
        LOOM_CHECK(loom_key_read(server, "the replicas' public key (--replica-server-key)",
                                 r->rep_server, err));
        LOOM_CHECK(loom_keypair_read(
            rsecret, "the router's secret key for replicas (--replica-secret)", &r->rep_kp, err));
        r->rep_keyed = 1;
        LOOM_INFO("CURVE: replicas keyed (server key %.8s..., the router's public key %s: list "
                  "it in each replica's --client-keys)",
                  r->rep_server, r->rep_kp.public_z85);
    }
    const char *secret = loom_key_source(c->curve_secret, "LOOM_CURVE_SECRET");
    const char *clients = loom_key_source(c->client_keys, "LOOM_CLIENT_KEYS");
    if (clients && !secret)
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "--client-keys needs the router's own key: --curve-secret FILE (or LOOM_CURVE_SECRET); "
            "make one with 'loom keygen'");
    if (secret && !clients)
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "--curve-secret needs an allow-list to check clients against: --client-keys FILE");
    LOOM_CHECK(loom_zap_api_rule(c->listen, clients != NULL, c->insecure_api,
                                 "the router's client API (--listen)", err));
    if (!clients) return LOOM_OK;
    loom_keypair_t kp;
    LOOM_CHECK(loom_keypair_read(secret, "the router's secret key (--curve-secret)", &kp, err));
    LOOM_CHECK(loom_zap_create(r->zctx, &r->zap, err));
    LOOM_CHECK(loom_zap_secure(r->zap, r->api, LOOM_ZAP_API, "client", &kp, clients, err));
    LOOM_CHECK(loom_zap_start(r->zap, err));
    LOOM_INFO("CURVE: client API keyed (clients from --client-keys, server key %s)", kp.public_z85);
    return LOOM_OK;
}

loom_status_t loom_router_create(const loom_router_config_t *cfg, loom_router_t **out,
                                 loom_err_t *err) {
    *out = NULL;
    loom_router_t *r = loom_xcalloc(1, sizeof *r);
    r->cfg = *cfg;
    pthread_mutex_init(&r->mu, NULL);
    r->index = loom_prefix_index_create(cfg->index_capacity > 0 ? cfg->index_capacity : 1 << 18);
    r->tier_index = loom_prefix_index_create(cfg->index_capacity > 0 ? cfg->index_capacity : 1 << 18);
    loom_status_t st = LOOM_OK;
    if (cfg->response_cache_bytes)
        r->rcache = loom_rcache_create(cfg->response_cache_bytes, cfg->response_cache_ttl_ms);
    if (cfg->tenants_path && (st = loom_tenants_load(cfg->tenants_path, &r->tenants, err)) < 0)
        goto fail;
    if (cfg->model_dir) {
        st = loom_tokenizer_load(cfg->model_dir, &r->tok, err);
        if (st < 0) goto fail;
        loom_err_t derr = {0};
        if (loom_model_digest(cfg->model_dir, r->ref_weights, r->ref_tokenizer, &derr) < 0)
            LOOM_INFO("--model %s: no weights to digest (%s); the first replica's weights digest is the reference",
                      cfg->model_dir, derr.msg);
        snprintf(r->ref_digest_from, sizeof r->ref_digest_from, "--model %s", cfg->model_dir);
    }
    const char *name = cfg->model_name;
    char base[256];
    if (!name && cfg->model_dir) { /* as a coordinator names its model by default */
        snprintf(base, sizeof base, "%s", cfg->model_dir);
        size_t bl = strlen(base);
        while (bl > 1 && base[bl - 1] == '/')
            base[--bl] = 0;
        const char *slash = strrchr(base, '/');
        name = slash ? slash + 1 : base;
    }
    if (name) snprintf(r->ref_model, sizeof r->ref_model, "%s", name);
    r->zctx = zmq_ctx_new();
    r->api = zmq_socket(r->zctx, ZMQ_ROUTER);
    int zero = 0, one = 1;
    int64_t maxmsg = LOOM_MAX_MSG_BYTES;
    zmq_setsockopt(r->api, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(r->api, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(r->api, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    st = router_keys(r, err);
    if (st < 0) goto fail;
    if (zmq_bind(r->api, cfg->listen) != 0) {
        st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cannot bind %s: %s", cfg->listen,
                          zmq_strerror(errno));
        goto fail;
    }
    size_t l = sizeof r->api_addr;
    zmq_getsockopt(r->api, ZMQ_LAST_ENDPOINT, r->api_addr, &l);
    snprintf(r->inproc_addr, sizeof r->inproc_addr, "inproc://loom-router-api");
    snprintf(r->etcd.pipe_addr, sizeof r->etcd.pipe_addr, "inproc://loom-router-etcd");
    if (zmq_bind(r->api, r->inproc_addr) != 0) {
        st = loom_err_set(err, LOOM_ERR_INTERNAL, "cannot bind %s", r->inproc_addr);
        goto fail;
    }
    r->pipe = zmq_socket(r->zctx, ZMQ_PAIR);
    zmq_setsockopt(r->pipe, ZMQ_LINGER, &zero, sizeof zero);
    zmq_bind(r->pipe, r->etcd.pipe_addr);
    r->tok_jobs = zmq_socket(r->zctx, ZMQ_PUSH);
    r->tok_results = zmq_socket(r->zctx, ZMQ_PULL);
    zmq_setsockopt(r->tok_jobs, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(r->tok_results, ZMQ_LINGER, &zero, sizeof zero);
    zmq_bind(r->tok_jobs, "inproc://loom-router-tok-jobs");
    zmq_bind(r->tok_results, "inproc://loom-router-tok-results");
    for (int k = 0; r->tok && k < cfg->tokenizer_threads && k < MAX_TOK_THREADS; k++) {
        if (pthread_create(&r->tok_th[k], NULL, tok_main, r) != 0) break;
        r->n_tok_th++;
    }
    for (int k = 0; k < cfg->n_prefill_replicas; k++) {
        int i = replica_find(r, cfg->prefill_replicas[k]);
        if (i < 0 && (i = replica_open(r, cfg->prefill_replicas[k], 0)) < 0) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "cannot use prefill replica '%s' (see the log)",
                              cfg->prefill_replicas[k]);
            goto fail;
        }
        r->reps[i].prefill = 1;
    }
    for (int k = 0; k < cfg->n_replicas; k++)
        if (replica_find(r, cfg->replicas[k]) < 0 && replica_open(r, cfg->replicas[k], 0) < 0) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "cannot use replica '%s' (see the log)", cfg->replicas[k]);
            goto fail;
        }
    if (cfg->etcd_url) {
        etcd_thread_t *t = &r->etcd;
        snprintf(t->url, sizeof t->url, "%s", cfg->etcd_url);
        snprintf(t->cluster, sizeof t->cluster, "%s", cfg->cluster ? cfg->cluster : "default");
        t->zctx = r->zctx;
        if (pthread_create(&t->th, NULL, etcd_main, t) != 0) {
            st = loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the etcd thread");
            goto fail;
        }
        t->started = 1;
    }
    render_metrics(r);
    *out = r;
    return LOOM_OK;
fail:
    loom_router_destroy(&r);
    return st;
}

void loom_router_destroy(loom_router_t **r_p) {
    if (!r_p || !*r_p) return;
    loom_router_t *r = *r_p;
    *r_p = NULL;
    if (r->etcd.started) {
        r->etcd.stop = 1;
        pthread_join(r->etcd.th, NULL);
    }
    r->tok_stop = 1;
    for (int k = 0; k < r->n_tok_th; k++)
        pthread_join(r->tok_th[k], NULL);
    if (r->tok_results) { /* prompts tokenized after the loop ended */
        tok_job_t *job;
        while (zmq_recv(r->tok_results, &job, sizeof job, ZMQ_DONTWAIT) == (int)sizeof job) {
            free(job->ids);
            free(job->text);
            free(job);
        }
    }
    while (r->routes)
        route_free(r, r->routes);
    for (int i = 0; i < MAX_REPLICAS; i++)
        if (r->reps[i].used) {
            zmq_close(r->reps[i].sock);
            if (r->reps[i].events) zmq_close(r->reps[i].events);
            free(r->reps[i].adapters);
        }
    if (r->pipe) zmq_close(r->pipe);
    if (r->tok_jobs) zmq_close(r->tok_jobs);
    if (r->tok_results) zmq_close(r->tok_results);
    if (r->api) zmq_close(r->api);
    loom_zap_stop(&r->zap);
    if (r->zctx) zmq_ctx_term(r->zctx);
    loom_prefix_index_destroy(&r->index);
    loom_prefix_index_destroy(&r->tier_index);
    loom_rcache_destroy(&r->rcache);
    loom_tenants_destroy(&r->tenants);
    loom_tokenizer_destroy(&r->tok);
    pthread_mutex_destroy(&r->mu);
    free(r->metrics_text);
    free(r);
}

void *loom_router_zmq_context(loom_router_t *r) {
    return r->zctx;
}
const char *loom_router_inproc_addr(const loom_router_t *r) {
    return r->inproc_addr;
}
