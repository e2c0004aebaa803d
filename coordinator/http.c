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
 * with Retry-After, then closed, instead of being reset. */
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
#include "common/log.h"
#include "common/tokenizer.h"
#include "common/util.h"
#include "coordinator/metrics.h"

#define DEFAULT_BIND "127.0.0.1:8000"
#define DEFAULT_MAX_BODY ((size_t)2 << 20)
#define DEFAULT_MAX_CONNECTIONS 256
#define DEFAULT_IDLE_TIMEOUT_S 60
#define DEFAULT_REQUEST_TIMEOUT_MS 300000
#define SLICE_MS 100           /* longest wait before checking the peer and the stop flag */
#define CANCEL_WAIT_MS 2000    /* how long an abandoned request waits for its cancel to land */
#define PROBE_TIMEOUT_MS 3000  /* Health and ListModels: the reactor answers at once when it runs */
#define MAX_STOP 64            /* more is refused here; the coordinator allows fewer */
#define COMPLETIONS_DEFAULT_MAX_TOKENS 16 /* OpenAI's default for /v1/completions */
#define SSE_BLOCK 4096
#define OVERFLOW_CONNECTIONS 64 /* connections over the limit that still get a 503 */
#define MAX_REQUEST_ID 128
#define MAX_STOP_IDS 64
#define RETRY_AFTER_S "1"

struct loom_http {
    loom_server_t *srv;  /* NULL when serving another endpoint (loom_http_start_at) */
    loom_http_metrics_fn metrics_fn; /* /metrics of such an endpoint */
    void *metrics_ctx;
    struct MHD_Daemon *daemon;
    void *zctx;
    char inproc[128];
    char bind[256];
    char *api_key;
    loom_chat_template_t *tmpl; /* NULL: this model has no chat template */
    size_t max_body;
    unsigned idle_timeout_s;
    int request_timeout_ms;
    int port;
    long long started; /* unix time, the "created" of the model object */
    atomic_int serving, stopping;
    atomic_int n_conns; /* open connections, over-limit ones included */
    int max_conns;
    loom_tokenizer_t *tok; /* /tokenize and /detokenize (NULL: no model directory) */
    atomic_int draining, generating; /* refuse new generations; generation requests not yet completed */
    atomic_uint_fast64_t n_ids;
    uint64_t id_salt;
    pthread_mutex_t mu; /* guards have_model, model */
    int have_model;
    loom_model_info_t model;
};

/* One per TCP connection (MHD's socket context). */
typedef struct conn {
    loom_client_t *client;
    int over_limit; /* accepted beyond --http-max-connections: answered 503 */
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
    R_VERSION
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
    char xid[MAX_REQUEST_ID + 1]; /* X-Request-Id */
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
    char fail_msg[600];
    /* timings: the coordinator's, and the gateway's own time handing chunks on */
    loom_timings_t timings;
    int has_timings;
    uint64_t send_ns;
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
    if (q->close_after || status == MHD_HTTP_SERVICE_UNAVAILABLE)
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, RETRY_AFTER_S);
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

static loom_status_t ensure_client(req_t *q, loom_err_t *err) {
    if (q->conn->client) return LOOM_OK;
    loom_client_options_t o = {.timeout_ms = q->h->request_timeout_ms, .api_key = q->h->api_key,
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
        if (atomic_load(&q->h->stopping)) return 0;
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
 * that turns the feature off, and a field no one defines is refused too,
 * so a client never gets an answer computed without what it asked for. */
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
    {"priority", F_ALL}, {"n", F_ALL}, {"best_of", F_ALL}, {"response_format", F_ALL}, {"stop_token_ids", F_ALL},
    {"skip_special_tokens", F_ALL}, {"user", F_ALL}, {"metadata", F_ALL},
    {"prompt", F_PROMPT}, {"add_special_tokens", F_PROMPT},
    {"messages", F_CHAT}, {"max_completion_tokens", F_CHAT}, {"add_generation_prompt", F_CHAT},
    /* OpenAI features Loom does not implement */
    {"echo", F_FALSY}, {"logprobs", F_FALSY}, {"top_logprobs", F_FALSY}, {"presence_penalty", F_FALSY},
    {"frequency_penalty", F_FALSY}, {"logit_bias", F_FALSY}, {"suffix", F_FALSY}, {"tools", F_FALSY},
    {"tool_choice", F_NONE_AUTO}, {"parallel_tool_calls", F_TRUE}, {"functions", F_FALSY},
    {"function_call", F_NONE_AUTO}, {"store", F_FALSY}, {"audio", F_FALSY}, {"prediction", F_FALSY},
    {"reasoning_effort", F_FALSY}, {"web_search_options", F_FALSY}, {"modalities", F_FALSY},
    {"service_tier", F_NONE_AUTO},
    /* vLLM's extensions Loom does not implement */
    {"guided_json", F_FALSY}, {"guided_regex", F_FALSY}, {"guided_choice", F_FALSY}, {"guided_grammar", F_FALSY},
    {"guided_decoding_backend", F_FALSY}, {"guided_whitespace_pattern", F_FALSY}, {"structural_tag", F_FALSY},
    {"structured_outputs", F_FALSY}, {"repetition_penalty", F_ONE}, {"min_p", F_FALSY}, {"min_tokens", F_FALSY},
    {"length_penalty", F_ONE}, {"use_beam_search", F_FALSY}, {"early_stopping", F_FALSY},
    {"stop_token_ids_str", F_FALSY}, {"include_stop_str_in_output", F_FALSY},
    {"spaces_between_special_tokens", F_TRUE}, {"truncate_prompt_tokens", F_FALSY}, {"prompt_logprobs", F_FALSY},
    {"allowed_token_ids", F_FALSY}, {"bad_words", F_FALSY}, {"logits_processors", F_FALSY},
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

/* Every top-level field of a generation request is one this route
 * implements or one that is off (see k_fields). */
static int check_fields(const cJSON *o, int chat, perr_t *e) {
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        size_t i = 0;
        while (i < LOOM_ARRAY_LEN(k_fields) && strcmp(k_fields[i].name, x->string) != 0) i++;
        if (i == LOOM_ARRAY_LEN(k_fields))
            return bad(e, x->string, "%.64s is not a field this server knows", x->string);
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
    char *prompt; /* owned: the rendered chat */
    int32_t *ids; /* owned: prompt token ids */
    char **parts; /* owned: message contents joined from parts */
    int n_parts;
} gen_t;

static void gen_free(gen_t *g) {
    free(g->prompt);
    free(g->ids);
    for (int i = 0; i < g->n_parts; i++) free(g->parts[i]);
    free(g->parts);
}

static int parse_common(req_t *q, const cJSON *o, gen_t *g, perr_t *e) {
    double v;
    int r, b = 0;
    if (check_fields(o, q->chat, e) < 0) return -1;
    const cJSON *x = field(o, "model");
    if (x && !cJSON_IsString(x)) return bad(e, "model", "model must be a string");
    if (x && x->valuestring[0]) g->p.model = x->valuestring;
    if ((r = opt_int(o, "n", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && v != 1) return bad(e, "n", "n must be 1: this server returns one choice per request (got %g)", v);
    if ((r = opt_int(o, "best_of", -1e9, 1e9, &v, e)) < 0) return -1;
    if (r && v != 1) return bad(e, "best_of", "best_of must be 1 (got %g)", v);
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
    x = field(o, "response_format");
    if (x) {
        const cJSON *t = cJSON_IsObject(x) ? field(x, "type") : NULL;
        if (!cJSON_IsString(t)) return bad(e, "response_format", "response_format must be an object with a type");
        if (strcmp(t->valuestring, "text") != 0)
            return bad(e, "response_format", "response_format '%.64s' is not supported (only 'text')", t->valuestring);
    }

    /* max_tokens; for chat max_completion_tokens wins */
    g->p.max_tokens = q->chat ? 0 : COMPLETIONS_DEFAULT_MAX_TOKENS;
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
    g->p.temperature = 1.0f;
    if ((r = opt_number(o, "temperature", 0, 2, &v, e)) < 0) return -1;
    if (r) g->p.temperature = (float)v;
    g->p.top_p = 1.0f;
    if ((r = opt_number(o, "top_p", 0, 1, &v, e)) < 0) return -1;
    if (r) g->p.top_p = (float)v;
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
    if ((r = opt_int(o, "priority", -1e6, 1e6, &v, e)) < 0) return -1;
    if (r) g->p.priority = (int)v;
    return 0;
}

/* /v1/completions: prompt is a string, an array of token ids, or a batch of
 * one of either. add_special_tokens: false (an extension, as in vLLM) sends
 * the text as already formatted: special tokens parsed, no BOS added. */
static int parse_prompt(const cJSON *o, gen_t *g, perr_t *e) {
    const cJSON *x = field(o, "prompt");
    if (!x) return bad(e, "prompt", "prompt is required");
    if (cJSON_IsArray(x) && cJSON_GetArraySize(x) == 1 && !cJSON_IsNumber(x->child)) x = x->child;
    if (cJSON_IsString(x)) {
        if (!x->valuestring[0]) return bad(e, "prompt", "prompt must not be empty");
        g->p.prompt = x->valuestring;
    } else if (cJSON_IsArray(x)) {
        int n = cJSON_GetArraySize(x);
        if (n == 0) return bad(e, "prompt", "prompt must not be empty");
        if (!cJSON_IsNumber(x->child))
            return bad(e, "prompt", "batched prompts (%d of them) are not supported: send one prompt per request", n);
        g->ids = loom_xmalloc((size_t)n * sizeof *g->ids);
        const cJSON *t;
        int k = 0;
        cJSON_ArrayForEach(t, x) {
            if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
                t->valuedouble > 2147483647.0)
                return bad(e, "prompt", "prompt[%d] is not a token id (a non-negative integer)", k);
            g->ids[k++] = (int32_t)t->valuedouble;
        }
        g->p.prompt_ids = g->ids;
        g->p.n_prompt_ids = n;
    } else {
        return bad(e, "prompt", "prompt must be a string or an array of token ids");
    }
    int r, b = 0;
    if ((r = opt_bool(o, "add_special_tokens", &b, e)) < 0) return -1;
    if (r && !b) g->p.raw_prompt = 1;
    return 0;
}

/* /v1/chat/completions: messages through the chat template. */
static int parse_messages(const loom_chat_template_t *tmpl, const cJSON *o, gen_t *g, perr_t *e) {
    const cJSON *x = field(o, "messages");
    if (!x) return bad(e, "messages", "messages is required");
    if (!cJSON_IsArray(x) || cJSON_GetArraySize(x) == 0)
        return bad(e, "messages", "messages must be a non-empty array of {role, content} objects");
    int n = cJSON_GetArraySize(x);
    loom_chat_msg_t *m = loom_xcalloc((size_t)n, sizeof *m);
    g->parts = loom_xcalloc((size_t)n, sizeof *g->parts);
    int i = 0, rc = -1;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, x) {
        const cJSON *role = cJSON_IsObject(msg) ? field(msg, "role") : NULL;
        if (!cJSON_IsString(role)) {
            bad(e, "messages", "messages[%d] must be an object with a string role", i);
            goto done;
        }
        m[i].role = role->valuestring;
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
    loom_err_t err = {0};
    size_t len;
    int add_gen = 1, r = opt_bool(o, "add_generation_prompt", &add_gen, e);
    if (r < 0) goto done;
    if (loom_chat_render(tmpl, m, n, add_gen, &g->prompt, &len, &err) < 0) {
        bad(e, "messages", "%s", err.msg);
        goto done;
    }
    if (len == 0) {
        bad(e, "messages", "the conversation renders to an empty prompt");
        goto done;
    }
    g->p.prompt = g->prompt;
    g->p.raw_prompt = 1;
    rc = 0;
done:
    free(m);
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
    cJSON_AddNumberToObject(o, "tokenize_ms", t->tokenize_ms);
    cJSON_AddNumberToObject(o, "prefill_ms", t->prefill_ms);
    cJSON_AddNumberToObject(o, "decode_ms", t->decode_ms);
    cJSON_AddNumberToObject(o, "detokenize_ms", t->detokenize_ms);
    cJSON_AddNumberToObject(o, "send_ms", t->send_ms + (double)q->send_ns * 1e-6);
    cJSON_AddNumberToObject(o, "ttft_ms", t->ttft_ms);
    cJSON_AddNumberToObject(o, "total_ms", t->total_ms);
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
    loom_sbuf_str(b, ",\"logprobs\":null,\"finish_reason\":");
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

/* Turns one coordinator chunk into SSE events in q->out. */
static void stream_chunk(req_t *q, const loom_chunk_t *ch) {
    uint64_t t0 = loom_now_ns();
    if (ch->n_ids > 0 || ch->text_len > 0) sse_choice(q, ch->text, ch->text_len, 0, NULL);
    q->send_ns += loom_now_ns() - t0;
    if (!ch->final) return;
    take_timings(q, ch);
    q->finished = 1;
    if (ch->status != LOOM_OK) {
        /* the stream broke after it began: an error event, and no [DONE] */
        unsigned http;
        const char *type, *code;
        status_http(ch->status, &http, &type, &code);
        sse_event(q, error_obj(ch->message && ch->message[0] ? ch->message : loom_status_str(ch->status), type, NULL,
                               code));
        LOOM_WARN("http: %s %s: stream %s failed: %s", q->method, q->path, q->id, ch->message);
        return;
    }
    sse_choice(q, NULL, 0, 0, finish_name(ch->finish));
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
    if (q->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", t);
    } else {
        cJSON_AddStringToObject(c, "text", t);
    }
    free(t);
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddStringToObject(c, "finish_reason", finish_name(ch->finish));
    cJSON_AddItemToArray(choices, c);
    cJSON_AddItemToObject(o, "usage", usage_obj(ch));
    take_timings(q, ch);
    if (q->has_timings) cJSON_AddItemToObject(o, "timings", timings_obj(q));
    return respond_json(q, MHD_HTTP_OK, o);
}

/* ---- generation ---- */

static enum MHD_Result handle_generate(req_t *q) {
    loom_http_t *h = q->h;
    q->chat = q->route == R_CHAT;
    if (q->body.len == 0)
        return respond_error(q, 400, "invalid_request_error", NULL, NULL,
                             "the request body is empty: send a JSON object");
    if (memchr(q->body.p, 0, q->body.len))
        return respond_error(q, 400, "invalid_request_error", NULL, NULL, "the request body contains a NUL byte");
    if (!valid_utf8((const unsigned char *)q->body.p, q->body.len))
        return respond_error(q, 400, "invalid_request_error", NULL, NULL, "the request body is not valid UTF-8");
    if (has_escaped_nul(q->body.p, q->body.len))
        return respond_error(q, 400, "invalid_request_error", NULL, NULL,
                             "strings in the request must not contain NUL characters (\\u0000)");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(q->body.p, q->body.len, &end, 0);
    if (!root)
        return respond_error(q, 400, "invalid_request_error", NULL, NULL,
                             "We could not parse the JSON body of your request (error near byte %zu)",
                             end && end >= q->body.p ? (size_t)(end - q->body.p) : (size_t)0);
    enum MHD_Result res;
    gen_t g = {0};
    perr_t e = {0};
    loom_err_t err = {0};
    loom_model_info_t mi;
    if (!cJSON_IsObject(root)) {
        res = respond_error(q, 400, "invalid_request_error", NULL, NULL, "the request body must be a JSON object");
        goto done;
    }
    if (q->chat && !h->tmpl) {
        res = respond_error(q, 400, "invalid_request_error", "messages", "no_chat_template",
                            "this model has no chat template; start the coordinator with --chat-template NAME (%s), "
                            "or use /v1/completions",
                            LOOM_CHAT_FAMILY_NAMES);
        goto done;
    }
    if (parse_common(q, root, &g, &e) < 0 ||
        (q->chat ? parse_messages(h->tmpl, root, &g, &e) : parse_prompt(root, &g, &e)) < 0) {
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
    if (loom_client_submit(q->conn->client, &g.p, &q->gen_id, &err) < 0) {
        res = respond_status(q, err.code, err.msg);
        goto done;
    }
    q->active = 1;
    q->counted = 1;
    atomic_fetch_add(&q->h->generating, 1);
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
        return respond_status(q, ch.status, ch.message);
    }
    if (q->stream) {
        if (q->chat) sse_choice(q, "", 0, 1, NULL);
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
        refresh_timeout(q);
        res = MHD_queue_response(q->mc, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        q->status = MHD_HTTP_OK;
        return res;
    }
    for (;;) {
        uint64_t t0 = loom_now_ns();
        loom_sbuf_add(&q->text, ch.text, ch.text_len);
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
    const char *end = NULL;
    cJSON *root = q->body.len && !memchr(q->body.p, 0, q->body.len) &&
                          valid_utf8((const unsigned char *)q->body.p, q->body.len) &&
                          !has_escaped_nul(q->body.p, q->body.len)
                      ? cJSON_ParseWithLengthOpts(q->body.p, q->body.len, &end, 0)
                      : NULL;
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        *res = respond_error(q, 400, "invalid_request_error", NULL, NULL,
                             "the request body must be a JSON object (UTF-8, no NUL characters)");
        return NULL;
    }
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
        if (parse_messages(q->h->tmpl, root, &g, &e) < 0) goto bad_field;
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
    if (loom_tokenizer_encode(q->h->tok, text, strlen(text), add_special, !add_special, &ids, &n_ids, &cap, &err) <
        0) {
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

static int authorized(const req_t *q, int *given) {
    const char *key = q->h->api_key;
    const char *a = MHD_lookup_connection_value(q->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    *given = a != NULL;
    if (!key) return 1;
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) return 0;
    a += 7;
    while (*a == ' ') a++;
    return loom_secret_equal(key, strlen(key), a, strlen(a));
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
};

/* Routes a request on its first call; a body over the limit is refused
 * then, before it is read (MHD closes the connection after the answer). */
static enum MHD_Result on_headers(req_t *q, const char *url) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(k_routes); i++)
        if (!strcmp(url, k_routes[i].path)) q->route = k_routes[i].route;
    if (q->route == R_NONE && !strncmp(url, "/v1/models/", 11) && url[11]) q->route = R_MODEL;
    int post = q->route == R_COMPLETIONS || q->route == R_CHAT || q->route == R_TOKENIZE || q->route == R_DETOKENIZE;
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
    default: return MHD_NO;
    }
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    loom_http_t *h = cls;
    req_t *q = *con_cls;
    if (!q) {
        q = loom_xcalloc(1, sizeof *q);
        q->h = h;
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
        if (q->conn->over_limit) {
            q->close_after = 1;
            return respond_error(q, 503, "server_error", NULL, "service_unavailable",
                                 "too many connections: this server takes %d at a time; retry after %s s",
                                 h->max_conns, RETRY_AFTER_S);
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
    free(q);
    *con_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    loom_http_t *h = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_t *c = loom_xcalloc(1, sizeof *c);
        c->over_limit = atomic_fetch_add(&h->n_conns, 1) >= h->max_conns;
        *socket_context = c;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        conn_t *c = *socket_context;
        if (c) {
            loom_client_close(&c->client);
            atomic_fetch_sub(&h->n_conns, 1);
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
static loom_status_t resolve_bind(const char *bind, struct sockaddr_storage *ss, socklen_t *len, int *v6,
                                  loom_err_t *err) {
    char host[256] = "127.0.0.1", port[16];
    const char *colon = strrchr(bind, ':');
    const char *p = colon ? colon + 1 : bind;
    if (colon) {
        const char *hs = bind, *he = colon;
        if (*hs == '[' && he > hs && he[-1] == ']') hs++, he--;
        if (he > hs) {
            if ((size_t)(he - hs) >= sizeof host)
                return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--http: host name too long in '%s'", bind);
            memcpy(host, hs, (size_t)(he - hs));
            host[he - hs] = '\0';
        }
    }
    char *end;
    long pn = strtol(p, &end, 10);
    if (!*p || *end || pn < 0 || pn > 65535)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--http expects HOST:PORT (e.g. 127.0.0.1:8000), got '%s'",
                            bind);
    snprintf(port, sizeof port, "%ld", pn);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0 || !ai)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "--http: cannot resolve '%s': %s", host, gai_strerror(rc));
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *len = ai->ai_addrlen;
    *v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);
    return LOOM_OK;
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
    struct sockaddr_storage ss;
    socklen_t ss_len;
    int v6 = 0;
    LOOM_CHECK(resolve_bind(bind, &ss, &ss_len, &v6, err));
    loom_chat_template_t *tmpl = NULL;
    if (cfg->model_dir) LOOM_CHECK(loom_chat_template_load(cfg->model_dir, cfg->chat_template, &tmpl, err));
    else LOOM_CHECK(loom_chat_template_from_text(NULL, cfg->chat_template, NULL, NULL, &tmpl, err));

    loom_http_t *h = loom_xcalloc(1, sizeof *h);
    h->tmpl = tmpl;
    h->zctx = ep->zmq_context;
    snprintf(h->inproc, sizeof h->inproc, "%s", ep->inproc_addr);
    h->metrics_fn = ep->metrics;
    h->metrics_ctx = ep->metrics_ctx;
    snprintf(h->bind, sizeof h->bind, "%s", bind);
    h->api_key = cfg->api_key && cfg->api_key[0] ? loom_xstrdup(cfg->api_key) : NULL;
    h->max_body = cfg->max_body_bytes ? cfg->max_body_bytes : DEFAULT_MAX_BODY;
    h->idle_timeout_s = (unsigned)(cfg->idle_timeout_s > 0 ? cfg->idle_timeout_s : DEFAULT_IDLE_TIMEOUT_S);
    h->request_timeout_ms = cfg->request_timeout_ms > 0 ? cfg->request_timeout_ms : DEFAULT_REQUEST_TIMEOUT_MS;
    h->started = (long long)time(NULL);
    h->id_salt = loom_now_ns() ^ ((uint64_t)(uintptr_t)h << 16);
    pthread_mutex_init(&h->mu, NULL);
    h->max_conns = cfg->max_connections > 0 ? cfg->max_connections : DEFAULT_MAX_CONNECTIONS;
    unsigned max_conn = (unsigned)h->max_conns + OVERFLOW_CONNECTIONS; /* the rest are answered 503 */
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
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0);
    uint16_t port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                              : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    errno = 0;
    h->daemon = MHD_start_daemon(flags, port, NULL, NULL, on_access, h,
                                 MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
                                 MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                                 MHD_OPTION_CONNECTION_LIMIT, max_conn,
                                 MHD_OPTION_CONNECTION_TIMEOUT, h->idle_timeout_s,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                                 MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
                                 MHD_OPTION_END);
    int e = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!h->daemon) {
        loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cannot serve HTTP on %s: %s", bind,
                     e ? strerror(e) : "libmicrohttpd could not start (see the log)");
        loom_http_stop(&h);
        return LOOM_ERR_UNAVAILABLE;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : port;
    atomic_store(&h->serving, 1);
    LOOM_INFO("HTTP gateway on %s (port %d), chat template: %s%s", bind, h->port,
              tmpl ? loom_chat_family_name(tmpl->family) : "none", h->api_key ? ", API key required" : "");
    *out = h;
    return LOOM_OK;
}

int loom_http_port(const loom_http_t *h) { return h ? h->port : 0; }

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
    if (h->daemon) MHD_stop_daemon(h->daemon);
    loom_chat_template_destroy(&h->tmpl);
    loom_tokenizer_destroy(&h->tok);
    pthread_mutex_destroy(&h->mu);
    free(h->api_key);
    free(h);
}
