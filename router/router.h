/* loom-router: one loom.v1 endpoint in front of many replicas (each a
 * coordinator with its grid). One reactor thread owns the client socket
 * and a DEALER per replica; it routes each Generate by policy, relays the
 * stream, and moves a request to another replica when its replica dies or
 * stalls (continuing from the tokens already streamed). See router.c for
 * the request and replica lifecycles and docs/scale-out.md. */
#ifndef LOOM_ROUTER_H
#define LOOM_ROUTER_H

#include <stddef.h>

#include "common/status.h"

typedef enum {
    LOOM_POLICY_PREFIX = 0,
    LOOM_POLICY_ROUND_ROBIN,
    LOOM_POLICY_LEAST_LOADED,
    LOOM_POLICY_SESSION,
    LOOM_POLICY_COUNT
} loom_policy_t;
const char *loom_policy_name(loom_policy_t p);
int loom_policy_parse(const char *name); /* -1 when unknown */

typedef struct loom_router_config {
    const char *listen;          /* client API, e.g. tcp://127.0.0.1:5550 */
    const char *const *replicas; /* static replica API addresses */
    int n_replicas;
    const char *etcd_url;   /* discover replicas in etcd (NULL: static only) */
    const char *cluster;    /* replicas: coordinators of clusters NAME, NAME-x and NAME/x */
    const char *model_dir;  /* the model's tokenizer (prefix hashing, failover); NULL: none */
    const char *model_name; /* the model id replicas must serve (NULL: the directory's name, or
                               without model_dir the first replica's) */
    loom_policy_t policy;
    const char *api_key;         /* clients must send it (NULL: open) */
    const char *replica_api_key; /* sent to replicas (NULL: none) */
    /* CURVE, each a key or a key file as loom_key_read (docs/operations.md#security) */
    const char *replica_server_key; /* the replicas' coordinator public key (NULL: unkeyed) */
    const char *replica_secret;  /* the router's own secret key towards replicas (with the above) */
    const char *curve_secret;    /* the router's secret key as a server of its --listen API */
    const char *client_keys;     /* allow-list of clients' public keys for --listen (NULL: open) */
    int insecure_api;            /* serve a non-loopback --listen without client keys */
    int max_retries;             /* re-sends of one request to other replicas */
    int probe_interval_ms;       /* Health + Stats to each replica */
    int replica_timeout_ms;      /* no answer to probes this long: the replica is down */
    int stall_timeout_ms;        /* a stream silent this long moves to another replica */
    int request_timeout_ms;      /* no request outlives this (DEADLINE_EXCEEDED) */
    double lambda;               /* prefix score: weight of load against cached tokens */
    double tier_token_cost;      /* prefix score: a token read from a KV tier against one computed */
    int index_capacity;          /* block hashes the prefix index keeps */
    int tokenizer_threads;       /* prompts are tokenized on these (0: on the reactor) */
    size_t response_cache_bytes; /* the response cache's bound (0: no cache) */
    int response_cache_ttl_ms;   /* its entries' lifetime (0: until evicted) */
    const char *tenants_path;    /* per-API-key limits, JSON (NULL: none; tenants.h) */
    /* prefill/decode disaggregation (docs/disaggregation.md): requests go
     * first to one of these replicas (max_tokens 1, kv_transfer_params
     * do_remote_decode), then with its answer's params to one of the others;
     * prompts under pd_min_prompt_tokens (known with a tokenizer) skip the
     * prefill; a prefill that fails is recomputed on the decode side. With
     * etcd, the coordinators registered with kv_role kv_producer are the
     * prefill replicas, the others decode */
    int pd;
    const char *const *prefill_replicas;
    int n_prefill_replicas;
    int pd_min_prompt_tokens;
} loom_router_config_t;

typedef struct loom_router loom_router_t;

loom_status_t loom_router_create(const loom_router_config_t *cfg, loom_router_t **out,
                                 loom_err_t *err);
int loom_router_run(loom_router_t *r);
void loom_router_stop(loom_router_t *r); /* async-signal-safe */
void loom_router_destroy(loom_router_t **r_p);

/* For the HTTP gateway in this process. */
void *loom_router_zmq_context(loom_router_t *r);
const char *loom_router_inproc_addr(const loom_router_t *r);
/* Prometheus text of the router's metrics (thread-safe; malloc'ed). */
char *loom_router_metrics(void *router, size_t *len);
/* For the probe listener (router/probe.h), from any thread: *live while the
 * reactor ticks, *ready while a replica is up, msg a line saying so. */
void loom_router_probe_state(void *router, int *live, int *ready, char *msg, size_t cap);

#endif
