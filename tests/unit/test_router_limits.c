/* The router's response cache (router/response_cache.c: what is cacheable,
 * the key, LRU within the byte bound, TTL) and tenant limits
 * (router/tenants.c: token buckets, concurrency, the file's errors), on a
 * clock the test sets; the latency histogram's quantiles (router/lathist.c)
 * against the exact ones of the same samples. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/wire.h"
#include "router/lathist.h"
#include "router/response_cache.h"
#include "router/tenants.h"
#include "tests/test.h"

#define MS 1000000ull

/* Records a stream of n chunks of one id each, the last final with `finish`. */
static void record(loom_rcache_t *c, const Loom__V1__GenerateRequest *g, int n, int finish,
                   uint64_t now) {
    size_t kl;
    unsigned char *key = loom_rcache_key(g, "m", &kl);
    loom_rcache_rec_t *rec = loom_rcache_rec_begin(c, key, kl);
    for (int i = 0; i < n; i++) {
        Loom__V1__Reply r = LOOM__V1__REPLY__INIT;
        Loom__V1__GenerateChunk ch = LOOM__V1__GENERATE_CHUNK__INIT;
        Loom__V1__Timings t = LOOM__V1__TIMINGS__INIT;
        int32_t id = 100 + i;
        ch.ids = &id;
        ch.n_ids = 1;
        ch.text = (char *)"ab";
        r.request_id = 77;
        if (i == n - 1) {
            ch.final = 1;
            ch.finish_reason = (Loom__V1__FinishReason)finish;
            t.total_ms = 5;
            ch.timings = &t;
        }
        r.body_case = LOOM__V1__REPLY__BODY_CHUNK;
        r.chunk = &ch;
        loom_rcache_rec_add(rec, &r);
    }
    loom_rcache_rec_commit(c, &rec, now);
    CHECK(rec == NULL);
}

static int has(loom_rcache_t *c, const Loom__V1__GenerateRequest *g, uint64_t now) {
    size_t kl;
    unsigned char *key = loom_rcache_key(g, "m", &kl);
    loom_rcache_hit_t hit;
    int found = loom_rcache_get(c, key, kl, now, &hit);
    free(key);
    return found ? hit.n : 0;
}

static void test_cacheable_and_key(void) {
    Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.prompt = (char *)"hello";
    CHECK(!loom_rcache_cacheable(&g)); /* no sampling params: temperature 1, the server's seed */
    g.sampling = &sp;
    CHECK(loom_rcache_cacheable(&g)); /* temperature 0 */
    sp.temperature = 0.7f;
    CHECK(!loom_rcache_cacheable(&g));
    sp.has_seed = 1;
    sp.seed = 9;
    CHECK(loom_rcache_cacheable(&g));
    g.no_cache = 1;
    CHECK(!loom_rcache_cacheable(&g));
    g.no_cache = 0;
    /* tag, session, priority and the served model's name spelled out change nothing; the rest does
     */
    size_t l1, l2;
    unsigned char *k1 = loom_rcache_key(&g, "m", &l1);
    Loom__V1__GenerateRequest h = g;
    h.tag = (char *)"x-1";
    h.session = (char *)"s";
    h.priority = 5;
    h.model = (char *)"m";
    unsigned char *k2 = loom_rcache_key(&h, "m", &l2);
    CHECK(l1 == l2 && !memcmp(k1, k2, l1));
    free(k2);
    h = g;
    h.max_tokens = 3;
    k2 = loom_rcache_key(&h, "m", &l2);
    CHECK(!(l1 == l2 && !memcmp(k1, k2, l1)));
    free(k2);
    Loom__V1__SamplingParams sp2 = sp;
    sp2.seed = 10;
    h = g;
    h.sampling = &sp2;
    k2 = loom_rcache_key(&h, "m", &l2);
    CHECK(!(l1 == l2 && !memcmp(k1, k2, l1))); /* another seed, another answer */
    free(k2);
    /* greedy: the seed does not matter */
    sp.temperature = 0;
    sp2.temperature = 0;
    free(k1);
    k1 = loom_rcache_key(&g, "m", &l1);
    k2 = loom_rcache_key(&h, "m", &l2);
    CHECK(l1 == l2 && !memcmp(k1, k2, l1));
    free(k1);
    free(k2);
}

static void test_store_replay_lru_ttl(void) {
    loom_rcache_t *c = loom_rcache_create(2000, 1000);
    Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
    Loom__V1__GenerateRequest g[4];
    const char *prompts[4] = {"one", "two", "three", "four"};
    for (int i = 0; i < 4; i++) {
        g[i] = (Loom__V1__GenerateRequest)LOOM__V1__GENERATE_REQUEST__INIT;
        g[i].prompt = (char *)prompts[i];
        g[i].sampling = &sp;
    }
    record(c, &g[0], 5, LOOM__V1__FINISH_REASON__FINISH_LENGTH, 0);
    CHECK(has(c, &g[0], 1 * MS) == 5);
    /* the replies kept: request id cleared, timings left out, final with its finish reason */
    size_t kl;
    unsigned char *key = loom_rcache_key(&g[0], "m", &kl);
    loom_rcache_hit_t hit;
    CHECK(loom_rcache_get(c, key, kl, 2 * MS, &hit));
    free(key);
    loom_err_t err = {0};
    Loom__V1__Reply *last = loom_wire_unpack_reply(hit.msg[hit.n - 1], hit.len[hit.n - 1], &err);
    CHECK(last && last->request_id == 0 && last->chunk->final && !last->chunk->timings &&
          last->chunk->finish_reason == LOOM__V1__FINISH_REASON__FINISH_LENGTH &&
          last->chunk->ids[0] == 104);
    if (last) protobuf_c_message_free_unpacked(&last->base, NULL);
    /* an error or a cancel is not kept */
    record(c, &g[1], 3, LOOM__V1__FINISH_REASON__FINISH_CANCELLED, 0);
    CHECK(!has(c, &g[1], 3 * MS));
    /* the byte bound: entries of ~5 chunks take a few hundred bytes; fill, then the least recently
     * used goes */
    loom_rcache_stats_t st = loom_rcache_stats(c);
    size_t one = st.bytes;
    CHECKF(one > 128 && one < 700, "one entry: %zu bytes", one);
    int fit = (int)(2000 / one);
    Loom__V1__GenerateRequest more[16];
    char names[16][16];
    for (int i = 0; i < fit + 1 && i < 16; i++) {
        more[i] = g[2];
        snprintf(names[i], sizeof names[i], "p%d", i);
        more[i].prompt = names[i];
        CHECK(has(c, &g[0], 4 * MS) == 5); /* g[0] stays the most recently used */
        record(c, &more[i], 5, LOOM__V1__FINISH_REASON__FINISH_STOP, 4 * MS);
    }
    st = loom_rcache_stats(c);
    CHECKF(st.bytes <= 2000 && st.evictions >= 1, "%zu bytes, %llu evictions", st.bytes,
           (unsigned long long)st.evictions);
    CHECK(has(c, &g[0], 5 * MS) == 5); /* kept: used before every commit */
    CHECK(!has(c, &more[0], 5 * MS));  /* the oldest unused one was evicted */
    /* larger than the whole cache: never stored, nothing else evicted */
    int entries = st.entries;
    record(c, &g[3], 200, LOOM__V1__FINISH_REASON__FINISH_STOP, 5 * MS);
    st = loom_rcache_stats(c);
    CHECK(!has(c, &g[3], 6 * MS) && st.too_big == 1 && st.entries == entries);
    /* TTL: 1000 ms after its store, an entry is gone */
    CHECK(has(c, &g[0], 999 * MS) == 5);
    CHECK(!has(c, &g[0], 1000 * MS));
    st = loom_rcache_stats(c);
    CHECK(st.expired == 1);
    loom_rcache_destroy(&c);
    CHECK(c == NULL);
    loom_rcache_destroy(&c);
}

static const char *k_file =
    "{\"default\": {\"requests_per_s\": 2},"
    " \"tenants\": {\"ka\": {\"name\": \"a\", \"requests_per_s\": 1, \"burst\": 2},"
    "              \"kb\": {\"max_concurrent\": 1},"
    "              \"kc\": {\"name\": \"c\", \"tokens_per_min\": 600}}}";

static void test_tenant_buckets(void) {
    loom_tenants_t *t = NULL;
    loom_err_t err = {0};
    CHECKF(loom_tenants_parse(k_file, strlen(k_file), &t, &err) == LOOM_OK, "%s", err.msg);
    int listed;
    int a = loom_tenants_find(t, "ka", &listed);
    CHECK(listed && !strcmp(loom_tenants_name(t, a), "a"));
    int b = loom_tenants_find(t, "kb", &listed);
    CHECK(listed && !strcmp(loom_tenants_name(t, b), "tenant-2"));
    CHECK(loom_tenants_find(t, "other", &listed) == 0 && !listed);
    CHECK(loom_tenants_find(t, NULL, &listed) == 0 && !listed);
    char msg[256];
    int retry;
    uint64_t now = 1000 * MS;
    /* a: a burst of 2 at 1 request/s */
    CHECK(loom_tenants_admit(t, a, now, &retry, msg, sizeof msg) == LOOM_OK);
    CHECK(loom_tenants_admit(t, a, now, &retry, msg, sizeof msg) == LOOM_OK);
    CHECK(loom_tenants_admit(t, a, now + 100 * MS, &retry, msg, sizeof msg) ==
          LOOM_ERR_RESOURCE_EXHAUSTED);
    CHECKF(retry == 900 && strstr(msg, "'a'") && strstr(msg, "1 requests/s"), "retry %d: %s", retry,
           msg);
    CHECK(loom_tenants_admit(t, a, now + 1000 * MS, &retry, msg, sizeof msg) == LOOM_OK);
    /* the default tenant is served all along */
    CHECK(loom_tenants_admit(t, 0, now + 100 * MS, &retry, msg, sizeof msg) == LOOM_OK);
    /* b: one at a time */
    CHECK(loom_tenants_admit(t, b, now, &retry, msg, sizeof msg) == LOOM_OK);
    CHECK(loom_tenants_admit(t, b, now, &retry, msg, sizeof msg) == LOOM_ERR_RESOURCE_EXHAUSTED);
    CHECK(strstr(msg, "max_concurrent") && retry == 1000);
    loom_tenants_release(t, b, 50, now);
    CHECK(loom_tenants_admit(t, b, now, &retry, msg, sizeof msg) == LOOM_OK);
    /* c: 600 tokens/min = 10/s; a request of 700 tokens takes the bucket to -100 */
    int c = loom_tenants_find(t, "kc", &listed);
    CHECK(loom_tenants_admit(t, c, now, &retry, msg, sizeof msg) == LOOM_OK);
    loom_tenants_release(t, c, 700, now);
    CHECK(loom_tenants_admit(t, c, now, &retry, msg, sizeof msg) == LOOM_ERR_RESOURCE_EXHAUSTED);
    CHECKF(retry == 10100 && strstr(msg, "tokens/min"), "retry %d: %s", retry,
           msg); /* (100 + 1) / 10 s */
    CHECK(loom_tenants_admit(t, c, now + 10100 * MS, &retry, msg, sizeof msg) == LOOM_OK);
    loom_tenant_stats_t s = loom_tenants_stats(t, a);
    CHECK(s.admitted == 3 && s.rate_limited == 1);
    char *text = loom_tenants_metrics_text(t);
    CHECK(strstr(text, "tenant=\"a\",outcome=\"rate_limited\"} 1") && !strstr(text, "ka"));
    free(text);
    loom_tenants_destroy(&t);
    CHECK(t == NULL);
}

static void test_tenant_file_errors(void) {
    static const struct {
        const char *json, *want;
    } bad[] = {
        {"[1]", "JSON object"},
        {"{\"tenant\": {}}", "tenant"},
        {"{\"tenants\": {\"k\": {\"requests_per_s\": -1}}}", "requests_per_s"},
        {"{\"tenants\": {\"k\": {\"rps\": 1}}}", "rps"},
        {"{\"tenants\": {\"k\": {\"max_concurrent\": 1.5}}}", "max_concurrent"},
        {"{\"tenants\": {\"k\": {\"burst\": 3}}}", "requests_per_s"},
        {"{\"tenants\": {\"k\": {\"name\": \"default\"}}}", "default"},
        {"{\"tenants\": {\"\": {}}}", "empty"},
        {"{\"default\": {\"name\": 3}}", "name"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        loom_tenants_t *t = NULL;
        loom_err_t err = {0};
        CHECKF(loom_tenants_parse(bad[i].json, strlen(bad[i].json), &t, &err) ==
                       LOOM_ERR_INVALID_ARGUMENT &&
                   !t && strstr(err.msg, bad[i].want),
               "%s -> %s", bad[i].json, err.msg);
    }
    loom_tenants_t *t = NULL;
    loom_err_t err = {0};
    CHECK(loom_tenants_load("/nonexistent/tenants.json", &t, &err) == LOOM_ERR_INVALID_ARGUMENT &&
          strstr(err.msg, "/nonexistent/tenants.json"));
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Samples spread over six decades (1 ns to 1 ms, log-uniform, plus a few
 * huge ones that are clamped): every quantile within 3.2% of the sorted
 * samples' own, sum and max exact. */
static void test_lathist(void) {
    static loom_lathist_t h;
    CHECK(loom_lathist_quantile(&h, 0.5) == 0);
    enum { N = 20000 };
    uint64_t *v = malloc(N * sizeof *v), s = 12345, sum = 0;
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u = (double)(s >> 11) / 9007199254740992.0;
        v[i] = (uint64_t)pow(10.0, 6.0 * u);
        if (i % 5000 == 4999) v[i] = 1ull << 50; /* past the top: clamped */
        loom_lathist_add(&h, v[i]);
        if (v[i] >= (1ull << LOOM_LATHIST_MAX_BITS)) v[i] = (1ull << LOOM_LATHIST_MAX_BITS) - 1;
        sum += v[i];
    }
    CHECK(h.n == N);
    CHECK(h.sum_ns == sum);
    qsort(v, N, sizeof *v, cmp_u64);
    CHECK(h.max_ns == v[N - 1]);
    const double qs[] = {0.001, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0};
    for (size_t k = 0; k < sizeof qs / sizeof *qs; k++) {
        double exact = (double)v[(size_t)ceil(qs[k] * N) - 1],
               got = loom_lathist_quantile(&h, qs[k]);
        CHECKF(fabs(got - exact) <= 0.032 * exact + 0.5, "q %g: %g against %g", qs[k], got, exact);
    }
    loom_lathist_t one = {0};
    loom_lathist_add(&one, 7);
    CHECK(loom_lathist_quantile(&one, 0.5) == 7 && loom_lathist_quantile(&one, 1) == 7);
    free(v);
}

int main(void) {
    RUN(test_lathist);
    RUN(test_cacheable_and_key);
    RUN(test_store_replay_lru_ttl);
    RUN(test_tenant_buckets);
    RUN(test_tenant_file_errors);
    return test_summary();
}
