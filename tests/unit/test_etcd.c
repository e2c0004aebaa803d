/* The etcd client (common/etcd.h) against a real etcd started by
 * tests/etcd_fixture.sh: base64, keys, prefix ranges, leases, create-if-absent,
 * the watch (events, lease expiry, compaction, an etcd restart, stop), the
 * keeper, and the errors (unreachable, silent, bad URL, gateway errors from a
 * fake HTTP server). Prints put/get and watch latencies.
 *
 * Under ctest the fixture has started etcd and LOOM_ETCD_DIR names its state
 * directory; run alone, the test starts (and stops) its own. Without etcd
 * the test fails. */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <curl/curl.h>

#include "common/etcd.h"
#include "common/log.h"
#include "common/util.h"
#include "tests/test.h"

static char g_url[256];
static char g_dir[512];
static const char *g_fixture;
static char g_prefix[64]; /* "/loom-test/<pid>" so reruns against one etcd don't collide */
static volatile sig_atomic_t g_own_pid;

/* ---------------------------------------------------------------- fixture */

static int run_fixture(const char *cmd) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        execl("/bin/bash", "bash", g_fixture, cmd, g_dir, (char *)NULL);
        _exit(127);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int read_line_file(const char *name, char *out, size_t n) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fgets(out, (int)n, f) != NULL;
    fclose(f);
    if (!ok) return -1;
    out[strcspn(out, "\r\n")] = '\0';
    return 0;
}

static void remember_own_pid(void) {
    char pid[32];
    if (read_line_file("pid", pid, sizeof pid) == 0) g_own_pid = atoi(pid);
}

/* When the test started etcd itself, a crash must not leave it running. */
static void on_fatal(int sig) {
    if (g_own_pid > 0) kill((pid_t)g_own_pid, SIGKILL);
    signal(sig, SIG_DFL);
    raise(sig);
}

/* --------------------------------------------------------------- helpers */

static double ms_since(uint64_t t0) {
    return (double)(loom_now_ns() - t0) / 1e6;
}

static void sleep_ms(int ms) {
    usleep((useconds_t)ms * 1000);
}

static loom_etcd_t *open_etcd(int timeout_ms) {
    loom_etcd_t *e = NULL;
    loom_err_t err = {0};
    if (loom_etcd_open(g_url, timeout_ms, &e, &err) != LOOM_OK)
        fprintf(stderr, "  open %s: %s\n", g_url, err.msg);
    return e;
}

static void key_of(char *out, size_t n, const char *test, const char *rest) {
    snprintf(out, n, "%s/%s/%s", g_prefix, test, rest);
}

/* Events a watch delivered, copied, with the time each arrived. */
typedef struct {
    loom_etcd_event_type_t type;
    char *key;
    char *value;
    size_t value_len;
    int64_t revision;
    uint64_t at_ns;
} rec_event_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rec_event_t ev[256];
    int n;
} collector_t;

static void collector_init(collector_t *c) {
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
}

static void collector_free(collector_t *c) {
    for (int i = 0; i < c->n; i++) {
        free(c->ev[i].key);
        free(c->ev[i].value);
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
}

static void collect(void *ctx, const loom_etcd_event_t *ev) {
    collector_t *c = ctx;
    pthread_mutex_lock(&c->mu);
    if (c->n < (int)LOOM_ARRAY_LEN(c->ev)) {
        rec_event_t *r = &c->ev[c->n++];
        r->type = ev->type;
        r->key = loom_xstrdup(ev->key);
        r->value = loom_xmalloc(ev->value_len + 1);
        memcpy(r->value, ev->value, ev->value_len + 1);
        r->value_len = ev->value_len;
        r->revision = ev->revision;
        r->at_ns = loom_now_ns();
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* Waits until at least n events have arrived; returns how many there are. */
static int collector_wait(collector_t *c, int n, int timeout_ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&c->mu);
    while (c->n < n && pthread_cond_timedwait(&c->cv, &c->mu, &ts) != ETIMEDOUT) {
    }
    int got = c->n;
    pthread_mutex_unlock(&c->mu);
    return got;
}

static const char *type_name(loom_etcd_event_type_t t) {
    return t == LOOM_ETCD_PUT ? "PUT" : t == LOOM_ETCD_DELETE ? "DELETE" : "COMPACTED";
}

static int event_is(const rec_event_t *r, loom_etcd_event_type_t type, const char *key,
                    const char *value) {
    int ok = r->type == type && !strcmp(r->key, key) && (!value || !strcmp(r->value, value));
    if (!ok)
        fprintf(stderr, "  event %s %s='%s' rev %" PRId64 ", wanted %s %s='%s'\n",
                type_name(r->type), r->key, r->value, r->revision, type_name(type), key,
                value ? value : "*");
    return ok;
}

/* Polls until key is absent; returns the milliseconds it took or -1. */
static double wait_absent(loom_etcd_t *e, const char *key, int timeout_ms) {
    uint64_t t0 = loom_now_ns();
    while (ms_since(t0) < timeout_ms) {
        char *v = NULL;
        loom_status_t s = loom_etcd_get(e, key, &v, NULL, NULL, NULL);
        free(v);
        if (s == LOOM_ERR_NOT_FOUND) return ms_since(t0);
        sleep_ms(50);
    }
    return -1;
}

/* ----------------------------------------------------------------- tests */

static void test_base64(void) {
    static const struct {
        const char *plain, *enc;
    } rfc[] = {{"", ""},
               {"f", "Zg=="},
               {"fo", "Zm8="},
               {"foo", "Zm9v"},
               {"foob", "Zm9vYg=="},
               {"fooba", "Zm9vYmE="},
               {"foobar", "Zm9vYmFy"}};
    char enc[512];
    unsigned char dec[512];
    size_t n;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(rfc); i++) {
        CHECK(loom_b64_encode(rfc[i].plain, strlen(rfc[i].plain), enc) == strlen(rfc[i].enc));
        CHECKF(!strcmp(enc, rfc[i].enc), "'%s' -> '%s'", rfc[i].plain, enc);
        CHECK(loom_b64_decode(rfc[i].enc, strlen(rfc[i].enc), dec, &n) == LOOM_OK &&
              n == strlen(rfc[i].plain) && !memcmp(dec, rfc[i].plain, n));
    }
    /* Every length 0..64, with every byte value at every position over the offsets. */
    unsigned char src[256];
    int bad = 0;
    for (int len = 0; len <= 64; len++) {
        for (int off = 0; off < 256; off++) {
            for (int i = 0; i < len; i++)
                src[i] = (unsigned char)(off + i * 7);
            size_t m = loom_b64_encode(src, (size_t)len, enc);
            if (m != 4 * (((size_t)len + 2) / 3) || enc[m] != '\0') bad++;
            if (loom_b64_decode(enc, m, dec, &n) != LOOM_OK || n != (size_t)len ||
                memcmp(dec, src, (size_t)len))
                bad++;
            size_t unpadded = m;
            while (unpadded && enc[unpadded - 1] == '=')
                unpadded--;
            if (loom_b64_decode(enc, unpadded, dec, &n) != LOOM_OK || n != (size_t)len ||
                memcmp(dec, src, (size_t)len))
                bad++;
        }
    }
    CHECKF(bad == 0, "%d round-trip failures", bad);
    for (int i = 0; i < 256; i++)
        src[i] = (unsigned char)i;
    size_t m = loom_b64_encode(src, 256, enc);
    CHECK(loom_b64_decode(enc, m, dec, &n) == LOOM_OK && n == 256 && !memcmp(src, dec, 256));
    static const char *invalid[] = {
        "Z", "Zg=", "Z===", "Zg==Zg==", "Z!==", "Zh==", "Zm9=", "Zm 9v"};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(invalid); i++)
        CHECKF(loom_b64_decode(invalid[i], strlen(invalid[i]), dec, &n) == LOOM_ERR_FORMAT,
               "'%s' accepted", invalid[i]);

    char end[16];
    CHECK(loom_etcd_prefix_end("/a/", 3, end) == 3 && !memcmp(end, "/a0", 3));
    CHECK(loom_etcd_prefix_end("a\xff", 2, end) == 1 && end[0] == 'b');
    CHECK(loom_etcd_prefix_end("\xff\xff", 2, end) == 1 && end[0] == '\0');
    CHECK(loom_etcd_prefix_end("", 0, end) == 1 && end[0] == '\0');
}

static void test_put_get_delete(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char key[128];
    key_of(key, sizeof key, "kv", "one");
    CHECKF(loom_etcd_put(e, key, "hello", 5, 0, &err) == LOOM_OK, "%s", err.msg);
    char *v = NULL;
    size_t len = 0;
    int64_t rev1 = 0, rev2 = 0;
    CHECKF(loom_etcd_get(e, key, &v, &len, &rev1, &err) == LOOM_OK, "%s", err.msg);
    CHECK(v && len == 5 && !strcmp(v, "hello") && rev1 > 0);
    free(v);

    static const char bin[] = {'a', 0, 'b', '\xff', 0};
    CHECK(loom_etcd_put(e, key, bin, sizeof bin, 0, &err) == LOOM_OK);
    CHECK(loom_etcd_get(e, key, &v, &len, &rev2, &err) == LOOM_OK);
    CHECK(v && len == sizeof bin && !memcmp(v, bin, sizeof bin) && v[len] == '\0' && rev2 > rev1);
    free(v);

    CHECK(loom_etcd_put(e, key, "", 0, 0, &err) == LOOM_OK); /* etcd omits an empty value */
    CHECK(loom_etcd_get(e, key, &v, &len, NULL, &err) == LOOM_OK && v && len == 0 && v[0] == '\0');
    free(v);

    CHECKF(loom_etcd_delete(e, key, &err) == LOOM_OK, "%s", err.msg);
    v = NULL;
    CHECK(loom_etcd_get(e, key, &v, &len, NULL, &err) == LOOM_ERR_NOT_FOUND && v == NULL);
    CHECKF(strstr(err.msg, key) != NULL, "%s", err.msg);
    CHECK(loom_etcd_delete(e, key, &err) == LOOM_OK); /* already gone: still fine */
    CHECK(loom_etcd_put(e, "", "x", 1, 0, &err) == LOOM_ERR_INVALID_ARGUMENT);

    /* Latency of put and get on one kept-alive connection. */
    enum { N = 100 };
    uint64_t t0 = loom_now_ns();
    int fails = 0;
    for (int i = 0; i < N; i++) {
        char val[32];
        int vn = snprintf(val, sizeof val, "v%d", i);
        fails += loom_etcd_put(e, key, val, (size_t)vn, 0, NULL) != LOOM_OK;
    }
    double put_ms = ms_since(t0) / N;
    t0 = loom_now_ns();
    for (int i = 0; i < N; i++) {
        fails += loom_etcd_get(e, key, &v, NULL, NULL, NULL) != LOOM_OK;
        free(v);
    }
    double get_ms = ms_since(t0) / N;
    CHECK(fails == 0);
    fprintf(stderr, "  latency: put %.3f ms, get %.3f ms (mean of %d, one connection)\n", put_ms,
            get_ms, N);
    loom_etcd_delete(e, key, NULL);
    loom_etcd_close(&e);
    loom_etcd_close(&e); /* twice is fine */
    CHECK(e == NULL);
}

static void test_range_prefix(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char prefix[128], key[160];
    key_of(prefix, sizeof prefix, "range", "workers/");
    static const char *names[] = {"c", "a", "b/x"};
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s%s", prefix, names[i]);
        CHECK(loom_etcd_put(e, key, names[i], strlen(names[i]), 0, &err) == LOOM_OK);
    }
    /* Just outside: the prefix's range end itself, and the prefix without its slash. */
    key_of(key, sizeof key, "range", "workers0");
    CHECK(loom_etcd_put(e, key, "out", 3, 0, &err) == LOOM_OK);
    key_of(key, sizeof key, "range", "workers");
    CHECK(loom_etcd_put(e, key, "out", 3, 0, &err) == LOOM_OK);

    loom_etcd_kv_t *kvs = NULL;
    int n = -1;
    int64_t rev = 0;
    CHECKF(loom_etcd_range_prefix(e, prefix, &kvs, &n, &rev, &err) == LOOM_OK, "%s", err.msg);
    REQUIRE(n == 3);
    static const char *sorted[] = {"a", "b/x", "c"};
    int64_t maxrev = 0;
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s%s", prefix, sorted[i]);
        CHECKF(!strcmp(kvs[i].key, key), "%s", kvs[i].key);
        CHECK(kvs[i].value_len == strlen(sorted[i]) && !strcmp(kvs[i].value, sorted[i]));
        maxrev = LOOM_MAX(maxrev, kvs[i].mod_revision);
    }
    CHECK(rev >= maxrev && maxrev > 0);
    loom_etcd_kvs_free(kvs, n);

    key_of(key, sizeof key, "range", "nothing-here/");
    CHECK(loom_etcd_range_prefix(e, key, &kvs, &n, NULL, &err) == LOOM_OK && n == 0);
    loom_etcd_kvs_free(kvs, n);
    loom_etcd_close(&e);
}

static void test_lease_keepalive(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    int64_t id = 0;
    int ttl = 0;
    REQUIRE(loom_etcd_lease_grant(e, 1, &id, &ttl, &err) == LOOM_OK);
    CHECK(id != 0 && ttl >= 1);
    char key[128];
    key_of(key, sizeof key, "lease", "kept");
    CHECK(loom_etcd_put(e, key, "x", 1, id, &err) == LOOM_OK);
    uint64_t t0 = loom_now_ns();
    int ok = 1;
    while (ms_since(t0) < (ttl * 1000.0) * 2.5) {
        int left = 0;
        if (loom_etcd_lease_keepalive(e, id, &left, &err) != LOOM_OK || left < 1) ok = 0;
        sleep_ms(ttl * 1000 / 4);
    }
    CHECKF(ok, "%s", err.msg);
    char *v = NULL;
    CHECK(loom_etcd_get(e, key, &v, NULL, NULL, &err) == LOOM_OK);
    free(v);
    CHECK(loom_etcd_lease_revoke(e, id, &err) == LOOM_OK);
    loom_etcd_close(&e);
}

static void test_lease_expiry(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    int64_t id = 0;
    int ttl = 0;
    REQUIRE(loom_etcd_lease_grant(e, 1, &id, &ttl, &err) == LOOM_OK);
    char key[128];
    key_of(key, sizeof key, "lease", "expires");
    CHECK(loom_etcd_put(e, key, "x", 1, id, &err) == LOOM_OK);
    double ms = wait_absent(e, key, ttl * 1000 + 3000);
    CHECKF(ms >= 0, "key still there %d ms after a %d s lease", ttl * 1000 + 3000, ttl);
    fprintf(stderr, "  TTL %d s (asked 1): key gone after %.0f ms\n", ttl, ms);
    int left = -1;
    CHECK(loom_etcd_lease_keepalive(e, id, &left, &err) == LOOM_ERR_NOT_FOUND);
    CHECK(loom_etcd_put(e, key, "x", 1, id, &err) == LOOM_ERR_NOT_FOUND); /* etcd's error JSON */
    CHECKF(strstr(err.msg, "lease not found") != NULL, "%s", err.msg);
    loom_etcd_close(&e);
}

static void test_lease_revoke(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    int64_t id = 0;
    REQUIRE(loom_etcd_lease_grant(e, 30, &id, NULL, &err) == LOOM_OK);
    char key[128];
    key_of(key, sizeof key, "lease", "revoked");
    CHECK(loom_etcd_put(e, key, "x", 1, id, &err) == LOOM_OK);
    CHECKF(loom_etcd_lease_revoke(e, id, &err) == LOOM_OK, "%s", err.msg);
    char *v = NULL;
    CHECK(loom_etcd_get(e, key, &v, NULL, NULL, &err) == LOOM_ERR_NOT_FOUND);
    free(v);
    CHECK(loom_etcd_lease_revoke(e, id, &err) == LOOM_ERR_NOT_FOUND);
    CHECK(loom_etcd_lease_grant(e, 0, &id, NULL, &err) == LOOM_ERR_INVALID_ARGUMENT);
    loom_etcd_close(&e);
}

static void test_put_if_absent(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char key[128];
    key_of(key, sizeof key, "cluster", "coordinator");
    const char *first = "{\"control\":\"tcp://127.0.0.1:5555\"}";
    CHECKF(loom_etcd_put_if_absent(e, key, first, strlen(first), 0, &err) == LOOM_OK, "%s",
           err.msg);
    CHECK(loom_etcd_put_if_absent(e, key, "second", 6, 0, &err) == LOOM_ERR_RESOURCE_EXHAUSTED);
    CHECKF(strstr(err.msg, "tcp://127.0.0.1:5555") && strstr(err.msg, key), "%s", err.msg);
    char *v = NULL;
    CHECK(loom_etcd_get(e, key, &v, NULL, NULL, &err) == LOOM_OK && v && !strcmp(v, first));
    free(v);
    CHECK(loom_etcd_delete(e, key, &err) == LOOM_OK);
    CHECK(loom_etcd_put_if_absent(e, key, "second", 6, 0, &err) == LOOM_OK);
    CHECK(loom_etcd_delete(e, key, &err) == LOOM_OK);
    loom_etcd_close(&e);
}

static void test_watch(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char prefix[128], ka[160], kb[160], kout[160];
    key_of(prefix, sizeof prefix, "watch", "workers/");
    snprintf(ka, sizeof ka, "%sa", prefix);
    snprintf(kb, sizeof kb, "%sb", prefix);
    key_of(kout, sizeof kout, "watch", "workers0");
    collector_t c;
    collector_init(&c);
    loom_etcd_watch_t *w = NULL;
    CHECKF(loom_etcd_watch_start(e, prefix, 0, collect, &c, &w, &err) == LOOM_OK, "%s", err.msg);
    if (!w) goto done;
    int64_t lease = 0;
    int ttl = 0;
    CHECK(loom_etcd_lease_grant(e, 1, &lease, &ttl, &err) == LOOM_OK);
    uint64_t t_put = loom_now_ns();
    CHECK(loom_etcd_put(e, ka, "va", 2, 0, &err) == LOOM_OK);
    CHECK(loom_etcd_put(e, kout, "no", 2, 0, &err) == LOOM_OK);
    CHECK(loom_etcd_put(e, kb, "vb", 2, lease, &err) == LOOM_OK);
    CHECK(loom_etcd_delete(e, ka, &err) == LOOM_OK);
    int n = collector_wait(&c, 4, ttl * 1000 + 4000); /* the lease-expiry DELETE comes last */
    CHECKF(n == 4, "%d events", n);
    if (n >= 4) {
        CHECK(event_is(&c.ev[0], LOOM_ETCD_PUT, ka, "va"));
        CHECK(event_is(&c.ev[1], LOOM_ETCD_PUT, kb, "vb"));
        CHECK(event_is(&c.ev[2], LOOM_ETCD_DELETE, ka, ""));
        CHECK(event_is(&c.ev[3], LOOM_ETCD_DELETE, kb, ""));
        for (int i = 1; i < 4; i++)
            CHECK(c.ev[i].revision > c.ev[i - 1].revision);
        fprintf(
            stderr,
            "  watch: first event %.2f ms after its put began; lease-expiry DELETE after %.0f ms\n",
            (double)(c.ev[0].at_ns - t_put) / 1e6, (double)(c.ev[3].at_ns - t_put) / 1e6);
    }

    /* Event latency: put, then wait for its event. */
    enum { N = 20 };
    double total = 0, worst = 0;
    int missing = 0;
    for (int i = 0; i < N; i++) {
        int have = collector_wait(&c, 0, 0);
        uint64_t t0 = loom_now_ns();
        loom_etcd_put(e, ka, "lat", 3, 0, NULL);
        if (collector_wait(&c, have + 1, 2000) < have + 1) {
            missing++;
            continue;
        }
        double ms = (double)(c.ev[have].at_ns - t0) / 1e6;
        total += ms;
        worst = LOOM_MAX(worst, ms);
    }
    CHECK(missing == 0);
    fprintf(stderr,
            "  watch latency (put call start -> callback): mean %.2f ms, worst %.2f ms over %d\n",
            total / N, worst, N);

    uint64_t t0 = loom_now_ns();
    loom_etcd_watch_stop(&w);
    double stop_ms = ms_since(t0);
    CHECKF(stop_ms < 1000, "watch_stop took %.0f ms", stop_ms);
    CHECK(w == NULL);
    loom_etcd_watch_stop(&w);
    fprintf(stderr, "  watch_stop: %.2f ms\n", stop_ms);
done:
    loom_etcd_delete(e, ka, NULL);
    loom_etcd_delete(e, kout, NULL);
    collector_free(&c);
    loom_etcd_close(&e);
}

/* A watch from a past revision replays what happened since then. */
static void test_watch_from_revision(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char prefix[128], k[160];
    key_of(prefix, sizeof prefix, "replay", "");
    loom_etcd_kv_t *kvs = NULL;
    int n = 0;
    int64_t rev = 0;
    REQUIRE(loom_etcd_range_prefix(e, prefix, &kvs, &n, &rev, &err) == LOOM_OK);
    loom_etcd_kvs_free(kvs, n);
    for (int i = 0; i < 3; i++) {
        char v[16];
        snprintf(k, sizeof k, "%sk%d", prefix, i);
        snprintf(v, sizeof v, "%d", i);
        CHECK(loom_etcd_put(e, k, v, strlen(v), 0, &err) == LOOM_OK);
    }
    collector_t c;
    collector_init(&c);
    loom_etcd_watch_t *w = NULL;
    CHECKF(loom_etcd_watch_start(e, prefix, rev + 1, collect, &c, &w, &err) == LOOM_OK, "%s",
           err.msg);
    CHECK(collector_wait(&c, 3, 3000) == 3);
    for (int i = 0; i < c.n && i < 3; i++) {
        char v[16];
        snprintf(k, sizeof k, "%sk%d", prefix, i);
        snprintf(v, sizeof v, "%d", i);
        CHECK(event_is(&c.ev[i], LOOM_ETCD_PUT, k, v) && c.ev[i].revision > rev);
    }
    loom_etcd_watch_stop(&w);
    collector_free(&c);
    loom_etcd_close(&e);
}

/* Compacts etcd's history up to rev (not part of the client: Loom never compacts). */
static int compact(int64_t rev) {
    CURL *c = curl_easy_init();
    if (!c) return -1;
    char url[300], body[64];
    snprintf(url, sizeof url, "%s/v3/kv/compaction", g_url);
    snprintf(body, sizeof body, "{\"revision\":\"%" PRId64 "\",\"physical\":true}", rev);
    FILE *devnull = fopen("/dev/null", "w");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 3000L);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, devnull);
    CURLcode rc = curl_easy_perform(c);
    long http = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http);
    curl_easy_cleanup(c);
    fclose(devnull);
    return rc == CURLE_OK && http == 200 ? 0 : -1;
}

static void test_watch_compacted(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char prefix[128], k[160];
    key_of(prefix, sizeof prefix, "compact", "");
    snprintf(k, sizeof k, "%sk", prefix);
    int64_t first = 0, last = 0;
    char *v = NULL;
    CHECK(loom_etcd_put(e, k, "1", 1, 0, &err) == LOOM_OK);
    CHECK(loom_etcd_get(e, k, &v, NULL, &first, &err) == LOOM_OK);
    free(v);
    CHECK(loom_etcd_put(e, k, "2", 1, 0, &err) == LOOM_OK);
    CHECK(loom_etcd_get(e, k, &v, NULL, &last, &err) == LOOM_OK);
    free(v);
    REQUIRE(compact(last) == 0);
    collector_t c;
    collector_init(&c);
    loom_etcd_watch_t *w = NULL;
    CHECKF(loom_etcd_watch_start(e, prefix, first, collect, &c, &w, &err) == LOOM_OK, "%s",
           err.msg);
    int n = collector_wait(&c, 1, 3000);
    CHECK(n >= 1);
    if (n >= 1) {
        CHECK(c.ev[0].type == LOOM_ETCD_COMPACTED && c.ev[0].revision == last);
        CHECK(!strcmp(c.ev[0].key, prefix));
    }
    /* It goes on from the compaction point: the value at `last`, then new puts. */
    CHECK(loom_etcd_put(e, k, "3", 1, 0, &err) == LOOM_OK);
    n = collector_wait(&c, 3, 3000);
    CHECKF(n == 3, "%d events", n);
    if (n == 3) {
        CHECK(event_is(&c.ev[1], LOOM_ETCD_PUT, k, "2") && c.ev[1].revision == last);
        CHECK(event_is(&c.ev[2], LOOM_ETCD_PUT, k, "3"));
    }
    loom_etcd_watch_stop(&w);
    collector_free(&c);
    loom_etcd_close(&e);
}

static void test_keeper(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char key[128];
    key_of(key, sizeof key, "keeper", "workers/w0");
    const char *val = "{\"id\":\"w0\"}";
    loom_etcd_keeper_t *k = NULL, *k2 = NULL;
    REQUIRE(loom_etcd_keeper_start(e, key, val, strlen(val), 1, 1, &k, &err) == LOOM_OK);
    int64_t lease = loom_etcd_keeper_lease(k);
    CHECK(lease != 0);
    CHECK(loom_etcd_keeper_start(e, key, "x", 1, 1, 1, &k2, &err) == LOOM_ERR_RESOURCE_EXHAUSTED &&
          k2 == NULL);
    sleep_ms(3000); /* three TTLs: only the keeper's keepalives hold it */
    char *v = NULL;
    CHECKF(loom_etcd_get(e, key, &v, NULL, NULL, &err) == LOOM_OK && v && !strcmp(v, val), "%s",
           err.msg);
    free(v);
    /* Losing the lease (as when etcd was away longer than the TTL): it registers again. */
    CHECK(loom_etcd_lease_revoke(e, lease, &err) == LOOM_OK);
    uint64_t t0 = loom_now_ns();
    int back = 0;
    while (!back && ms_since(t0) < 3000) {
        sleep_ms(50);
        back = loom_etcd_get(e, key, &v, NULL, NULL, NULL) == LOOM_OK;
        free(v);
        v = NULL;
    }
    CHECKF(back, "key not registered again after its lease was revoked");
    CHECK(loom_etcd_keeper_lease(k) != lease && loom_etcd_keeper_lease(k) != 0);
    fprintf(stderr, "  keeper: key back %.0f ms after its lease was revoked\n", ms_since(t0));
    t0 = loom_now_ns();
    loom_etcd_keeper_stop(&k);
    CHECK(k == NULL);
    fprintf(stderr, "  keeper_stop: %.2f ms\n", ms_since(t0));
    CHECK(loom_etcd_get(e, key, &v, NULL, NULL, &err) == LOOM_ERR_NOT_FOUND); /* revoked at once */
    free(v);
    loom_etcd_keeper_stop(&k);
    loom_etcd_close(&e);
}

/* Stop etcd, start it again on the same ports and data: the watch resumes. */
static void test_watch_survives_restart(void) {
    loom_etcd_t *e = open_etcd(2000);
    REQUIRE(e);
    loom_err_t err = {0};
    char prefix[128], k1[160], k2[160], kk[160];
    key_of(prefix, sizeof prefix, "restart", "workers/");
    snprintf(k1, sizeof k1, "%sbefore", prefix);
    snprintf(k2, sizeof k2, "%safter", prefix);
    key_of(kk, sizeof kk, "restart", "kept");
    collector_t c;
    collector_init(&c);
    loom_etcd_watch_t *w = NULL;
    loom_etcd_keeper_t *k = NULL;
    CHECKF(loom_etcd_watch_start(e, prefix, 0, collect, &c, &w, &err) == LOOM_OK, "%s", err.msg);
    CHECKF(loom_etcd_keeper_start(e, kk, "k", 1, 2, 0, &k, &err) == LOOM_OK, "%s", err.msg);
    loom_etcd_watch_t *w2 = NULL;
    collector_t c2;
    collector_init(&c2);
    CHECK(loom_etcd_watch_start(e, kk, 0, collect, &c2, &w2, &err) == LOOM_OK);
    CHECK(loom_etcd_put(e, k1, "1", 1, 0, &err) == LOOM_OK);
    CHECK(collector_wait(&c, 1, 3000) == 1);

    fprintf(stderr, "  stopping etcd (the watch and keeper log that it is gone)\n");
    REQUIRE(run_fixture("stop") == 0);
    uint64_t t0 = loom_now_ns();
    CHECK(loom_etcd_put(e, k2, "x", 1, 0, &err) == LOOM_ERR_UNAVAILABLE);
    CHECKF(strstr(err.msg, g_url) != NULL, "%s", err.msg);
    CHECKF(ms_since(t0) < 2500, "a refused connection took %.0f ms", ms_since(t0));
    sleep_ms(500);
    /* A watch waiting to reconnect stops at once too. */
    t0 = loom_now_ns();
    loom_etcd_watch_stop(&w2);
    CHECKF(ms_since(t0) < 1000, "watch_stop while etcd is down took %.0f ms", ms_since(t0));
    fprintf(stderr, "  watch_stop while etcd is down: %.2f ms\n", ms_since(t0));
    int rc = run_fixture("restart");
    CHECK(rc == 0);
    remember_own_pid();
    if (rc == 0) {
        t0 = loom_now_ns();
        CHECKF(loom_etcd_put(e, k2, "2", 1, 0, &err) == LOOM_OK, "%s", err.msg);
        int n = collector_wait(&c, 2, 5000);
        CHECKF(n == 2, "%d events after the restart", n);
        if (n == 2) {
            CHECK(event_is(&c.ev[1], LOOM_ETCD_PUT, k2, "2"));
            CHECK(c.ev[1].revision > c.ev[0].revision);
            fprintf(stderr, "  event after restart delivered %.0f ms after the put\n",
                    (double)(c.ev[1].at_ns - t0) / 1e6);
        }
        sleep_ms(2500); /* longer than the keeper's TTL: it must still hold its key */
        char *v = NULL;
        CHECK(loom_etcd_get(e, kk, &v, NULL, NULL, &err) == LOOM_OK);
        free(v);
        CHECK(collector_wait(&c, 3, 0) == 2); /* nothing replayed twice */
    }
    loom_etcd_keeper_stop(&k);
    loom_etcd_watch_stop(&w);
    loom_etcd_watch_stop(&w2);
    collector_free(&c);
    collector_free(&c2);
    loom_etcd_close(&e);
}

/* A fake gateway on loopback: answers each connection with a canned reply. */
typedef struct {
    int fd;
    int port;
    pthread_t thread;
    _Atomic(const char *) reply;
    atomic_int stop;
    pthread_mutex_t mu;
    char last_request[8192]; /* the last request, headers and body */
    int requests;
} fake_t;

static void *fake_main(void *arg) {
    fake_t *f = arg;
    for (;;) {
        int c = accept(f->fd, NULL, NULL);
        if (c < 0 || atomic_load(&f->stop)) {
            if (c >= 0) close(c);
            return NULL;
        }
        char req[8192];
        size_t n = 0;
        req[0] = '\0';
        long want = -1;
        for (;;) { /* headers, then Content-Length bytes of body */
            ssize_t r = recv(c, req + n, sizeof req - 1 - n, 0);
            if (r <= 0) break;
            n += (size_t)r;
            req[n] = '\0';
            char *end = strstr(req, "\r\n\r\n");
            if (end) {
                char *cl = strcasestr(req, "Content-Length:");
                want = (long)(end + 4 - req) + (cl ? atol(cl + 15) : 0);
                if ((long)n >= want) break;
            }
            if (n >= sizeof req - 1) break;
        }
        pthread_mutex_lock(&f->mu);
        memcpy(f->last_request, req, n + 1);
        f->requests++;
        pthread_mutex_unlock(&f->mu);
        const char *reply = atomic_load(&f->reply);
        size_t left = strlen(reply);
        while (left) {
            ssize_t w = send(c, reply, left, MSG_NOSIGNAL);
            if (w <= 0) break;
            reply += w;
            left -= (size_t)w;
        }
        close(c);
    }
}

static int listen_loopback(int *port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 16) ||
        getsockname(fd, (struct sockaddr *)&a, &len)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return fd;
}

static void test_errors_unreachable(void) {
    loom_err_t err = {0};
    loom_etcd_t *e = NULL;
    /* A port nothing listens on: refused at once. */
    int port = 0, fd = listen_loopback(&port);
    REQUIRE(fd >= 0);
    close(fd);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    REQUIRE(loom_etcd_open(url, 500, &e, &err) == LOOM_OK);
    uint64_t t0 = loom_now_ns();
    CHECK(loom_etcd_put(e, "/k", "v", 1, 0, &err) == LOOM_ERR_UNAVAILABLE);
    CHECKF(strstr(err.msg, url) != NULL, "%s", err.msg);
    fprintf(stderr, "  refused: %.2f ms: %s\n", ms_since(t0), err.msg);
    CHECK(ms_since(t0) < 500);
    loom_etcd_watch_t *w = NULL;
    collector_t c;
    collector_init(&c);
    CHECK(loom_etcd_watch_start(e, "/k", 0, collect, &c, &w, &err) == LOOM_ERR_UNAVAILABLE && !w);
    loom_etcd_keeper_t *k = NULL;
    CHECK(loom_etcd_keeper_start(e, "/k", "v", 1, 2, 0, &k, &err) == LOOM_ERR_UNAVAILABLE && !k);
    loom_etcd_close(&e);

    /* A server that accepts but never answers: the timeout bounds each call. */
    fd = listen_loopback(&port);
    REQUIRE(fd >= 0);
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    REQUIRE(loom_etcd_open(url, 300, &e, &err) == LOOM_OK);
    t0 = loom_now_ns();
    char *v = NULL;
    CHECK(loom_etcd_get(e, "/k", &v, NULL, NULL, &err) == LOOM_ERR_UNAVAILABLE && !v);
    double ms = ms_since(t0);
    fprintf(stderr, "  silent server: %.0f ms (timeout 300): %s\n", ms, err.msg);
    CHECK(ms >= 250 && ms < 1500 && strstr(err.msg, url));
    t0 = loom_now_ns();
    CHECK(loom_etcd_watch_start(e, "/k", 0, collect, &c, &w, &err) == LOOM_ERR_UNAVAILABLE && !w);
    ms = ms_since(t0);
    CHECKF(ms >= 250 && ms < 1500, "watch_start on a silent server took %.0f ms", ms);
    CHECK(c.n == 0);
    loom_etcd_close(&e);
    close(fd);
    collector_free(&c);
}

static void test_errors_bad_url(void) {
    static const char *bad[] = {
        "not a url",      "tcp://127.0.0.1:2379",  "http://", "", "http://127.0.0.1:2379/v3",
        "127.0.0.1:2379", "http://127.0.0.1:99999"};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(bad); i++) {
        loom_err_t err = {0};
        loom_etcd_t *e = (loom_etcd_t *)(uintptr_t)1; /* open must reset it to NULL */
        CHECKF(loom_etcd_open(bad[i], 1000, &e, &err) == LOOM_ERR_INVALID_ARGUMENT && !e,
               "'%s' accepted", bad[i]);
        CHECKF(strstr(err.msg, "etcd URL"), "%s", err.msg);
        if (i < 2) fprintf(stderr, "  '%s': %s\n", bad[i], err.msg);
    }
    loom_etcd_t *e = NULL;
    CHECK(loom_etcd_open("http://127.0.0.1:2379/", 0, &e, NULL) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(loom_etcd_open("http://127.0.0.1:2379/", 1000, &e, NULL) == LOOM_OK);
    CHECK(e && !strcmp(loom_etcd_url(e), "http://127.0.0.1:2379"));
    loom_etcd_close(&e);
}

static char *http_reply(const char *status, const char *body) {
    char *r = loom_xmalloc(strlen(body) + 200);
    sprintf(r,
            "HTTP/1.1 %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
            "Content-Length: %zu\r\n\r\n%s",
            status, strlen(body), body);
    return r;
}

static void test_errors_gateway(void) {
    fake_t f = {0};
    f.fd = listen_loopback(&f.port);
    REQUIRE(f.fd >= 0);
    pthread_mutex_init(&f.mu, NULL);
    atomic_init(&f.stop, 0);
    char *replies[6];
    replies[0] = http_reply("400 Bad Request",
                            "{\"error\":\"illegal base64 data at input byte 0\",\"message\":"
                            "\"illegal base64 data at input byte 0\",\"code\":3}");
    replies[1] = http_reply("200 OK", "this is not json");
    replies[2] =
        http_reply("200 OK", "{\"header\":{\"revision\":\"7\"},\"kvs\":[{\"key\":\"!!\"}]}");
    replies[3] = http_reply("404 Not Found", "Not Found\n");
    replies[4] = http_reply("503 Service Unavailable",
                            "{\"error\":\"etcdserver: request timed out\",\"code\":14}");
    replies[5] = loom_xstrdup(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
        "{\"result\":{\"header\":{\"revision\":\"5\"},\"created\":true}}\n"
        "{\"result\":{\"header\":{\"revision\":\"7\"},\"events\":["
        "{\"kv\":{\"key\":\"L2svYQ==\",\"mod_revision\":\"6\",\"value\":\"eA==\"}},"
        "{\"type\":\"DELETE\",\"kv\":{\"key\":\"L2svYQ==\",\"mod_revision\":\"7\"}}]}}\n"
        "{\"result\":{\"header\":{\"revision\":\"7\"},\"canceled\":true,"
        "\"cancel_reason\":\"test\"}}\n");
    atomic_init(&f.reply, replies[0]);
    REQUIRE(pthread_create(&f.thread, NULL, fake_main, &f) == 0);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", f.port);
    loom_etcd_t *e = NULL;
    loom_err_t err = {0};
    CHECK(loom_etcd_open(url, 1000, &e, &err) == LOOM_OK);
    char *v = NULL;
    if (e) {
        CHECK(loom_etcd_put(e, "/k", "v", 1, 0, &err) == LOOM_ERR_INVALID_ARGUMENT);
        CHECKF(strstr(err.msg, "illegal base64") && strstr(err.msg, "/v3/kv/put"), "%s", err.msg);
        fprintf(stderr, "  gateway error: %s\n", err.msg);
        atomic_store(&f.reply, replies[1]);
        CHECK(loom_etcd_put(e, "/k", "v", 1, 0, &err) == LOOM_ERR_FORMAT);
        CHECKF(strstr(err.msg, "not json"), "%s", err.msg);
        atomic_store(&f.reply, replies[2]);
        CHECK(loom_etcd_get(e, "/k", &v, NULL, NULL, &err) == LOOM_ERR_FORMAT && !v);
        atomic_store(&f.reply, replies[3]);
        CHECK(loom_etcd_get(e, "/k", &v, NULL, NULL, &err) == LOOM_ERR_PROTOCOL);
        CHECKF(strstr(err.msg, "404"), "%s", err.msg);
        atomic_store(&f.reply, replies[4]);
        CHECK(loom_etcd_delete(e, "/k", &err) == LOOM_ERR_UNAVAILABLE);
        CHECKF(strstr(err.msg, "request timed out"), "%s", err.msg);
        /* A watch refused by the gateway: start reports it. */
        collector_t c;
        collector_init(&c);
        loom_etcd_watch_t *w = NULL;
        atomic_store(&f.reply, replies[0]);
        CHECK(loom_etcd_watch_start(e, "/k", 0, collect, &c, &w, &err) ==
              LOOM_ERR_INVALID_ARGUMENT);
        CHECKF(strstr(err.msg, "illegal base64"), "%s", err.msg);

        /* A stream: created, a PUT (no "type": the default is omitted) and a
         * DELETE, then a cancel. The watch reconnects from revision 8. */
        atomic_store(&f.reply, replies[5]);
        CHECKF(loom_etcd_watch_start(e, "/k/", 0, collect, &c, &w, &err) == LOOM_OK, "%s", err.msg);
        CHECK(collector_wait(&c, 2, 2000) >= 2);
        if (c.n >= 2) {
            CHECK(event_is(&c.ev[0], LOOM_ETCD_PUT, "/k/a", "x") && c.ev[0].revision == 6);
            CHECK(event_is(&c.ev[1], LOOM_ETCD_DELETE, "/k/a", "") && c.ev[1].revision == 7);
        }
        uint64_t t0 = loom_now_ns();
        int resumed = 0;
        while (!resumed && ms_since(t0) < 2000) {
            sleep_ms(20);
            pthread_mutex_lock(&f.mu);
            resumed = strstr(f.last_request, "\"start_revision\":\"8\"") != NULL;
            pthread_mutex_unlock(&f.mu);
        }
        CHECKF(resumed, "the watch did not reconnect from revision 8");
        CHECKF(collector_wait(&c, 3, 0) == 2, "%d events: replayed ones delivered again", c.n);
        loom_etcd_watch_stop(&w);
        collector_free(&c);
    }
    loom_etcd_close(&e);
    atomic_store(&f.stop, 1);
    shutdown(f.fd, SHUT_RDWR);
    int wake = socket(AF_INET, SOCK_STREAM, 0); /* in case accept does not return on shutdown */
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)f.port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    connect(wake, (struct sockaddr *)&a, sizeof a);
    close(wake);
    pthread_join(f.thread, NULL);
    close(f.fd);
    for (int i = 0; i < 6; i++)
        free(replies[i]);
    pthread_mutex_destroy(&f.mu);
}

/* ------------------------------------------------------------------ main */

int main(void) {
    loom_log_init("test_etcd");
    snprintf(g_prefix, sizeof g_prefix, "/loom-test/%d", (int)getpid());
    g_fixture = getenv("LOOM_ETCD_FIXTURE");
    if (!g_fixture) g_fixture = LOOM_SOURCE_DIR "/tests/etcd_fixture.sh";

    RUN(test_base64);
    RUN(test_errors_bad_url);
    RUN(test_errors_gateway);
    RUN(test_errors_unreachable);

    const char *dir = getenv("LOOM_ETCD_DIR");
    int own = 0;
    if (dir && dir[0]) {
        snprintf(g_dir, sizeof g_dir, "%s", dir);
    } else {
        const char *tmp = getenv("TMPDIR");
        snprintf(g_dir, sizeof g_dir, "%s/loom-test-etcd.XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
        if (!mkdtemp(g_dir)) {
            perror("mkdtemp");
            return 1;
        }
        own = 1;
        signal(SIGSEGV, on_fatal);
        signal(SIGABRT, on_fatal);
        signal(SIGINT, on_fatal);
        signal(SIGTERM, on_fatal);
        fprintf(stderr, "starting a private etcd in %s\n", g_dir);
        if (run_fixture("start") != 0) fprintf(stderr, "etcd_fixture.sh start failed\n");
        remember_own_pid();
    }
    if (read_line_file("url", g_url, sizeof g_url) != 0) {
        g_test_failures++;
        fprintf(
            stderr,
            "FAIL: no etcd: %s/url is missing (the etcd fixture did not start).\n"
            "  These tests need etcd 3.4+: 'sudo apt-get install etcd-server' on Debian/Ubuntu,\n"
            "  or a release from https://github.com/etcd-io/etcd/releases on PATH.\n",
            g_dir);
    } else {
        fprintf(stderr, "etcd at %s\n", g_url);
        RUN(test_put_get_delete);
        RUN(test_range_prefix);
        RUN(test_lease_keepalive);
        RUN(test_lease_expiry);
        RUN(test_lease_revoke);
        RUN(test_put_if_absent);
        RUN(test_watch);
        RUN(test_watch_from_revision);
        RUN(test_watch_compacted);
        RUN(test_keeper);
        RUN(test_watch_survives_restart);
    }
    if (own) run_fixture("clean");
    return test_summary();
}
