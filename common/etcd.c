/* etcd v3 over its JSON gateway: each call is one POST of a JSON body to
 * /v3/<service>/<method> on a kept-alive connection, keys and values base64,
 * int64 fields as JSON strings, fields at their default value omitted.
 *
 * The watch is a long POST to /v3/watch whose reply is a stream of
 * newline-separated {"result":{...}} objects, read by a curl multi handle on
 * the watch's own thread so that stop can wake it at once.
 *   CONNECTING --created--> STREAMING --events--> fn(ev), next_rev = rev + 1
 *   STREAMING --stream broken--> BACKOFF (100 ms doubling to 1 s) --> CONNECTING from next_rev
 *   STREAMING --canceled, compact_revision c--> fn(COMPACTED c), CONNECTING from c
 *   any --stop--> done.  A first connection that never gets "created" ends
 *   the watch and its error goes back to watch_start. */
#include "common/etcd.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/cert.h"
#include "common/log.h"
#include "common/util.h"

/* ------------------------------------------------------------------ base64 */

static const char b64_chars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t loom_b64_encode(const void *src, size_t n, char *dst) {
    const unsigned char *s = src;
    size_t o = 0, i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        dst[o++] = b64_chars[v >> 18];
        dst[o++] = b64_chars[(v >> 12) & 63];
        dst[o++] = b64_chars[(v >> 6) & 63];
        dst[o++] = b64_chars[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)s[i] << 16;
        dst[o++] = b64_chars[v >> 18];
        dst[o++] = b64_chars[(v >> 12) & 63];
        dst[o++] = '=';
        dst[o++] = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8;
        dst[o++] = b64_chars[v >> 18];
        dst[o++] = b64_chars[(v >> 12) & 63];
        dst[o++] = b64_chars[(v >> 6) & 63];
        dst[o++] = '=';
    }
    dst[o] = '\0';
    return o;
}

static int b64_val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

loom_status_t loom_b64_decode(const char *src, size_t n, void *dst, size_t *out_len) {
    unsigned char *d = dst;
    size_t pad = 0;
    while (pad < 2 && n > pad && src[n - 1 - pad] == '=')
        pad++;
    size_t m = n - pad; /* characters carrying data */
    if (m % 4 == 1 || (pad && n % 4 != 0)) return LOOM_ERR_FORMAT;
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < m; i++) {
        int v = b64_val((unsigned char)src[i]);
        if (v < 0) return LOOM_ERR_FORMAT;
        acc = acc << 6 | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            d[o++] = (unsigned char)(acc >> bits);
            acc &= (1u << bits) - 1;
        }
    }
    if (acc != 0) return LOOM_ERR_FORMAT; /* non-canonical trailing bits */
    *out_len = o;
    return LOOM_OK;
}

size_t loom_etcd_prefix_end(const char *prefix, size_t n, char *end) {
    memcpy(end, prefix, n);
    while (n > 0) {
        unsigned char c = (unsigned char)end[n - 1];
        if (c < 0xff) {
            end[n - 1] = (char)(c + 1);
            end[n] = '\0';
            return n;
        }
        n--; /* 0xff cannot be incremented: drop it and carry */
    }
    end[0] = '\0'; /* every key */
    return 1;
}

/* ------------------------------------------------------------ JSON helpers */

/* Adds name: base64(data) to obj. */
static void json_add_b64(cJSON *obj, const char *name, const void *data, size_t n) {
    char *s = loom_xmalloc(4 * ((n + 2) / 3) + 1);
    loom_b64_encode(data, n, s);
    cJSON_AddStringToObject(obj, name, s);
    free(s);
}

static void json_add_i64(cJSON *obj, const char *name, int64_t v) {
    char s[24];
    snprintf(s, sizeof s, "%" PRId64, v);
    cJSON_AddStringToObject(obj, name, s);
}

/* An int64 field: a JSON string (as the gateway writes them) or number;
 * absent means 0. Returns -1 when it is something else. */
static int json_i64(const cJSON *obj, const char *name, int64_t *v) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
    *v = 0;
    if (!it) return 0;
    if (cJSON_IsNumber(it)) {
        *v = (int64_t)it->valuedouble;
        return 0;
    }
    if (!cJSON_IsString(it) || !it->valuestring[0]) return -1;
    errno = 0;
    char *end;
    long long x = strtoll(it->valuestring, &end, 10);
    if (errno || *end) return -1;
    *v = x;
    return 0;
}

/* A base64 bytes field, decoded into a malloc'd NUL-terminated buffer;
 * absent means empty. Returns -1 when it is not valid base64. */
static int json_b64(const cJSON *obj, const char *name, char **out, size_t *len) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, name);
    const char *s = "";
    if (it) {
        if (!cJSON_IsString(it)) return -1;
        s = it->valuestring;
    }
    size_t n = strlen(s);
    char *d = loom_xmalloc(3 * (n / 4) + 3);
    size_t got = 0;
    if (loom_b64_decode(s, n, d, &got) != LOOM_OK) {
        free(d);
        return -1;
    }
    d[got] = '\0';
    *out = d;
    if (len) *len = got;
    return 0;
}

static int json_true(const cJSON *obj, const char *name) {
    return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(obj, name));
}

/* gRPC status codes, as etcd reports them, to loom's. */
static loom_status_t grpc_to_status(int code) {
    switch (code) {
    case 1:
        return LOOM_ERR_CANCELLED;
    case 3:
        return LOOM_ERR_INVALID_ARGUMENT;
    case 4:
        return LOOM_ERR_DEADLINE_EXCEEDED;
    case 5:
        return LOOM_ERR_NOT_FOUND;
    case 6:
        return LOOM_ERR_RESOURCE_EXHAUSTED; /* already exists */
    case 7:
        return LOOM_ERR_UNAUTHENTICATED; /* permission denied */
    case 8:
        return LOOM_ERR_RESOURCE_EXHAUSTED;
    case 9:
        return LOOM_ERR_INVALID_ARGUMENT; /* failed precondition */
    case 10:
        return LOOM_ERR_UNAVAILABLE; /* aborted */
    case 11:
        return LOOM_ERR_INVALID_ARGUMENT; /* out of range */
    case 12:
        return LOOM_ERR_UNSUPPORTED;
    case 14:
        return LOOM_ERR_UNAVAILABLE;
    case 16:
        return LOOM_ERR_UNAUTHENTICATED;
    default:
        return LOOM_ERR_INTERNAL;
    }
}

/* Copies up to n bytes of body into out as printable text, for messages. */
static void snippet(const char *body, size_t len, char *out, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < len && o + 1 < n; i++) {
        unsigned char c = (unsigned char)body[i];
        if (c == '\n' || c == '\r') continue;
        out[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    out[o] = '\0';
}

/* An error from the gateway: HTTP status http (0 inside a 200 stream) and a
 * body that is etcd's JSON error ({"error":"..","message":"..","code":N} or,
 * in streams, {"error":{"grpc_code":N,"message":".."}}) or plain text. */
static loom_status_t gateway_error(const char *url, const char *path, long http, const char *body,
                                   size_t len, loom_err_t *err) {
    cJSON *j = cJSON_ParseWithLength(body, len);
    const cJSON *e = cJSON_IsObject(j) ? cJSON_GetObjectItemCaseSensitive(j, "error") : NULL;
    if (e) {
        const cJSON *src = cJSON_IsObject(e) ? e : j;
        const cJSON *msg = cJSON_GetObjectItemCaseSensitive(src, "message");
        const cJSON *code =
            cJSON_GetObjectItemCaseSensitive(src, cJSON_IsObject(e) ? "grpc_code" : "code");
        const char *m = cJSON_IsString(msg) ? msg->valuestring
                        : cJSON_IsString(e) ? e->valuestring
                                            : "(no message)";
        int c = cJSON_IsNumber(code) ? code->valueint : 2;
        loom_status_t s = grpc_to_status(c);
        loom_err_set(err, s, "etcd at %s: %s: %s (HTTP %ld, gRPC code %d)", url, path, m, http, c);
        cJSON_Delete(j);
        return s;
    }
    cJSON_Delete(j);
    char text[160];
    snippet(body, len, text, sizeof text);
    if (http == 404)
        return loom_err_set(err, LOOM_ERR_PROTOCOL,
                            "etcd at %s: %s: HTTP 404 (%s): is this an etcd 3.4+ v3 JSON gateway?",
                            url, path, text[0] ? text : "empty body");
    loom_status_t s = http >= 500 ? LOOM_ERR_UNAVAILABLE : LOOM_ERR_INVALID_ARGUMENT;
    return loom_err_set(err, s, "etcd at %s: %s: HTTP %ld: %s", url, path, http,
                        text[0] ? text : "(empty body)");
}

static loom_status_t curl_error(const char *url, CURLcode rc, const char *detail, int timeout_ms,
                                loom_err_t *err) {
    const char *what = detail && detail[0] ? detail : curl_easy_strerror(rc);
    if (rc == CURLE_OPERATION_TIMEDOUT)
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE,
                            "etcd at %s did not answer within %d ms (%s)", url, timeout_ms, what);
    if (rc == CURLE_URL_MALFORMAT || rc == CURLE_UNSUPPORTED_PROTOCOL)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "etcd URL %s: %s", url, what);
    if (rc == CURLE_PEER_FAILED_VERIFICATION || rc == CURLE_SSL_CACERT_BADFILE)
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "etcd at %s: refused its TLS certificate (%s); check --etcd-cacert", url, what);
    if (rc == CURLE_SSL_CERTPROBLEM)
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "etcd at %s: this client's certificate or key cannot be used (%s); check --etcd-cert "
                            "and --etcd-key",
                            url, what);
    if (rc == CURLE_SSL_CONNECT_ERROR || (rc == CURLE_RECV_ERROR && strstr(what, "alert")))
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "etcd at %s: the TLS handshake failed (%s): etcd refused this client's certificate, or "
                            "needs one (--etcd-cert, --etcd-key)",
                            url, what);
    return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "etcd at %s unreachable: %s", url, what);
}

/* ------------------------------------------------------------------ handle */

/* TLS and authentication, from the environment at open (the binaries' flags
 * put them there: docs/membership.md#security). */
typedef struct etcd_sec {
    char *cacert, *cert, *key; /* PEM files; NULL: the system's CAs, no client certificate */
    char *user, *password;     /* v3 auth; NULL user: none */
} etcd_sec_t;

struct loom_etcd {
    char *url; /* scheme://host:port, no trailing slash */
    int timeout_ms;
    CURL *curl;
    struct curl_slist *headers; /* JSON, plus Authorization once a token is held */
    loom_sbuf_t resp;
    char errbuf[CURL_ERROR_SIZE];
    etcd_sec_t sec;
    char token[1024]; /* from /v3/auth/authenticate; "" until then */
};

static void sodium_like_wipe(char *p) {
    volatile char *v = p;
    while (*v) *v++ = 0;
}

static char *env_dup(const char *name) {
    const char *v = getenv(name);
    return v && v[0] ? loom_xstrdup(v) : NULL;
}

static loom_status_t sec_load(etcd_sec_t *s, loom_err_t *err) {
    memset(s, 0, sizeof *s);
    s->cacert = env_dup("LOOM_ETCD_CACERT");
    s->cert = env_dup("LOOM_ETCD_CERT");
    s->key = env_dup("LOOM_ETCD_KEY");
    s->user = env_dup("LOOM_ETCD_USER");
    s->password = env_dup("LOOM_ETCD_PASSWORD");
    const char *pf = getenv("LOOM_ETCD_PASSWORD_FILE");
    if (!s->password && pf && pf[0]) {
        char *data = NULL;
        size_t len = 0;
        LOOM_CHECK(loom_read_file(pf, &data, &len, err));
        while (len > 0 && (data[len - 1] == '\n' || data[len - 1] == '\r')) data[--len] = 0;
        s->password = data;
    }
    if (s->password && !s->user)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "an etcd password needs a user name (--etcd-user)");
    if (!!s->cert != !!s->key)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "an etcd client certificate needs its key, and a key its certificate (--etcd-cert with "
                            "--etcd-key)");
    /* etcd (Go's TLS) answers an expired client certificate with a bare "bad
     * certificate" alert: say what is wrong before asking */
    if (s->cert) LOOM_CHECK(loom_cert_check_dates(s->cert, "the etcd client certificate --etcd-cert", time(NULL), err));
    if (s->cacert) LOOM_CHECK(loom_cert_check_dates(s->cacert, "the etcd CA certificate --etcd-cacert", time(NULL), err));
    return LOOM_OK;
}

static void sec_free(etcd_sec_t *s) {
    free(s->cacert);
    free(s->cert);
    free(s->key);
    if (s->password) sodium_like_wipe(s->password);
    free(s->password);
    free(s->user);
}

/* Checks that url is http(s)://host[:port][/] and returns it without the
 * trailing slash. */
static loom_status_t parse_url(const char *url, char **base, loom_err_t *err) {
    if (!url || !url[0]) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "etcd URL is empty");
    if (strlen(url) > 512)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "etcd URL is too long (%zu characters)",
                            strlen(url));
    CURLU *u = curl_url();
    if (!u) return loom_err_set(err, LOOM_ERR_NOMEM, "out of memory parsing an etcd URL");
    char *scheme = NULL, *host = NULL, *path = NULL, *query = NULL;
    loom_status_t s = LOOM_OK;
    CURLUcode rc = curl_url_set(u, CURLUPART_URL, url, 0);
    if (rc != CURLUE_OK) {
        s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                         "etcd URL '%s' is not valid (%s); expected http://host:port", url,
                         curl_url_strerror(rc));
        goto done;
    }
    curl_url_get(u, CURLUPART_SCHEME, &scheme, 0);
    curl_url_get(u, CURLUPART_HOST, &host, 0);
    curl_url_get(u, CURLUPART_PATH, &path, 0);
    curl_url_get(u, CURLUPART_QUERY, &query, 0);
    if (!scheme || (strcasecmp(scheme, "http") != 0 && strcasecmp(scheme, "https") != 0)) {
        s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                         "etcd URL '%s' must start with http:// or https:// (got scheme '%s')", url,
                         scheme ? scheme : "");
        goto done;
    }
    if (!host || !host[0] || (path && strcmp(path, "/") != 0) || query) {
        s = loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                         "etcd URL '%s' is not valid; expected http://host:port with no path", url);
        goto done;
    }
    size_t n = strlen(url);
    while (n > 0 && url[n - 1] == '/')
        n--;
    *base = loom_xmalloc(n + 1);
    memcpy(*base, url, n);
    (*base)[n] = '\0';
done:
    curl_free(scheme);
    curl_free(host);
    curl_free(path);
    curl_free(query);
    curl_url_cleanup(u);
    return s;
}

static size_t collect_cb(char *ptr, size_t size, size_t nmemb, void *userdata) {
    loom_sbuf_add(userdata, ptr, size * nmemb);
    return size * nmemb;
}

static void curl_tls(CURL *c, const etcd_sec_t *s) {
    if (s->cacert) curl_easy_setopt(c, CURLOPT_CAINFO, s->cacert);
    if (s->cert) curl_easy_setopt(c, CURLOPT_SSLCERT, s->cert);
    if (s->key) curl_easy_setopt(c, CURLOPT_SSLKEY, s->key);
}

/* Options shared by the request and the watch handles. */
static void curl_common(CURL *c, struct curl_slist *headers, int timeout_ms) {
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_PROXY, "");
#if LIBCURL_VERSION_NUM >= 0x075500
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
#endif
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(c, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(c, CURLOPT_TCP_KEEPIDLE, 10L);
    curl_easy_setopt(c, CURLOPT_TCP_KEEPINTVL, 5L);
}

static struct curl_slist *json_headers(void) {
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    return h ? curl_slist_append(h, "Expect:") : NULL;
}

loom_status_t loom_etcd_open(const char *url, int timeout_ms, loom_etcd_t **out, loom_err_t *err) {
    *out = NULL;
    if (timeout_ms <= 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "etcd timeout must be positive (got %d ms)", timeout_ms);
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "libcurl failed to initialise");
    char *base = NULL;
    loom_status_t s = parse_url(url, &base, err);
    if (s != LOOM_OK) {
        curl_global_cleanup();
        return s;
    }
    loom_etcd_t *e = loom_xcalloc(1, sizeof *e);
    e->url = base;
    e->timeout_ms = timeout_ms;
    s = sec_load(&e->sec, err);
    if (s != LOOM_OK) {
        loom_etcd_close(&e);
        return s;
    }
    e->curl = curl_easy_init();
    e->headers = json_headers();
    if (!e->curl || !e->headers) {
        loom_etcd_close(&e);
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of memory creating an etcd client");
    }
    curl_common(e->curl, e->headers, timeout_ms);
    curl_tls(e->curl, &e->sec);
    curl_easy_setopt(e->curl, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(e->curl, CURLOPT_WRITEFUNCTION, collect_cb);
    curl_easy_setopt(e->curl, CURLOPT_WRITEDATA, &e->resp);
    curl_easy_setopt(e->curl, CURLOPT_ERRORBUFFER, e->errbuf);
    *out = e;
    return LOOM_OK;
}

void loom_etcd_close(loom_etcd_t **e_p) {
    if (!e_p || !*e_p) return;
    loom_etcd_t *e = *e_p;
    if (e->curl) curl_easy_cleanup(e->curl);
    curl_slist_free_all(e->headers);
    free(e->resp.p);
    free(e->url);
    sec_free(&e->sec);
    free(e);
    *e_p = NULL;
    curl_global_cleanup();
}

const char *loom_etcd_url(const loom_etcd_t *e) {
    return e->url;
}

static loom_status_t etcd_post(loom_etcd_t *e, const char *path, cJSON *body, cJSON **reply, loom_err_t *err);

/* A token for the configured user (v3 auth), in e->token and e->headers. */
static loom_status_t etcd_authenticate(loom_etcd_t *e, loom_err_t *err) {
    e->token[0] = 0;
    curl_slist_free_all(e->headers);
    e->headers = json_headers();
    curl_easy_setopt(e->curl, CURLOPT_HTTPHEADER, e->headers);
    cJSON *body = cJSON_CreateObject();
    cJSON_AddStringToObject(body, "name", e->sec.user);
    cJSON_AddStringToObject(body, "password", e->sec.password ? e->sec.password : "");
    cJSON *reply = NULL;
    loom_err_t aerr = {0};
    loom_status_t s = etcd_post(e, "/v3/auth/authenticate", body, &reply, &aerr);
    if (s != LOOM_OK) {
        if (strstr(aerr.msg, "authentication failed") || strstr(aerr.msg, "invalid user") ||
            strstr(aerr.msg, "password"))
            return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                                "etcd at %s refused user '%s': wrong user name or password (%s)", e->url,
                                e->sec.user, aerr.msg);
        if (err) *err = aerr;
        return s;
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(reply, "token");
    if (!cJSON_IsString(t) || !t->valuestring[0] || strlen(t->valuestring) + 16 > sizeof e->token) {
        cJSON_Delete(reply);
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "etcd at %s: /v3/auth/authenticate answered no token: is auth enabled there?", e->url);
    }
    snprintf(e->token, sizeof e->token, "%s", t->valuestring);
    cJSON_Delete(reply);
    char line[sizeof e->token + 32];
    snprintf(line, sizeof line, "Authorization: %s", e->token);
    e->headers = curl_slist_append(e->headers, line);
    curl_easy_setopt(e->curl, CURLOPT_HTTPHEADER, e->headers);
    return LOOM_OK;
}

/* POSTs body (consumed) to path and parses the reply object into *reply.
 * With a user, first gets a token, and gets a new one once when etcd says
 * the token is no longer valid (it expires when idle: --auth-token-ttl). */
static loom_status_t etcd_call(loom_etcd_t *e, const char *path, cJSON *body, cJSON **reply,
                               loom_err_t *err) {
    *reply = NULL;
    if (!e->sec.user) return etcd_post(e, path, body, reply, err);
    loom_status_t s = LOOM_OK;
    if (!e->token[0] && (s = etcd_authenticate(e, err)) != LOOM_OK) {
        cJSON_Delete(body);
        return s;
    }
    cJSON *again = cJSON_Duplicate(body, 1);
    loom_err_t first = {0};
    s = etcd_post(e, path, body, reply, &first);
    if (s != LOOM_OK && strstr(first.msg, "auth token")) { /* expired or revoked: once more with a new one */
        s = etcd_authenticate(e, err);
        if (s == LOOM_OK) return etcd_post(e, path, again, reply, err);
        return s;
    }
    cJSON_Delete(again);
    if (s != LOOM_OK && strstr(first.msg, "permission denied"))
        return loom_err_set(err, LOOM_ERR_UNAUTHENTICATED,
                            "%s: etcd user '%s' may not do that (grant it a read-write role on the /loom/ prefix)",
                            first.msg, e->sec.user);
    if (s != LOOM_OK && err) *err = first;
    return s;
}

static loom_status_t etcd_post(loom_etcd_t *e, const char *path, cJSON *body, cJSON **reply,
                               loom_err_t *err) {
    *reply = NULL;
    char *text = cJSON_PrintUnformatted(body);
    cJSON_Delete(body);
    if (!text) return loom_err_set(err, LOOM_ERR_NOMEM, "out of memory encoding an etcd request");
    char full[1024];
    snprintf(full, sizeof full, "%s%s", e->url, path);
    e->resp.len = 0;
    e->errbuf[0] = '\0';
    curl_easy_setopt(e->curl, CURLOPT_URL, full);
    curl_easy_setopt(e->curl, CURLOPT_POSTFIELDS, text);
    curl_easy_setopt(e->curl, CURLOPT_POSTFIELDSIZE, (long)strlen(text));
    CURLcode rc = curl_easy_perform(e->curl);
    curl_easy_setopt(e->curl, CURLOPT_POSTFIELDS, NULL);
    free(text);
    if (rc != CURLE_OK) return curl_error(e->url, rc, e->errbuf, e->timeout_ms, err);
    long http = 0;
    curl_easy_getinfo(e->curl, CURLINFO_RESPONSE_CODE, &http);
    const char *data = e->resp.p ? e->resp.p : "";
    if (http >= 400 || http < 200) return gateway_error(e->url, path, http, data, e->resp.len, err);
    cJSON *j = cJSON_ParseWithLength(data, e->resp.len);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        char text_[120];
        snippet(data, e->resp.len, text_, sizeof text_);
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "etcd at %s: %s: reply is not a JSON object: '%s'", e->url, path,
                            text_);
    }
    if (cJSON_GetObjectItemCaseSensitive(j, "error") &&
        !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(j, "error"))) {
        cJSON_Delete(j);
        return gateway_error(e->url, path, http, data, e->resp.len, err);
    }
    *reply = j;
    return LOOM_OK;
}

static loom_status_t bad_reply(const loom_etcd_t *e, const char *path, const char *what,
                               loom_err_t *err) {
    return loom_err_set(err, LOOM_ERR_FORMAT, "etcd at %s: %s: malformed reply (%s)", e->url, path,
                        what);
}

/* ------------------------------------------------------------------ leases */

loom_status_t loom_etcd_lease_grant(loom_etcd_t *e, int ttl_s, int64_t *lease_id, int *granted_ttl,
                                    loom_err_t *err) {
    if (ttl_s <= 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "lease TTL must be positive (got %d s)",
                            ttl_s);
    cJSON *body = cJSON_CreateObject();
    cJSON_AddNumberToObject(body, "TTL", ttl_s);
    cJSON *r;
    LOOM_CHECK(etcd_call(e, "/v3/lease/grant", body, &r, err));
    loom_status_t s = LOOM_OK;
    const cJSON *emsg = cJSON_GetObjectItemCaseSensitive(r, "error");
    int64_t id, ttl;
    if (cJSON_IsString(emsg) && emsg->valuestring[0]) {
        s = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "etcd at %s refused a lease: %s", e->url,
                         emsg->valuestring);
    } else if (json_i64(r, "ID", &id) || json_i64(r, "TTL", &ttl) || id == 0 || ttl <= 0) {
        s = bad_reply(e, "/v3/lease/grant", "no lease ID or TTL", err);
    } else {
        *lease_id = id;
        if (granted_ttl) *granted_ttl = (int)ttl;
    }
    cJSON_Delete(r);
    return s;
}

loom_status_t loom_etcd_lease_keepalive(loom_etcd_t *e, int64_t lease_id, int *ttl_left,
                                        loom_err_t *err) {
    cJSON *body = cJSON_CreateObject();
    json_add_i64(body, "ID", lease_id);
    cJSON *r;
    LOOM_CHECK(etcd_call(e, "/v3/lease/keepalive", body, &r, err));
    loom_status_t s = LOOM_OK;
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(r, "result");
    int64_t ttl;
    if (!cJSON_IsObject(res) || json_i64(res, "TTL", &ttl)) {
        s = bad_reply(e, "/v3/lease/keepalive", "no result", err);
    } else if (ttl <= 0) {
        s = loom_err_set(err, LOOM_ERR_NOT_FOUND,
                         "etcd lease %" PRId64 " has expired or was revoked", lease_id);
    } else if (ttl_left) {
        *ttl_left = (int)ttl;
    }
    cJSON_Delete(r);
    return s;
}

loom_status_t loom_etcd_lease_revoke(loom_etcd_t *e, int64_t lease_id, loom_err_t *err) {
    cJSON *body = cJSON_CreateObject();
    json_add_i64(body, "ID", lease_id);
    cJSON *r;
    LOOM_CHECK(etcd_call(e, "/v3/lease/revoke", body, &r, err));
    cJSON_Delete(r);
    return LOOM_OK;
}

/* -------------------------------------------------------------------- keys */

static cJSON *put_request(const char *key, const void *value, size_t len, int64_t lease_id) {
    cJSON *p = cJSON_CreateObject();
    json_add_b64(p, "key", key, strlen(key));
    json_add_b64(p, "value", value, len);
    if (lease_id) json_add_i64(p, "lease", lease_id);
    return p;
}

static loom_status_t check_key(const char *key, loom_err_t *err) {
    if (!key || !key[0]) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "etcd key is empty");
    return LOOM_OK;
}

loom_status_t loom_etcd_put(loom_etcd_t *e, const char *key, const void *value, size_t len,
                            int64_t lease_id, loom_err_t *err) {
    LOOM_CHECK(check_key(key, err));
    cJSON *r;
    LOOM_CHECK(
        etcd_call(e, "/v3/kv/put", put_request(key, value ? value : "", len, lease_id), &r, err));
    cJSON_Delete(r);
    return LOOM_OK;
}

/* Decodes one mvccpb.KeyValue. */
static int kv_decode(const cJSON *kv, loom_etcd_kv_t *out) {
    memset(out, 0, sizeof *out);
    if (!cJSON_IsObject(kv) || json_b64(kv, "key", &out->key, NULL)) return -1;
    if (json_b64(kv, "value", &out->value, &out->value_len) ||
        json_i64(kv, "mod_revision", &out->mod_revision)) {
        free(out->key);
        out->key = NULL;
        return -1;
    }
    return 0;
}

loom_status_t loom_etcd_get(loom_etcd_t *e, const char *key, char **value, size_t *len,
                            int64_t *mod_revision, loom_err_t *err) {
    *value = NULL;
    LOOM_CHECK(check_key(key, err));
    cJSON *body = cJSON_CreateObject();
    json_add_b64(body, "key", key, strlen(key));
    cJSON *r;
    LOOM_CHECK(etcd_call(e, "/v3/kv/range", body, &r, err));
    loom_status_t s = LOOM_OK;
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(r, "kvs");
    loom_etcd_kv_t kv;
    if (kvs && !cJSON_IsArray(kvs)) {
        s = bad_reply(e, "/v3/kv/range", "kvs is not an array", err);
    } else if (cJSON_GetArraySize(kvs) == 0) {
        s = loom_err_set(err, LOOM_ERR_NOT_FOUND, "etcd key %s not found", key);
    } else if (kv_decode(cJSON_GetArrayItem(kvs, 0), &kv)) {
        s = bad_reply(e, "/v3/kv/range", "bad key-value", err);
    } else {
        free(kv.key);
        *value = kv.value;
        if (len) *len = kv.value_len;
        if (mod_revision) *mod_revision = kv.mod_revision;
    }
    cJSON_Delete(r);
    return s;
}

loom_status_t loom_etcd_range_prefix(loom_etcd_t *e, const char *prefix, loom_etcd_kv_t **kvs_out,
                                     int *n_out, int64_t *revision, loom_err_t *err) {
    *kvs_out = NULL;
    *n_out = 0;
    size_t pn = strlen(prefix);
    char *end = loom_xmalloc(pn + 2);
    size_t en = loom_etcd_prefix_end(prefix, pn, end);
    cJSON *body = cJSON_CreateObject();
    json_add_b64(body, "key", pn ? prefix : "", pn ? pn : 1); /* "" prefix: from key "\0" */
    json_add_b64(body, "range_end", end, en);
    free(end);
    cJSON *r;
    LOOM_CHECK(etcd_call(e, "/v3/kv/range", body, &r, err));
    loom_status_t s = LOOM_OK;
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(r, "kvs");
    const cJSON *hdr = cJSON_GetObjectItemCaseSensitive(r, "header");
    int64_t rev = 0;
    if ((kvs && !cJSON_IsArray(kvs)) || !cJSON_IsObject(hdr) || json_i64(hdr, "revision", &rev)) {
        s = bad_reply(e, "/v3/kv/range", "no header or kvs", err);
        goto done;
    }
    int n = cJSON_GetArraySize(kvs);
    loom_etcd_kv_t *out = loom_xcalloc((size_t)(n ? n : 1), sizeof *out);
    for (int i = 0; i < n; i++) {
        if (kv_decode(cJSON_GetArrayItem(kvs, i), &out[i])) {
            loom_etcd_kvs_free(out, i);
            s = bad_reply(e, "/v3/kv/range", "bad key-value", err);
            goto done;
        }
    }
    *kvs_out = out;
    *n_out = n;
    if (revision) *revision = rev;
done:
    cJSON_Delete(r);
    return s;
}

void loom_etcd_kvs_free(loom_etcd_kv_t *kvs, int n) {
    if (!kvs) return;
    for (int i = 0; i < n; i++) {
        free(kvs[i].key);
        free(kvs[i].value);
    }
    free(kvs);
}

loom_status_t loom_etcd_delete(loom_etcd_t *e, const char *key, loom_err_t *err) {
    LOOM_CHECK(check_key(key, err));
    cJSON *body = cJSON_CreateObject();
    json_add_b64(body, "key", key, strlen(key));
    cJSON *r;
    LOOM_CHECK(etcd_call(e, "/v3/kv/deleterange", body, &r, err));
    cJSON_Delete(r);
    return LOOM_OK;
}

loom_status_t loom_etcd_put_if_absent(loom_etcd_t *e, const char *key, const void *value,
                                      size_t len, int64_t lease_id, loom_err_t *err) {
    LOOM_CHECK(check_key(key, err));
    size_t kn = strlen(key);
    cJSON *body = cJSON_CreateObject();
    cJSON *cmp = cJSON_CreateObject();
    cJSON_AddStringToObject(cmp, "target", "CREATE");
    cJSON_AddStringToObject(cmp, "result", "EQUAL");
    json_add_b64(cmp, "key", key, kn);
    cJSON_AddStringToObject(cmp, "create_revision", "0");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(body, "compare"), cmp);
    cJSON *ok = cJSON_CreateObject();
    cJSON_AddItemToObject(ok, "request_put", put_request(key, value ? value : "", len, lease_id));
    cJSON_AddItemToArray(cJSON_AddArrayToObject(body, "success"), ok);
    cJSON *fail = cJSON_CreateObject();
    cJSON *rr = cJSON_AddObjectToObject(fail, "request_range");
    json_add_b64(rr, "key", key, kn);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(body, "failure"), fail);
    cJSON *r;
    LOOM_CHECK(etcd_call(e, "/v3/kv/txn", body, &r, err));
    if (json_true(r, "succeeded")) {
        cJSON_Delete(r);
        return LOOM_OK;
    }
    /* Name the holder: responses[0].response_range.kvs[0].value. */
    char holder[200] = "";
    const cJSON *resp = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r, "responses"), 0);
    const cJSON *range = cJSON_GetObjectItemCaseSensitive(resp, "response_range");
    const cJSON *kv = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(range, "kvs"), 0);
    loom_etcd_kv_t cur;
    if (kv && kv_decode(kv, &cur) == 0) {
        snippet(cur.value, cur.value_len, holder, sizeof holder);
        free(cur.key);
        free(cur.value);
    }
    cJSON_Delete(r);
    return loom_err_set(err, LOOM_ERR_RESOURCE_EXHAUSTED,
                        "etcd key %s already exists (held by: %s)", key, holder[0] ? holder : "?");
}

/* ------------------------------------------------------------------- watch */

enum { WATCH_BACKOFF_MIN_MS = 100, WATCH_BACKOFF_MAX_MS = 1000, WATCH_MAX_LINE = 64 << 20 };

struct loom_etcd_watch {
    char *url;
    loom_etcd_t *auth; /* with an etcd user: a handle whose token each connection presents */
    char *prefix;
    int timeout_ms;
    loom_etcd_watch_fn fn;
    void *ctx;
    CURLM *multi;
    CURL *curl;
    struct curl_slist *headers;
    pthread_t thread;
    atomic_int stop;

    /* Watch thread only. */
    int64_t next_rev;          /* resume point; 0: from now */
    loom_sbuf_t line;                /* bytes of the stream not yet split into lines */
    long http;                 /* this connection's HTTP status, once known */
    int created;               /* this connection got "created" */
    int failures;              /* connections broken in a row */
    int64_t compacted;         /* this connection was canceled at this compact revision */
    loom_status_t conn_status; /* why this connection ended, when the stream said */
    loom_err_t conn_err;

    /* Start hand-off. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int start_done;
    loom_status_t start_status;
    loom_err_t start_err;
};

static void watch_signal_start(loom_etcd_watch_t *w, loom_status_t s, const loom_err_t *e) {
    pthread_mutex_lock(&w->mu);
    if (!w->start_done) {
        w->start_done = 1;
        w->start_status = s;
        if (e) w->start_err = *e;
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
}

/* Handles one line of the stream; returns -1 to end the connection. */
static int watch_line(loom_etcd_watch_t *w, const char *text, size_t len) {
    size_t i = 0;
    while (i < len && (text[i] == ' ' || text[i] == '\r' || text[i] == '\t'))
        i++;
    if (i == len) return 0;
    cJSON *j = cJSON_ParseWithLength(text, len);
    if (!cJSON_IsObject(j)) {
        char s[120];
        snippet(text, len, s, sizeof s);
        loom_err_set(&w->conn_err, LOOM_ERR_FORMAT, "etcd at %s: /v3/watch: not JSON: '%s'", w->url,
                     s);
        goto fail;
    }
    if (cJSON_GetObjectItemCaseSensitive(j, "error")) {
        gateway_error(w->url, "/v3/watch", w->http, text, len, &w->conn_err);
        goto fail;
    }
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(j, "result");
    const cJSON *hdr = cJSON_GetObjectItemCaseSensitive(res, "header");
    if (!cJSON_IsObject(res)) {
        loom_err_set(&w->conn_err, LOOM_ERR_FORMAT, "etcd at %s: /v3/watch: no result", w->url);
        goto fail;
    }
    if (json_true(res, "canceled")) {
        int64_t c = 0;
        json_i64(res, "compact_revision", &c);
        if (c > 0) {
            w->compacted = c;
        } else {
            const cJSON *why = cJSON_GetObjectItemCaseSensitive(res, "cancel_reason");
            w->conn_status = loom_err_set(
                &w->conn_err, LOOM_ERR_UNAVAILABLE, "etcd at %s canceled the watch on %s: %s",
                w->url, w->prefix, cJSON_IsString(why) ? why->valuestring : "no reason");
        }
        cJSON_Delete(j);
        return -1;
    }
    if (json_true(res, "created")) {
        int64_t rev = 0;
        if (json_i64(hdr, "revision", &rev)) {
            loom_err_set(&w->conn_err, LOOM_ERR_FORMAT, "etcd at %s: /v3/watch: bad header",
                         w->url);
            goto fail;
        }
        w->created = 1;
        if (w->next_rev <= 0) w->next_rev = rev + 1;
        if (w->failures)
            LOOM_INFO("etcd watch on %s at %s: reconnected at revision %" PRId64, w->prefix, w->url,
                      w->next_rev);
        w->failures = 0;
        watch_signal_start(w, LOOM_OK, NULL);
    }
    /* Events older than the resume point were delivered before: skip them
     * (min_rev is per reply, as all events of one revision share a reply). */
    const int64_t min_rev = w->next_rev;
    const cJSON *evs = cJSON_GetObjectItemCaseSensitive(res, "events");
    const cJSON *ev;
    cJSON_ArrayForEach(ev, evs) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(ev, "type");
        loom_etcd_kv_t kv;
        if ((type && !cJSON_IsString(type)) ||
            kv_decode(cJSON_GetObjectItemCaseSensitive(ev, "kv"), &kv)) {
            loom_err_set(&w->conn_err, LOOM_ERR_FORMAT, "etcd at %s: /v3/watch: malformed event",
                         w->url);
            goto fail;
        }
        loom_etcd_event_t out = {
            .type = type && !strcmp(type->valuestring, "DELETE") ? LOOM_ETCD_DELETE : LOOM_ETCD_PUT,
            .key = kv.key,
            .value = kv.value,
            .value_len = kv.value_len,
            .revision = kv.mod_revision,
        };
        if (kv.mod_revision >= min_rev) w->fn(w->ctx, &out);
        if (kv.mod_revision >= w->next_rev) w->next_rev = kv.mod_revision + 1;
        free(kv.key);
        free(kv.value);
    }
    cJSON_Delete(j);
    return 0;
fail:
    if (w->conn_err.code == LOOM_OK) w->conn_err.code = LOOM_ERR_FORMAT;
    w->conn_status = w->conn_err.code;
    cJSON_Delete(j);
    return -1;
}

static size_t watch_write(char *ptr, size_t size, size_t nmemb, void *userdata) {
    loom_etcd_watch_t *w = userdata;
    size_t n = size * nmemb;
    if (atomic_load(&w->stop)) return 0;
    if (w->http == 0) curl_easy_getinfo(w->curl, CURLINFO_RESPONSE_CODE, &w->http);
    loom_sbuf_add(&w->line, ptr, n);
    if (w->http >= 400) return n; /* an error body: read it whole, report at the end */
    size_t start = 0;
    for (;;) {
        char *nl = memchr(w->line.p + start, '\n', w->line.len - start);
        if (!nl) break;
        size_t len = (size_t)(nl - (w->line.p + start));
        int rc = watch_line(w, w->line.p + start, len);
        start += len + 1;
        if (rc < 0) return 0;
    }
    memmove(w->line.p, w->line.p + start, w->line.len - start);
    w->line.len -= start;
    if (w->line.len > WATCH_MAX_LINE) {
        loom_err_set(&w->conn_err, LOOM_ERR_FORMAT, "etcd at %s: /v3/watch: line over %d bytes",
                     w->url, WATCH_MAX_LINE);
        w->conn_status = LOOM_ERR_FORMAT;
        return 0;
    }
    return n;
}

typedef enum { CONN_STOPPED, CONN_COMPACTED, CONN_BROKEN } conn_end_t;

/* One connection: sends the create request and streams until it ends. */
static conn_end_t watch_connect(loom_etcd_watch_t *w) {
    size_t pn = strlen(w->prefix);
    char *end = loom_xmalloc(pn + 2);
    size_t en = loom_etcd_prefix_end(w->prefix, pn, end);
    cJSON *body = cJSON_CreateObject();
    cJSON *cr = cJSON_AddObjectToObject(body, "create_request");
    json_add_b64(cr, "key", pn ? w->prefix : "", pn ? pn : 1);
    json_add_b64(cr, "range_end", end, en);
    if (w->next_rev > 0) json_add_i64(cr, "start_revision", w->next_rev);
    free(end);
    char *text = cJSON_PrintUnformatted(body);
    cJSON_Delete(body);
    if (!text) {
        loom_err_set(&w->conn_err, LOOM_ERR_NOMEM, "out of memory encoding a watch");
        w->conn_status = LOOM_ERR_NOMEM;
        return CONN_BROKEN;
    }

    if (w->auth) { /* a fresh token per connection: watches reconnect rarely, and tokens expire */
        loom_err_t aerr = {0};
        loom_status_t as = etcd_authenticate(w->auth, &aerr);
        if (as != LOOM_OK) {
            free(text);
            w->conn_err = aerr;
            w->conn_status = as;
            return CONN_BROKEN;
        }
        curl_slist_free_all(w->headers);
        w->headers = json_headers();
        char line[sizeof w->auth->token + 32];
        snprintf(line, sizeof line, "Authorization: %s", w->auth->token);
        w->headers = curl_slist_append(w->headers, line);
        curl_easy_setopt(w->curl, CURLOPT_HTTPHEADER, w->headers);
    }
    char url[1024];
    snprintf(url, sizeof url, "%s/v3/watch", w->url);
    char errbuf[CURL_ERROR_SIZE] = "";
    w->line.len = 0;
    w->http = 0;
    w->created = 0;
    w->compacted = 0;
    w->conn_status = LOOM_OK;
    loom_err_clear(&w->conn_err);
    curl_easy_setopt(w->curl, CURLOPT_URL, url);
    curl_easy_setopt(w->curl, CURLOPT_POSTFIELDS, text);
    curl_easy_setopt(w->curl, CURLOPT_POSTFIELDSIZE, (long)strlen(text));
    curl_easy_setopt(w->curl, CURLOPT_ERRORBUFFER, errbuf);
    curl_multi_add_handle(w->multi, w->curl);

    uint64_t deadline = loom_now_ns() + (uint64_t)w->timeout_ms * 1000000ull;
    CURLcode result = CURLE_OK;
    int done = 0, timed_out = 0;
    for (;;) {
        int running = 0;
        curl_multi_perform(w->multi, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(w->multi, &left)))
            if (msg->msg == CURLMSG_DONE) {
                result = msg->data.result;
                done = 1;
            }
        if (done || !running || atomic_load(&w->stop)) break;
        int wait_ms = 1000;
        if (!w->created) {
            uint64_t now = loom_now_ns();
            if (now >= deadline) {
                timed_out = 1;
                break;
            }
            wait_ms = (int)LOOM_MIN((uint64_t)wait_ms, (deadline - now) / 1000000ull + 1);
        }
        curl_multi_poll(w->multi, NULL, 0, wait_ms, NULL);
    }
    curl_multi_remove_handle(w->multi, w->curl);
    curl_easy_setopt(w->curl, CURLOPT_ERRORBUFFER, NULL);
    curl_easy_setopt(w->curl, CURLOPT_POSTFIELDS, NULL);
    free(text);

    if (atomic_load(&w->stop)) return CONN_STOPPED;
    if (w->compacted > 0) return CONN_COMPACTED;
    if (w->conn_status != LOOM_OK) return CONN_BROKEN;
    if (timed_out) {
        w->conn_status =
            loom_err_set(&w->conn_err, LOOM_ERR_UNAVAILABLE,
                         "etcd at %s did not accept a watch within %d ms", w->url, w->timeout_ms);
    } else if (w->http >= 400) {
        w->conn_status = gateway_error(w->url, "/v3/watch", w->http, w->line.p ? w->line.p : "",
                                       w->line.len, &w->conn_err);
    } else if (result != CURLE_OK) {
        w->conn_status = curl_error(w->url, result, errbuf, w->timeout_ms, &w->conn_err);
    } else {
        w->conn_status = loom_err_set(&w->conn_err, LOOM_ERR_UNAVAILABLE,
                                      "etcd at %s closed the watch stream", w->url);
    }
    return CONN_BROKEN;
}

static void *watch_main(void *arg) {
    loom_etcd_watch_t *w = arg;
    int backoff = WATCH_BACKOFF_MIN_MS, started = 0;
    while (!atomic_load(&w->stop)) {
        conn_end_t end = watch_connect(w);
        if (!started) {
            if (!w->created) {
                watch_signal_start(w, w->conn_status ? w->conn_status : LOOM_ERR_UNAVAILABLE,
                                   &w->conn_err);
                return NULL;
            }
            started = 1;
        }
        if (w->created) backoff = WATCH_BACKOFF_MIN_MS;
        if (end == CONN_STOPPED) break;
        if (end == CONN_COMPACTED) {
            LOOM_WARN("etcd watch on %s at %s: revision %" PRId64
                      " was compacted; resuming from %" PRId64 " (events before it are lost)",
                      w->prefix, w->url, w->next_rev, w->compacted);
            loom_etcd_event_t ev = {.type = LOOM_ETCD_COMPACTED,
                                    .key = w->prefix,
                                    .value = "",
                                    .revision = w->compacted};
            w->fn(w->ctx, &ev);
            w->next_rev = w->compacted;
            continue;
        }
        if (w->failures++ == 0)
            LOOM_WARN("etcd watch on %s: %s; reconnecting from revision %" PRId64, w->prefix,
                      w->conn_err.msg, w->next_rev);
        curl_multi_poll(w->multi, NULL, 0, backoff, NULL); /* woken by stop */
        backoff = LOOM_MIN(backoff * 2, WATCH_BACKOFF_MAX_MS);
    }
    return NULL;
}

static void watch_free(loom_etcd_watch_t *w) {
    if (w->curl) curl_easy_cleanup(w->curl);
    if (w->multi) curl_multi_cleanup(w->multi);
    curl_slist_free_all(w->headers);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->line.p);
    free(w->url);
    free(w->prefix);
    loom_etcd_close(&w->auth);
    free(w);
    curl_global_cleanup();
}

loom_status_t loom_etcd_watch_start(loom_etcd_t *e, const char *prefix, int64_t start_revision,
                                    loom_etcd_watch_fn fn, void *ctx, loom_etcd_watch_t **out,
                                    loom_err_t *err) {
    *out = NULL;
    if (!prefix || !fn)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "etcd watch needs a prefix and a callback");
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "libcurl failed to initialise");
    loom_etcd_watch_t *w = loom_xcalloc(1, sizeof *w);
    w->url = loom_xstrdup(e->url);
    w->prefix = loom_xstrdup(prefix);
    w->timeout_ms = e->timeout_ms;
    w->fn = fn;
    w->ctx = ctx;
    w->next_rev = start_revision > 0 ? start_revision : 0;
    atomic_init(&w->stop, 0);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->multi = curl_multi_init();
    w->curl = curl_easy_init();
    w->headers = json_headers();
    if (!w->multi || !w->curl || !w->headers) {
        watch_free(w);
        return loom_err_set(err, LOOM_ERR_NOMEM, "out of memory creating an etcd watch");
    }
    curl_common(w->curl, w->headers, w->timeout_ms);
    curl_tls(w->curl, &e->sec);
    if (e->sec.user) {
        loom_status_t s = loom_etcd_open(e->url, e->timeout_ms, &w->auth, err);
        if (s != LOOM_OK) {
            watch_free(w);
            return s;
        }
    }
    curl_easy_setopt(w->curl, CURLOPT_WRITEFUNCTION, watch_write);
    curl_easy_setopt(w->curl, CURLOPT_WRITEDATA, w);
    int rc = pthread_create(&w->thread, NULL, watch_main, w);
    if (rc) {
        watch_free(w);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the etcd watch thread: %s",
                            strerror(rc));
    }
    pthread_mutex_lock(&w->mu);
    while (!w->start_done)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    if (w->start_status != LOOM_OK) {
        loom_status_t s = w->start_status;
        if (err) *err = w->start_err;
        if (err && err->code == LOOM_OK) err->code = s;
        atomic_store(&w->stop, 1);
        pthread_join(w->thread, NULL);
        watch_free(w);
        return s;
    }
    *out = w;
    return LOOM_OK;
}

void loom_etcd_watch_stop(loom_etcd_watch_t **w_p) {
    if (!w_p || !*w_p) return;
    loom_etcd_watch_t *w = *w_p;
    atomic_store(&w->stop, 1);
    curl_multi_wakeup(w->multi);
    pthread_join(w->thread, NULL);
    watch_free(w);
    *w_p = NULL;
}

/* ------------------------------------------------------------------ keeper */

struct loom_etcd_keeper {
    loom_etcd_t *e; /* the keeper's own connection */
    char *key;
    char *value;
    size_t len;
    int ttl_s;
    int exclusive;
    _Atomic int64_t lease; /* 0 while none is held */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC */
    int stop;
};

/* Grants a lease and puts the key under it; the lease is revoked if the put fails. */
static loom_status_t keeper_register(loom_etcd_keeper_t *k, loom_err_t *err) {
    int64_t id;
    int ttl;
    LOOM_CHECK(loom_etcd_lease_grant(k->e, k->ttl_s, &id, &ttl, err));
    loom_status_t s = k->exclusive
                          ? loom_etcd_put_if_absent(k->e, k->key, k->value, k->len, id, err)
                          : loom_etcd_put(k->e, k->key, k->value, k->len, id, err);
    if (s != LOOM_OK) {
        loom_etcd_lease_revoke(k->e, id, NULL);
        return s;
    }
    atomic_store(&k->lease, id);
    return LOOM_OK;
}

static void *keeper_main(void *arg) {
    loom_etcd_keeper_t *k = arg;
    int interval_ms = LOOM_MAX(k->ttl_s * 1000 / 3, 100);
    int failing = 0;
    for (;;) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        long ns = ts.tv_nsec + (long)(interval_ms % 1000) * 1000000L;
        ts.tv_sec += interval_ms / 1000 + ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        pthread_mutex_lock(&k->mu);
        while (!k->stop && pthread_cond_timedwait(&k->cv, &k->mu, &ts) != ETIMEDOUT) {
        }
        int stop = k->stop;
        pthread_mutex_unlock(&k->mu);
        if (stop) break;

        loom_err_t err = {0};
        loom_status_t s;
        int64_t id = atomic_load(&k->lease);
        if (id) {
            s = loom_etcd_lease_keepalive(k->e, id, NULL, &err);
            if (s == LOOM_ERR_NOT_FOUND) {
                LOOM_WARN("etcd lease for %s expired; registering again", k->key);
                atomic_store(&k->lease, 0);
                s = keeper_register(k, &err);
            }
        } else {
            s = keeper_register(k, &err);
        }
        if (s != LOOM_OK) {
            if (!failing) LOOM_WARN("etcd keeper for %s: %s", k->key, err.msg);
            failing = 1;
        } else if (failing) {
            LOOM_INFO("etcd keeper for %s: holding the key again", k->key);
            failing = 0;
        }
    }
    return NULL;
}

static void keeper_free(loom_etcd_keeper_t *k) {
    loom_etcd_close(&k->e);
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    free(k->key);
    free(k->value);
    free(k);
}

loom_status_t loom_etcd_keeper_start(loom_etcd_t *e, const char *key, const void *value, size_t len,
                                     int ttl_s, int exclusive, loom_etcd_keeper_t **out,
                                     loom_err_t *err) {
    *out = NULL;
    LOOM_CHECK(check_key(key, err));
    if (ttl_s <= 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "lease TTL must be positive (got %d s)",
                            ttl_s);
    loom_etcd_keeper_t *k = loom_xcalloc(1, sizeof *k);
    loom_status_t s = loom_etcd_open(e->url, e->timeout_ms, &k->e, err);
    if (s != LOOM_OK) {
        free(k);
        return s;
    }
    k->key = loom_xstrdup(key);
    k->value = loom_xmalloc(len + 1);
    if (len) memcpy(k->value, value, len);
    k->value[len] = '\0';
    k->len = len;
    k->ttl_s = ttl_s;
    k->exclusive = exclusive;
    atomic_init(&k->lease, 0);
    pthread_mutex_init(&k->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&k->cv, &ca);
    pthread_condattr_destroy(&ca);
    s = keeper_register(k, err);
    if (s != LOOM_OK) {
        keeper_free(k);
        return s;
    }
    int rc = pthread_create(&k->thread, NULL, keeper_main, k);
    if (rc) {
        loom_etcd_lease_revoke(k->e, atomic_load(&k->lease), NULL);
        keeper_free(k);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the etcd keeper thread: %s",
                            strerror(rc));
    }
    *out = k;
    return LOOM_OK;
}

void loom_etcd_keeper_stop(loom_etcd_keeper_t **k_p) {
    if (!k_p || !*k_p) return;
    loom_etcd_keeper_t *k = *k_p;
    pthread_mutex_lock(&k->mu);
    k->stop = 1;
    pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu);
    pthread_join(k->thread, NULL);
    int64_t id = atomic_load(&k->lease);
    loom_err_t err = {0};
    if (id && loom_etcd_lease_revoke(k->e, id, &err) != LOOM_OK && err.code != LOOM_ERR_NOT_FOUND)
        LOOM_WARN(
            "etcd keeper for %s: revoking its lease: %s (the key goes when the lease expires)",
            k->key, err.msg);
    keeper_free(k);
    *k_p = NULL;
}

int64_t loom_etcd_keeper_lease(const loom_etcd_keeper_t *k) {
    return atomic_load(&k->lease);
}

void loom_etcd_security_env(const loom_etcd_security_t *s) {
    if (s->cacert) setenv("LOOM_ETCD_CACERT", s->cacert, 1);
    if (s->cert) setenv("LOOM_ETCD_CERT", s->cert, 1);
    if (s->key) setenv("LOOM_ETCD_KEY", s->key, 1);
    if (s->user) setenv("LOOM_ETCD_USER", s->user, 1);
    if (s->password_file) {
        setenv("LOOM_ETCD_PASSWORD_FILE", s->password_file, 1);
        unsetenv("LOOM_ETCD_PASSWORD"); /* the flag wins */
    }
}
