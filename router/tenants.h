/* Tenants at the router: per-API-key token buckets (requests per second,
 * tokens per minute) and concurrency quotas, read from a JSON file
 * (--tenants FILE). Keys the file lists are tenants of their own; every
 * other key (and no key) shares the "default" limits. Used by the reactor
 * only (no locking). See docs/scale-out.md, "Tenants". */
#ifndef LOOM_TENANTS_H
#define LOOM_TENANTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct loom_tenants loom_tenants_t;

/* The file:
 *   {"default": {LIMITS}, "tenants": {"KEY": {"name": "team-a", LIMITS}, ...}}
 * LIMITS: "requests_per_s" (> 0), "burst" (requests, >= 1; default
 * max(1, requests_per_s)), "tokens_per_min" (> 0; tokens are prompt plus
 * generated, charged when a request ends), "max_concurrent" (>= 1). A limit
 * left out is no limit. INVALID_ARGUMENT naming the file and field on a bad one. */
loom_status_t loom_tenants_load(const char *path, loom_tenants_t **out, loom_err_t *err);
loom_status_t loom_tenants_parse(const char *json, size_t len, loom_tenants_t **out,
                                 loom_err_t *err);
void loom_tenants_destroy(loom_tenants_t **t_p);

/* The tenant of an API key (NULL or "": none): its index, and *listed = 1
 * when the file names the key (0: the default tenant, index 0). */
int loom_tenants_find(const loom_tenants_t *t, const char *key, int *listed);
const char *loom_tenants_name(const loom_tenants_t *t, int i);
int loom_tenants_count(const loom_tenants_t *t);

/* Admits one request of tenant i now, or refuses it with RESOURCE_EXHAUSTED:
 * msg says which limit, *retry_after_ms when it could pass. Admitted
 * requests count against max_concurrent until loom_tenants_release. */
loom_status_t loom_tenants_admit(loom_tenants_t *t, int i, uint64_t now_ns, int *retry_after_ms,
                                 char *msg, size_t msg_cap);
/* An admitted request ended after `tokens` tokens (prompt + generated):
 * its concurrency slot is free, its tokens are charged. */
void loom_tenants_release(loom_tenants_t *t, int i, long long tokens, uint64_t now_ns);

typedef struct loom_tenant_stats {
    uint64_t admitted, rate_limited, token_limited, concurrency_limited;
    int inflight;
} loom_tenant_stats_t;
loom_tenant_stats_t loom_tenants_stats(const loom_tenants_t *t, int i);
/* Prometheus text, by tenant name (never the key; malloc'ed). */
char *loom_tenants_metrics_text(const loom_tenants_t *t);

#endif
