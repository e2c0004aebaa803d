/* Tenants at the router (tenants.h).
 *
 * Each tenant has two token buckets, refilled continuously from the time of
 * the last look: requests (capacity `burst`, rate requests_per_s; a request
 * takes 1) and tokens (capacity and rate tokens_per_min per minute; a
 * request needs the bucket above 0 to start and is charged its tokens when
 * it ends, so the bucket can go below 0 and holds the next requests back
 * until it refills). Concurrency counts admitted requests not yet released.
 * Retry-After is when the refusing bucket would let one request through
 * (for the concurrency quota, which frees at no known time, a second). */
#include "router/tenants.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"

#define MAX_TENANTS 4096

typedef struct tenant {
    char *key; /* NULL: the default tenant */
    char name[64];
    double rps, burst, tpm;
    int max_concurrent; /* 0: no quota */
    double req_level, tok_level;
    uint64_t last_ns;
    int inflight;
    loom_tenant_stats_t st;
} tenant_t;

struct loom_tenants {
    tenant_t *t; /* t[0]: the default */
    int n;
};

static loom_status_t parse_limits(const cJSON *o, const char *what, tenant_t *t, loom_err_t *err) {
    if (!cJSON_IsObject(o))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s must be an object", what);
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        const char *k = x->string;
        if (!strcmp(k, "name")) {
            if (!cJSON_IsString(x) || !x->valuestring[0] ||
                strlen(x->valuestring) >= sizeof t->name)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                    "%s.name must be a string of 1 to %zu bytes", what,
                                    sizeof t->name - 1);
            for (const char *c = x->valuestring; *c; c++)
                if (*c < 32 || *c > 126 || *c == '"' || *c == '\\')
                    return loom_err_set(
                        err, LOOM_ERR_INVALID_ARGUMENT,
                        "%s.name must be printable ASCII without quotes or backslashes", what);
            snprintf(t->name, sizeof t->name, "%s", x->valuestring);
            continue;
        }
        double *dst = !strcmp(k, "requests_per_s")   ? &t->rps
                      : !strcmp(k, "burst")          ? &t->burst
                      : !strcmp(k, "tokens_per_min") ? &t->tpm
                                                     : NULL;
        if (!dst && strcmp(k, "max_concurrent"))
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "%s: unknown field '%s' (name, requests_per_s, burst, "
                                "tokens_per_min, max_concurrent)",
                                what, k);
        if (!cJSON_IsNumber(x) || !isfinite(x->valuedouble) || x->valuedouble <= 0 ||
            x->valuedouble > 1e12)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "%s.%s must be a positive number, got %s", what, k,
                                cJSON_IsNumber(x) ? "a number out of range" : "another type");
        if (dst) {
            *dst = x->valuedouble;
        } else {
            if (x->valuedouble != floor(x->valuedouble) || x->valuedouble > 1e6)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                    "%s.max_concurrent must be an integer in [1, 1e6]", what);
            t->max_concurrent = (int)x->valuedouble;
        }
    }
    if (t->burst && t->burst < 1)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s.burst must be at least 1", what);
    if (t->burst && !t->rps)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s.burst needs requests_per_s", what);
    if (t->rps && !t->burst) t->burst = t->rps > 1 ? t->rps : 1;
    t->req_level = t->burst;
    t->tok_level = t->tpm;
    return LOOM_OK;
}

loom_status_t loom_tenants_parse(const char *json, size_t len, loom_tenants_t **out,
                                 loom_err_t *err) {
    *out = NULL;
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "not a JSON object");
    }
    loom_tenants_t *ts = loom_xcalloc(1, sizeof *ts);
    const cJSON *def = cJSON_GetObjectItemCaseSensitive(root, "default");
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "tenants");
    loom_status_t st = LOOM_OK;
    const cJSON *x;
    cJSON_ArrayForEach(x, root) {
        if (strcmp(x->string, "default") && strcmp(x->string, "tenants")) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "unknown top-level field '%s' (default, tenants)", x->string);
            goto fail;
        }
    }
    if (list && !cJSON_IsObject(list)) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                          "tenants must be an object of API key -> limits");
        goto fail;
    }
    int n = list ? cJSON_GetArraySize(list) : 0;
    if (n > MAX_TENANTS) {
        st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%d tenants; at most %d", n, MAX_TENANTS);
        goto fail;
    }
    ts->t = loom_xcalloc((size_t)n + 1, sizeof *ts->t);
    ts->n = 1;
    snprintf(ts->t[0].name, sizeof ts->t[0].name, "default");
    if (def && (st = parse_limits(def, "default", &ts->t[0], err)) < 0) goto fail;
    snprintf(ts->t[0].name, sizeof ts->t[0].name, "default");
    cJSON_ArrayForEach(x, list) {
        tenant_t *t = &ts->t[ts->n];
        char what[96];
        snprintf(what, sizeof what, "tenants entry %d", ts->n);
        if (!x->string[0]) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: the API key is empty", what);
            goto fail;
        }
        for (int k = 1; k < ts->n; k++)
            if (!strcmp(ts->t[k].key, x->string)) {
                st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                  "%s: the same API key as entry %d", what, k);
                goto fail;
            }
        snprintf(t->name, sizeof t->name, "tenant-%d", ts->n);
        if ((st = parse_limits(x, what, t, err)) < 0) goto fail;
        t->key = loom_xstrdup(x->string);
        ts->n++;
        if (!strcmp(t->name, "default")) {
            st = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                              "%s: the name 'default' is the default tenant's", what);
            goto fail;
        }
    }
    cJSON_Delete(root);
    *out = ts;
    return LOOM_OK;
fail:
    cJSON_Delete(root);
    loom_tenants_destroy(&ts);
    return st;
}

loom_status_t loom_tenants_load(const char *path, loom_tenants_t **out, loom_err_t *err) {
    char *data = NULL;
    size_t len = 0;
    *out = NULL;
    loom_err_t e = {0};
    if (loom_read_file(path, &data, &len, &e) < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--tenants %s: %s", path, e.msg);
    loom_status_t st = loom_tenants_parse(data, len, out, &e);
    free(data);
    if (st < 0) return loom_err_set(err, st, "--tenants %s: %s", path, e.msg);
    return LOOM_OK;
}

void loom_tenants_destroy(loom_tenants_t **t_p) {
    if (!t_p || !*t_p) return;
    loom_tenants_t *ts = *t_p;
    *t_p = NULL;
    for (int i = 0; ts->t && i < ts->n; i++)
        free(ts->t[i].key);
    free(ts->t);
    free(ts);
}

int loom_tenants_find(const loom_tenants_t *ts, const char *key, int *listed) {
    *listed = 0;
    if (!key || !key[0]) return 0;
    size_t kl = strlen(key);
    for (int i = 1; i < ts->n;
         i++) /* constant time per key compared: no timing hint of a near miss */
        if (loom_secret_equal(ts->t[i].key, strlen(ts->t[i].key), key, kl)) {
            *listed = 1;
            return i;
        }
    return 0;
}

const char *loom_tenants_name(const loom_tenants_t *ts, int i) {
    return ts->t[i].name;
}

int loom_tenants_count(const loom_tenants_t *ts) {
    return ts->n;
}

static void refill(tenant_t *t, uint64_t now_ns) {
    if (t->last_ns && now_ns > t->last_ns) {
        double dt = (double)(now_ns - t->last_ns) / 1e9;
        if (t->rps) t->req_level = fmin(t->burst, t->req_level + dt * t->rps);
        if (t->tpm) t->tok_level = fmin(t->tpm, t->tok_level + dt * t->tpm / 60.0);
    }
    t->last_ns = now_ns;
}

loom_status_t loom_tenants_admit(loom_tenants_t *ts, int i, uint64_t now_ns, int *retry_after_ms,
                                 char *msg, size_t msg_cap) {
    tenant_t *t = &ts->t[i];
    refill(t, now_ns);
    *retry_after_ms = 0;
    if (t->max_concurrent && t->inflight >= t->max_concurrent) {
        t->st.concurrency_limited++;
        *retry_after_ms = 1000;
        snprintf(msg, msg_cap,
                 "tenant '%s' has %d requests in flight, its max_concurrent: retry after one ends",
                 t->name, t->inflight);
        return LOOM_ERR_RESOURCE_EXHAUSTED;
    }
    if (t->rps && t->req_level < 1.0) {
        t->st.rate_limited++;
        *retry_after_ms = (int)ceil((1.0 - t->req_level) / t->rps * 1000.0);
        snprintf(
            msg, msg_cap,
            "tenant '%s' is over its rate limit of %g requests/s (burst %g): retry after %d ms",
            t->name, t->rps, t->burst, *retry_after_ms);
        return LOOM_ERR_RESOURCE_EXHAUSTED;
    }
    if (t->tpm && t->tok_level <= 0.0) {
        t->st.token_limited++;
        *retry_after_ms = (int)ceil((1.0 - t->tok_level) / (t->tpm / 60.0) * 1000.0);
        snprintf(msg, msg_cap, "tenant '%s' is over its limit of %g tokens/min: retry after %d ms",
                 t->name, t->tpm, *retry_after_ms);
        return LOOM_ERR_RESOURCE_EXHAUSTED;
    }
    if (t->rps) t->req_level -= 1.0;
    t->inflight++;
    t->st.admitted++;
    return LOOM_OK;
}

void loom_tenants_release(loom_tenants_t *ts, int i, long long tokens, uint64_t now_ns) {
    tenant_t *t = &ts->t[i];
    refill(t, now_ns);
    if (t->inflight > 0) t->inflight--;
    if (t->tpm && tokens > 0) t->tok_level -= (double)tokens;
}

loom_tenant_stats_t loom_tenants_stats(const loom_tenants_t *ts, int i) {
    loom_tenant_stats_t s = ts->t[i].st;
    s.inflight = ts->t[i].inflight;
    return s;
}

char *loom_tenants_metrics_text(const loom_tenants_t *ts) {
    size_t cap = 1024 + (size_t)ts->n * 1024,
           len = 0; /* a tenant's lines: < 800 bytes with a 63-byte name */
    char *t = loom_xmalloc(cap);
    len += (size_t)snprintf(
        t + len, cap - len,
        "# HELP loom_router_tenant_requests_total Generate requests by tenant and outcome "
        "(admitted, or refused with RESOURCE_EXHAUSTED / 429 by the limit named)\n"
        "# TYPE loom_router_tenant_requests_total counter\n");
    for (int i = 0; i < ts->n; i++) {
        const tenant_t *x = &ts->t[i];
        const char *oc[] = {"admitted", "rate_limited", "token_limited", "concurrency_limited"};
        uint64_t v[] = {x->st.admitted, x->st.rate_limited, x->st.token_limited,
                        x->st.concurrency_limited};
        for (int k = 0; k < 4; k++)
            len += (size_t)snprintf(
                t + len, cap - len,
                "loom_router_tenant_requests_total{tenant=\"%s\",outcome=\"%s\"} %llu\n", x->name,
                oc[k], (unsigned long long)v[k]);
    }
    len += (size_t)snprintf(t + len, cap - len, "# TYPE loom_router_tenant_inflight gauge\n");
    for (int i = 0; i < ts->n; i++)
        len +=
            (size_t)snprintf(t + len, cap - len, "loom_router_tenant_inflight{tenant=\"%s\"} %d\n",
                             ts->t[i].name, ts->t[i].inflight);
    return t;
}
