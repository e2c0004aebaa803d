/* The HTTP gateway (http.h): OpenAI-compatible completions and chat over
 * libmicrohttpd, translated into loom.v1 Generate requests on in-process
 * clients of the reactor.
 *
 * Threads: MHD runs one thread per connection, so the access handler and
 * the SSE reader may block. Each connection owns one loom_client_t, made
 * on its first request that needs the coordinator and closed with the
 * connection; clients are never shared. Besides that, threads share only
 * the read-only config, the chat template, the metrics (thread-safe) and
 * the served model's info (cached under a mutex).
 *
 * A generation request, per HTTP request:
 *   RECEIVING   body chunks appended (bounded: too big -> 413 when it ends)
 *   SUBMITTED   Generate sent (active = 1); waiting for the first chunk or
 *               a refusal, which becomes an HTTP status (400/404/429/503)
 *   STREAMING   stream: true; the SSE reader turns chunks into events
 *   COLLECTING  stream: false; chunks are gathered into one JSON body
 *   DONE        the final chunk was seen (active = 0)
 * While active, a peer that goes away (a failed write, or a peek at the
 * socket while waiting) or a stopping gateway abandons the request: it is
 * cancelled on the coordinator, the cancel is awaited briefly, and the
 * connection's client is closed.
 *
 * Every request has an id: the client's X-Request-Id when it is 1 to 128
 * printable ASCII characters, else a generated one. It is echoed in the
 * X-Request-Id response header, ends the completion id, goes to the
 * coordinator as the request's tag, and names the request in every log
 * line (the connection thread's log request id).
 *
 * Connections beyond --http-max-connections are accepted (up to
 * OVERFLOW_CONNECTIONS more, libmicrohttpd's own limit) and answered 503
 * with Retry-After, then closed, instead of being reset.
 *
 * Two listeners (listener_t), each a daemon with its own slots: --http
 * (traffic, HTTPS with --tls-cert) and --probe-listen (/health, /metrics,
 * /version only, plain HTTP). Every connection's socket is watched by
 * http_guard.c, which closes it when its headers or body miss their
 * deadline. Request bodies are strict JSON (loom_http_parse_json_body);
 * chat prompts are tokenized here with the messages' text as plain text. */
#include "coordinator/http.h"

#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
/* before microhttpd.h, which needs struct sockaddr_in complete */
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include "client/loom_client.h"
#include "common/chat_template.h"
#include "common/json.h"
#include "common/etcd.h"
#include "common/log.h"
#include "common/request_limits.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "coordinator/http_guard.h"
#include "coordinator/http_parse.h"
#include "coordinator/http_tls.h"
#include "coordinator/metrics.h"
#include "coordinator/tool_calls.h"
#include "coordinator/tool_stream.h"

#define DEFAULT_BIND "127.0.0.1:8000"
#define DEFAULT_MAX_BODY ((size_t)2 << 20)
#define DEFAULT_MAX_CONNECTIONS 256
#define DEFAULT_IDLE_TIMEOUT_S 60
#define DEFAULT_REQUEST_TIMEOUT_MS 300000
#define SLICE_MS 100           /* longest wait before checking the peer and the stop flag */
#define CANCEL_WAIT_MS 2000    /* how long an abandoned request waits for its cancel to land */
#define PROBE_TIMEOUT_MS 3000  /* Health and ListModels: the reactor answers at once when it runs */
#define MAX_STOP LOOM_MAX_STOP /* as the coordinator (common/request_limits.h) */
#define COMPLETIONS_DEFAULT_MAX_TOKENS 16 /* OpenAI's default for /v1/completions */
#define SSE_BLOCK 4096
#define OVERFLOW_CONNECTIONS 64 /* connections over the limit that still get a 503 */
#define MAX_REQUEST_ID 128
#define MAX_STOP_IDS LOOM_MAX_STOP_IDS
#define MAX_LOGIT_BIAS 1024  /* as the coordinator's LOOM_MAX_LOGIT_BIAS */
#define MAX_BAD_WORDS 64
#define MAX_TOP_LOGPROBS 20
#define MAX_CHOICES 64 /* n x prompts of one request */ /* as kernels/sampling.h LOOM_MAX_TOP_LOGPROBS */
#define MAX_ALLOWED_IDS 131072
#define RETRY_AFTER_S "1"
#define DEFAULT_HEADER_TIMEOUT_S 10 /* headers complete this long after accept (or the last response) */
#define DEFAULT_BODY_TIMEOUT_S 60   /* the body complete this long after the headers */
#define PROBE_MAX_CONNECTIONS 16    /* the probe listener: /health, /metrics, /version only */
#define PROBE_OVERFLOW_CONNECTIONS 16

/* One libmicrohttpd daemon: the traffic listener (--http) or the probe
 * listener (--probe-listen). Each has its own connection slots. */
typedef struct listener {
    loom_http_t *h;
    int probe;
    atomic_int n_conns; /* open connections, over-limit ones included */
    int max_conns;
} listener_t;

struct loom_http {
    loom_server_t *srv;  /* NULL when serving another endpoint (loom_http_start_at) */
    loom_http_metrics_fn metrics_fn; /* /metrics of such an endpoint */
    void *metrics_ctx;
    struct MHD_Daemon *daemon;
    void *zctx;
    char inproc[128];
    char bind[256];
    char *api_key;
    int forward_api_keys; /* loom_http_config_t.forward_api_keys */
    loom_chat_template_t *tmpl; /* NULL: this model has no chat template */
    size_t max_body;
    unsigned idle_timeout_s;
    int request_timeout_ms;
    int port;
    long long started; /* unix time, the "created" of the model object */
    loom_gen_defaults_t gen; /* defaults for fields a request leaves out (--generation-config) */
    atomic_int serving, stopping;
    loom_tokenizer_t *tok; /* /tokenize and /detokenize (NULL: no model directory) */
    atomic_int draining, generating; /* refuse new generations; generation requests not yet completed */
    atomic_uint_fast64_t n_ids;
    uint64_t id_salt;
    pthread_mutex_t mu; /* guards have_model, model */
    int have_model;
    loom_model_info_t model;
    /* the probe listener, the read deadlines, TLS */
    listener_t traffic, probe;
    struct MHD_Daemon *probe_daemon;
    int probe_port;
    loom_http_guard_t *guard;
    loom_http_tls_t tls; /* empty: plain HTTP */
    int per_ip;          /* MHD's per-client-address cap on the traffic listener (0: none) */
    int special_in_content; /* --chat-special-tokens-in-content: message text may write control tokens */
};

/* One per TCP connection (MHD's socket context). */
typedef struct conn {
    loom_client_t *client;
    char *client_key; /* forward_api_keys: the key the client was made with */
    int over_limit; /* accepted beyond --http-max-connections: answered 503 */
    int probe;      /* on the probe listener */
    loom_http_slot_t *slot; /* its read deadlines (NULL: unguarded) */
} conn_t;

typedef enum {
    R_NONE,
    R_HEALTH,
    R_METRICS,
    R_MODELS,
    R_MODEL,
    R_COMPLETIONS,
    R_CHAT,
    R_TOKENIZE,
    R_DETOKENIZE,
    R_VERSION,
    R_EMBEDDINGS
} route_t;

/* One per HTTP request (MHD's con_cls). */
typedef struct req {
    loom_http_t *h;
    struct MHD_Connection *mc;
    conn_t *conn;
    route_t route;
    char method[16], path[256];
    unsigned status;
    uint64_t t0;
    const char *allow;    /* Allow header of a 405 */
    int www_auth;         /* WWW-Authenticate header of a 401 */
    int close_after;      /* Retry-After and Connection: close (over the connection limit) */
    int retry_after_ms;   /* a router's tenant limit said when to try again (Retry-After on a 429) */
    char xid[MAX_REQUEST_ID + 1]; /* X-Request-Id */
    char ignored[256];    /* X-Loom-Ignored-Fields: unknown request fields, comma-separated */
    /* the body */
    loom_sbuf_t body;
    int too_big;
    size_t discarded;
    /* the generation */
    int chat, stream, include_usage, active, finished;
    int counted; /* counted in h->generating */
    uint64_t gen_id, last_peek_ns;
    char id[64], model[256];
    long long created;
    loom_sbuf_t out; /* SSE bytes not yet handed to MHD */
    loom_sbuf_t prefix; /* "data: {...,"choices":[{"index":0," of every chunk of this stream */
    size_t out_off;
    loom_sbuf_t text; /* the completion, when not streaming */
    /* logprobs: asked for (completions: logprobs N; chat: logprobs + top_logprobs N) */
    int logprobs, top_logprobs;
    cJSON *lp_acc;    /* the collected logprobs object, when not streaming */
    size_t lp_offset; /* text_offset of the next token (completions) */
    char *lp_json;    /* this chunk's logprobs for sse_choice (NULL: null) */
    int echo;         /* completions: the prompt's text starts each choice */
    int prompt_lp;    /* vLLM's prompt_logprobs: its top size, -1 not asked */
    cJSON *plp;       /* the collected prompt_logprobs list */
    char fail_msg[600];
    /* timings: the coordinator's, and the gateway's own time handing chunks on */
    loom_timings_t timings;
    int has_timings;
    uint64_t send_ns;
    uint64_t tok_ns; /* the gateway's tokenization of a chat prompt (before the coordinator's clock) */
    loom_tools_t tools; /* chat: tools, tool_choice (tool_calls.h); mode OFF: none */
    cJSON *tools_req;   /* the request's tools array, kept for parsing the output */
    loom_tstream_t *ts; /* a streamed tool-calling answer, read as it comes (tool_stream.h) */
} req_t;

/* ---- small helpers ---- */


/* Text from a chunk without NUL bytes (which JSON strings here cannot hold). */
static char *text_dup(const char *s, size_t n) {
    char *o = loom_xmalloc(n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i]) o[k++] = s[i];
    o[k] = '\0';
    return o;
}

static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static int valid_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned min;
        if ((c & 0xE0) == 0xC0) {
            len = 2, min = 0x80, c &= 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, min = 0x800, c &= 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, min = 0x10000, c &= 0x07;
        } else {
            return 0;
        }
        if (i + len > n) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            c = (c << 6) | (s[i + k] & 0x3Fu);
        }
        if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0;
        i += len;
    }
    return 1;
}

/* "\u0000" in a JSON text (cJSON would silently cut the string there). */
static int has_escaped_nul(const char *s, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (s[i] != '\\') continue;
        if (s[i + 1] == 'u' && i + 5 < n && !memcmp(s + i + 2, "0000", 4)) return 1;
        i++;
    }
    return 0;
}

/* The JSON object of a request body, strictly: UTF-8 without NUL bytes or
 * \u0000, one value with only whitespace after it, no key twice in one
 * object (at any depth). NULL with a message for the client otherwise. */
cJSON *loom_http_parse_json_body(const char *body, size_t len, char *msg, size_t cap) {
    if (!body || len == 0) {
        snprintf(msg, cap, "the request body is empty: send a JSON object");
        return NULL;
    }
    if (memchr(body, 0, len)) {
        snprintf(msg, cap, "the request body contains a NUL byte");
        return NULL;
    }
    if (!valid_utf8((const unsigned char *)body, len)) {
        snprintf(msg, cap, "the request body is not valid UTF-8");
        return NULL;
    }
    if (has_escaped_nul(body, len)) {
        snprintf(msg, cap, "strings in the request must not contain NUL characters (\\u0000)");
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    size_t at = end && end >= body ? (size_t)(end - body) : 0;
    if (!root) {
        snprintf(msg, cap, "We could not parse the JSON body of your request (error near byte %zu)", at);
        return NULL;
    }
    while (at < len && (body[at] == ' ' || body[at] == '\t' || body[at] == '\n' || body[at] == '\r')) at++;
    char path[256];
    if (at < len) {
        snprintf(msg, cap, "the request body goes on after its JSON value (at byte %zu of %zu): send exactly one "
                           "JSON object", at, len);
    } else if (!cJSON_IsObject(root)) {
        snprintf(msg, cap, "the request body must be a JSON object");
    } else if (loom_json_find_duplicate(root, path, sizeof path)) {
        snprintf(msg, cap, "the request body has the key %.200s more than once: each key may appear once per object",
                 path);
    } else {
        return root;
    }
    cJSON_Delete(root);
    return NULL;
}

/* ---- responses ---- */

static enum MHD_Result respond(req_t *q, unsigned status, const char *ctype, char *body, size_t len) {
    struct MHD_Response *r = MHD_create_response_from_buffer_with_free_callback(len, body, free);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (q->allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, q->allow);
    if (q->www_auth) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (q->xid[0]) MHD_add_response_header(r, "X-Request-Id", q->xid);
    if (q->ignored[0]) MHD_add_response_header(r, "X-Loom-Ignored-Fields", q->ignored);
    if (q->close_after || status == MHD_HTTP_SERVICE_UNAVAILABLE)
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, RETRY_AFTER_S);
    else if (status == MHD_HTTP_TOO_MANY_REQUESTS && q->retry_after_ms > 0) {
        char ra[16]; /* whole seconds, rounded up */
        snprintf(ra, sizeof ra, "%d", (q->retry_after_ms + 999) / 1000);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    if (q->close_after) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ok = MHD_queue_response(q->mc, status, r);
    MHD_destroy_response(r);
    q->status = status;
    return ok;
}

static enum MHD_Result respond_json(req_t *q, unsigned status, cJSON *j) {
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!s) return MHD_NO;
    return respond(q, status, "application/json", s, strlen(s));
}

static cJSON *error_obj(const char *msg, const char *type, const char *param, const char *code) {
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", type);
    if (param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "error", e);
    return root;
}

static enum MHD_Result respond_error(req_t *q, unsigned status, const char *type, const char *param,
                                     const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static enum MHD_Result respond_error(req_t *q, unsigned status, const char *type, const char *param,
                                     const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return respond_json(q, status, error_obj(msg, type, param, code));
}

/* How a coordinator status reads over HTTP. */
static void status_http(loom_status_t s, unsigned *http, const char **type, const char **code) {
    switch (s) {
    case LOOM_ERR_INVALID_ARGUMENT: *http = 400, *type = "invalid_request_error", *code = NULL; break;
    case LOOM_ERR_NOT_FOUND: *http = 404, *type = "invalid_request_error", *code = "model_not_found"; break;
    case LOOM_ERR_RESOURCE_EXHAUSTED: *http = 429, *type = "rate_limit_error", *code = "rate_limit_exceeded"; break;
    case LOOM_ERR_UNAVAILABLE: *http = 503, *type = "server_error", *code = "service_unavailable"; break;
    case LOOM_ERR_UNAUTHENTICATED: *http = 401, *type = "invalid_request_error", *code = "invalid_api_key"; break;
    case LOOM_ERR_DEADLINE_EXCEEDED: *http = 504, *type = "server_error", *code = "timeout"; break;
    default: *http = 500, *type = "server_error", *code = "internal_error"; break;
    }
}

static enum MHD_Result respond_status(req_t *q, loom_status_t s, const char *msg) {
    unsigned http;
    const char *type, *code;
    status_http(s, &http, &type, &code);
    return respond_error(q, http, type, s == LOOM_ERR_NOT_FOUND ? "model" : NULL, code, "%s",
                         msg && msg[0] ? msg : loom_status_str(s));
}

/* ---- the connection's client ---- */

static int peer_gone(req_t *q) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(q->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    char b;
    ssize_t r = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* MHD closes a connection idle for the timeout even when the wait was ours;
 * re-arming the timeout from zero restarts its clock. */
static void refresh_timeout(req_t *q) {
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, q->h->idle_timeout_s);
}

static const char *bearer(const req_t *q);

static loom_status_t ensure_client(req_t *q, loom_err_t *err) {
    const char *key = q->h->api_key;
    if (q->h->forward_api_keys) {
        if (q->route == R_COMPLETIONS || q->route == R_CHAT)
            key = bearer(q); /* the router checks it, and finds its tenant */
        const char *had = q->conn->client_key;
        if (q->conn->client && !((had && key && !strcmp(had, key)) || (!had && !key)))
            loom_client_close(&q->conn->client); /* another key on this connection */
        if (!q->conn->client) {
            free(q->conn->client_key);
            q->conn->client_key = key ? loom_xstrdup(key) : NULL;
        }
    }
    if (q->conn->client) return LOOM_OK;
    loom_client_options_t o = {.timeout_ms = q->h->request_timeout_ms, .api_key = key,
                               .zmq_context = q->h->zctx};
    return loom_client_connect(q->h->inproc, &o, &q->conn->client, err);
}

/* A short-lived client for one unary call (Health, ListModels). Its short
 * timeout bounds how long a connection thread can be stuck in a call that
 * cannot notice the gateway stopping (the reactor is gone by then). */
static loom_status_t probe_client(const loom_http_t *h, loom_client_t **c, loom_err_t *err) {
    loom_client_options_t o = {.timeout_ms = PROBE_TIMEOUT_MS, .api_key = h->api_key, .zmq_context = h->zctx};
    return loom_client_connect(h->inproc, &o, c, err);
}

/* The served model (ListModels once, then cached). */
static loom_status_t served_model(req_t *q, loom_model_info_t *m, loom_err_t *err) {
    loom_http_t *h = q->h;
    pthread_mutex_lock(&h->mu);
    int have = h->have_model;
    if (have) *m = h->model;
    pthread_mutex_unlock(&h->mu);
    if (have) return LOOM_OK;
    loom_client_t *c = NULL;
    LOOM_CHECK(probe_client(h, &c, err));
    int n = 0;
    loom_status_t st = loom_client_list_models(c, m, 1, &n, err);
    loom_client_close(&c);
    if (st < 0) return st;
    if (n < 1) return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "the coordinator lists no model");
    pthread_mutex_lock(&h->mu);
    h->model = *m;
    h->have_model = 1;
    pthread_mutex_unlock(&h->mu);
    return LOOM_OK;
}

/* The next chunk of q's request: 1 (a failure of the client itself comes as
 * a final chunk with its status), or 0 when the request must be abandoned
 * (the peer left or the gateway is stopping). */
static int next_chunk(req_t *q, loom_chunk_t *ch) {
    loom_client_t *c = q->conn->client;
    for (;;) {
        if (atomic_load(&q->h->stopping)) {
            if (!q->active) return 0;
            /* the coordinator is going away: the stream ends with an error, not in silence */
            q->active = 0;
            *ch = (loom_chunk_t){.request_id = q->gen_id, .text = "", .final = 1, .finish = LOOM_FINISH_ERROR,
                                 .status = LOOM_ERR_UNAVAILABLE, .message = "the coordinator is shutting down"};
            return 1;
        }
        uint64_t now = loom_now_ns();
        if (now - q->last_peek_ns >= (uint64_t)SLICE_MS * 1000000u) {
            q->last_peek_ns = now;
            if (peer_gone(q)) return 0;
        }
        int got = 0;
        loom_err_t err = {0};
        if (loom_client_poll(c, SLICE_MS, ch, &got, &err) < 0) {
            snprintf(q->fail_msg, sizeof q->fail_msg, "%s", err.msg);
            *ch = (loom_chunk_t){.request_id = q->gen_id, .text = "", .final = 1, .finish = LOOM_FINISH_ERROR,
                                 .status = err.code < 0 ? err.code : LOOM_ERR_INTERNAL, .message = q->fail_msg};
            return 1;
        }
        if (got && ch->request_id == q->gen_id) {
            if (ch->final) q->active = 0;
            return 1;
        }
    }
}

/* Cancels q's request on the coordinator and waits a little for the
 * confirmation, then closes the connection's client so that nothing of
 * this request is left for the next one. */
static void abandon(req_t *q) {
    if (!q->active) return;
    q->active = 0;
    loom_client_t *c = q->conn->client;
    if (!c) return;
    if (!atomic_load(&q->h->stopping)) {
        loom_err_t err = {0};
        if (loom_client_cancel(c, q->gen_id, &err) == LOOM_OK) {
            uint64_t deadline = loom_now_ns() + (uint64_t)CANCEL_WAIT_MS * 1000000u;
            while (loom_now_ns() < deadline && !atomic_load(&q->h->stopping)) {
                loom_chunk_t ch;
                int got = 0;
                if (loom_client_poll(c, SLICE_MS, &ch, &got, &err) < 0) break;
                if (got && ch.request_id == q->gen_id && ch.final) break;
            }
        }
        LOOM_DEBUG("http: %s %s: the client went away; request %llu cancelled", q->method, q->path,
                   (unsigned long long)q->gen_id);
    }
    loom_client_close(&q->conn->client);
}

/* ---- request parameters ---- */

typedef struct perr {
    char param[64];
    char msg[600];
} perr_t;

static int bad(perr_t *e, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(perr_t *e, const char *param, const char *fmt, ...) {
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return -1;
}

static const cJSON *field(const cJSON *o, const char *k) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    return x && !cJSON_IsNull(x) ? x : NULL;
}

/* Optional fields: 0 absent or null, 1 present (*v set), -1 bad (e set). */
static int opt_number(const cJSON *o, const char *k, double lo, double hi, double *v, perr_t *e) {
    const cJSON *x = field(o, k);
    if (!x) return 0;
    if (!cJSON_IsNumber(x)) return bad(e, k, "%s must be a number", k);
    if (!(x->valuedouble >= lo && x->valuedouble <= hi))
        return bad(e, k, "%s %g is outside [%g, %g]", k, x->valuedouble, lo, hi);
    *v = x->valuedouble;
    return 1;
}

static int opt_int(const cJSON *o, const char *k, double lo, double hi, double *v, perr_t *e) {
    const cJSON *x = field(o, k);
    if (!x) return 0;
    if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble)) return bad(e, k, "%s must be an integer", k);
    if (!(x->valuedouble >= lo && x->valuedouble <= hi))
        return bad(e, k, "%s %.17g is outside [%.17g, %.17g]", k, x->valuedouble, lo, hi);
    *v = x->valuedouble;
    return 1;
}

static int opt_bool(const cJSON *o, const char *k, int *v, perr_t *e) {
    const cJSON *x = field(o, k);
    if (!x) return 0;
    if (!cJSON_IsBool(x)) return bad(e, k, "%s must be true or false", k);
    *v = cJSON_IsTrue(x);
    return 1;
}

/* Which fields a request may carry. Loom answers every field it accepts:
 * one it does not implement (an OpenAI feature, or one of vLLM's
 * extensions) is refused with 400 naming it unless it holds the value
 * that turns the feature off, so a client never gets an answer computed
 * without what it asked for. A field no one here defines is ignored
 * (ignore_field): a new SDK's field must not break requests. */
typedef enum {
    F_ALL = 0,  /* implemented by every generation route */
    F_PROMPT,   /* implemented by /v1/completions */
    F_CHAT,     /* implemented by /v1/chat/completions */
    F_FALSY,    /* not implemented: null, false, 0, "", [] or {} only */
    F_ONE,      /* not implemented: null or 1 only (a neutral factor) */
    F_TRUE,     /* not implemented: null or true only (the default behaviour) */
    F_NONE_AUTO /* not implemented: null, "none" or "auto" only (no tools given) */
} field_kind_t;

static const struct {
    const char *name;
    field_kind_t kind;
} k_fields[] = {
    /* implemented */
    {"model", F_ALL}, {"max_tokens", F_ALL}, {"temperature", F_ALL}, {"top_p", F_ALL}, {"top_k", F_ALL},
    {"seed", F_ALL}, {"stop", F_ALL}, {"stream", F_ALL}, {"stream_options", F_ALL}, {"ignore_eos", F_ALL},
    {"speculative", F_ALL}, {"loom_cache", F_ALL},
    {"priority", F_ALL}, {"n", F_ALL}, {"best_of", F_ALL}, {"response_format", F_ALL}, {"stop_token_ids", F_ALL},
    {"skip_special_tokens", F_ALL}, {"user", F_ALL}, {"metadata", F_ALL},
    {"presence_penalty", F_ALL}, {"frequency_penalty", F_ALL}, {"repetition_penalty", F_ALL}, {"min_p", F_ALL},
    {"logit_bias", F_ALL}, {"allowed_token_ids", F_ALL}, {"bad_words", F_ALL}, {"min_tokens", F_ALL},
    {"include_stop_str_in_output", F_ALL}, {"logprobs", F_ALL}, {"top_logprobs", F_CHAT}, {"echo", F_ALL},
    {"prompt_logprobs", F_ALL},
    {"prompt", F_PROMPT}, {"add_special_tokens", F_PROMPT},
    {"guided_json", F_ALL}, {"guided_regex", F_ALL}, {"guided_choice", F_ALL}, {"guided_grammar", F_ALL},
    {"guided_decoding_backend", F_ALL}, {"structured_outputs", F_ALL},
    {"messages", F_CHAT}, {"max_completion_tokens", F_CHAT}, {"add_generation_prompt", F_CHAT},
    {"tools", F_CHAT}, {"tool_choice", F_CHAT}, {"parallel_tool_calls", F_CHAT},
    /* OpenAI features Loom does not implement */
    {"suffix", F_FALSY}, {"functions", F_FALSY},
    {"function_call", F_NONE_AUTO}, {"store", F_FALSY}, {"audio", F_FALSY}, {"prediction", F_FALSY},
    {"reasoning_effort", F_FALSY}, {"web_search_options", F_FALSY}, {"modalities", F_FALSY},
    {"service_tier", F_NONE_AUTO},
    /* vLLM's extensions Loom does not implement */
    {"guided_whitespace_pattern", F_FALSY}, {"structural_tag", F_FALSY}, {"length_penalty", F_ONE}, {"use_beam_search", F_FALSY}, {"early_stopping", F_FALSY},
    {"stop_token_ids_str", F_FALSY},
    {"spaces_between_special_tokens", F_TRUE}, {"truncate_prompt_tokens", F_FALSY},
    {"logits_processors", F_FALSY},
    {"return_tokens_as_token_ids", F_FALSY}, {"return_token_ids", F_FALSY}, {"prompt_embeds", F_FALSY},
    {"request_id", F_FALSY}, {"cache_salt", F_FALSY}, {"kv_transfer_params", F_FALSY}, {"vllm_xargs", F_FALSY},
    {"chat_template", F_FALSY}, {"chat_template_kwargs", F_FALSY}, {"continue_final_message", F_FALSY},
    {"documents", F_FALSY}, {"mm_processor_kwargs", F_FALSY}, {"thinking_token_budget", F_FALSY},
};

static int field_is_off(const cJSON *x, field_kind_t kind) {
    if (cJSON_IsNull(x)) return 1;
    switch (kind) {
    case F_FALSY:
        return cJSON_IsFalse(x) || (cJSON_IsNumber(x) && x->valuedouble == 0) ||
               (cJSON_IsString(x) && !x->valuestring[0]) || (cJSON_IsArray(x) && !x->child) ||
               (cJSON_IsObject(x) && !x->child);
    case F_ONE: return cJSON_IsNumber(x) && x->valuedouble == 1;
    case F_TRUE: return cJSON_IsTrue(x);
    case F_NONE_AUTO:
        return cJSON_IsString(x) && (!strcmp(x->valuestring, "none") || !strcmp(x->valuestring, "auto") ||
                                     !strcmp(x->valuestring, "default"));
    default: return 1;
    }
}

/* A field no table here names (a newer SDK's, another server's) is accepted
 * and ignored: logged, and named in the X-Loom-Ignored-Fields response
 * header (printable ASCII names only; others are listed as "?"). */
static void ignore_field(req_t *q, const char *name) {
    char clean[65];
    size_t n = 0;
    for (const char *c = name; *c && n < 64; c++) clean[n++] = *c > 32 && *c < 127 && *c != ',' ? *c : '?';
    clean[n] = '\0';
    LOOM_WARN("request %s: ignoring the unknown field '%s'", q->xid, clean);
    size_t used = strlen(q->ignored);
    if (used + n + 3 < sizeof q->ignored)
        snprintf(q->ignored + used, sizeof q->ignored - used, "%s%s", used ? ", " : "", clean);
}

/* Every top-level field of a generation request is one this route
 * implements, one that is off (see k_fields), or one no one here knows
 * (ignored, see ignore_field). */
static int check_fields(req_t *q, const cJSON *o, int chat, perr_t *e) {
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        size_t i = 0;
        while (i < LOOM_ARRAY_LEN(k_fields) && strcmp(k_fields[i].name, x->string) != 0) i++;
        if (i == LOOM_ARRAY_LEN(k_fields)) {
            ignore_field(q, x->string);
            continue;
        }
        field_kind_t k = k_fields[i].kind;
        if (k == F_ALL || (k == F_PROMPT && !chat) || (k == F_CHAT && chat)) continue;
        if (k == F_PROMPT || k == F_CHAT)
            return bad(e, x->string, "%s is not a field of %s", x->string,
                       chat ? "/v1/chat/completions" : "/v1/completions");
        if (!field_is_off(x, k)) return bad(e, x->string, "%s is not supported by this server", x->string);
    }
    return 0;
}

typedef struct gen {
    loom_gen_params_t p;
    const char *stop[MAX_STOP];
    int32_t stop_ids[MAX_STOP_IDS];
    /* sampling controls */
    int32_t bias_ids[MAX_LOGIT_BIAS];
    float bias_values[MAX_LOGIT_BIAS];
    int32_t *allowed; /* owned */
    const char *bad_words[MAX_BAD_WORDS];
    /* a batch of prompts (n_batch > 1: answered by handle_multi) */
    const char **batch_text; /* (n_batch) a string, or NULL ... */
    int32_t **batch_ids;     /* ... token ids (owned) */
    int *batch_n_ids;
    int n_batch;
    int n;                   /* choices per prompt */
    int echo;
    int prompt_lp;           /* prompt_logprobs: its top size, -1 not asked */
    char *prompt; /* owned: the rendered chat */
    int32_t *ids; /* owned: prompt token ids */
    char *guide_spec; /* owned: the constrained-decoding spec sent to the coordinator */
    loom_tools_t tools; /* chat: tools and tool_choice (tool_calls.h), owned */
    char **parts; /* owned: message contents joined from parts */
    int n_parts;
    uint64_t tok_ns; /* the gateway's own tokenization of a chat prompt */
} gen_t;

static void gen_free(gen_t *g) {
    for (int i = 0; i < g->n_batch; i++) free(g->batch_ids[i]);
    free(g->batch_ids);
    free(g->batch_text);
    free(g->batch_n_ids);
    free(g->allowed);
    free(g->guide_spec);
    loom_tools_free(&g->tools);
    free(g->prompt);
    free(g->ids);
    for (int i = 0; i < g->n_parts; i++) free(g->parts[i]);
    free(g->parts);
}

static int is_token_id(const cJSON *t) {
    return cJSON_IsNumber(t) && t->valuedouble == floor(t->valuedouble) && t->valuedouble >= 0 &&
           t->valuedouble <= 2147483647.0;
}

/* Sampling controls: OpenAI's penalties and logit_bias, vLLM's
 * repetition_penalty, min_p, allowed_token_ids, bad_words, min_tokens and
 * include_stop_str_in_output. The coordinator checks ids against the
 * vocabulary and min_tokens against max_tokens. */
static int parse_controls(const cJSON *o, int chat, gen_t *g, perr_t *e) {
    double v;
    int r, b = 0;
    if ((r = opt_number(o, "presence_penalty", -2, 2, &v, e)) < 0) return -1;
    if (r) g->p.presence_penalty = (float)v;
    if ((r = opt_number(o, "frequency_penalty", -2, 2, &v, e)) < 0) return -1;
    if (r) g->p.frequency_penalty = (float)v;
    if ((r = opt_number(o, "repetition_penalty", 0, 10, &v, e)) < 0) return -1;
    if (r && v <= 0) return bad(e, "repetition_penalty", "repetition_penalty must be greater than 0 (got %g)", v);
    if (r) g->p.repetition_penalty = (float)v;
    if ((r = opt_number(o, "min_p", 0, 1, &v, e)) < 0) return -1;
    if (r) g->p.min_p = (float)v;
    if ((r = opt_int(o, "min_tokens", 0, 1 << 30, &v, e)) < 0) return -1;
    if (r) g->p.min_tokens = (int)v;
    if ((r = opt_bool(o, "include_stop_str_in_output", &b, e)) < 0) return -1;
    g->p.include_stop_str_in_output = r && b;
    if ((r = opt_bool(o, "echo", &b, e)) < 0) return -1;
    if (r && b && chat) return bad(e, "echo", "echo is not supported on /v1/chat/completions");
    g->echo = r && b;
    if ((r = opt_int(o, "prompt_logprobs", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && v < 0) return bad(e, "prompt_logprobs", "prompt_logprobs must be a non-negative integer (got %g)", v);
    if (r && v > MAX_TOP_LOGPROBS)
        return bad(e, "prompt_logprobs", "prompt_logprobs %g is over the limit of %d", v, MAX_TOP_LOGPROBS);
    g->prompt_lp = r ? (int)v : -1;
    if (!chat) { /* completions: logprobs N, the sampled token's and the N most likely */
        if ((r = opt_int(o, "logprobs", 0, 1e9, &v, e)) < 0) return -1;
        if (r && v > MAX_TOP_LOGPROBS)
            return bad(e, "logprobs", "logprobs %g is over the limit of %d", v, MAX_TOP_LOGPROBS);
        g->p.logprobs = r;
        g->p.top_logprobs = r ? (int)v : 0;
    } else { /* chat: logprobs true, top_logprobs N */
        if ((r = opt_bool(o, "logprobs", &b, e)) < 0) return -1;
        g->p.logprobs = r && b;
        if ((r = opt_int(o, "top_logprobs", 0, 1e9, &v, e)) < 0) return -1;
        if (r && v > MAX_TOP_LOGPROBS)
            return bad(e, "top_logprobs", "top_logprobs %g is over the limit of %d", v, MAX_TOP_LOGPROBS);
        if (r && v > 0 && !g->p.logprobs)
            return bad(e, "top_logprobs", "top_logprobs needs logprobs set to true");
        g->p.top_logprobs = r ? (int)v : 0;
    }
    const cJSON *x = field(o, "logit_bias"), *t;
    if (x) { /* {"token id": bias}, the keys strings as JSON requires */
        if (!cJSON_IsObject(x)) return bad(e, "logit_bias", "logit_bias must be an object of token id -> bias");
        cJSON_ArrayForEach(t, x) {
            char *end;
            errno = 0;
            long id = strtol(t->string, &end, 10);
            if (!t->string[0] || *end || errno || id < 0 || id > 2147483647L)
                return bad(e, "logit_bias", "logit_bias key '%.64s' is not a token id (a non-negative integer)",
                           t->string);
            if (!cJSON_IsNumber(t) || !(t->valuedouble >= -100 && t->valuedouble <= 100))
                return bad(e, "logit_bias", "logit_bias['%.64s'] must be a number in [-100, 100]", t->string);
            if (g->p.n_logit_bias == MAX_LOGIT_BIAS)
                return bad(e, "logit_bias", "logit_bias has more than %d entries", MAX_LOGIT_BIAS);
            g->bias_ids[g->p.n_logit_bias] = (int32_t)id;
            g->bias_values[g->p.n_logit_bias++] = (float)t->valuedouble;
        }
        g->p.logit_bias_ids = g->bias_ids;
        g->p.logit_bias_values = g->bias_values;
    }
    x = field(o, "allowed_token_ids");
    if (x) {
        int n = cJSON_IsArray(x) ? cJSON_GetArraySize(x) : -1;
        if (n <= 0) return bad(e, "allowed_token_ids", "allowed_token_ids must be a non-empty array of token ids");
        if (n > MAX_ALLOWED_IDS) return bad(e, "allowed_token_ids", "at most %d allowed_token_ids", MAX_ALLOWED_IDS);
        g->allowed = loom_xmalloc((size_t)n * sizeof *g->allowed);
        cJSON_ArrayForEach(t, x) {
            if (!is_token_id(t))
                return bad(e, "allowed_token_ids", "allowed_token_ids[%d] is not a token id (a non-negative integer)",
                           g->p.n_allowed_token_ids);
            g->allowed[g->p.n_allowed_token_ids++] = (int32_t)t->valuedouble;
        }
        g->p.allowed_token_ids = g->allowed;
    }
    x = field(o, "bad_words");
    if (x) {
        if (!cJSON_IsArray(x)) return bad(e, "bad_words", "bad_words must be an array of strings");
        cJSON_ArrayForEach(t, x) {
            if (!cJSON_IsString(t) || !t->valuestring[0])
                return bad(e, "bad_words", "bad_words[%d] must be a non-empty string", g->p.n_bad_words);
            if (g->p.n_bad_words == MAX_BAD_WORDS) return bad(e, "bad_words", "at most %d bad_words", MAX_BAD_WORDS);
            g->bad_words[g->p.n_bad_words++] = t->valuestring;
        }
        g->p.bad_words = g->bad_words;
    }
    return 0;
}

/* ---- Constrained decoding: response_format, vLLM's guided_* and
 * structured_outputs become one (guide_kind, guide_spec) pair; the
 * coordinator compiles it (a bad spec is a 400 with the compiler's message). */
enum { GUIDE_JSON_OBJECT = 1, GUIDE_JSON_SCHEMA = 2, GUIDE_REGEX = 3, GUIDE_CHOICE = 4, GUIDE_GRAMMAR = 5 };

static int set_guide(gen_t *g, int kind, const cJSON *x, const char *param, perr_t *e) {
    if (g->p.guide_kind)
        return bad(e, param, "%s: only one of response_format, guided_json, guided_regex, guided_choice, "
                             "guided_grammar and structured_outputs may constrain the output", param);
    char *spec = NULL;
    switch (kind) {
    case GUIDE_JSON_OBJECT: spec = loom_xstrdup(""); break;
    case GUIDE_JSON_SCHEMA: /* a schema object, or its JSON text */
        if (cJSON_IsString(x)) spec = loom_xstrdup(x->valuestring);
        else if (cJSON_IsObject(x) || cJSON_IsBool(x)) spec = cJSON_PrintUnformatted(x);
        else return bad(e, param, "%s must be a JSON Schema (an object, or its JSON text)", param);
        break;
    case GUIDE_CHOICE: {
        const cJSON *t;
        if (!cJSON_IsArray(x) || !x->child) return bad(e, param, "%s must be a non-empty array of strings", param);
        cJSON_ArrayForEach(t, x) if (!cJSON_IsString(t)) return bad(e, param, "%s must be a non-empty array of strings", param);
        spec = cJSON_PrintUnformatted(x);
        break;
    }
    default: /* regex, grammar */
        if (!cJSON_IsString(x) || !x->valuestring[0]) return bad(e, param, "%s must be a non-empty string", param);
        spec = loom_xstrdup(x->valuestring);
    }
    if (!spec) return bad(e, param, "%s cannot be serialised", param);
    g->guide_spec = spec;
    g->p.guide_kind = kind;
    g->p.guide_spec = spec;
    return 0;
}

static int parse_response_format(const cJSON *x, gen_t *g, perr_t *e) {
    const cJSON *t = cJSON_IsObject(x) ? field(x, "type") : NULL;
    if (!cJSON_IsString(t)) return bad(e, "response_format", "response_format must be an object with a type");
    if (!strcmp(t->valuestring, "text")) return 0;
    if (!strcmp(t->valuestring, "json_object")) return set_guide(g, GUIDE_JSON_OBJECT, NULL, "response_format", e);
    if (strcmp(t->valuestring, "json_schema") != 0)
        return bad(e, "response_format",
                   "response_format type '%.64s' is not supported (text, json_object or json_schema)", t->valuestring);
    const cJSON *js = field(x, "json_schema");
    if (!cJSON_IsObject(js))
        return bad(e, "response_format", "response_format.json_schema must be an object with a schema");
    const cJSON *strict = field(js, "strict"), *name = field(js, "name");
    if (strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict))
        return bad(e, "response_format", "response_format.json_schema.strict must be a boolean");
    if (name && !cJSON_IsString(name))
        return bad(e, "response_format", "response_format.json_schema.name must be a string");
    const cJSON *schema = field(js, "schema");
    if (!schema) return bad(e, "response_format", "response_format.json_schema.schema is required");
    /* strict or not, the output follows the schema exactly */
    return set_guide(g, GUIDE_JSON_SCHEMA, schema, "response_format", e);
}

static int parse_guide(const cJSON *o, gen_t *g, perr_t *e) {
    const cJSON *x = field(o, "response_format");
    if (x && parse_response_format(x, g, e) < 0) return -1;
    static const struct {
        const char *name;
        int kind;
    } guided[] = {{"guided_json", GUIDE_JSON_SCHEMA}, {"guided_regex", GUIDE_REGEX},
                  {"guided_choice", GUIDE_CHOICE}, {"guided_grammar", GUIDE_GRAMMAR}};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(guided); i++) {
        x = field(o, guided[i].name);
        if (x && set_guide(g, guided[i].kind, x, guided[i].name, e) < 0) return -1;
    }
    x = field(o, "guided_decoding_backend"); /* one engine here: any name is accepted */
    if (x && !cJSON_IsString(x)) return bad(e, "guided_decoding_backend", "guided_decoding_backend must be a string");
    x = field(o, "structured_outputs");
    if (x) {
        if (!cJSON_IsObject(x)) return bad(e, "structured_outputs", "structured_outputs must be an object");
        static const struct {
            const char *name;
            int kind;
        } so[] = {{"json", GUIDE_JSON_SCHEMA}, {"regex", GUIDE_REGEX}, {"choice", GUIDE_CHOICE},
                  {"grammar", GUIDE_GRAMMAR}};
        const cJSON *t;
        cJSON_ArrayForEach(t, x) {
            char what[96];
            snprintf(what, sizeof what, "structured_outputs.%.64s", t->string);
            if (cJSON_IsNull(t)) continue;
            size_t i = 0;
            while (i < LOOM_ARRAY_LEN(so) && strcmp(so[i].name, t->string) != 0) i++;
            if (i < LOOM_ARRAY_LEN(so)) {
                if (set_guide(g, so[i].kind, t, what, e) < 0) return -1;
            } else if (!strcmp(t->string, "json_object")) {
                if (!cJSON_IsBool(t)) return bad(e, "structured_outputs", "%s must be a boolean", what);
                if (cJSON_IsTrue(t) && set_guide(g, GUIDE_JSON_OBJECT, NULL, what, e) < 0) return -1;
            } else if (strcmp(t->string, "backend") != 0 && strcmp(t->string, "disable_fallback") != 0 &&
                       strcmp(t->string, "disable_any_whitespace") != 0 &&
                       strcmp(t->string, "disable_additional_properties") != 0) {
                return bad(e, "structured_outputs", "%s is not supported by this server", what);
            }
        }
    }
    return 0;
}

/* ---- Tool calling (tool_calls.h): a forced call (tool_choice "required"
 * or a named function) becomes a JSON Schema guide, so its arguments always
 * match the tool's schema. */
static int parse_tools(req_t *q, const cJSON *o, gen_t *g, perr_t *e) {
    const char *param = "tools";
    char msg[300];
    loom_chat_family_t fam = q->h && q->h->tmpl ? q->h->tmpl->family : LOOM_CHAT_CHATML;
    if (loom_tools_parse(o, fam, &g->tools, &param, msg, sizeof msg) < 0) return bad(e, param, "%s", msg);
    if (!g->tools.schema) return 0;
    if (g->p.guide_kind)
        return bad(e, "tool_choice", "tool_choice '%s' forces the output; it cannot be combined with response_format, "
                                     "guided_* or structured_outputs",
                   g->tools.mode == LOOM_TOOLS_NAMED ? g->tools.named : "required");
    g->guide_spec = loom_xstrdup(g->tools.schema);
    g->p.guide_kind = GUIDE_JSON_SCHEMA;
    g->p.guide_spec = g->guide_spec;
    return 0;
}

static int parse_common(req_t *q, const cJSON *o, gen_t *g, perr_t *e) {
    double v;
    int r, b = 0;
    if (check_fields(q, o, q->chat, e) < 0) return -1;
    const cJSON *x = field(o, "model");
    if (x && !cJSON_IsString(x)) return bad(e, "model", "model must be a string");
    if (x && x->valuestring[0]) g->p.model = x->valuestring;
    g->n = 1;
    if ((r = opt_int(o, "n", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && (v < 1 || v > MAX_CHOICES)) return bad(e, "n", "n must be in [1, %d] (got %g)", MAX_CHOICES, v);
    if (r) g->n = (int)v;
    if ((r = opt_int(o, "best_of", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && v != g->n) return bad(e, "best_of", "best_of must equal n, %d (got %g)", g->n, v);
    if ((r = opt_bool(o, "skip_special_tokens", &b, e)) < 0) return -1;
    g->p.keep_special = r && !b;
    x = field(o, "stop_token_ids");
    if (x) {
        if (!cJSON_IsArray(x)) return bad(e, "stop_token_ids", "stop_token_ids must be an array of token ids");
        const cJSON *t;
        cJSON_ArrayForEach(t, x) {
            if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
                t->valuedouble > 2147483647.0)
                return bad(e, "stop_token_ids", "stop_token_ids[%d] is not a token id (a non-negative integer)",
                           g->p.n_stop_token_ids);
            if (g->p.n_stop_token_ids == MAX_STOP_IDS)
                return bad(e, "stop_token_ids", "at most %d stop token ids", MAX_STOP_IDS);
            g->stop_ids[g->p.n_stop_token_ids++] = (int32_t)t->valuedouble;
        }
        g->p.stop_token_ids = g->stop_ids;
    }
    x = field(o, "user");
    if (x && !cJSON_IsString(x)) return bad(e, "user", "user must be a string");
    if (x) g->p.session = x->valuestring; /* a router's session affinity */
    x = field(o, "metadata");
    if (x && !cJSON_IsObject(x)) return bad(e, "metadata", "metadata must be an object");
    if (parse_guide(o, g, e) < 0) return -1;
    if (q->chat && parse_tools(q, o, g, e) < 0) return -1;

    /* max_tokens; for chat max_completion_tokens wins */
    static const loom_gen_defaults_t no_defaults; /* loom_http_parse_generate has no gateway */
    const loom_gen_defaults_t *gd = q->h ? &q->h->gen : &no_defaults;
    g->p.max_tokens = gd->has_max_tokens ? gd->max_tokens : q->chat ? 0 : COMPLETIONS_DEFAULT_MAX_TOKENS;
    if ((r = opt_int(o, "max_tokens", -1e18, 1e18, &v, e)) < 0) return -1;
    const char *mt = "max_tokens";
    if (q->chat) {
        double v2;
        int r2 = opt_int(o, "max_completion_tokens", -1e18, 1e18, &v2, e);
        if (r2 < 0) return -1;
        if (r2) {
            r = 1, v = v2;
            mt = "max_completion_tokens";
        }
    }
    if (r) {
        if (v < 1) return bad(e, mt, "%s must be at least 1 (got %g)", mt, v);
        g->p.max_tokens = v > (1 << 30) ? (1 << 30) : (int)v;
    }
    g->p.temperature = gd->has_temperature ? gd->temperature : 1.0f;
    if ((r = opt_number(o, "temperature", 0, 2, &v, e)) < 0) return -1;
    if (r) g->p.temperature = (float)v;
    g->p.top_p = gd->has_top_p ? gd->top_p : 1.0f;
    if ((r = opt_number(o, "top_p", 0, 1, &v, e)) < 0) return -1;
    if (r) g->p.top_p = (float)v;
    if (gd->has_top_k) g->p.top_k = gd->top_k;
    if ((r = opt_int(o, "top_k", -1, 1 << 30, &v, e)) < 0) return -1;
    if (r) g->p.top_k = v < 0 ? 0 : (int)v;
    if ((r = opt_int(o, "seed", -9223372036854775808.0, 18446744073709551615.0, &v, e)) < 0) return -1;
    if (r) {
        g->p.seed = v < 0 ? (uint64_t)(int64_t)v : v >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)v;
        g->p.has_seed = 1;
    }
    x = field(o, "stop");
    if (x) {
        if (cJSON_IsString(x)) {
            g->stop[g->p.n_stop++] = x->valuestring;
        } else if (cJSON_IsArray(x)) {
            const cJSON *s;
            cJSON_ArrayForEach(s, x) {
                if (!cJSON_IsString(s)) return bad(e, "stop", "stop must be a string or an array of strings");
                if (g->p.n_stop == MAX_STOP) return bad(e, "stop", "at most %d stop strings", MAX_STOP);
                g->stop[g->p.n_stop++] = s->valuestring;
            }
        } else {
            return bad(e, "stop", "stop must be a string or an array of strings");
        }
        g->p.stop = g->stop;
    }
    if ((r = opt_bool(o, "stream", &b, e)) < 0) return -1;
    q->stream = r && b;
    x = field(o, "stream_options");
    if (x) {
        if (!cJSON_IsObject(x)) return bad(e, "stream_options", "stream_options must be an object");
        if ((r = opt_bool(x, "include_usage", &b, e)) < 0) return -1;
        q->include_usage = r && b;
    }
    if ((r = opt_bool(o, "ignore_eos", &b, e)) < 0) return -1;
    g->p.ignore_eos = r && b;
    if ((r = opt_bool(o, "speculative", &b, e)) < 0) return -1; /* false: no speculation for this request */
    g->p.no_speculation = r && !b;
    if ((r = opt_bool(o, "loom_cache", &b, e)) < 0) return -1; /* false: a router's response cache is skipped */
    g->p.no_cache = r && !b;
    if ((r = opt_int(o, "priority", -1e6, 1e6, &v, e)) < 0) return -1;
    if (r) g->p.priority = (int)v;
    if (parse_controls(o, q->chat, g, e) < 0) return -1;
    q->logprobs = g->p.logprobs;
    q->top_logprobs = g->p.top_logprobs;
    q->echo = g->echo;
    q->prompt_lp = g->prompt_lp;
    if (q->prompt_lp >= 0 && q->stream) /* as vLLM */
        return bad(e, "prompt_logprobs", "prompt_logprobs are not available when stream is true");
    if (q->prompt_lp >= 0 || (g->echo && g->p.logprobs)) { /* echo with logprobs covers the prompt's tokens too */
        g->p.prompt_logprobs = 1;
        g->p.prompt_top_logprobs = LOOM_MAX(q->prompt_lp, g->echo && g->p.logprobs ? g->p.top_logprobs : 0);
    }
    return 0;
}

/* One prompt: a non-empty string, or an array of token ids (*ids owned by
 * the caller). `what` names it in errors ("prompt", "prompt[2]"). */
static int parse_one_prompt(const cJSON *x, const char *what, const char **text, int32_t **ids, int *n_ids,
                            perr_t *e) {
    if (cJSON_IsString(x)) {
        if (!x->valuestring[0]) return bad(e, "prompt", "%s must not be empty", what);
        *text = x->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(x)) return bad(e, "prompt", "%s must be a string or an array of token ids", what);
    int n = cJSON_GetArraySize(x);
    if (n == 0) return bad(e, "prompt", "%s must not be empty", what);
    *ids = loom_xmalloc((size_t)n * sizeof **ids);
    const cJSON *t;
    int k = 0;
    cJSON_ArrayForEach(t, x) {
        if (!is_token_id(t)) return bad(e, "prompt", "%s[%d] is not a token id (a non-negative integer)", what, k);
        (*ids)[k++] = (int32_t)t->valuedouble;
    }
    *n_ids = n;
    return 0;
}

/* /v1/completions: prompt is a string, an array of token ids, or a batch
 * (an array) of either, answered as choices in prompt order (OpenAI's
 * index: prompt i, choice j of n is i * n + j). add_special_tokens: false
 * (an extension, as in vLLM) sends the text as already formatted: special
 * tokens parsed, no BOS added. */
static int parse_prompt(const cJSON *o, gen_t *g, perr_t *e) {
    const cJSON *x = field(o, "prompt");
    if (!x) return bad(e, "prompt", "prompt is required");
    if (cJSON_IsArray(x) && cJSON_GetArraySize(x) >= 1 && !cJSON_IsNumber(x->child)) { /* a batch */
        int n = cJSON_GetArraySize(x);
        if (n > MAX_CHOICES) return bad(e, "prompt", "a batch of %d prompts; at most %d", n, MAX_CHOICES);
        g->batch_text = loom_xcalloc((size_t)n, sizeof *g->batch_text);
        g->batch_ids = loom_xcalloc((size_t)n, sizeof *g->batch_ids);
        g->batch_n_ids = loom_xcalloc((size_t)n, sizeof *g->batch_n_ids);
        g->n_batch = n;
        const cJSON *t;
        int i = 0;
        cJSON_ArrayForEach(t, x) {
            char what[32];
            snprintf(what, sizeof what, "prompt[%d]", i);
            if (parse_one_prompt(t, what, &g->batch_text[i], &g->batch_ids[i], &g->batch_n_ids[i], e) < 0) return -1;
            i++;
        }
        if (n == 1) { /* a batch of one is the prompt itself */
            g->p.prompt = g->batch_text[0];
            g->p.prompt_ids = g->batch_ids[0];
            g->p.n_prompt_ids = g->batch_n_ids[0];
        }
    } else {
        if (parse_one_prompt(x, "prompt", &g->p.prompt, &g->ids, &g->p.n_prompt_ids, e) < 0) return -1;
        g->p.prompt_ids = g->ids;
    }
    int r, b = 0;
    if ((r = opt_bool(o, "add_special_tokens", &b, e)) < 0) return -1;
    if (r && !b) g->p.raw_prompt = 1;
    return 0;
}

/* /v1/chat/completions: messages through the chat template. The prompt is
 * tokenized here, with special-token text inside the messages' content
 * encoded as plain text (only the template's own special tokens are
 * control tokens), and sent as ids; with special_in_content (the
 * --chat-special-tokens-in-content flag) the rendered text goes to the
 * coordinator, which parses every special token in it. */
/* A message of the tool-calling history, in the family's conventions:
 * an assistant message with tool_calls, or a tool result (as a user turn;
 * consecutive results share one). 1: handled (m[*i] set, *i advanced or
 * merged), 0: an ordinary message, -1: bad input. */
static int tool_message(const loom_chat_template_t *tmpl, const cJSON *msg, loom_chat_msg_t *m, int *i,
                        int *prev_tool, gen_t *g, perr_t *e) {
    loom_chat_family_t fam = tmpl ? tmpl->family : LOOM_CHAT_CHATML;
    const char *role = field(msg, "role")->valuestring;
    const cJSON *calls = field(msg, "tool_calls"), *c = field(msg, "content");
    int was_tool = *prev_tool;
    *prev_tool = 0;
    if (!strcmp(role, "assistant") && calls && !cJSON_IsNull(calls) && !(cJSON_IsArray(calls) && !calls->child)) {
        char msgbuf[256];
        char *t = loom_tools_render_calls(fam, calls, cJSON_IsString(c) ? c->valuestring : NULL, msgbuf, sizeof msgbuf);
        if (!t) return bad(e, "messages", "messages[%d].%s", *i, msgbuf);
        g->parts[g->n_parts++] = t;
        m[*i].content = t;
        (*i)++;
        return 1;
    }
    if (strcmp(role, "tool") != 0) return 0;
    if (!cJSON_IsString(c)) return bad(e, "messages", "messages[%d] (a tool result) must have string content", *i);
    char *t = loom_tools_render_result(fam, c->valuestring);
    if (was_tool && *i > 0) { /* one user turn for consecutive results */
        char *prev = g->parts[g->n_parts - 1];
        size_t a = strlen(prev), b = strlen(t);
        prev = loom_xrealloc(prev, a + b + 2);
        prev[a] = '\n';
        memcpy(prev + a + 1, t, b + 1);
        free(t);
        g->parts[g->n_parts - 1] = prev;
        m[*i - 1].content = prev;
    } else {
        g->parts[g->n_parts++] = t;
        m[*i].role = "user";
        m[*i].content = t;
        (*i)++;
    }
    *prev_tool = 1;
    return 1;
}

/* The tools where the family lists them: chatml in the system turn (one is
 * added when there is none), llama3 before the first user text, mistral
 * before the last user text. */
static void add_tools_turn(const loom_chat_template_t *tmpl, loom_chat_msg_t *m, int *n, gen_t *g) {
    loom_chat_family_t fam = tmpl ? tmpl->family : LOOM_CHAT_CHATML;
    const char *r = g->tools.render;
    int at = -1, before = 1;
    if (fam == LOOM_CHAT_LLAMA3 || fam == LOOM_CHAT_MISTRAL) {
        for (int k = 0; k < *n; k++)
            if (!strcmp(m[k].role, "user") && (at < 0 || fam == LOOM_CHAT_MISTRAL)) at = k;
    } else {
        before = 0;
        if (*n > 0 && (!strcmp(m[0].role, "system") || !strcmp(m[0].role, "developer"))) at = 0;
    }
    if (at < 0) { /* a system turn of its own (chatml), or the first turn */
        memmove(m + 1, m, (size_t)*n * sizeof *m);
        (*n)++;
        m[0].role = fam == LOOM_CHAT_LLAMA3 || fam == LOOM_CHAT_MISTRAL ? "user" : "system";
        m[0].content = r;
        return;
    }
    loom_sbuf_t b = {0};
    loom_sbuf_add(&b, "", 0);
    if (before) loom_sbuf_printf(&b, "%s%s", r, m[at].content);
    else loom_sbuf_printf(&b, "%s%s%s", m[at].content, m[at].content[0] ? "\n\n" : "", r);
    g->parts[g->n_parts++] = b.p;
    m[at].content = b.p;
}

static int parse_messages(const loom_chat_template_t *tmpl, const loom_tokenizer_t *tok, int special_in_content,
                          const cJSON *o, gen_t *g, perr_t *e) {
    const cJSON *x = field(o, "messages");
    if (!x) return bad(e, "messages", "messages is required");
    if (!cJSON_IsArray(x) || cJSON_GetArraySize(x) == 0)
        return bad(e, "messages", "messages must be a non-empty array of {role, content} objects");
    int n = cJSON_GetArraySize(x);
    loom_chat_msg_t *m = loom_xcalloc((size_t)n + 1, sizeof *m); /* + a system turn for the tools */
    g->parts = loom_xcalloc((size_t)n + 2, sizeof *g->parts);
    int i = 0, rc = -1, prev_tool = 0;
    size_t len, *plain = NULL, n_plain = 0; /* before the first goto done */
    const cJSON *msg;
    cJSON_ArrayForEach(msg, x) {
        const cJSON *role = cJSON_IsObject(msg) ? field(msg, "role") : NULL;
        if (!cJSON_IsString(role)) {
            bad(e, "messages", "messages[%d] must be an object with a string role", i);
            goto done;
        }
        m[i].role = role->valuestring;
        int tr = tool_message(tmpl, msg, m, &i, &prev_tool, g, e);
        if (tr < 0) goto done;
        if (tr) continue;
        const cJSON *c = field(msg, "content");
        if (!c) {
            if (strcmp(role->valuestring, "assistant") != 0) {
                bad(e, "messages", "messages[%d] has no content", i);
                goto done;
            }
            m[i].content = "";
        } else if (cJSON_IsString(c)) {
            m[i].content = c->valuestring;
        } else if (cJSON_IsArray(c)) {
            loom_sbuf_t s = {0};
            loom_sbuf_add(&s, "", 0);
            const cJSON *part;
            int k = 0;
            cJSON_ArrayForEach(part, c) {
                const cJSON *type = cJSON_IsObject(part) ? field(part, "type") : NULL;
                const cJSON *text = cJSON_IsObject(part) ? field(part, "text") : NULL;
                if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0 || !cJSON_IsString(text)) {
                    free(s.p);
                    bad(e, "messages", "messages[%d].content[%d]: only {\"type\": \"text\", \"text\": ...} parts are supported",
                        i, k);
                    goto done;
                }
                if (k++) loom_sbuf_str(&s, "\n");
                loom_sbuf_str(&s, text->valuestring);
            }
            g->parts[g->n_parts++] = s.p;
            m[i].content = s.p;
        } else {
            bad(e, "messages", "messages[%d].content must be a string or an array of text parts", i);
            goto done;
        }
        i++;
    }
    n = i;
    if (g->tools.render) add_tools_turn(tmpl, m, &n, g);
    loom_err_t err = {0};
    int add_gen = 1, r = opt_bool(o, "add_generation_prompt", &add_gen, e);
    if (r < 0) goto done;
    if (!special_in_content && !tok) {
        bad(e, "messages", "this server has no tokenizer loaded to encode chat prompts");
        goto done;
    }
    if (loom_chat_render_spans(tmpl, m, n, add_gen, &g->prompt, &len, special_in_content ? NULL : &plain,
                               special_in_content ? NULL : &n_plain, &err) < 0) {
        bad(e, "messages", "%s", err.msg);
        goto done;
    }
    if (len == 0) {
        bad(e, "messages", "the conversation renders to an empty prompt");
        goto done;
    }
    g->p.raw_prompt = 1;
    if (special_in_content) {
        g->p.prompt = g->prompt;
    } else {
        uint64_t t0 = loom_now_ns();
        int n_ids = 0, cap = 0;
        loom_status_t st = loom_tokenizer_encode_spans(tok, g->prompt, len, 0, plain, n_plain, &g->ids, &n_ids, &cap,
                                                       &err);
        g->tok_ns = loom_now_ns() - t0;
        if (st < 0) {
            bad(e, "messages", "cannot tokenize the conversation: %s", err.msg);
            goto done;
        }
        g->p.prompt_ids = g->ids;
        g->p.n_prompt_ids = n_ids;
    }
    rc = 0;
done:
    free(plain);
    free(m);
    return rc;
}

int loom_http_parse_generate(const char *body, size_t len, int chat, const loom_chat_template_t *tmpl,
                             const loom_tokenizer_t *tok, int special_in_content, char *msg, size_t cap) {
    cJSON *root = loom_http_parse_json_body(body, len, msg, cap);
    if (!root) return -1;
    req_t q = {.chat = chat};
    gen_t g = {0};
    perr_t e = {0};
    int rc = -1;
    if (chat && !tmpl) snprintf(msg, cap, "this model has no chat template");
    else if (parse_common(&q, root, &g, &e) < 0 ||
             (chat ? parse_messages(tmpl, tok, special_in_content, root, &g, &e) : parse_prompt(root, &g, &e)) < 0)
        snprintf(msg, cap, "%s", e.msg);
    else
        rc = 0;
    gen_free(&g);
    cJSON_Delete(root);
    return rc;
}

/* ---- response bodies ---- */

/* The completion id: the request id after OpenAI's prefix. */
static void new_id(req_t *q) {
    snprintf(q->id, sizeof q->id, "%s-%.*s", q->chat ? "chatcmpl" : "cmpl", (int)(sizeof q->id - 10), q->xid);
}

/* The client's X-Request-Id when it is 1..MAX_REQUEST_ID printable ASCII
 * characters; otherwise a fresh one (24 hex digits). */
static void take_request_id(req_t *q) {
    const char *x = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, "X-Request-Id");
    size_t n = 0;
    if (x) {
        while (x[n] && n <= MAX_REQUEST_ID && x[n] >= 0x20 && x[n] <= 0x7e) n++;
        if (n > 0 && n <= MAX_REQUEST_ID && !x[n]) {
            memcpy(q->xid, x, n + 1);
            return;
        }
    }
    uint64_t k = atomic_fetch_add(&q->h->n_ids, 1);
    uint64_t a = mix64(q->h->id_salt + k), b = mix64(a ^ 0x5bd1e995u);
    snprintf(q->xid, sizeof q->xid, "%016llx%08llx", (unsigned long long)a, (unsigned long long)(b >> 32));
}

static const char *finish_name(loom_finish_t f) {
    return f == LOOM_FINISH_LENGTH ? "length" : "stop";
}

static cJSON *usage_obj(const loom_chunk_t *ch) {
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", ch->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", ch->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)ch->prompt_tokens + ch->completion_tokens);
    cJSON *d = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "cached_tokens", ch->cached_tokens);
    cJSON_AddItemToObject(u, "prompt_tokens_details", d);
    return u;
}

/* The coordinator's timings plus the gateway's own send time (ms). */
static cJSON *timings_obj(const req_t *q) {
    const loom_timings_t *t = &q->timings;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "queue_ms", t->queue_ms);
    double gw_tok_ms = (double)q->tok_ns * 1e-6; /* before the coordinator saw the request */
    cJSON_AddNumberToObject(o, "tokenize_ms", t->tokenize_ms + gw_tok_ms);
    cJSON_AddNumberToObject(o, "prefill_ms", t->prefill_ms);
    cJSON_AddNumberToObject(o, "decode_ms", t->decode_ms);
    cJSON_AddNumberToObject(o, "detokenize_ms", t->detokenize_ms);
    cJSON_AddNumberToObject(o, "send_ms", t->send_ms + (double)q->send_ns * 1e-6);
    cJSON_AddNumberToObject(o, "ttft_ms", t->ttft_ms + gw_tok_ms);
    cJSON_AddNumberToObject(o, "total_ms", t->total_ms + gw_tok_ms);
    return o;
}

static void take_timings(req_t *q, const loom_chunk_t *ch) {
    if (!ch->has_timings) return;
    q->timings = ch->timings;
    q->has_timings = 1;
}

static cJSON *head_obj(const req_t *q, const char *object) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", q->id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)q->created);
    cJSON_AddStringToObject(o, "model", q->model);
    return o;
}

static void sse_event(req_t *q, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    loom_sbuf_str(&q->out, "data: ");
    if (s) loom_sbuf_str(&q->out, s);
    loom_sbuf_str(&q->out, "\n\n");
    free(s);
}

/* Appends s as a JSON string literal (NUL bytes dropped). */
static void sb_json_str(loom_sbuf_t *b, const char *s, size_t n) {
    loom_sbuf_add(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        loom_sbuf_add(b, s + run, i - run);
        run = i + 1;
        char esc[8];
        if (c == '"' || c == '\\') snprintf(esc, sizeof esc, "\\%c", c);
        else if (c == '\n') snprintf(esc, sizeof esc, "\\n");
        else if (c == '\t') snprintf(esc, sizeof esc, "\\t");
        else if (c == '\r') snprintf(esc, sizeof esc, "\\r");
        else if (c) snprintf(esc, sizeof esc, "\\u%04x", c);
        else esc[0] = '\0';
        loom_sbuf_str(b, esc);
    }
    loom_sbuf_add(b, s + run, n - run);
    loom_sbuf_add(b, "\"", 1);
}

/* One streamed chunk: text (or a chat delta), with finish_reason in the
 * last one. Written by hand, not through cJSON: this runs once per token,
 * and the part before the choice is the same for the whole stream. */
static void sse_choice(req_t *q, const char *text, size_t len, int role, const char *finish) {
    if (!q->prefix.len) {
        cJSON *o = head_obj(q, q->chat ? "chat.completion.chunk" : "text_completion");
        char *head = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!head) return;
        loom_sbuf_str(&q->prefix, "data: ");
        loom_sbuf_add(&q->prefix, head, strlen(head) - 1); /* without the closing brace */
        loom_sbuf_str(&q->prefix, ",\"choices\":[{\"index\":0,");
        free(head);
    }
    loom_sbuf_t *b = &q->out;
    loom_sbuf_add(b, q->prefix.p, q->prefix.len);
    if (q->chat) {
        loom_sbuf_str(b, "\"delta\":{");
        if (role) loom_sbuf_str(b, text ? "\"role\":\"assistant\"," : "\"role\":\"assistant\"");
        if (text) {
            loom_sbuf_str(b, "\"content\":");
            sb_json_str(b, text, len);
        }
        loom_sbuf_str(b, "}");
    } else {
        loom_sbuf_str(b, "\"text\":");
        sb_json_str(b, text ? text : "", text ? len : 0);
    }
    loom_sbuf_str(b, ",\"logprobs\":");
    loom_sbuf_str(b, q->lp_json ? q->lp_json : "null");
    loom_sbuf_str(b, ",\"finish_reason\":");
    if (finish) {
        loom_sbuf_str(b, "\"");
        loom_sbuf_str(b, finish);
        loom_sbuf_str(b, "\"}]");
        if (q->has_timings) { /* Loom's extension: where the request's time went */
            cJSON *tj = timings_obj(q);
            char *t = cJSON_PrintUnformatted(tj);
            cJSON_Delete(tj);
            if (t) {
                loom_sbuf_str(b, ",\"timings\":");
                loom_sbuf_str(b, t);
                free(t);
            }
        }
    } else {
        loom_sbuf_str(b, "null}]");
    }
    loom_sbuf_str(b, q->include_usage ? ",\"usage\":null}\n\n" : "}\n\n");
}

/* A token's text as it continues the output (a SentencePiece space kept),
 * NUL bytes left out (JSON strings here cannot hold them). */
static char *token_text(const req_t *q, int32_t id) {
    if (!q->h->tok) return loom_xstrdup("");
    char buf[1024];
    loom_detok_t d;
    loom_detok_init(&d, q->h->tok, 0, 0);
    size_t n = loom_detok_push(&d, id, buf, sizeof buf);
    n += loom_detok_flush(&d, buf + n, sizeof buf - n);
    return text_dup(buf, n);
}

static double clamp_lp(float lp) {
    return lp > -9999.0f ? (double)lp : -9999.0; /* as vLLM: -inf is not JSON */
}

static cJSON *bytes_arr(const char *t) {
    cJSON *a = cJSON_CreateArray();
    for (const unsigned char *c = (const unsigned char *)t; *c; c++) cJSON_AddItemToArray(a, cJSON_CreateNumber(*c));
    return a;
}

static cJSON *arr_of(cJSON *o, const char *k) {
    cJSON *a = cJSON_GetObjectItemCaseSensitive(o, k);
    return a ? a : cJSON_AddArrayToObject(o, k);
}

/* Appends the chunk's tokens to a logprobs object: completions' {tokens,
 * token_logprobs, top_logprobs, text_offset}, or chat's {content: [...]}. */
static void add_logprobs(req_t *q, cJSON *lp, const loom_chunk_t *ch) {
    size_t top = 0;
    for (int i = 0; i < ch->n_ids; i++) {
        char *t = token_text(q, ch->ids[i]);
        int nt = (int)LOOM_MIN(ch->n_top[i], (uint32_t)q->top_logprobs);
        if (q->chat) {
            cJSON *it = cJSON_CreateObject();
            cJSON_AddStringToObject(it, "token", t);
            cJSON_AddNumberToObject(it, "logprob", clamp_lp(ch->logprobs[i]));
            cJSON_AddItemToObject(it, "bytes", bytes_arr(t));
            cJSON *tl = cJSON_AddArrayToObject(it, "top_logprobs");
            for (int j = 0; j < nt; j++) {
                char *tt = token_text(q, ch->top_ids[top + (size_t)j]);
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "token", tt);
                cJSON_AddNumberToObject(e, "logprob", clamp_lp(ch->top_logprobs[top + (size_t)j]));
                cJSON_AddItemToObject(e, "bytes", bytes_arr(tt));
                cJSON_AddItemToArray(tl, e);
                free(tt);
            }
            cJSON_AddItemToArray(arr_of(lp, "content"), it);
        } else {
            cJSON_AddItemToArray(arr_of(lp, "tokens"), cJSON_CreateString(t));
            cJSON_AddItemToArray(arr_of(lp, "token_logprobs"), cJSON_CreateNumber(clamp_lp(ch->logprobs[i])));
            cJSON *d = cJSON_CreateObject();
            for (int j = 0; j < nt; j++) {
                char *tt = token_text(q, ch->top_ids[top + (size_t)j]);
                if (!cJSON_GetObjectItemCaseSensitive(d, tt)) /* two ids may read alike: the likelier stays */
                    cJSON_AddNumberToObject(d, tt, clamp_lp(ch->top_logprobs[top + (size_t)j]));
                free(tt);
            }
            cJSON_AddItemToArray(arr_of(lp, "top_logprobs"), d);
            cJSON_AddItemToArray(arr_of(lp, "text_offset"), cJSON_CreateNumber((double)q->lp_offset));
            q->lp_offset += strlen(t);
        }
        top += ch->n_top[i];
        free(t);
    }
}

/* vLLM's prompt_logprobs from the chunk that carries them: null for the
 * first prompt token, then per token {"id": {logprob, rank, decoded_token}},
 * the prompt's token first, then the q->prompt_lp most likely. */
static cJSON *prompt_lp_json(const req_t *q, const loom_chunk_t *ch) {
    cJSON *a = cJSON_CreateArray();
    if (ch->n_prompt_ids > 0) cJSON_AddItemToArray(a, cJSON_CreateNull());
    size_t top = 0;
    for (int i = 1; i < ch->n_prompt_ids; i++) {
        cJSON *d = cJSON_CreateObject();
        char key[16];
        int32_t id = ch->prompt_ids[i];
        char *t = token_text(q, id);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "logprob", clamp_lp(ch->prompt_logprobs[i - 1]));
        cJSON_AddNumberToObject(e, "rank", ch->prompt_ranks[i - 1]);
        cJSON_AddStringToObject(e, "decoded_token", t);
        free(t);
        snprintf(key, sizeof key, "%d", (int)id);
        cJSON_AddItemToObject(d, key, e);
        int nt = (int)LOOM_MIN(ch->prompt_n_top[i - 1], (uint32_t)LOOM_MAX(q->prompt_lp, 0));
        for (int j = 0; j < nt; j++) {
            int32_t tid = ch->prompt_top_ids[top + (size_t)j];
            if (tid == id) continue; /* already there, with its rank */
            snprintf(key, sizeof key, "%d", (int)tid);
            char *tt = token_text(q, tid);
            cJSON *te = cJSON_CreateObject();
            cJSON_AddNumberToObject(te, "logprob", clamp_lp(ch->prompt_top_logprobs[top + (size_t)j]));
            cJSON_AddNumberToObject(te, "rank", j + 1);
            cJSON_AddStringToObject(te, "decoded_token", tt);
            free(tt);
            cJSON_AddItemToObject(d, key, te);
        }
        top += ch->prompt_n_top[i - 1];
        cJSON_AddItemToArray(a, d);
    }
    return a;
}

/* echo with logprobs (completions): the prompt's tokens open the logprobs
 * object as OpenAI's legacy API has them, the first with null logprob and
 * top_logprobs; text_offset counts from 0 over the prompt's tokens, and the
 * generated tokens' go on from echo_len, the echoed text's length (as vLLM). */
static void add_echo_logprobs(req_t *q, cJSON *lp, const loom_chunk_t *ch, size_t echo_len) {
    size_t top = 0, off = 0;
    for (int i = 0; i < ch->n_prompt_ids; i++) {
        char *t = token_text(q, ch->prompt_ids[i]);
        cJSON_AddItemToArray(arr_of(lp, "tokens"), cJSON_CreateString(t));
        cJSON_AddItemToArray(arr_of(lp, "text_offset"), cJSON_CreateNumber((double)off));
        off += strlen(t);
        free(t);
        if (i == 0) {
            cJSON_AddItemToArray(arr_of(lp, "token_logprobs"), cJSON_CreateNull());
            cJSON_AddItemToArray(arr_of(lp, "top_logprobs"), cJSON_CreateNull());
            continue;
        }
        cJSON_AddItemToArray(arr_of(lp, "token_logprobs"), cJSON_CreateNumber(clamp_lp(ch->prompt_logprobs[i - 1])));
        cJSON *d = cJSON_CreateObject();
        int nt = (int)LOOM_MIN(ch->prompt_n_top[i - 1], (uint32_t)q->top_logprobs);
        for (int j = 0; j < nt; j++) {
            char *tt = token_text(q, ch->prompt_top_ids[top + (size_t)j]);
            if (!cJSON_GetObjectItemCaseSensitive(d, tt))
                cJSON_AddNumberToObject(d, tt, clamp_lp(ch->prompt_top_logprobs[top + (size_t)j]));
            free(tt);
        }
        top += ch->prompt_n_top[i - 1];
        cJSON_AddItemToArray(arr_of(lp, "top_logprobs"), d);
    }
    q->lp_offset = echo_len;
}

/* The request's tools outlive its JSON body: copied for parsing the output. */
static void keep_tools(req_t *q, gen_t *g) {
    if (g->tools.mode == LOOM_TOOLS_OFF) return;
    q->tools = g->tools;
    memset(&g->tools, 0, sizeof g->tools);
    q->tools_req = cJSON_Duplicate(q->tools.tools, 1);
    q->tools.tools = q->tools_req;
    if (q->tools.named) { /* the same name, inside the copy */
        const cJSON *t;
        cJSON_ArrayForEach(t, q->tools_req) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
            if (cJSON_IsString(nm) && !strcmp(nm->valuestring, q->tools.named)) q->tools.named = nm->valuestring;
        }
    }
}

static loom_chat_family_t chat_family(const req_t *q) {
    return q->h->tmpl ? q->h->tmpl->family : LOOM_CHAT_CHATML;
}

/* The seed of this completion's call ids (FNV-1a of its id): the same
 * streamed or not. */
static unsigned long long call_seed(const req_t *q) {
    unsigned long long seed = 1469598103934665603ull;
    for (const char *p = q->id; *p; p++) seed = (seed ^ (unsigned char)*p) * 1099511628211ull;
    return seed;
}

/* The OpenAI tool_calls of a finished chat answer (NULL: none, the text is
 * the content). A forced call (required, named) that the budget cut short
 * stays text with finish length; auto and required finish as "tool_calls",
 * a named function as "stop" (as OpenAI). */
static cJSON *tool_calls_of(req_t *q, const char *text, size_t len, const loom_chunk_t *ch, char **rest,
                            const char **finish) {
    *rest = NULL;
    if (q->tools.mode == LOOM_TOOLS_OFF || ch->finish != LOOM_FINISH_STOP) return NULL;
    cJSON *calls = loom_tools_parse_output(&q->tools, chat_family(q), text, len, call_seed(q), rest);
    if (calls) *finish = q->tools.mode == LOOM_TOOLS_NAMED ? "stop" : "tool_calls";
    return calls;
}

/* An event of a streamed tool-calling answer (tool_stream.h) as OpenAI
 * streams it: content as a content delta; a call's start as
 * {index, id, type, function: {name, arguments: ""}}, then its arguments
 * piece by piece as {index, function: {arguments}}. */
static void tool_event(void *ctx, const loom_tse_t *e) {
    req_t *q = ctx;
    if (e->kind == LOOM_TSE_CONTENT) {
        sse_choice(q, e->text, e->len, 0, NULL);
        return;
    }
    cJSON *o = head_obj(q, "chat.completion.chunk"), *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *choice = cJSON_CreateObject(), *delta = cJSON_AddObjectToObject(choice, "delta");
    cJSON_AddNumberToObject(choice, "index", 0);
    cJSON *call = cJSON_CreateObject();
    cJSON_AddNumberToObject(call, "index", e->index);
    if (e->kind == LOOM_TSE_CALL) {
        char id[48];
        loom_tools_call_id(call_seed(q), e->index, id, sizeof id);
        cJSON_AddStringToObject(call, "id", id);
        cJSON_AddStringToObject(call, "type", "function");
    }
    cJSON *fn = cJSON_AddObjectToObject(call, "function");
    if (e->kind == LOOM_TSE_CALL) {
        cJSON_AddStringToObject(fn, "name", e->name);
        cJSON_AddStringToObject(fn, "arguments", "");
    } else {
        char *piece = text_dup(e->text, e->len);
        cJSON_AddStringToObject(fn, "arguments", piece);
        free(piece);
    }
    cJSON_AddItemToArray(cJSON_AddArrayToObject(delta, "tool_calls"), call);
    cJSON_AddNullToObject(choice, "logprobs");
    cJSON_AddNullToObject(choice, "finish_reason");
    cJSON_AddItemToArray(choices, choice);
    if (q->include_usage) cJSON_AddNullToObject(o, "usage");
    sse_event(q, o);
}

/* A streamed tool-calling answer's text, as it comes (NULL at the end:
 * what is still held goes out, and finish becomes tool_calls or, for a
 * named function, stop when the answer was calls). */
static void stream_tool_text(req_t *q, const loom_chunk_t *ch, const char **finish) {
    if (!q->ts) q->ts = loom_tstream_create(&q->tools, chat_family(q), tool_event, q);
    if (!finish) {
        loom_tstream_feed(q->ts, ch->text, ch->text_len);
        return;
    }
    if (loom_tstream_finish(q->ts, ch->finish == LOOM_FINISH_STOP) > 0)
        *finish = q->tools.mode == LOOM_TOOLS_NAMED ? "stop" : "tool_calls";
}

/* Turns one coordinator chunk into SSE events in q->out. */
static void stream_chunk(req_t *q, const loom_chunk_t *ch) {
    uint64_t t0 = loom_now_ns();
    if (ch->n_ids > 0 || ch->text_len > 0) {
        /* (not with tools: content may go out a chunk or more after its tokens) */
        cJSON *lp = q->logprobs && ch->has_logprobs && q->tools.mode == LOOM_TOOLS_OFF ? cJSON_CreateObject() : NULL;
        if (lp) {
            add_logprobs(q, lp, ch);
            q->lp_json = cJSON_PrintUnformatted(lp);
            cJSON_Delete(lp);
        }
        if (q->tools.mode != LOOM_TOOLS_OFF) stream_tool_text(q, ch, NULL);
        else sse_choice(q, ch->text, ch->text_len, 0, NULL);
        free(q->lp_json);
        q->lp_json = NULL;
    }
    q->send_ns += loom_now_ns() - t0;
    if (!ch->final) return;
    take_timings(q, ch);
    q->finished = 1;
    if (ch->status != LOOM_OK) {
        /* the stream broke after it began (a worker lost, the coordinator
         * going away): an error event, then [DONE] so every client stops reading */
        unsigned http;
        const char *type, *code;
        status_http(ch->status, &http, &type, &code);
        sse_event(q, error_obj(ch->message && ch->message[0] ? ch->message : loom_status_str(ch->status), type, NULL,
                               code));
        LOOM_WARN("http: %s %s: stream %s failed: %s", q->method, q->path, q->id, ch->message);
        loom_sbuf_str(&q->out, "data: [DONE]\n\n");
        return;
    }
    const char *finish = finish_name(ch->finish);
    if (q->tools.mode != LOOM_TOOLS_OFF) stream_tool_text(q, ch, &finish);
    sse_choice(q, NULL, 0, 0, finish);
    if (q->include_usage) {
        cJSON *o = head_obj(q, q->chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddArrayToObject(o, "choices");
        cJSON_AddItemToObject(o, "usage", usage_obj(ch));
        sse_event(q, o);
    }
    loom_sbuf_str(&q->out, "data: [DONE]\n\n");
}

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    req_t *q = cls;
    while (q->out_off >= q->out.len) {
        q->out.len = q->out_off = 0;
        if (q->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        uint64_t t = loom_now_ns();
        loom_chunk_t ch;
        if (!next_chunk(q, &ch)) return MHD_CONTENT_READER_END_WITH_ERROR;
        stream_chunk(q, &ch);
        if (loom_now_ns() - t > 1000000000ull) refresh_timeout(q);
    }
    size_t n = LOOM_MIN(max, q->out.len - q->out_off);
    memcpy(buf, q->out.p + q->out_off, n);
    q->out_off += n;
    return (ssize_t)n;
}

static enum MHD_Result finish_collected(req_t *q, const loom_chunk_t *ch) {
    cJSON *o = head_obj(q, q->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    char *t = text_dup(q->text.p ? q->text.p : "", q->text.len);
    const char *finish = finish_name(ch->finish);
    if (q->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        char *rest = NULL;
        cJSON *calls = tool_calls_of(q, t, strlen(t), ch, &rest, &finish);
        if (calls) {
            if (rest) cJSON_AddStringToObject(m, "content", rest);
            else cJSON_AddNullToObject(m, "content");
            cJSON_AddItemToObject(m, "tool_calls", calls);
            free(rest);
        } else {
            cJSON_AddStringToObject(m, "content", t);
        }
    } else {
        cJSON_AddStringToObject(c, "text", t);
    }
    free(t);
    if (q->logprobs) { /* asked for: an object even when no token came */
        cJSON *lp = q->lp_acc ? q->lp_acc : cJSON_CreateObject();
        q->lp_acc = NULL;
        if (q->chat) {
            arr_of(lp, "content");
            cJSON_AddNullToObject(lp, "refusal");
        } else {
            arr_of(lp, "tokens"), arr_of(lp, "token_logprobs"), arr_of(lp, "top_logprobs"), arr_of(lp, "text_offset");
        }
        cJSON_AddItemToObject(c, "logprobs", lp);
    } else {
        cJSON_AddNullToObject(c, "logprobs");
    }
    cJSON_AddStringToObject(c, "finish_reason", finish);
    cJSON *plp = q->prompt_lp >= 0 ? (q->plp ? q->plp : cJSON_CreateArray()) : NULL;
    q->plp = NULL;
    if (plp && !q->chat) cJSON_AddItemToObject(c, "prompt_logprobs", plp); /* vLLM: the choice's */
    cJSON_AddItemToArray(choices, c);
    if (plp && q->chat) cJSON_AddItemToObject(o, "prompt_logprobs", plp); /* vLLM: the response's */
    cJSON_AddItemToObject(o, "usage", usage_obj(ch));
    take_timings(q, ch);
    if (q->has_timings) cJSON_AddItemToObject(o, "timings", timings_obj(q));
    return respond_json(q, MHD_HTTP_OK, o);
}

/* The text echo puts before a choice: the prompt string, or its token ids
 * decoded (special tokens left out). */
static void add_echo(const req_t *q, loom_sbuf_t *b, const char *text, const int32_t *ids, int n_ids) {
    if (text) {
        loom_sbuf_str(b, text);
    } else if (q->h->tok && n_ids > 0) {
        size_t len = 0;
        char *t = loom_tokenizer_decode(q->h->tok, ids, n_ids, 1, &len);
        if (t) loom_sbuf_add(b, t, len);
        free(t);
    }
}

/* ---- several choices: n > 1 and batched prompts ---- */

typedef struct choice {
    uint64_t gen_id;
    int done;
    loom_sbuf_t text;
    cJSON *lp;
    size_t lp_offset;
    cJSON *plp; /* prompt_logprobs */
    loom_finish_t finish;
    int prompt_tokens, completion_tokens, cached_tokens;
} choice_t;

/* Cancels every unfinished choice and drops the connection's client (what
 * abandon does for one). */
static void abandon_multi(req_t *q, choice_t *cs, int n) {
    loom_client_t *c = q->conn->client;
    q->active = 0;
    if (!c) return;
    loom_err_t err = {0};
    for (int i = 0; i < n; i++)
        if (cs[i].gen_id && !cs[i].done) loom_client_cancel(c, cs[i].gen_id, &err);
    loom_client_close(&q->conn->client);
}

/* Each (prompt i, choice j) is one generation on the coordinator, with the
 * seed (when given) mixed with j so that the n choices differ and a seed
 * still gives the same answer; they run concurrently (the prefix cache
 * shares the prompt's full blocks once computed). Answered without
 * streaming; usage counts each prompt once. */
static enum MHD_Result handle_multi(req_t *q, gen_t *g) {
    int n_prompts = g->n_batch > 1 ? g->n_batch : 1, n = n_prompts * g->n;
    choice_t *cs = loom_xcalloc((size_t)n, sizeof *cs);
    enum MHD_Result res;
    loom_err_t err = {0};
    q->active = 1;
    q->counted = 1;
    atomic_fetch_add(&q->h->generating, 1);
    for (int i = 0; i < n; i++) {
        loom_gen_params_t p = g->p;
        int pi = i / g->n, j = i % g->n;
        if (g->n_batch > 1) {
            p.prompt = g->batch_text[pi];
            p.prompt_ids = g->batch_ids[pi];
            p.n_prompt_ids = g->batch_n_ids[pi];
        }
        if (p.has_seed && j > 0) p.seed ^= mix64((uint64_t)j);
        if (q->echo) add_echo(q, &cs[i].text, p.prompt, p.prompt_ids, p.n_prompt_ids);
        if (loom_client_submit(q->conn->client, &p, &cs[i].gen_id, &err) < 0) {
            abandon_multi(q, cs, i);
            res = respond_status(q, err.code, err.msg);
            goto done;
        }
    }
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    int left = n;
    loom_status_t fail = LOOM_OK;
    char fail_msg[600] = "";
    while (left > 0) {
        if (atomic_load(&q->h->stopping) || peer_gone(q)) {
            abandon_multi(q, cs, n);
            res = MHD_NO;
            goto done;
        }
        loom_chunk_t ch;
        int got = 0;
        if (loom_client_poll(q->conn->client, SLICE_MS, &ch, &got, &err) < 0) {
            abandon_multi(q, cs, n);
            res = respond_status(q, err.code, err.msg);
            goto done;
        }
        if (!got) continue;
        int i = 0;
        while (i < n && cs[i].gen_id != ch.request_id) i++;
        if (i == n || cs[i].done) continue;
        choice_t *c = &cs[i];
        if (ch.n_prompt_ids > 0) {
            if (q->echo && q->logprobs) {
                if (!c->lp) c->lp = cJSON_CreateObject();
                add_echo_logprobs(q, c->lp, &ch, c->text.len);
                c->lp_offset = q->lp_offset;
            }
            if (q->prompt_lp >= 0 && !c->plp) c->plp = prompt_lp_json(q, &ch);
        }
        loom_sbuf_add(&c->text, ch.text, ch.text_len);
        if (q->logprobs && ch.has_logprobs) {
            if (!c->lp) c->lp = cJSON_CreateObject();
            q->lp_offset = c->lp_offset;
            add_logprobs(q, c->lp, &ch);
            c->lp_offset = q->lp_offset;
        }
        if (!ch.final) continue;
        c->done = 1;
        left--;
        c->finish = ch.finish;
        c->prompt_tokens = ch.prompt_tokens;
        c->completion_tokens = ch.completion_tokens;
        c->cached_tokens = ch.cached_tokens;
        if (ch.status != LOOM_OK && fail == LOOM_OK) {
            fail = ch.status;
            snprintf(fail_msg, sizeof fail_msg, "%s", ch.message ? ch.message : "");
        }
    }
    q->active = 0;
    refresh_timeout(q);
    if (fail != LOOM_OK) {
        res = respond_status(q, fail, fail_msg);
        goto done;
    }
    cJSON *o = head_obj(q, q->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    loom_chunk_t usage = {0};
    for (int i = 0; i < n; i++) {
        cJSON *c = cJSON_CreateObject();
        cJSON_AddNumberToObject(c, "index", i);
        char *t = text_dup(cs[i].text.p ? cs[i].text.p : "", cs[i].text.len);
        if (q->chat) {
            cJSON *m = cJSON_AddObjectToObject(c, "message");
            cJSON_AddStringToObject(m, "role", "assistant");
            cJSON_AddStringToObject(m, "content", t);
        } else {
            cJSON_AddStringToObject(c, "text", t);
        }
        free(t);
        if (q->logprobs) {
            cJSON *lp = cs[i].lp ? cs[i].lp : cJSON_CreateObject();
            cs[i].lp = NULL;
            if (q->chat) {
                arr_of(lp, "content");
                cJSON_AddNullToObject(lp, "refusal");
            } else {
                arr_of(lp, "tokens"), arr_of(lp, "token_logprobs"), arr_of(lp, "top_logprobs"),
                    arr_of(lp, "text_offset");
            }
            cJSON_AddItemToObject(c, "logprobs", lp);
        } else {
            cJSON_AddNullToObject(c, "logprobs");
        }
        cJSON_AddStringToObject(c, "finish_reason", finish_name(cs[i].finish));
        if (q->prompt_lp >= 0 && !q->chat) {
            cJSON_AddItemToObject(c, "prompt_logprobs", cs[i].plp ? cs[i].plp : cJSON_CreateArray());
            cs[i].plp = NULL;
        }
        cJSON_AddItemToArray(choices, c);
        if (i % g->n == 0) { /* the prompt once per prompt */
            usage.prompt_tokens += cs[i].prompt_tokens;
            usage.cached_tokens += cs[i].cached_tokens;
        }
        usage.completion_tokens += cs[i].completion_tokens;
    }
    if (q->prompt_lp >= 0 && q->chat) { /* one prompt: the response's */
        cJSON_AddItemToObject(o, "prompt_logprobs", cs[0].plp ? cs[0].plp : cJSON_CreateArray());
        cs[0].plp = NULL;
    }
    cJSON_AddItemToObject(o, "usage", usage_obj(&usage));
    res = respond_json(q, MHD_HTTP_OK, o);
done:
    for (int i = 0; i < n; i++) {
        free(cs[i].text.p);
        cJSON_Delete(cs[i].lp);
        cJSON_Delete(cs[i].plp);
    }
    free(cs);
    return res;
}

/* ---- generation ---- */

static enum MHD_Result handle_generate(req_t *q) {
    loom_http_t *h = q->h;
    q->chat = q->route == R_CHAT;
    char msg[600];
    cJSON *root = loom_http_parse_json_body(q->body.p, q->body.len, msg, sizeof msg);
    if (!root) return respond_error(q, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    enum MHD_Result res;
    gen_t g = {0};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    if (q->chat && !h->tmpl) {
        res = respond_error(q, 400, "invalid_request_error", "messages", "no_chat_template",
                            "this model has no chat template; start the coordinator with --chat-template NAME (%s), "
                            "or use /v1/completions",
                            LOOM_CHAT_FAMILY_NAMES);
        goto done;
    }
    if (parse_common(q, root, &g, &e) < 0 ||
        (q->chat ? parse_messages(h->tmpl, h->tok, h->special_in_content, root, &g, &e) : parse_prompt(root, &g, &e)) <
            0) {
        res = respond_error(q, 400, "invalid_request_error", e.param[0] ? e.param : NULL, NULL, "%s", e.msg);
        goto done;
    }
    if (ensure_client(q, &err) < 0 || served_model(q, &mi, &err) < 0) {
        res = respond_status(q, err.code, err.msg);
        goto done;
    }
    if (g.p.model && strcmp(g.p.model, mi.id) != 0) {
        res = respond_error(q, 404, "invalid_request_error", "model", "model_not_found",
                            "The model '%.300s' does not exist; this server serves '%s'", g.p.model, mi.id);
        goto done;
    }
    snprintf(q->model, sizeof q->model, "%s", mi.id);
    q->created = (long long)time(NULL);
    new_id(q);
    if (atomic_load(&q->h->draining)) {
        res = respond_status(q, LOOM_ERR_UNAVAILABLE, "draining: this coordinator is shutting down and admits no "
                                                      "new requests");
        goto done;
    }
    g.p.tag = q->xid;
    const char *session = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, "X-Session-Id");
    if (session && session[0]) g.p.session = session;
    const char *cc = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CACHE_CONTROL);
    if (cc && (strcasestr(cc, "no-cache") || strcasestr(cc, "no-store"))) g.p.no_cache = 1;
    if (g.tools.mode != LOOM_TOOLS_OFF && g.n > 1) {
        res = respond_error(q, 400, "invalid_request_error", "n", NULL, "tools are answered with n = 1 only");
        goto done;
    }
    if (g.n > 1 || g.n_batch > 1) {
        if (q->stream) {
            res = respond_error(q, 400, "invalid_request_error", g.n > 1 ? "n" : "prompt", NULL,
                                "n > 1 and batched prompts are answered without streaming: set stream to false");
            goto done;
        }
        res = handle_multi(q, &g);
        goto done;
    }
    if (loom_client_submit(q->conn->client, &g.p, &q->gen_id, &err) < 0) {
        res = respond_status(q, err.code, err.msg);
        goto done;
    }
    q->active = 1;
    q->counted = 1;
    q->tok_ns = g.tok_ns;
    keep_tools(q, &g);
    atomic_fetch_add(&q->h->generating, 1);
    if (q->echo) add_echo(q, &q->text, g.p.prompt, g.p.prompt_ids, g.p.n_prompt_ids); /* the choice starts so */
    cJSON_Delete(root);
    root = NULL;
    gen_free(&g);
    memset(&g, 0, sizeof g);
    /* no client timeout while the coordinator works: silence is ours, not the peer's */
    MHD_set_connection_option(q->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);

    loom_chunk_t ch;
    if (!next_chunk(q, &ch)) {
        abandon(q);
        return MHD_NO;
    }
    if (ch.final && ch.status != LOOM_OK) {
        refresh_timeout(q);
        q->retry_after_ms = ch.retry_after_ms;
        return respond_status(q, ch.status, ch.message);
    }
    if (q->stream) {
        if (q->chat) sse_choice(q, "", 0, 1, NULL);
        if (q->text.len || ch.n_prompt_ids > 0) { /* echo, with the prompt's logprobs when asked */
            if (q->logprobs && ch.n_prompt_ids > 0) {
                cJSON *lp = cJSON_CreateObject();
                add_echo_logprobs(q, lp, &ch, q->text.len);
                q->lp_json = cJSON_PrintUnformatted(lp);
                cJSON_Delete(lp);
            }
            sse_choice(q, q->text.p, q->text.len, 0, NULL);
            free(q->lp_json);
            q->lp_json = NULL;
        }
        stream_chunk(q, &ch);
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, SSE_BLOCK, sse_read, q, NULL);
        if (!r) {
            abandon(q);
            return MHD_NO;
        }
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        MHD_add_response_header(r, "X-Request-Id", q->xid);
        if (q->ignored[0]) MHD_add_response_header(r, "X-Loom-Ignored-Fields", q->ignored);
        refresh_timeout(q);
        res = MHD_queue_response(q->mc, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        q->status = MHD_HTTP_OK;
        return res;
    }
    for (;;) {
        uint64_t t0 = loom_now_ns();
        if (ch.n_prompt_ids > 0) {
            if (q->echo && q->logprobs) {
                if (!q->lp_acc) q->lp_acc = cJSON_CreateObject();
                add_echo_logprobs(q, q->lp_acc, &ch, q->text.len);
            }
            if (q->prompt_lp >= 0 && !q->plp) q->plp = prompt_lp_json(q, &ch);
        }
        loom_sbuf_add(&q->text, ch.text, ch.text_len);
        if (q->logprobs && ch.has_logprobs) {
            if (!q->lp_acc) q->lp_acc = cJSON_CreateObject();
            add_logprobs(q, q->lp_acc, &ch);
        }
        q->send_ns += loom_now_ns() - t0;
        if (ch.final) break;
        if (!next_chunk(q, &ch)) {
            abandon(q);
            return MHD_NO;
        }
    }
    refresh_timeout(q);
    if (ch.status != LOOM_OK) return respond_status(q, ch.status, ch.message);
    return finish_collected(q, &ch);
done:
    cJSON_Delete(root);
    gen_free(&g);
    return res;
}

/* ---- the other routes ---- */

static cJSON *model_obj(const loom_http_t *h, const loom_model_info_t *m) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", m->id);
    cJSON_AddStringToObject(o, "object", "model");
    cJSON_AddNumberToObject(o, "created", (double)h->started);
    cJSON_AddStringToObject(o, "owned_by", "loom");
    cJSON_AddNumberToObject(o, "max_model_len", m->context_length);
    cJSON_AddNumberToObject(o, "vocab_size", m->vocab_size);
    return o;
}

static enum MHD_Result handle_models(req_t *q, const char *one) {
    loom_model_info_t m;
    loom_err_t err = {0};
    if (served_model(q, &m, &err) < 0) return respond_status(q, err.code, err.msg);
    if (one) {
        if (strcmp(one, m.id) != 0)
            return respond_error(q, 404, "invalid_request_error", "model", "model_not_found",
                                 "The model '%.300s' does not exist; this server serves '%s'", one, m.id);
        return respond_json(q, MHD_HTTP_OK, model_obj(q->h, &m));
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON_AddItemToArray(data, model_obj(q->h, &m));
    return respond_json(q, MHD_HTTP_OK, o);
}

static enum MHD_Result handle_health(req_t *q) {
    loom_health_t hl;
    loom_err_t err = {0};
    loom_client_t *c = NULL;
    if (atomic_load(&q->h->draining)) { /* the reactor is gone or going */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", "unavailable");
        cJSON_AddStringToObject(o, "state", "draining");
        cJSON_AddStringToObject(o, "message", "draining: shutting down");
        return respond_json(q, MHD_HTTP_SERVICE_UNAVAILABLE, o);
    }
    loom_status_t st = probe_client(q->h, &c, &err);
    if (st == LOOM_OK) st = loom_client_health(c, &hl, &err);
    loom_client_close(&c);
    cJSON *o = cJSON_CreateObject();
    if (st < 0) {
        cJSON_AddStringToObject(o, "status", "unavailable");
        cJSON_AddStringToObject(o, "message", err.msg);
        return respond_json(q, MHD_HTTP_SERVICE_UNAVAILABLE, o);
    }
    cJSON_AddStringToObject(o, "status", hl.ready ? "ok" : "unavailable");
    cJSON_AddStringToObject(o, "state", hl.state);
    cJSON_AddNumberToObject(o, "workers_ready", hl.workers_ready);
    cJSON_AddNumberToObject(o, "workers_expected", hl.workers_expected);
    cJSON_AddStringToObject(o, "message", hl.message);
    return respond_json(q, hl.ready ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, o);
}

static enum MHD_Result handle_version(req_t *q) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "version", LOOM_VERSION);
    return respond_json(q, MHD_HTTP_OK, o);
}

/* The JSON object body of a POST, or NULL after answering 400. */
static cJSON *json_body(req_t *q, enum MHD_Result *res) {
    char msg[600];
    cJSON *root = loom_http_parse_json_body(q->body.p, q->body.len, msg, sizeof msg);
    if (!root) *res = respond_error(q, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    return root;
}

/* Only these fields, and "model" naming the served model. */
static int check_plain_fields(req_t *q, const cJSON *o, const char *const *names, size_t n, perr_t *e,
                              loom_model_info_t *mi, loom_err_t *err, int *status_err) {
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        size_t i = 0;
        while (i < n && strcmp(names[i], x->string) != 0) i++;
        if (i == n && strcmp(x->string, "model") != 0)
            return bad(e, x->string, "%.64s is not a field of %s", x->string, q->path);
    }
    if (served_model(q, mi, err) < 0) {
        *status_err = 1;
        return -1;
    }
    x = field(o, "model");
    if (x && (!cJSON_IsString(x) || (x->valuestring[0] && strcmp(x->valuestring, mi->id) != 0)))
        return bad(e, "model", "The model '%.300s' does not exist; this server serves '%s'",
                   cJSON_IsString(x) ? x->valuestring : "?", mi->id);
    return 0;
}

/* POST /tokenize {"prompt", "add_special_tokens"} or {"messages",
 * "add_generation_prompt"}: {"count", "max_model_len", "tokens"}, the ids
 * the coordinator would compute for that prompt (as in vLLM). */
static enum MHD_Result handle_tokenize(req_t *q) {
    enum MHD_Result res;
    cJSON *root = json_body(q, &res);
    if (!root) return res;
    static const char *const names[] = {"prompt", "add_special_tokens", "messages", "add_generation_prompt"};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    gen_t g = {0};
    int status_err = 0, r, add_special = 1;
    int32_t *ids = NULL;
    int n_ids = 0, cap = 0;
    if (check_plain_fields(q, root, names, LOOM_ARRAY_LEN(names), &e, &mi, &err, &status_err) < 0) {
        res = status_err ? respond_status(q, err.code, err.msg)
                         : respond_error(q, e.param[0] && !strcmp(e.param, "model") ? 404 : 400,
                                         "invalid_request_error", e.param, NULL, "%s", e.msg);
        goto done;
    }
    int chat = field(root, "messages") != NULL;
    if (chat && field(root, "prompt")) {
        res = respond_error(q, 400, "invalid_request_error", "prompt", NULL, "send either prompt or messages");
        goto done;
    }
    if (chat && !q->h->tmpl) {
        res = respond_error(q, 400, "invalid_request_error", "messages", "no_chat_template",
                            "this model has no chat template");
        goto done;
    }
    const char *text;
    if (chat) {
        if (parse_messages(q->h->tmpl, q->h->tok, q->h->special_in_content, root, &g, &e) < 0) goto bad_field;
        text = g.prompt;
        add_special = 0; /* the template wrote BOS and the special tokens */
    } else {
        const cJSON *p = field(root, "prompt");
        if (!cJSON_IsString(p)) {
            bad(&e, "prompt", "prompt must be a string");
            goto bad_field;
        }
        text = p->valuestring;
        if ((r = opt_bool(root, "add_special_tokens", &add_special, &e)) < 0) goto bad_field;
    }
    if (!q->h->tok) {
        res = respond_error(q, 503, "server_error", NULL, "service_unavailable", "no tokenizer loaded");
        goto done;
    }
    if (chat && g.p.prompt_ids) { /* encoded already, content as plain text */
        n_ids = (int)g.p.n_prompt_ids;
        ids = loom_xmalloc((size_t)(n_ids > 0 ? n_ids : 1) * sizeof *ids);
        memcpy(ids, g.p.prompt_ids, (size_t)n_ids * sizeof *ids);
    } else if (loom_tokenizer_encode(q->h->tok, text, strlen(text), add_special, !add_special, &ids, &n_ids, &cap,
                                     &err) < 0) {
        res = respond_error(q, 400, "invalid_request_error", chat ? "messages" : "prompt", NULL,
                            "cannot tokenize: %s", err.msg);
        goto done;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", n_ids);
    cJSON_AddNumberToObject(o, "max_model_len", mi.context_length);
    cJSON *arr = cJSON_AddArrayToObject(o, "tokens");
    for (int i = 0; i < n_ids; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    res = respond_json(q, MHD_HTTP_OK, o);
    goto done;
bad_field:
    res = respond_error(q, 400, "invalid_request_error", e.param[0] ? e.param : NULL, NULL, "%s", e.msg);
done:
    free(ids);
    gen_free(&g);
    cJSON_Delete(root);
    return res;
}

/* POST /detokenize {"tokens": [ids]}: {"prompt": text}, special tokens
 * written out (as in vLLM). */
static enum MHD_Result handle_detokenize(req_t *q) {
    enum MHD_Result res;
    cJSON *root = json_body(q, &res);
    if (!root) return res;
    static const char *const names[] = {"tokens"};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    int status_err = 0;
    int32_t *ids = NULL;
    if (check_plain_fields(q, root, names, LOOM_ARRAY_LEN(names), &e, &mi, &err, &status_err) < 0) {
        res = status_err ? respond_status(q, err.code, err.msg)
                         : respond_error(q, e.param[0] && !strcmp(e.param, "model") ? 404 : 400,
                                         "invalid_request_error", e.param, NULL, "%s", e.msg);
        goto done;
    }
    const cJSON *t = field(root, "tokens");
    if (!cJSON_IsArray(t)) {
        res = respond_error(q, 400, "invalid_request_error", "tokens", NULL, "tokens must be an array of token ids");
        goto done;
    }
    int n = cJSON_GetArraySize(t), k = 0;
    ids = loom_xmalloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    const cJSON *x;
    cJSON_ArrayForEach(x, t) {
        if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) || x->valuedouble < 0 ||
            x->valuedouble >= mi.vocab_size) {
            res = respond_error(q, 400, "invalid_request_error", "tokens", NULL,
                                "tokens[%d] is not a token id in [0, %d)", k, mi.vocab_size);
            goto done;
        }
        ids[k++] = (int32_t)x->valuedouble;
    }
    if (!q->h->tok) {
        res = respond_error(q, 503, "server_error", NULL, "service_unavailable", "no tokenizer loaded");
        goto done;
    }
    size_t text_len = 0;
    char *text = loom_tokenizer_decode(q->h->tok, ids, n, 0, &text_len);
    if (!text) {
        res = respond_error(q, 500, "server_error", NULL, "internal_error", "cannot decode these tokens");
        goto done;
    }
    cJSON *o = cJSON_CreateObject();
    char *clean = text_dup(text, text_len);
    cJSON_AddStringToObject(o, "prompt", clean);
    free(clean);
    free(text);
    res = respond_json(q, MHD_HTTP_OK, o);
done:
    free(ids);
    cJSON_Delete(root);
    return res;
}

static enum MHD_Result handle_metrics(req_t *q) {
    size_t len = 0;
    char *text = q->h->srv ? loom_metrics_render(loom_server_metrics(q->h->srv), &len)
                           : q->h->metrics_fn ? q->h->metrics_fn(q->h->metrics_ctx, &len) : NULL;
    if (!text) return respond_error(q, 500, "server_error", NULL, "internal_error", "cannot render the metrics");
    return respond(q, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len);
}

/* ---- MHD callbacks ---- */

/* The request's Bearer key (NULL: none). */
static const char *bearer(const req_t *q) {
    const char *a = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) return NULL;
    a += 7;
    while (*a == ' ') a++;
    return a[0] ? a : NULL;
}

static int authorized(const req_t *q, int *given) {
    const char *key = q->h->api_key;
    const char *a = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    *given = a != NULL;
    if (!key) return 1;
    if (q->h->forward_api_keys && (q->route == R_COMPLETIONS || q->route == R_CHAT) && bearer(q))
        return 1; /* the router decides */
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) return 0;
    a += 7;
    while (*a == ' ') a++;
    return loom_secret_equal(key, strlen(key), a, strlen(a));
}

/* ---- /v1/embeddings ---- */

#define MAX_EMBED_INPUTS 2048 /* as the coordinator's Embed */

/* One input of /v1/embeddings: a string, or an array of token ids. */
static int embed_input(const cJSON *x, int i, loom_embed_input_t *in, int32_t **owned, perr_t *e) {
    if (cJSON_IsString(x)) {
        if (!x->valuestring[0]) return bad(e, "input", "input %d is an empty string", i);
        in->text = x->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(x)) return bad(e, "input", "input %d must be a string or an array of token ids", i);
    int n = cJSON_GetArraySize(x);
    if (n == 0) return bad(e, "input", "input %d is an empty list of token ids", i);
    int32_t *ids = loom_xmalloc((size_t)n * sizeof *ids);
    int k = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, x) {
        if (!is_token_id(t)) {
            free(ids);
            return bad(e, "input", "input %d: token ids must be non-negative integers", i);
        }
        ids[k++] = (int32_t)t->valuedouble;
    }
    *owned = ids;
    in->ids = ids;
    in->n_ids = n;
    return 0;
}

/* OpenAI's input: a string, an array of strings, an array of token ids, or
 * an array of token-id arrays. Returns the number of inputs, -1 on error. */
static int embed_inputs(const cJSON *x, loom_embed_input_t **ins, int32_t ***owned, int *n_alloc, perr_t *e) {
    *ins = NULL;
    *owned = NULL;
    *n_alloc = 0;
    if (!x || cJSON_IsNull(x)) return bad(e, "input", "input is required");
    int n = 1, flat = !cJSON_IsArray(x) || (cJSON_GetArraySize(x) > 0 && cJSON_IsNumber(cJSON_GetArrayItem(x, 0)));
    if (!flat) n = cJSON_GetArraySize(x);
    if (n == 0) return bad(e, "input", "input is empty: give a string, token ids, or a non-empty list of them");
    if (n > MAX_EMBED_INPUTS)
        return bad(e, "input", "input has %d items; at most %d are allowed", n, MAX_EMBED_INPUTS);
    *ins = loom_xcalloc((size_t)n, sizeof **ins);
    *owned = loom_xcalloc((size_t)n, sizeof **owned);
    *n_alloc = n;
    if (flat) return embed_input(x, 0, &(*ins)[0], &(*owned)[0], e) < 0 ? -1 : 1;
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, x) {
        if (embed_input(it, i, &(*ins)[i], &(*owned)[i], e) < 0) return -1;
        i++;
    }
    return n;
}

/* POST /v1/embeddings {"input", "model", "encoding_format", "dimensions",
 * "user"}: OpenAI's list of embeddings (float arrays, or base64 of the
 * little-endian float32 values), computed by the coordinator's Embed. */
static enum MHD_Result handle_embeddings(req_t *q) {
    enum MHD_Result res;
    cJSON *root = json_body(q, &res);
    if (!root) return res;
    static const char *const known[] = {"input", "model", "encoding_format", "dimensions", "user"};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    loom_embed_input_t *ins = NULL;
    int32_t **owned = NULL;
    int n = 0, n_alloc = 0, b64 = 0;
    double dims = 0;
    loom_embed_result_t out = {0};
    if (!cJSON_IsObject(root)) {
        res = respond_error(q, 400, "invalid_request_error", NULL, NULL, "the body must be a JSON object");
        goto done;
    }
    const cJSON *x;
    cJSON_ArrayForEach(x, root) {
        size_t i = 0;
        while (i < LOOM_ARRAY_LEN(known) && strcmp(known[i], x->string) != 0) i++;
        if (i == LOOM_ARRAY_LEN(known)) ignore_field(q, x->string);
    }
    if (served_model(q, &mi, &err) < 0) {
        res = respond_status(q, err.code, err.msg);
        goto done;
    }
    x = field(root, "model");
    if (x && !cJSON_IsNull(x) && (!cJSON_IsString(x) || (x->valuestring[0] && strcmp(x->valuestring, mi.id) != 0))) {
        res = respond_error(q, 404, "invalid_request_error", "model", "model_not_found",
                            "The model '%.300s' does not exist; this server serves '%s'",
                            cJSON_IsString(x) ? x->valuestring : "?", mi.id);
        goto done;
    }
    x = field(root, "encoding_format");
    if (x && !cJSON_IsNull(x)) {
        if (!cJSON_IsString(x) || (strcmp(x->valuestring, "float") && strcmp(x->valuestring, "base64"))) {
            bad(&e, "encoding_format", "encoding_format must be \"float\" or \"base64\"");
            goto bad_field;
        }
        b64 = !strcmp(x->valuestring, "base64");
    }
    if (opt_int(root, "dimensions", 1, 1 << 20, &dims, &e) < 0) goto bad_field;
    if ((n = embed_inputs(field(root, "input"), &ins, &owned, &n_alloc, &e)) < 0) goto bad_field;
    if (ensure_client(q, &err) < 0 || loom_client_embed(q->conn->client, NULL, ins, n, q->xid, &out, &err) < 0) {
        if (err.code == LOOM_ERR_INVALID_ARGUMENT)
            res = respond_error(q, 400, "invalid_request_error", "input", NULL, "%s", err.msg);
        else res = respond_status(q, err.code, err.msg);
        goto done;
    }
    if (dims > 0 && (int)dims != out.dim) {
        bad(&e, "dimensions", "dimensions %d is not supported: this model's embeddings have %d", (int)dims, out.dim);
        goto bad_field;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    char *b = b64 ? loom_xmalloc(4 * (((size_t)out.dim * 4 + 2) / 3) + 1) : NULL;
    for (int i = 0; i < out.n; i++) {
        const float *v = out.values + (size_t)i * out.dim;
        cJSON *d = cJSON_CreateObject();
        cJSON_AddStringToObject(d, "object", "embedding");
        cJSON_AddNumberToObject(d, "index", i);
        if (b64) {
            uint8_t *le = loom_xmalloc((size_t)out.dim * 4);
            for (int j = 0; j < out.dim; j++) {
                uint32_t u;
                memcpy(&u, &v[j], 4);
                for (int k = 0; k < 4; k++) le[(size_t)j * 4 + k] = (uint8_t)(u >> (8 * k));
            }
            loom_b64_encode(le, (size_t)out.dim * 4, b);
            free(le);
            cJSON_AddStringToObject(d, "embedding", b);
        } else {
            cJSON *arr = cJSON_AddArrayToObject(d, "embedding");
            for (int j = 0; j < out.dim; j++) cJSON_AddItemToArray(arr, cJSON_CreateNumber((double)v[j]));
        }
        cJSON_AddItemToArray(data, d);
    }
    free(b);
    cJSON_AddStringToObject(o, "model", mi.id);
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", out.prompt_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", out.prompt_tokens);
    res = respond_json(q, MHD_HTTP_OK, o);
    goto done;
bad_field:
    res = respond_error(q, 400, "invalid_request_error", e.param[0] ? e.param : NULL, NULL, "%s", e.msg);
done:
    for (int i = 0; i < n_alloc; i++) free(owned[i]);
    free(owned);
    free(ins);
    loom_embed_result_free(&out);
    cJSON_Delete(root);
    return res;
}

static const struct {
    const char *path;
    route_t route;
    int post, open;
} k_routes[] = {
    {"/v1/completions", R_COMPLETIONS, 1, 0},
    {"/v1/chat/completions", R_CHAT, 1, 0},
    {"/v1/models", R_MODELS, 0, 0},
    {"/health", R_HEALTH, 0, 1},
    {"/metrics", R_METRICS, 0, 1},
    {"/tokenize", R_TOKENIZE, 1, 0},
    {"/detokenize", R_DETOKENIZE, 1, 0},
    {"/version", R_VERSION, 0, 1},
    {"/v1/embeddings", R_EMBEDDINGS, 1, 0},
};

/* Routes a request on its first call; a body over the limit is refused
 * then, before it is read (MHD closes the connection after the answer). */
static enum MHD_Result on_headers(req_t *q, const char *url) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_routes); i++)
        if (!strcmp(url, k_routes[i].path)) q->route = k_routes[i].route;
    if (q->route == R_NONE && !strncmp(url, "/v1/models/", 11) && url[11]) q->route = R_MODEL;
    int post = q->route == R_COMPLETIONS || q->route == R_CHAT || q->route == R_TOKENIZE || q->route == R_DETOKENIZE ||
               q->route == R_EMBEDDINGS;
    if (post && !strcmp(q->method, "POST")) {
        const char *cl = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            unsigned long long n = strtoull(cl, &end, 10);
            if (*end == '\0' && n > q->h->max_body)
                return respond_error(q, 413, "invalid_request_error", NULL, "request_too_large",
                                     "the request body is %llu bytes; this server accepts at most %zu", n,
                                     q->h->max_body);
        }
    }
    return MHD_YES;
}

/* The last call, with the whole body read: answers the request. */
static enum MHD_Result dispatch(req_t *q) {
    const char *url = q->path, *method = q->method;
    loom_http_guard_serving(q->h->guard, q->conn->slot);
    if (q->conn->probe && q->route != R_HEALTH && q->route != R_METRICS && q->route != R_VERSION)
        return respond_error(q, 404, "invalid_request_error", NULL, "not_found",
                             "Invalid URL (%s %.200s): this is the probe listener, serving only /health, /metrics "
                             "and /version",
                             method, url);
    if (q->route == R_NONE)
        return respond_error(q, 404, "invalid_request_error", NULL, "not_found", "Invalid URL (%s %.200s)", method,
                             url);
    int post = 0, open = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_routes); i++)
        if (k_routes[i].route == q->route) {
            post = k_routes[i].post;
            open = k_routes[i].open;
        }
    int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), is_post = !strcmp(method, "POST");
    if (post ? !is_post : !is_get) {
        q->allow = post ? "POST" : "GET, HEAD";
        return respond_error(q, 405, "invalid_request_error", NULL, "method_not_allowed",
                             "Method %s is not allowed for %.200s (use %s)", method, url, q->allow);
    }
    int given = 0;
    if (!open && !authorized(q, &given)) {
        q->www_auth = 1;
        if (!given)
            return respond_error(q, 401, "invalid_request_error", NULL, "invalid_api_key",
                                 "You didn't provide an API key. You need to provide your API key in an "
                                 "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).");
        return respond_error(q, 401, "invalid_request_error", NULL, "invalid_api_key", "Incorrect API key provided.");
    }
    if (q->too_big)
        return respond_error(q, 413, "invalid_request_error", NULL, "request_too_large",
                             "the request body is over %zu bytes, the most this server accepts", q->h->max_body);
    switch (q->route) {
    case R_COMPLETIONS:
    case R_CHAT: return handle_generate(q);
    case R_HEALTH: return handle_health(q);
    case R_METRICS: return handle_metrics(q);
    case R_MODELS: return handle_models(q, NULL);
    case R_MODEL: return handle_models(q, url + 11);
    case R_TOKENIZE: return handle_tokenize(q);
    case R_DETOKENIZE: return handle_detokenize(q);
    case R_VERSION: return handle_version(q);
    case R_EMBEDDINGS: return handle_embeddings(q);
    default: return MHD_NO;
    }
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    listener_t *l = cls;
    loom_http_t *h = l->h;
    req_t *q = *con_cls;
    if (!q) {
        q = loom_xcalloc(1, sizeof *q);
        q->h = h;
        q->prompt_lp = -1;
        q->mc = mc;
        q->t0 = loom_now_ns();
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        q->conn = ci ? ci->socket_context : NULL;
        snprintf(q->method, sizeof q->method, "%s", method);
        snprintf(q->path, sizeof q->path, "%s", url);
        *con_cls = q;
        take_request_id(q);
        loom_log_set_request(q->xid); /* this connection's thread serves this request now */
        if (!q->conn) return MHD_NO;
        loom_http_guard_headers_done(h->guard, q->conn->slot);
        if (q->conn->over_limit) {
            q->close_after = 1;
            return respond_error(q, 503, "server_error", NULL, "service_unavailable",
                                 "too many connections: this %s takes %d at a time; retry after %s s",
                                 l->probe ? "probe listener" : "server", l->max_conns, RETRY_AFTER_S);
        }
        return on_headers(q, url);
    }
    if (q->status) { /* answered already (413 before the body): drop the rest */
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (!q->too_big && q->body.len + n > h->max_body) {
            q->too_big = 1;
            q->discarded = q->body.len;
            free(q->body.p);
            q->body = (loom_sbuf_t){0};
        }
        if (q->too_big) {
            q->discarded += n;
            /* reading a huge body only to refuse it is bounded too */
            return q->discarded > 4 * h->max_body + ((size_t)1 << 20) ? MHD_NO : MHD_YES;
        }
        loom_sbuf_add(&q->body, upload, n);
        return MHD_YES;
    }
    return dispatch(q);
}

static void on_completed(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe) {
    req_t *q = *con_cls;
    if (!q) return;
    if (q->conn) loom_http_guard_next(q->h->guard, q->conn->slot); /* keep-alive: the next headers' clock */
    if (q->active) abandon(q); /* a stream cut short: the peer left, timed out, or we are stopping */
    if (q->counted) atomic_fetch_sub(&q->h->generating, 1);
    /* the access log: scrapes and probes only at debug level */
    int quiet = q->route == R_HEALTH || q->route == R_METRICS || q->route == R_VERSION;
    loom_log(quiet ? LOOM_LOG_DEBUG : LOOM_LOG_INFO, "http: %s %s -> %u in %.1f ms%s", q->method, q->path, q->status,
             (double)(loom_now_ns() - q->t0) / 1e6,
             toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? "" : " (terminated early)");
    loom_log_set_request(NULL);
    free(q->body.p);
    free(q->out.p);
    free(q->prefix.p);
    free(q->text.p);
    cJSON_Delete(q->lp_acc);
    cJSON_Delete(q->plp);
    loom_tools_free(&q->tools);
    cJSON_Delete(q->tools_req);
    loom_tstream_destroy(&q->ts);
    free(q);
    *con_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    listener_t *l = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_t *c = loom_xcalloc(1, sizeof *c);
        c->over_limit = atomic_fetch_add(&l->n_conns, 1) >= l->max_conns;
        c->probe = l->probe;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci) c->slot = loom_http_guard_add(l->h->guard, ci->connect_fd);
        *socket_context = c;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        conn_t *c = *socket_context;
        if (c) {
            loom_http_guard_remove(l->h->guard, &c->slot);
            loom_client_close(&c->client);
            free(c->client_key);
            atomic_fetch_sub(&l->n_conns, 1);
        }
        free(c);
        *socket_context = NULL;
    }
}

/* libmicrohttpd's own messages: start-up failures are warnings; once
 * serving, they are about single connections (a client that misbehaved or
 * left, which the gateway answers for itself) and go to the debug log. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    loom_http_t *h = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
    loom_log(atomic_load(&h->serving) ? LOOM_LOG_DEBUG : LOOM_LOG_WARN, "http: %s", msg);
}

/* ---- start / stop ---- */

/* "HOST:PORT", "[V6]:PORT", ":PORT" or "PORT" (loopback). */
static loom_status_t resolve_bind(const char *flag, const char *bind, struct sockaddr_storage *ss, socklen_t *len,
                                  int *v6, loom_err_t *err) {
    char host[256] = "127.0.0.1", port[16];
    const char *colon = strrchr(bind, ':');
    const char *p = colon ? colon + 1 : bind;
    if (colon) {
        const char *hs = bind, *he = colon;
        if (*hs == '[' && he > hs && he[-1] == ']') hs++, he--;
        if (he > hs) {
            if ((size_t)(he - hs) >= sizeof host)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: host name too long in '%s'", flag, bind);
            memcpy(host, hs, (size_t)(he - hs));
            host[he - hs] = '\0';
        }
    }
    char *end;
    long pn = strtol(p, &end, 10);
    if (!*p || *end || pn < 0 || pn > 65535)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s expects HOST:PORT (e.g. 127.0.0.1:8000), got '%s'",
                            flag, bind);
    snprintf(port, sizeof port, "%ld", pn);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0 || !ai)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%s: cannot resolve '%s': %s", flag, host,
                            gai_strerror(rc));
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *len = ai->ai_addrlen;
    *v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);
    return LOOM_OK;
}

/* Starts one listener's daemon on ss. TLS when h->tls holds a certificate
 * (the traffic listener only). */
static struct MHD_Daemon *start_daemon(loom_http_t *h, listener_t *l, struct sockaddr_storage *ss, int v6,
                                       unsigned conn_limit, int tls) {
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0) | (tls ? MHD_USE_TLS : 0);
    uint16_t port = ss->ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)ss)->sin6_port)
                                               : ntohs(((struct sockaddr_in *)ss)->sin_port);
    struct MHD_OptionItem extra[4];
    int n = 0;
    if (tls) {
        extra[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, h->tls.cert_pem};
        extra[n++] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, h->tls.key_pem};
    }
    if (!l->probe && h->per_ip > 0)
        extra[n++] = (struct MHD_OptionItem){MHD_OPTION_PER_IP_CONNECTION_LIMIT, h->per_ip, NULL};
    extra[n++] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    return MHD_start_daemon(flags, port, NULL, NULL, on_access, l,
                            MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)ss,
                            MHD_OPTION_CONNECTION_LIMIT, conn_limit,
                            MHD_OPTION_CONNECTION_TIMEOUT, h->idle_timeout_s,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, l,
                            MHD_OPTION_ARRAY, extra,
                            MHD_OPTION_END);
}

static int daemon_port(struct MHD_Daemon *d) {
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    return di ? di->port : 0;
}

loom_status_t loom_http_start(loom_server_t *srv, const loom_http_config_t *cfg, loom_http_t **out, loom_err_t *err) {
    loom_http_endpoint_t ep = {.zmq_context = loom_server_zmq_context(srv), .inproc_addr = loom_server_inproc_addr(srv)};
    LOOM_CHECK(loom_http_start_at(&ep, cfg, out, err));
    (*out)->srv = srv;
    return LOOM_OK;
}

loom_status_t loom_http_start_at(const loom_http_endpoint_t *ep, const loom_http_config_t *cfg, loom_http_t **out,
                                 loom_err_t *err) {
    *out = NULL;
    const char *bind = cfg->bind && cfg->bind[0] ? cfg->bind : DEFAULT_BIND;
    const char *probe_bind = cfg->probe_bind && cfg->probe_bind[0] ? cfg->probe_bind : NULL;
    struct sockaddr_storage ss, pss;
    socklen_t ss_len, pss_len;
    int v6 = 0, pv6 = 0;
    LOOM_CHECK(resolve_bind("--http", bind, &ss, &ss_len, &v6, err));
    if (probe_bind) LOOM_CHECK(resolve_bind("--probe-listen", probe_bind, &pss, &pss_len, &pv6, err));
    if (!MHD_is_feature_supported(MHD_FEATURE_TLS) && (cfg->tls_cert || cfg->tls_key))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "--tls-cert/--tls-key: this libmicrohttpd is built without TLS support");
    loom_http_tls_t tls = {0};
    if (cfg->tls_cert || cfg->tls_key) LOOM_CHECK(loom_http_tls_load(cfg->tls_cert, cfg->tls_key, &tls, err));
    loom_chat_template_t *tmpl = NULL;
    loom_status_t tst = cfg->model_dir ? loom_chat_template_load(cfg->model_dir, cfg->chat_template, &tmpl, err)
                                       : loom_chat_template_from_text(NULL, cfg->chat_template, NULL, NULL, &tmpl, err);
    if (tst < 0) {
        loom_http_tls_free(&tls);
        return tst;
    }

    loom_http_t *h = loom_xcalloc(1, sizeof *h);
    h->tmpl = tmpl;
    h->tls = tls;
    h->zctx = ep->zmq_context;
    snprintf(h->inproc, sizeof h->inproc, "%s", ep->inproc_addr);
    h->metrics_fn = ep->metrics;
    h->metrics_ctx = ep->metrics_ctx;
    snprintf(h->bind, sizeof h->bind, "%s", bind);
    h->api_key = cfg->api_key && cfg->api_key[0] ? loom_xstrdup(cfg->api_key) : NULL;
    h->forward_api_keys = cfg->forward_api_keys;
    h->max_body = cfg->max_body_bytes ? cfg->max_body_bytes : DEFAULT_MAX_BODY;
    h->idle_timeout_s = (unsigned)(cfg->idle_timeout_s > 0 ? cfg->idle_timeout_s : DEFAULT_IDLE_TIMEOUT_S);
    h->request_timeout_ms = cfg->request_timeout_ms > 0 ? cfg->request_timeout_ms : DEFAULT_REQUEST_TIMEOUT_MS;
    h->started = (long long)time(NULL);
    if (cfg->gen_defaults) h->gen = *cfg->gen_defaults;
    h->id_salt = loom_now_ns() ^ ((uint64_t)(uintptr_t)h << 16);
    h->per_ip = cfg->max_connections_per_ip > 0 ? cfg->max_connections_per_ip : 0;
    h->special_in_content = cfg->chat_special_in_content;
    pthread_mutex_init(&h->mu, NULL);
    h->traffic = (listener_t){.h = h, .probe = 0};
    h->traffic.max_conns = cfg->max_connections > 0 ? cfg->max_connections : DEFAULT_MAX_CONNECTIONS;
    h->probe = (listener_t){.h = h, .probe = 1, .max_conns = PROBE_MAX_CONNECTIONS};
    unsigned max_conn = (unsigned)h->traffic.max_conns + OVERFLOW_CONNECTIONS; /* the rest are answered 503 */
    int header_s = cfg->header_timeout_s ? cfg->header_timeout_s : DEFAULT_HEADER_TIMEOUT_S;
    int body_s = cfg->body_timeout_s ? cfg->body_timeout_s : DEFAULT_BODY_TIMEOUT_S;
    h->guard = loom_http_guard_create(header_s > 0 ? header_s * 1000 : 0, body_s > 0 ? body_s * 1000 : 0);
    if (!h->guard) {
        loom_http_stop(&h);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cannot start the HTTP read-deadline thread");
    }
    if (cfg->model_dir) {
        loom_err_t terr = {0};
        if (loom_tokenizer_load(cfg->model_dir, &h->tok, &terr) < 0)
            LOOM_WARN("http: no tokenizer for /tokenize and /detokenize: %s", terr.msg);
    }

    /* MHD's threads leave SIGINT/SIGTERM to the main thread */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    errno = 0;
    h->daemon = start_daemon(h, &h->traffic, &ss, v6, max_conn, h->tls.cert_pem != NULL);
    int e = errno;
    if (h->daemon && probe_bind) {
        errno = 0;
        h->probe_daemon =
            start_daemon(h, &h->probe, &pss, pv6, PROBE_MAX_CONNECTIONS + PROBE_OVERFLOW_CONNECTIONS, 0);
        e = errno;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!h->daemon || (probe_bind && !h->probe_daemon)) {
        loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cannot serve HTTP on %s: %s", h->daemon ? probe_bind : bind,
                     e ? strerror(e) : "libmicrohttpd could not start (see the log)");
        loom_http_stop(&h);
        return LOOM_ERR_UNAVAILABLE;
    }
    h->port = daemon_port(h->daemon);
    if (h->probe_daemon) h->probe_port = daemon_port(h->probe_daemon);
    atomic_store(&h->serving, 1);
    LOOM_INFO("HTTP gateway on %s (port %d, %s), chat template: %s%s", bind, h->port,
              h->tls.cert_pem ? "HTTPS" : "plain HTTP", tmpl ? loom_chat_family_name(tmpl->family) : "none",
              h->api_key ? ", API key required" : "");
    if (h->probe_daemon)
        LOOM_INFO("HTTP probe listener (/health, /metrics, /version) on %s (port %d)", probe_bind, h->probe_port);
    *out = h;
    return LOOM_OK;
}

int loom_http_port(const loom_http_t *h) { return h ? h->port : 0; }

int loom_http_probe_port(const loom_http_t *h) { return h ? h->probe_port : 0; }

void loom_http_drain(loom_http_t *h, int timeout_ms) {
    if (!h) return;
    atomic_store(&h->draining, 1);
    uint64_t deadline = loom_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (atomic_load(&h->generating) > 0 && loom_now_ns() < deadline) {
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
}

void loom_http_stop(loom_http_t **h_p) {
    if (!h_p || !*h_p) return;
    loom_http_t *h = *h_p;
    *h_p = NULL;
    atomic_store(&h->stopping, 1);
    if (h->probe_daemon) MHD_stop_daemon(h->probe_daemon);
    if (h->daemon) MHD_stop_daemon(h->daemon);
    uint64_t cut = loom_http_guard_n_closed(h->guard);
    if (cut) LOOM_INFO("http: %llu connection(s) were closed for missing their header or body deadline", (unsigned long long)cut);
    loom_http_guard_destroy(&h->guard);
    loom_http_tls_free(&h->tls);
    loom_chat_template_destroy(&h->tmpl);
    loom_tokenizer_destroy(&h->tok);
    pthread_mutex_destroy(&h->mu);
    free(h->api_key);
    free(h);
}
