/* `loom bench`: the serving load generator. Sends requests with random
 * token-id prompts at a Poisson rate (or all at once), records when every
 * chunk arrives, and reports TTFT, TPOT, ITL and E2E latency percentiles
 * plus throughput, for one rate or a sweep of rates, and where the time
 * went on the server: the stage breakdown (tokenize, queue, prefill,
 * decode, detokenize, send) from the timings in each final chunk.
 *
 * One thread drives everything: requests are submitted when their arrival
 * time comes (and a concurrency slot is free) and chunks are polled in
 * between. The transport sits behind a small table of functions: ZeroMQ
 * (one loom.v1 connection for all requests) or HTTP (the coordinator's
 * OpenAI-compatible gateway: one TCP connection per request, streaming
 * /v1/completions read as Server-Sent Events), so one load generator
 * measures both APIs the same way. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/commands.h"
#include "client/loom_client.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"

extern char **environ;

#define EXIT_USAGE 2
#define EXIT_UNAVAILABLE 4
#define MAX_RATES 32
#define MAX_ERROR_KINDS 4

/* ---- transport ---- */

typedef struct bench_req {
    const int32_t *prompt_ids;
    int n_prompt, max_tokens;
    float temperature;
    uint64_t seed;
} bench_req_t;

typedef struct bench_event {
    uint64_t handle;
    int n_tokens, final;
    loom_status_t status;
    const char *message;
    int prompt_tokens, completion_tokens;
    loom_timings_t timings; /* the server's, in the final event (has_timings) */
    int has_timings;
} bench_event_t;

typedef struct bench_model {
    char id[256];
    int context_length, vocab_size;
} bench_model_t;

typedef struct transport {
    const char *name;
    void *self;
    loom_status_t (*submit)(void *self, const bench_req_t *r, uint64_t *handle, loom_err_t *err);
    loom_status_t (*poll)(void *self, int timeout_ms, bench_event_t *ev, int *got, loom_err_t *err);
    loom_status_t (*cancel)(void *self, uint64_t handle, loom_err_t *err);
    loom_status_t (*model)(void *self, bench_model_t *m, loom_err_t *err); /* optional */
    void (*close)(void *self);
} transport_t;

static loom_status_t zmq_submit(void *self, const bench_req_t *r, uint64_t *handle, loom_err_t *err) {
    loom_gen_params_t p = {.prompt_ids = r->prompt_ids, .n_prompt_ids = r->n_prompt, .max_tokens = r->max_tokens,
                           .temperature = r->temperature, .seed = r->seed, .has_seed = 1, .ignore_eos = 1};
    return loom_client_submit(self, &p, handle, err);
}

static loom_status_t zmq_poll_event(void *self, int timeout_ms, bench_event_t *ev, int *got, loom_err_t *err) {
    loom_chunk_t ch;
    LOOM_CHECK(loom_client_poll(self, timeout_ms, &ch, got, err));
    if (*got)
        *ev = (bench_event_t){.handle = ch.request_id, .n_tokens = ch.n_ids, .final = ch.final,
                              .status = ch.status, .message = ch.message, .prompt_tokens = ch.prompt_tokens,
                              .completion_tokens = ch.completion_tokens, .timings = ch.timings,
                              .has_timings = ch.has_timings};
    return LOOM_OK;
}

static loom_status_t zmq_cancel(void *self, uint64_t handle, loom_err_t *err) {
    return loom_client_cancel(self, handle, err);
}

static loom_status_t zmq_model(void *self, bench_model_t *m, loom_err_t *err) {
    loom_model_info_t info;
    int n = 0;
    LOOM_CHECK(loom_client_list_models(self, &info, 1, &n, err));
    if (n < 1) return loom_err_set(err, LOOM_ERR_NOT_FOUND, "NOT_FOUND: the server lists no models");
    snprintf(m->id, sizeof m->id, "%s", info.id);
    m->context_length = info.context_length;
    m->vocab_size = info.vocab_size;
    return LOOM_OK;
}

static void zmq_close_transport(void *self) {
    loom_client_t *c = self;
    loom_client_close(&c);
}

static loom_status_t zmq_open(const char *addr, int timeout_ms, const char *api_key, transport_t *t,
                              loom_err_t *err) {
    char ep[256];
    snprintf(ep, sizeof ep, "%s%s", strstr(addr, "://") ? "" : "tcp://", addr);
    loom_client_options_t o = {.timeout_ms = timeout_ms, .api_key = api_key};
    loom_client_t *c = NULL;
    LOOM_CHECK(loom_client_connect(ep, &o, &c, err));
    *t = (transport_t){.name = "zmq", .self = c, .submit = zmq_submit, .poll = zmq_poll_event,
                       .cancel = zmq_cancel, .model = zmq_model, .close = zmq_close_transport};
    return LOOM_OK;
}


/* ---- HTTP transport: the OpenAI-compatible gateway ----
 *
 * Each request is one blocking connect + write, then a non-blocking socket
 * read by poll(): the status line and headers, a chunked (or sized) body,
 * and in it SSE events. A completion chunk with finish_reason null carries
 * one token; the usage chunk (stream_options.include_usage) gives the exact
 * counts; "data: [DONE]" ends the stream. A status other than 200 ends the
 * request with the error body's message. The JSON the gateway writes is
 * compact, so fields are found by their "key": text (a quote inside a
 * string value is always escaped, so such a key cannot match inside one). */

typedef enum { HS_HEAD, HS_CHUNK_SIZE, HS_CHUNK_DATA, HS_CHUNK_CRLF, HS_SIZED, HS_TO_CLOSE } hstate_t;

typedef struct hreq {
    uint64_t handle;
    int fd;
    hstate_t state;
    int status;               /* HTTP status */
    long long left;           /* bytes left in the chunk or the sized body */
    loom_sbuf_t raw, body;         /* received bytes not yet parsed; the decoded body (SSE text or error JSON) */
    int prompt_tokens, completion_tokens;
    loom_timings_t timings;   /* from the final choice chunk */
    int has_timings;
    double last_s;            /* last time anything arrived */
} hreq_t;

typedef struct hevent {
    bench_event_t ev;
    char msg[300];
} hevent_t;

typedef struct http_transport {
    struct sockaddr_storage addr;
    socklen_t addr_len;
    char hostport[300];
    char *auth;               /* "Authorization: Bearer KEY\r\n" or "" */
    char model[256];
    double timeout_s;
    uint64_t next_handle;
    hreq_t **reqs;
    int n_reqs, cap_reqs;
    hevent_t *events;         /* FIFO of events decoded but not yet returned */
    int ev_head, n_events, cap_events;
    hevent_t cur;
    loom_sbuf_t req_buf;
} http_transport_t;

static const char *json_find(const char *s, const char *key) {
    const char *p = strstr(s, key);
    if (!p) return NULL;
    p += strlen(key);
    while (*p == ' ') p++;
    return p;
}

static long long json_int(const char *s, const char *key, long long dflt) {
    const char *p = json_find(s, key);
    return p && (*p == '-' || (*p >= '0' && *p <= '9')) ? strtoll(p, NULL, 10) : dflt;
}

/* The JSON string at key, with \" and \\ unescaped (enough for messages). */
static double json_double(const char *s, const char *key, double dflt) {
    const char *p = json_find(s, key);
    if (!p) return dflt;
    char *end;
    double v = strtod(p, &end);
    return end == p ? dflt : v;
}

static void json_str_at(const char *s, const char *key, char *out, size_t n) {
    out[0] = '\0';
    const char *p = json_find(s, key);
    if (!p || *p != '"' || n == 0) return;
    size_t k = 0;
    for (p++; *p && *p != '"' && k + 1 < n; p++) {
        if (*p == '\\' && p[1]) {
            p++;
            out[k++] = *p == 'n' ? ' ' : *p;
        } else {
            out[k++] = *p;
        }
    }
    out[k] = '\0';
}

static loom_status_t status_from_http(int code) {
    switch (code) {
    case 400: return LOOM_ERR_INVALID_ARGUMENT;
    case 401: return LOOM_ERR_UNAUTHENTICATED;
    case 404: return LOOM_ERR_NOT_FOUND;
    case 429: return LOOM_ERR_RESOURCE_EXHAUSTED;
    case 503: return LOOM_ERR_UNAVAILABLE;
    case 504: return LOOM_ERR_DEADLINE_EXCEEDED;
    default: return LOOM_ERR_INTERNAL;
    }
}

static void http_push(http_transport_t *t, const bench_event_t *ev, const char *msg) {
    if (t->ev_head > 0 && t->n_events == t->cap_events) {
        memmove(t->events, t->events + t->ev_head, (size_t)(t->n_events - t->ev_head) * sizeof *t->events);
        t->n_events -= t->ev_head;
        t->ev_head = 0;
    }
    if (t->n_events == t->cap_events) {
        t->cap_events = t->cap_events ? 2 * t->cap_events : 64;
        t->events = loom_xrealloc(t->events, (size_t)t->cap_events * sizeof *t->events);
    }
    hevent_t *e = &t->events[t->n_events++];
    e->ev = *ev;
    snprintf(e->msg, sizeof e->msg, "%s", msg ? msg : "");
}

static void http_drop(http_transport_t *t, int i) {
    hreq_t *r = t->reqs[i];
    if (r->fd >= 0) close(r->fd);
    free(r->raw.p);
    free(r->body.p);
    free(r);
    t->reqs[i] = t->reqs[--t->n_reqs];
}

/* Ends request i with a final event. */
static void http_finish(http_transport_t *t, int i, loom_status_t st, const char *msg) {
    hreq_t *r = t->reqs[i];
    bench_event_t ev = {.handle = r->handle, .final = 1, .status = st, .prompt_tokens = r->prompt_tokens,
                        .completion_tokens = r->completion_tokens, .timings = r->timings,
                        .has_timings = r->has_timings};
    http_push(t, &ev, msg);
    http_drop(t, i);
}

/* Handles the SSE events complete in the body so far; 1 when the stream ended. */
static int http_sse(http_transport_t *t, int i) {
    hreq_t *r = t->reqs[i];
    for (;;) {
        char *end = strstr(r->body.p ? r->body.p : "", "\n\n");
        if (!end) return 0;
        *end = '\0';
        const char *data = strncmp(r->body.p, "data: ", 6) == 0 ? r->body.p + 6 : NULL;
        if (data && !strcmp(data, "[DONE]")) {
            http_finish(t, i, LOOM_OK, NULL);
            return 1;
        } else if (data && strstr(data, "{\"error\":") == data) {
            char msg[300];
            json_str_at(data, "\"message\":", msg, sizeof msg);
            http_finish(t, i, LOOM_ERR_UNAVAILABLE, msg);
            return 1;
        } else if (data) {
            const char *u = json_find(data, "\"usage\":");
            if (u && *u == '{') {
                r->prompt_tokens = (int)json_int(u, "\"prompt_tokens\":", 0);
                r->completion_tokens = (int)json_int(u, "\"completion_tokens\":", 0);
            }
            const char *tm = json_find(data, "\"timings\":");
            if (tm && *tm == '{') {
                r->timings = (loom_timings_t){json_double(tm, "\"queue_ms\":", 0), json_double(tm, "\"tokenize_ms\":", 0),
                                              json_double(tm, "\"prefill_ms\":", 0), json_double(tm, "\"decode_ms\":", 0),
                                              json_double(tm, "\"detokenize_ms\":", 0), json_double(tm, "\"send_ms\":", 0),
                                              json_double(tm, "\"ttft_ms\":", 0), json_double(tm, "\"total_ms\":", 0)};
                r->has_timings = 1;
            }
            const char *c = json_find(data, "\"choices\":");
            const char *f = json_find(data, "\"finish_reason\":");
            if (c && *c == '[' && c[1] != ']' && f && *f == 'n') {
                bench_event_t ev = {.handle = r->handle, .n_tokens = 1};
                http_push(t, &ev, NULL);
            }
        }
        loom_sbuf_consume(&r->body, (size_t)(end + 2 - r->body.p));
    }
}

/* Parses what arrived for request i; 1 when the request ended. */
static int http_parse(http_transport_t *t, int i) {
    hreq_t *r = t->reqs[i];
    for (;;) {
        if (r->state == HS_HEAD) {
            char *end = r->raw.p ? strstr(r->raw.p, "\r\n\r\n") : NULL;
            if (!end) return 0;
            *end = '\0';
            if (sscanf(r->raw.p, "HTTP/%*d.%*d %d", &r->status) != 1) {
                http_finish(t, i, LOOM_ERR_PROTOCOL, "the server did not answer HTTP");
                return 1;
            }
            r->state = HS_TO_CLOSE;
            for (char *line = strstr(r->raw.p, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
                const char *h = line + 2;
                if (!strncasecmp(h, "Transfer-Encoding:", 18) && strstr(h, "chunked")) r->state = HS_CHUNK_SIZE;
                else if (!strncasecmp(h, "Content-Length:", 15) && r->state != HS_CHUNK_SIZE) {
                    r->state = HS_SIZED;
                    r->left = strtoll(h + 15, NULL, 10);
                }
            }
            loom_sbuf_consume(&r->raw, (size_t)(end + 4 - r->raw.p));
        } else if (r->state == HS_CHUNK_SIZE) {
            char *end = r->raw.p ? strstr(r->raw.p, "\r\n") : NULL;
            if (!end) return 0;
            r->left = strtoll(r->raw.p, NULL, 16);
            loom_sbuf_consume(&r->raw, (size_t)(end + 2 - r->raw.p));
            if (r->left == 0) break; /* the last chunk: the body is complete */
            r->state = HS_CHUNK_DATA;
        } else if (r->state == HS_CHUNK_DATA || r->state == HS_SIZED || r->state == HS_TO_CLOSE) {
            size_t n = r->state == HS_TO_CLOSE ? r->raw.len : (size_t)LOOM_MIN((long long)r->raw.len, r->left);
            if (n == 0 && !(r->state == HS_SIZED && r->left == 0)) return 0;
            loom_sbuf_add(&r->body, r->raw.p ? r->raw.p : "", n);
            loom_sbuf_consume(&r->raw, n);
            r->left -= (long long)n;
            if (r->status == 200 && http_sse(t, i)) return 1;
            if (r->state == HS_CHUNK_DATA && r->left == 0) r->state = HS_CHUNK_CRLF;
            else if (r->state == HS_SIZED && r->left == 0) break;
            else if (r->state == HS_TO_CLOSE) return 0;
        } else { /* HS_CHUNK_CRLF */
            if (r->raw.len < 2) return 0;
            loom_sbuf_consume(&r->raw, 2);
            r->state = HS_CHUNK_SIZE;
        }
    }
    /* the body is complete */
    char msg[300];
    if (r->status == 200) {
        snprintf(msg, sizeof msg, "the stream ended without data: [DONE]");
        http_finish(t, i, LOOM_ERR_PROTOCOL, msg);
    } else {
        char m[250];
        json_str_at(r->body.p ? r->body.p : "", "\"message\":", m, sizeof m);
        snprintf(msg, sizeof msg, "HTTP %d: %s", r->status, m);
        http_finish(t, i, status_from_http(r->status), msg);
    }
    return 1;
}

static loom_status_t http_connect(http_transport_t *t, int *fd_out, loom_err_t *err) {
    int fd = socket(t->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&t->addr, t->addr_len) < 0) {
        int e = errno;
        close(fd);
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: cannot connect to %s: %s", t->hostport,
                            strerror(e));
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    *fd_out = fd;
    return LOOM_OK;
}

static loom_status_t write_all(int fd, const char *p, size_t n, const char *what, loom_err_t *err) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: sending to %s: %s", what,
                                        strerror(errno));
        p += w;
        n -= (size_t)w;
    }
    return LOOM_OK;
}

static loom_status_t http_submit(void *self, const bench_req_t *br, uint64_t *handle, loom_err_t *err) {
    http_transport_t *t = self;
    loom_sbuf_t *b = &t->req_buf;
    b->len = 0;
    char num[64];
    loom_sbuf_add(b, "{\"model\":\"", 10);
    loom_sbuf_add(b, t->model, strlen(t->model));
    loom_sbuf_add(b, "\",\"prompt\":[", 12);
    for (int i = 0; i < br->n_prompt; i++) {
        int n = snprintf(num, sizeof num, "%s%d", i ? "," : "", br->prompt_ids[i]);
        loom_sbuf_add(b, num, (size_t)n);
    }
    int n = snprintf(num, sizeof num, "],\"max_tokens\":%d,\"temperature\":%g,\"seed\":%llu", br->max_tokens,
                     (double)br->temperature, (unsigned long long)br->seed);
    loom_sbuf_add(b, num, (size_t)n);
    const char *tail = ",\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true}}";
    loom_sbuf_add(b, tail, strlen(tail));
    char head[1024];
    int hl = snprintf(head, sizeof head,
                      "POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
                      "Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %zu\r\n\r\n",
                      t->hostport, t->auth, b->len);
    int fd;
    LOOM_CHECK(http_connect(t, &fd, err));
    loom_status_t st = write_all(fd, head, (size_t)hl, t->hostport, err);
    if (st == LOOM_OK) st = write_all(fd, b->p, b->len, t->hostport, err);
    if (st < 0) {
        close(fd);
        return st;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    hreq_t *r = loom_xcalloc(1, sizeof *r);
    r->handle = ++t->next_handle;
    r->fd = fd;
    r->last_s = loom_now_s();
    if (t->n_reqs == t->cap_reqs) {
        t->cap_reqs = t->cap_reqs ? 2 * t->cap_reqs : 64;
        t->reqs = loom_xrealloc(t->reqs, (size_t)t->cap_reqs * sizeof *t->reqs);
    }
    t->reqs[t->n_reqs++] = r;
    *handle = r->handle;
    return LOOM_OK;
}

static int http_take(http_transport_t *t, bench_event_t *ev) {
    if (t->ev_head == t->n_events) return 0;
    t->cur = t->events[t->ev_head++];
    if (t->ev_head == t->n_events) t->ev_head = t->n_events = 0;
    *ev = t->cur.ev;
    ev->message = t->cur.msg;
    return 1;
}

static loom_status_t http_poll(void *self, int timeout_ms, bench_event_t *ev, int *got, loom_err_t *err) {
    http_transport_t *t = self;
    *got = 0;
    double deadline = loom_now_s() + (timeout_ms > 0 ? timeout_ms / 1e3 : 0);
    for (int pass = 0;; pass++) {
        if ((*got = http_take(t, ev))) break;
        double now = loom_now_s();
        if (pass > 0 && timeout_ms >= 0 && now >= deadline) break;
        if (t->n_reqs == 0 && timeout_ms < 0) break;
        for (int i = t->n_reqs - 1; i >= 0; i--)
            if (now - t->reqs[i]->last_s > t->timeout_s) {
                char msg[200];
                snprintf(msg, sizeof msg, "no data from %.100s for %.0f s", t->hostport, t->timeout_s);
                http_finish(t, i, LOOM_ERR_UNAVAILABLE, msg);
            }
        if (t->n_events) continue;
        struct pollfd *fds = loom_xmalloc((size_t)(t->n_reqs + 1) * sizeof *fds);
        for (int i = 0; i < t->n_reqs; i++) fds[i] = (struct pollfd){.fd = t->reqs[i]->fd, .events = POLLIN};
        int wait = timeout_ms < 0 ? 1000 : (int)ceil((deadline - now) * 1e3);
        int n = poll(fds, (nfds_t)t->n_reqs, LOOM_MAX(0, LOOM_MIN(wait, 1000)));
        if (n < 0 && errno != EINTR) {
            free(fds);
            return loom_err_set(err, LOOM_ERR_INTERNAL, "INTERNAL: poll: %s", strerror(errno));
        }
        /* walk backwards: finishing a request moves the last one into its slot */
        for (int i = t->n_reqs - 1; n > 0 && i >= 0; i--) {
            if (!fds[i].revents) continue;
            hreq_t *r = t->reqs[i];
            char buf[16384];
            ssize_t k = recv(r->fd, buf, sizeof buf, 0);
            if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (k <= 0) {
                if (r->state == HS_TO_CLOSE && r->status != 200) {
                    r->state = HS_SIZED;
                    r->left = 0;
                    http_parse(t, i);
                } else {
                    http_finish(t, i, LOOM_ERR_UNAVAILABLE, "the connection closed before the stream ended");
                }
                continue;
            }
            r->last_s = loom_now_s();
            loom_sbuf_add(&r->raw, buf, (size_t)k);
            http_parse(t, i);
        }
        free(fds);
    }
    return LOOM_OK;
}

static loom_status_t http_cancel(void *self, uint64_t handle, loom_err_t *err) {
    http_transport_t *t = self;
    for (int i = 0; i < t->n_reqs; i++)
        if (t->reqs[i]->handle == handle) {
            /* closing the connection is the cancel: the gateway notices and cancels upstream */
            http_finish(t, i, LOOM_ERR_CANCELLED, "cancelled");
            return LOOM_OK;
        }
    return loom_err_set(err, LOOM_ERR_NOT_FOUND, "NOT_FOUND: request %llu is not in flight",
                        (unsigned long long)handle);
}

/* GET /v1/models: the id, and Loom's max_model_len and vocab_size fields. */
static loom_status_t http_model(void *self, bench_model_t *m, loom_err_t *err) {
    http_transport_t *t = self;
    char head[1024];
    int hl = snprintf(head, sizeof head, "GET /v1/models HTTP/1.1\r\nHost: %s\r\n%sConnection: close\r\n\r\n",
                      t->hostport, t->auth);
    int fd;
    LOOM_CHECK(http_connect(t, &fd, err));
    struct timeval tv = {.tv_sec = (time_t)t->timeout_s};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    loom_sbuf_t b = {0};
    loom_status_t st = write_all(fd, head, (size_t)hl, t->hostport, err);
    for (char buf[8192]; st == LOOM_OK;) {
        ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: no answer from %s: %s", t->hostport,
                                     strerror(errno));
        if (k <= 0) break;
        loom_sbuf_add(&b, buf, (size_t)k);
    }
    close(fd);
    int code = 0;
    const char *body = b.p ? strstr(b.p, "\r\n\r\n") : NULL;
    if (st == LOOM_OK && (!body || sscanf(b.p, "HTTP/%*d.%*d %d", &code) != 1))
        st = loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: %s did not answer HTTP", t->hostport);
    if (st == LOOM_OK && code != 200) {
        char msg[300];
        json_str_at(body, "\"message\":", msg, sizeof msg);
        st = loom_err_set(err, status_from_http(code), "%s: HTTP %d from %s: %s", loom_status_str(status_from_http(code)),
                          code, t->hostport, msg);
    }
    if (st == LOOM_OK) {
        const char *d = json_find(body, "\"data\":");
        json_str_at(d ? d : body, "\"id\":", m->id, sizeof m->id);
        m->context_length = (int)json_int(body, "\"max_model_len\":", 0);
        m->vocab_size = (int)json_int(body, "\"vocab_size\":", 0);
        snprintf(t->model, sizeof t->model, "%s", m->id);
        if (!m->id[0]) st = loom_err_set(err, LOOM_ERR_NOT_FOUND, "NOT_FOUND: %s lists no model", t->hostport);
    }
    free(b.p);
    return st;
}

static void http_close_transport(void *self) {
    http_transport_t *t = self;
    while (t->n_reqs) http_drop(t, t->n_reqs - 1);
    free(t->reqs);
    free(t->events);
    free(t->req_buf.p);
    free(t->auth);
    free(t);
}

/* url: http://host:port[/v1] */
static loom_status_t http_open(const char *url, int timeout_ms, const char *api_key, const char *model,
                               transport_t *tr, loom_err_t *err) {
    const char *p = url;
    if (!strncmp(p, "http://", 7)) p += 7;
    else if (strstr(p, "://"))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: --url must be http://HOST:PORT, got '%s'",
                            url);
    char host[256], port[16] = "80";
    size_t hl = strcspn(p, "/");
    if (hl >= sizeof host) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: --url too long");
    memcpy(host, p, hl);
    host[hl] = '\0';
    char *colon = host[0] == '[' ? strstr(host, "]:") : strrchr(host, ':');
    if (colon) {
        if (*colon == ']') *colon++ = '\0';
        *colon = '\0';
        snprintf(port, sizeof port, "%.15s", colon + 1);
    }
    char *h = host[0] == '[' ? host + 1 : host;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int rc = getaddrinfo(h, port, &hints, &ai);
    if (rc != 0 || !ai)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: cannot resolve '%s': %s", h,
                            gai_strerror(rc));
    http_transport_t *t = loom_xcalloc(1, sizeof *t);
    memcpy(&t->addr, ai->ai_addr, ai->ai_addrlen);
    t->addr_len = ai->ai_addrlen;
    freeaddrinfo(ai);
    snprintf(t->hostport, sizeof t->hostport, "%.*s", (int)hl, p);
    t->timeout_s = timeout_ms / 1e3;
    if (api_key) {
        size_t n = strlen(api_key) + 32;
        t->auth = loom_xmalloc(n);
        snprintf(t->auth, n, "Authorization: Bearer %s\r\n", api_key);
    } else {
        t->auth = loom_xstrdup("");
    }
    if (model) snprintf(t->model, sizeof t->model, "%s", model);
    *tr = (transport_t){.name = "http", .self = t, .submit = http_submit, .poll = http_poll, .cancel = http_cancel,
                        .model = http_model, .close = http_close_transport};
    return LOOM_OK;
}

static loom_status_t open_transport(int http, const char *where, int timeout_ms, const char *api_key,
                                    const char *model, transport_t *t, loom_err_t *err) {
    return http ? http_open(where, timeout_ms, api_key, model, t, err) : zmq_open(where, timeout_ms, api_key, t, err);
}

/* ---- workload ---- */

typedef struct rng {
    uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_uniform(rng_t *r) { /* [0, 1) */
    return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

static int rng_range(rng_t *r, int lo, int hi) { /* [lo, hi] */
    return lo + (int)(rng_next(r) % (uint64_t)(hi - lo + 1));
}

typedef struct bench_cfg {
    int num_requests, prompt_len, output_len, vocab, max_concurrency;
    float prompt_range, output_range, temperature;
    uint64_t seed;
    double deadline; /* loom_now_s() at which everything stops */
} bench_cfg_t;

/* One request: its plan, then what happened to it. Times are seconds since
 * the start of its rate's run. */
typedef struct rec {
    int prompt_len, output_len;
    int32_t *prompt;   /* into the run's pool */
    double t_arrival;  /* when it is due */
    double t_send, t_first, t_end;
    double *chunk_t;   /* arrival of each chunk that carried tokens */
    int n_chunks, cap_chunks;
    int tokens_seen, prompt_tokens, completion_tokens;
    loom_timings_t timings; /* the server's (has_timings) */
    int has_timings;
    int state; /* 0 not sent, 1 in flight, 2 done */
    loom_status_t status;
    char msg[200];
    uint64_t handle;
} rec_t;

typedef struct stat4 {
    double mean, p50, p90, p99;
    int n;
} stat4_t;

/* The server-side stages of a request, from its timings. */
enum { ST_TOKENIZE, ST_QUEUE, ST_PREFILL, ST_DECODE, ST_DETOKENIZE, ST_SEND, ST_TTFT, ST_COUNT };
static const char *const k_stage_names[ST_COUNT] = {"tokenize", "queue", "prefill", "decode",
                                                    "detokenize", "send", "ttft"};

static double stage_ms(const loom_timings_t *t, int st) {
    switch (st) {
    case ST_TOKENIZE: return t->tokenize_ms;
    case ST_QUEUE: return t->queue_ms;
    case ST_PREFILL: return t->prefill_ms;
    case ST_DECODE: return t->decode_ms;
    case ST_DETOKENIZE: return t->detokenize_ms;
    case ST_SEND: return t->send_ms;
    default: return t->ttft_ms;
    }
}

typedef struct rate_result {
    double rate; /* requests/s; INFINITY: all at once */
    int skipped;
    int n, completed, failed, peak_in_flight;
    double duration_s, req_per_s, out_tok_per_s, total_tok_per_s;
    long long in_tokens, out_tokens;
    stat4_t ttft, tpot, itl, e2e; /* milliseconds */
    stat4_t stages[ST_COUNT];     /* server timings, milliseconds (n = 0: the server sent none) */
    char errors[MAX_ERROR_KINDS][200];
    int error_counts[MAX_ERROR_KINDS], n_error_kinds;
} rate_result_t;

static int lengths_lo(int mean, float range) {
    return LOOM_MAX(1, (int)floor(mean * (1.0 - range)));
}

static int lengths_hi(int mean, float range) {
    return LOOM_MAX(1, (int)ceil(mean * (1.0 + range)));
}

/* The same seed gives the same prompts and arrival pattern at every rate. */
static int32_t *plan_requests(const bench_cfg_t *cfg, double rate, rec_t *recs) {
    rng_t r = {cfg->seed};
    int plo = lengths_lo(cfg->prompt_len, cfg->prompt_range), phi = lengths_hi(cfg->prompt_len, cfg->prompt_range);
    int olo = lengths_lo(cfg->output_len, cfg->output_range), ohi = lengths_hi(cfg->output_len, cfg->output_range);
    size_t total = 0;
    double t = 0;
    for (int i = 0; i < cfg->num_requests; i++) {
        recs[i] = (rec_t){.prompt_len = rng_range(&r, plo, phi), .output_len = rng_range(&r, olo, ohi)};
        double u = rng_uniform(&r);
        if (i > 0 && isfinite(rate)) t += -log(1.0 - u) / rate;
        recs[i].t_arrival = t;
        total += (size_t)recs[i].prompt_len;
    }
    int32_t *pool = loom_xmalloc(total * sizeof *pool);
    size_t off = 0;
    for (int i = 0; i < cfg->num_requests; i++) {
        recs[i].prompt = pool + off;
        for (int k = 0; k < recs[i].prompt_len; k++) recs[i].prompt[k] = (int32_t)rng_range(&r, 3, cfg->vocab - 1);
        off += (size_t)recs[i].prompt_len;
    }
    return pool;
}

/* ---- one run ---- */

typedef struct handle_ix {
    uint64_t handle;
    int index;
} handle_ix_t;

static int find_handle(const handle_ix_t *h, int n, uint64_t handle) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (h[mid].handle == handle) return h[mid].index;
        if (h[mid].handle < handle) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

static void finish_rec(rec_t *q, double now, loom_status_t status, const char *msg) {
    q->state = 2;
    q->t_end = now;
    q->status = status;
    snprintf(q->msg, sizeof q->msg, "%s%s%s", loom_status_str(status), msg && msg[0] ? ": " : "", msg ? msg : "");
}

static void on_event(rec_t *q, const bench_event_t *ev, double now) {
    if (ev->n_tokens > 0) {
        if (!q->tokens_seen) q->t_first = now;
        q->tokens_seen += ev->n_tokens;
        if (q->n_chunks == q->cap_chunks) {
            q->cap_chunks = q->cap_chunks ? 2 * q->cap_chunks : 64;
            q->chunk_t = loom_xrealloc(q->chunk_t, (size_t)q->cap_chunks * sizeof *q->chunk_t);
        }
        q->chunk_t[q->n_chunks++] = now;
    }
    if (ev->final) {
        q->prompt_tokens = ev->prompt_tokens;
        q->completion_tokens = ev->completion_tokens;
        q->timings = ev->timings;
        q->has_timings = ev->has_timings;
        finish_rec(q, now, ev->status, ev->status == LOOM_OK ? NULL : ev->message);
    }
}

/* Runs every planned request at one rate; fills recs with what happened. */
static loom_status_t run_rate(const transport_t *t, const bench_cfg_t *cfg, rec_t *recs, handle_ix_t *hix,
                              int *peak, double *duration, loom_err_t *err) {
    int n = cfg->num_requests, next = 0, in_flight = 0, done = 0, n_hix = 0;
    double t0 = loom_now_s();
    *peak = 0;
    while (done < n) {
        double now = loom_now_s() - t0;
        if (t0 + now >= cfg->deadline) break;
        while (next < n && recs[next].t_arrival <= now && (!cfg->max_concurrency || in_flight < cfg->max_concurrency)) {
            rec_t *q = &recs[next++];
            bench_req_t br = {.prompt_ids = q->prompt, .n_prompt = q->prompt_len, .max_tokens = q->output_len,
                              .temperature = cfg->temperature, .seed = cfg->seed + (uint64_t)next};
            loom_err_t serr = {0};
            q->t_send = loom_now_s() - t0;
            if (t->submit(t->self, &br, &q->handle, &serr) < 0) {
                finish_rec(q, q->t_send, serr.code, NULL);
                snprintf(q->msg, sizeof q->msg, "%.199s", serr.msg); /* already names the status */
                done++;
                continue;
            }
            q->state = 1;
            hix[n_hix++] = (handle_ix_t){q->handle, (int)(q - recs)};
            in_flight++;
            *peak = LOOM_MAX(*peak, in_flight);
        }
        double wait = 0.05;
        if (next < n && (!cfg->max_concurrency || in_flight < cfg->max_concurrency))
            wait = LOOM_MIN(wait, recs[next].t_arrival - now);
        wait = LOOM_MIN(wait, cfg->deadline - (t0 + now));
        int wait_ms = wait > 0 ? (int)ceil(wait * 1000) : 0;
        bench_event_t ev;
        int got = 0;
        if (t->poll(t->self, wait_ms, &ev, &got, err) < 0) return err->code;
        if (!got) continue;
        int i = find_handle(hix, n_hix, ev.handle);
        if (i < 0 || recs[i].state != 1) continue; /* left over from an earlier run */
        on_event(&recs[i], &ev, loom_now_s() - t0);
        if (recs[i].state == 2) {
            in_flight--;
            done++;
        }
    }
    double end = loom_now_s() - t0;
    *duration = 0;
    for (int i = 0; i < n; i++) {
        rec_t *q = &recs[i];
        if (q->state == 2) {
            *duration = LOOM_MAX(*duration, q->t_end);
            continue;
        }
        if (q->state == 1) t->cancel(t->self, q->handle, NULL);
        finish_rec(q, end, LOOM_ERR_DEADLINE_EXCEEDED,
                   q->state == 1 ? "unfinished at the --timeout-s limit" : "not sent before the --timeout-s limit");
        *duration = end;
    }
    /* Give the cancels a moment to leave and their streams to end. */
    double grace_end = loom_now_s() + 1.0;
    for (int left = in_flight; left > 0 && loom_now_s() < grace_end;) {
        bench_event_t ev;
        int got = 0;
        if (t->poll(t->self, 100, &ev, &got, NULL) < 0) break;
        if (got && ev.final && find_handle(hix, n_hix, ev.handle) >= 0) left--;
    }
    return LOOM_OK;
}

/* ---- statistics ---- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Mean and percentiles (linear interpolation between ranks); sorts x. */
static stat4_t summarize(double *x, int n) {
    stat4_t s = {.mean = NAN, .p50 = NAN, .p90 = NAN, .p99 = NAN, .n = n};
    if (n == 0) return s;
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += x[i];
    s.mean = sum / n;
    double q[3] = {0.50, 0.90, 0.99}, *out[3] = {&s.p50, &s.p90, &s.p99};
    for (int k = 0; k < 3; k++) {
        double pos = q[k] * (n - 1);
        int lo = (int)floor(pos), hi = LOOM_MIN(lo + 1, n - 1);
        *out[k] = x[lo] + (x[hi] - x[lo]) * (pos - lo);
    }
    return s;
}

static void add_error(rate_result_t *res, const char *msg) {
    for (int k = 0; k < res->n_error_kinds; k++)
        if (!strcmp(res->errors[k], msg)) {
            res->error_counts[k]++;
            return;
        }
    if (res->n_error_kinds == MAX_ERROR_KINDS) return;
    snprintf(res->errors[res->n_error_kinds], sizeof res->errors[0], "%s", msg);
    res->error_counts[res->n_error_kinds++] = 1;
}

static void compute_result(const rec_t *recs, int n, double duration, rate_result_t *res) {
    size_t n_itl = 0;
    for (int i = 0; i < n; i++)
        if (recs[i].status == LOOM_OK && recs[i].n_chunks > 1) n_itl += (size_t)recs[i].n_chunks - 1;
    double *ttft = loom_xmalloc((size_t)(n + 1) * sizeof *ttft), *tpot = loom_xmalloc((size_t)(n + 1) * sizeof *tpot);
    double *e2e = loom_xmalloc((size_t)(n + 1) * sizeof *e2e), *itl = loom_xmalloc((n_itl + 1) * sizeof *itl);
    int n_ttft = 0, n_tpot = 0, n_e2e = 0;
    n_itl = 0;
    res->n = n;
    res->duration_s = duration;
    for (int i = 0; i < n; i++) {
        const rec_t *q = &recs[i];
        if (q->status != LOOM_OK) {
            res->failed++;
            add_error(res, q->msg);
            continue;
        }
        res->completed++;
        int out = q->completion_tokens > 0 ? q->completion_tokens : q->tokens_seen;
        res->out_tokens += out;
        res->in_tokens += q->prompt_tokens > 0 ? q->prompt_tokens : q->prompt_len;
        double e = q->t_end - q->t_send;
        e2e[n_e2e++] = e * 1e3;
        if (q->n_chunks > 0) {
            double f = q->t_first - q->t_send;
            ttft[n_ttft++] = f * 1e3;
            if (out > 1) tpot[n_tpot++] = (e - f) / (out - 1) * 1e3;
        }
        for (int k = 1; k < q->n_chunks; k++) itl[n_itl++] = (q->chunk_t[k] - q->chunk_t[k - 1]) * 1e3;
    }
    double *st = loom_xmalloc((size_t)(n + 1) * sizeof *st);
    for (int k = 0; k < ST_COUNT; k++) {
        int m = 0;
        for (int i = 0; i < n; i++)
            if (recs[i].status == LOOM_OK && recs[i].has_timings) st[m++] = stage_ms(&recs[i].timings, k);
        res->stages[k] = summarize(st, m);
    }
    free(st);
    res->ttft = summarize(ttft, n_ttft);
    res->tpot = summarize(tpot, n_tpot);
    res->itl = summarize(itl, (int)n_itl);
    res->e2e = summarize(e2e, n_e2e);
    if (duration > 0) {
        res->req_per_s = res->completed / duration;
        res->out_tok_per_s = (double)res->out_tokens / duration;
        res->total_tok_per_s = (double)(res->in_tokens + res->out_tokens) / duration;
    }
    free(ttft);
    free(tpot);
    free(e2e);
    free(itl);
}

/* ---- reporting ---- */

static void rate_label(double rate, char *out, size_t n) {
    if (isfinite(rate)) snprintf(out, n, "%g", rate);
    else snprintf(out, n, "inf");
}

/* A latency cell; "-" when there were no samples. */
static void print_ms(double x, int width) {
    if (isfinite(x)) printf("%*.2f", width, x);
    else printf("%*s", width, "-");
}

static void print_result(const rate_result_t *r, const bench_cfg_t *cfg) {
    char rl[32];
    rate_label(r->rate, rl, sizeof rl);
    char mc[32];
    if (cfg->max_concurrency) snprintf(mc, sizeof mc, "%d", cfg->max_concurrency);
    else snprintf(mc, sizeof mc, "unlimited");
    printf("\n---- rate %s req/s (%s), %d requests, max concurrency %s ----\n", rl,
           isfinite(r->rate) ? "Poisson arrivals" : "all at once", r->n, mc);
    printf("%-28s %d\n", "successful requests", r->completed);
    printf("%-28s %d\n", "failed requests", r->failed);
    printf("%-28s %.2f s\n", "duration", r->duration_s);
    printf("%-28s %d\n", "peak requests in flight", r->peak_in_flight);
    printf("%-28s %.2f req/s\n", "request throughput", r->req_per_s);
    printf("%-28s %.1f tok/s\n", "output token throughput", r->out_tok_per_s);
    printf("%-28s %.1f tok/s\n", "total token throughput", r->total_tok_per_s);
    printf("%-28s %lld\n", "input tokens", r->in_tokens);
    printf("%-28s %lld\n", "output tokens", r->out_tokens);
    printf("%-8s %10s %10s %10s %10s   (ms)\n", "", "mean", "p50", "p90", "p99");
    const struct {
        const char *name;
        const stat4_t *s;
    } rows[] = {{"TTFT", &r->ttft}, {"TPOT", &r->tpot}, {"ITL", &r->itl}, {"E2E", &r->e2e}};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(rows); i++) {
        printf("%-8s", rows[i].name);
        const double v[4] = {rows[i].s->mean, rows[i].s->p50, rows[i].s->p90, rows[i].s->p99};
        for (int k = 0; k < 4; k++) print_ms(v[k], 11);
        putchar('\n');
    }
    if (r->stages[0].n > 0) {
        printf("stage breakdown on the server, %d requests (ms; detokenize and send are inside prefill and decode):\n",
               r->stages[0].n);
        printf("%-11s %10s %10s %10s\n", "", "mean", "p50", "p99");
        for (int k = 0; k < ST_COUNT; k++) {
            printf("%-11s", k_stage_names[k]);
            const double v[3] = {r->stages[k].mean, r->stages[k].p50, r->stages[k].p99};
            for (int j = 0; j < 3; j++) print_ms(v[j], 11);
            putchar('\n');
        }
    }
    for (int k = 0; k < r->n_error_kinds; k++) printf("error (%d x): %s\n", r->error_counts[k], r->errors[k]);
    fflush(stdout);
}

static void print_sweep(const rate_result_t *res, int n) {
    printf("\n%-8s %8s %10s %10s %10s %10s %10s %10s %7s\n", "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
           "TPOT p50", "TPOT p99", "E2E p50", "failed");
    for (int i = 0; i < n; i++) {
        const rate_result_t *r = &res[i];
        char rl[32];
        rate_label(r->rate, rl, sizeof rl);
        if (r->skipped) {
            printf("%-8s skipped: the --timeout-s limit was reached\n", rl);
            continue;
        }
        printf("%-8s %8.2f %10.1f", rl, r->req_per_s, r->out_tok_per_s);
        const double v[5] = {r->ttft.p50, r->ttft.p99, r->tpot.p50, r->tpot.p99, r->e2e.p50};
        for (int k = 0; k < 5; k++) print_ms(v[k], 11);
        printf(" %7d\n", r->failed);
    }
    printf("(latencies in ms)\n");
    fflush(stdout);
}

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch == '\n') fputs("\\n", f);
        else if (ch < 0x20) fprintf(f, "\\u%04x", ch);
        else fputc(ch, f);
    }
    fputc('"', f);
}

static void json_num(FILE *f, double x) {
    if (isfinite(x)) fprintf(f, "%.6g", x);
    else fputs("null", f);
}

static void json_stat(FILE *f, const char *name, const stat4_t *s) {
    fprintf(f, ",\n    \"%s\": {\"n\": %d, \"mean\": ", name, s->n);
    json_num(f, s->mean);
    fputs(", \"p50\": ", f);
    json_num(f, s->p50);
    fputs(", \"p90\": ", f);
    json_num(f, s->p90);
    fputs(", \"p99\": ", f);
    json_num(f, s->p99);
    fputc('}', f);
}

static void json_result(FILE *f, const rate_result_t *r, const bench_cfg_t *cfg, const char *transport,
                        const char *model) {
    fputs("  {\n    \"rate\": ", f);
    if (isfinite(r->rate)) json_num(f, r->rate);
    else fputs("\"inf\"", f);
    fprintf(f, ",\n    \"api\": \"%s\",\n    \"model\": ", transport);
    json_str(f, model);
    fprintf(f, ",\n    \"skipped\": %s,\n    \"num_requests\": %d,\n    \"completed\": %d,\n    \"failed\": %d",
            r->skipped ? "true" : "false", r->n, r->completed, r->failed);
    fprintf(f, ",\n    \"max_concurrency\": %d,\n    \"peak_in_flight\": %d", cfg->max_concurrency, r->peak_in_flight);
    fprintf(f, ",\n    \"prompt_len\": %d,\n    \"prompt_len_range\": %g,\n    \"output_len\": %d", cfg->prompt_len,
            (double)cfg->prompt_range, cfg->output_len);
    fprintf(f, ",\n    \"output_len_range\": %g,\n    \"temperature\": %g,\n    \"seed\": %llu",
            (double)cfg->output_range, (double)cfg->temperature, (unsigned long long)cfg->seed);
    fputs(",\n    \"duration_s\": ", f);
    json_num(f, r->duration_s);
    fputs(",\n    \"request_throughput\": ", f);
    json_num(f, r->req_per_s);
    fputs(",\n    \"output_throughput\": ", f);
    json_num(f, r->out_tok_per_s);
    fputs(",\n    \"total_token_throughput\": ", f);
    json_num(f, r->total_tok_per_s);
    fprintf(f, ",\n    \"total_input_tokens\": %lld,\n    \"total_output_tokens\": %lld", r->in_tokens,
            r->out_tokens);
    json_stat(f, "ttft_ms", &r->ttft);
    json_stat(f, "tpot_ms", &r->tpot);
    json_stat(f, "itl_ms", &r->itl);
    json_stat(f, "e2e_ms", &r->e2e);
    fputs(",\n    \"stages\": {", f);
    for (int k = 0; k < ST_COUNT; k++) {
        fprintf(f, "%s\"%s_ms\": {\"n\": %d, \"mean\": ", k ? ", " : "", k_stage_names[k], r->stages[k].n);
        json_num(f, r->stages[k].mean);
        fputs(", \"p50\": ", f);
        json_num(f, r->stages[k].p50);
        fputs(", \"p99\": ", f);
        json_num(f, r->stages[k].p99);
        fputc('}', f);
    }
    fputc('}', f);
    fputs(",\n    \"errors\": [", f);
    for (int k = 0; k < r->n_error_kinds; k++) {
        fprintf(f, "%s{\"count\": %d, \"message\": ", k ? ", " : "", r->error_counts[k]);
        json_str(f, r->errors[k]);
        fputc('}', f);
    }
    fputs("]\n  }", f);
}

static int write_json(const char *path, const rate_result_t *res, int n, int sweep, const bench_cfg_t *cfg,
                      const char *transport, const char *model) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (sweep) fputs("[\n", f);
    for (int i = 0; i < n; i++) {
        if (i) fputs(",\n", f);
        json_result(f, &res[i], cfg, transport, model);
    }
    fputs(sweep ? "\n]\n" : "\n", f);
    if (fclose(f) != 0) {
        fprintf(stderr, "error: writing %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* gnuplot's single-quoted strings: only ' needs doubling. */
static void gp_str(FILE *f, const char *s) {
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'') fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

/* Opens the gnuplot script gp and writes its head: what it draws, a PNG
 * terminal (cairo when there is one) and the output file png. */
static FILE *open_gp_script(const char *gp, const char *png, const char *what) {
    FILE *f = fopen(gp, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", gp, strerror(errno));
        return NULL;
    }
    fprintf(f, "# Draws %s.\n", what);
    fputs("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
          "  set terminal pngcairo size 1200,480\n"
          "} else {\n"
          "  set terminal png size 1200,480\n"
          "}\n"
          "set output ",
          f);
    gp_str(f, png);
    return f;
}

static int run_gnuplot(const char *png, const char *dat, char *gp);

/* PNG without ".png", then ".dat" and ".gp" file names. */
static int plot_names(const char *png, char *dat, char *gp, size_t n) {
    char base[1024];
    size_t len = strlen(png);
    if (len >= sizeof base || len + 8 > n) {
        fprintf(stderr, "error: the plot path is too long\n");
        return -1;
    }
    snprintf(base, sizeof base, "%s", png);
    if (len > 4 && !strcmp(base + len - 4, ".png")) base[len - 4] = '\0';
    snprintf(dat, n, "%s.dat", base);
    snprintf(gp, n, "%s.gp", base);
    return 0;
}

/* Writes PNG.dat (per rate: the mean of each server stage; then p50 and
 * p99 per stage of the last rate) and PNG.gp, and draws PNG: where the
 * time of a request goes, stacked, against the offered rate; and the
 * spread of each stage at the last (highest) rate. */
static int write_stage_plot(const char *png, const rate_result_t *res, int n, const char *model) {
    char dat[1100], gp[1100];
    if (plot_names(png, dat, gp, sizeof dat) < 0) return -1;
    const rate_result_t *last = NULL;
    for (int i = 0; i < n; i++)
        if (!res[i].skipped && res[i].stages[0].n > 0) last = &res[i];
    if (!last) {
        fprintf(stderr, "warning: the server sent no timings: no stage plot\n");
        return 0;
    }
    FILE *f = fopen(dat, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", dat, strerror(errno));
        return -1;
    }
    fprintf(f, "# loom bench stage breakdown, model %s; milliseconds\n# rate", model);
    for (int k = 0; k < ST_COUNT; k++) fprintf(f, " %s_mean", k_stage_names[k]);
    fputc('\n', f);
    for (int i = 0; i < n; i++) {
        const rate_result_t *r = &res[i];
        if (r->skipped || r->stages[0].n == 0) continue;
        char rl[32];
        rate_label(r->rate, rl, sizeof rl);
        fprintf(f, "%s", rl);
        for (int k = 0; k < ST_COUNT; k++) fprintf(f, " %.6g", r->stages[k].mean);
        fputc('\n', f);
    }
    char rl[32];
    rate_label(last->rate, rl, sizeof rl);
    fprintf(f, "\n\n# stage p50 p99 at rate %s\n", rl);
    for (int k = 0; k < ST_COUNT; k++)
        fprintf(f, "%s %.6g %.6g\n", k_stage_names[k], last->stages[k].p50, last->stages[k].p99);
    fclose(f);
    f = open_gp_script(gp, png, "the server-side stage breakdown of loom bench requests");
    if (!f) return -1;
    char title[400];
    snprintf(title, sizeof title, "loom bench: where a request's time goes (%s)", model);
    fputs("\nset datafile missing 'nan'\nset multiplot layout 1,2 title ", f);
    gp_str(f, title);
    fputs("\nset grid ytics\nset style data histograms\nset style fill solid 0.8 border -1\nset boxwidth 0.7\n"
          "set ylabel 'ms'\nset key top left\n"
          "set style histogram rowstacked\nset xlabel 'offered rate (req/s)'\n"
          "set title 'mean per request, stacked (= end to end)'\nplot ",
          f);
    gp_str(f, dat);
    /* columns: 1 rate, 2 tokenize, 3 queue, 4 prefill, 5 decode */
    fputs(" index 0 using 2:xtic(1) title 'tokenize', '' index 0 using 3 title 'queue', "
          "'' index 0 using 4 title 'prefill', '' index 0 using 5 title 'decode'\n"
          "set style histogram clustered gap 1\nset xlabel 'stage'\nset logscale y\nset xtics rotate by -30\n",
          f);
    snprintf(title, sizeof title, "spread at rate %s req/s", rl);
    fputs("set title ", f);
    gp_str(f, title);
    fputs("\nplot ", f);
    gp_str(f, dat);
    fputs(" index 1 using 2:xtic(1) title 'p50', '' index 1 using 3 title 'p99'\nunset multiplot\n", f);
    fclose(f);
    return run_gnuplot(png, dat, gp);
}

/* Writes PNG.dat (the sweep's latencies against the achieved request rate)
 * and PNG.gp (the gnuplot script), then runs gnuplot to draw PNG. */
static int write_plot(const char *png, const rate_result_t *res, int n, const char *model) {
    char dat[1100], gp[1100];
    if (plot_names(png, dat, gp, sizeof dat) < 0) return -1;
    FILE *f = fopen(dat, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", dat, strerror(errno));
        return -1;
    }
    fprintf(f, "# loom bench, model %s; latencies in ms\n"
               "# rate achieved_req_s ttft_p50 ttft_p99 tpot_p50 tpot_p99 e2e_p50 e2e_p99 out_tok_s failed\n",
            model);
    for (int i = 0; i < n; i++) {
        const rate_result_t *r = &res[i];
        if (r->skipped) continue;
        char rl[32];
        rate_label(r->rate, rl, sizeof rl);
        fprintf(f, "%s %.6g %.6g %.6g %.6g %.6g %.6g %.6g %.6g %d\n", rl, r->req_per_s, r->ttft.p50, r->ttft.p99,
                r->tpot.p50, r->tpot.p99, r->e2e.p50, r->e2e.p99, r->out_tok_per_s, r->failed);
    }
    fclose(f);
    f = open_gp_script(gp, png, "loom bench latencies against the achieved request rate");
    if (!f) return -1;
    fputs("\nset datafile missing 'nan'\nset multiplot layout 1,2 title ", f);
    char title[400];
    snprintf(title, sizeof title, "loom bench: %s", model);
    gp_str(f, title);
    fputs("\nset grid\nset key top left\nset xlabel 'achieved request rate (req/s)'\nset ylabel 'ms'\n"
          "set title 'time to first token'\nplot ",
          f);
    gp_str(f, dat);
    fputs(" using 2:3 with linespoints title 'TTFT p50', '' using 2:4 with linespoints title 'TTFT p99'\n"
          "set title 'time per output token'\nplot ",
          f);
    gp_str(f, dat);
    fputs(" using 2:5 with linespoints title 'TPOT p50', '' using 2:6 with linespoints title 'TPOT p99'\n"
          "unset multiplot\n",
          f);
    fclose(f);
    return run_gnuplot(png, dat, gp);
}

/* Runs gnuplot on the script gp; a missing or failing gnuplot is a warning
 * (the data and the script stay for later). */
static int run_gnuplot(const char *png, const char *dat, char *gp) {
    char *args[] = {"gnuplot", gp, NULL};
    pid_t pid;
    int e = posix_spawnp(&pid, "gnuplot", NULL, NULL, args, environ);
    if (e != 0) {
        fprintf(stderr, "warning: cannot run gnuplot (%s; install gnuplot-nox); the data is in %s and the script in %s\n",
                strerror(e), dat, gp);
        return 0;
    }
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
        fprintf(stderr, "warning: gnuplot failed on %s; the data is in %s\n", gp, dat);
        return 0;
    }
    fprintf(stderr, "plot: %s (data %s, script %s)\n", png, dat, gp);
    return 0;
}

/* ---- the command ---- */

static int parse_rate(const char *s, double *rate) {
    if (!strcmp(s, "inf") || !strcmp(s, "Inf") || !strcmp(s, "INF")) {
        *rate = INFINITY;
        return 0;
    }
    char *end = NULL;
    errno = 0;
    double x = strtod(s, &end);
    if (errno || end == s || *end || !(x > 0) || !isfinite(x)) return -1;
    *rate = x;
    return 0;
}

static int parse_rates(const char *list, double *rates, int max) {
    char buf[512];
    if (snprintf(buf, sizeof buf, "%s", list) >= (int)sizeof buf) return -1;
    int n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        if (n == max || parse_rate(tok, &rates[n]) < 0) return -1;
        n++;
    }
    return n > 0 ? n : -1;
}

int loom_cmd_bench(int argc, char **argv) {
    const char *addr = NULL, *rate_s = NULL, *rates_s = NULL, *json = NULL, *plot = NULL, *api = "zmq";
    const char *stage_plot = NULL;
    const char *api_key = NULL, *url = NULL, *curve_server = NULL, *curve_secret = NULL;
    int num_requests = 100, prompt_len = 128, output_len = 128, vocab = 0, max_conc = 0, timeout_s = 300;
    float prompt_range = 0, output_range = 0, temperature = 0;
    uint64_t seed = 0;
    loom_opt_t opts[] = {
        LOOM_CMD_OPT_ADDR(addr),
        {"rate", LOOM_OPT_STR, &rate_s, "R", "requests/s with Poisson arrivals, or inf: all at once (default inf)", 1, 0, NULL},
        {"rates", LOOM_OPT_STR, &rates_s, "LIST", "a sweep, e.g. \"1,2,4,8,inf\" (one run per rate)", 1, 0, NULL},
        {"num-requests", LOOM_OPT_INT, &num_requests, "N", "requests per rate (default 100)", 1, 1e6, NULL},
        {"seed", LOOM_OPT_U64, &seed, "S", "seed for lengths, prompts and arrivals (default 0)", 1, 0, NULL},
        {"prompt-len", LOOM_OPT_INT, &prompt_len, "N", "mean prompt length in tokens (default 128)", 1, 1e7, NULL},
        {"prompt-len-range", LOOM_OPT_FLOAT, &prompt_range, "FRAC", "prompt lengths uniform in N*(1 +- FRAC) (default 0)", 0, 1, NULL},
        {"output-len", LOOM_OPT_INT, &output_len, "N", "mean output length in tokens (default 128)", 1, 1e7, NULL},
        {"output-len-range", LOOM_OPT_FLOAT, &output_range, "FRAC", "output lengths uniform in N*(1 +- FRAC) (default 0)", 0, 1, NULL},
        {"vocab", LOOM_OPT_INT, &vocab, "V", "prompt ids are drawn from [3, V) (default: the model's vocabulary)", 4, 1e8, NULL},
        {"max-concurrency", LOOM_OPT_INT, &max_conc, "C", "most requests in flight, 0 = no limit (default 0)", 0, 1e6, NULL},
        {"temperature", LOOM_OPT_FLOAT, &temperature, "T", "sampling temperature (default 0: greedy)", 0, 100, NULL},
        {"json", LOOM_OPT_STR, &json, "FILE", "write the results as JSON (an object; an array for --rates)", 1, 0, NULL},
        {"plot", LOOM_OPT_STR, &plot, "FILE.png", "plot TTFT/TPOT p50/p99 against the achieved rate (gnuplot)", 1, 0, NULL},
        {"stage-plot", LOOM_OPT_STR, &stage_plot, "FILE.png", "plot the server-side stage breakdown (mean per stage, stacked, per rate; p50/p99 per stage) (gnuplot)", 1, 0, NULL},
        {"timeout-s", LOOM_OPT_INT, &timeout_s, "N", "cap on the whole run; unfinished requests fail (default 300)", 1, 1e6, NULL},
        {"api", LOOM_OPT_STR, &api, "zmq|http", "transport: the ZeroMQ API, or the OpenAI-compatible HTTP gateway (default zmq)", 1, 0, NULL},
        {"url", LOOM_OPT_STR, &url, "URL", "with --api http: the gateway, e.g. http://127.0.0.1:8000", 1, 0, NULL},
        LOOM_CMD_OPT_API_KEY(api_key),
        LOOM_CMD_OPT_CURVE(curve_server, curve_secret),
    };
    int r = loom_cli_parse(argc, argv, 2, opts, (int)LOOM_ARRAY_LEN(opts), "loom bench --addr ADDR [options]",
                           "Load-tests a Loom coordinator like vLLM's benchmark_serving: random token-id prompts\n"
                           "(ignore_eos, so output lengths are exact) arrive at a Poisson rate; reports TTFT, TPOT,\n"
                           "ITL and end-to-end latency (mean/p50/p90/p99) and throughput per rate.\n"
                           "Exit codes: 0 all requests succeeded, 1 some failed, 2 usage, 4 server unavailable.");
    if (r) return r < 0 ? EXIT_USAGE : 0;
    loom_cmd_curve_env(curve_server, curve_secret);
    double rates[MAX_RATES];
    int n_rates = 1, sweep = rates_s != NULL;
    rates[0] = INFINITY;
    if (rate_s && rates_s) {
        fprintf(stderr, "error: give --rate or --rates, not both\n");
        return EXIT_USAGE;
    }
    if (rate_s && parse_rate(rate_s, &rates[0]) < 0) {
        fprintf(stderr, "error: --rate expects a positive number or inf, got '%s'\n", rate_s);
        return EXIT_USAGE;
    }
    if (rates_s && (n_rates = parse_rates(rates_s, rates, MAX_RATES)) < 0) {
        fprintf(stderr, "error: --rates expects up to %d comma-separated positive numbers or inf, got '%s'\n",
                MAX_RATES, rates_s);
        return EXIT_USAGE;
    }
    int http = !strcmp(api, "http");
    if (!http && strcmp(api, "zmq") != 0) {
        fprintf(stderr, "error: --api must be zmq or http, got '%s'\n", api);
        return EXIT_USAGE;
    }
    if (http) {
        if (!url || !url[0]) {
            fprintf(stderr, "error: --api http needs --url http://HOST:PORT (the coordinator's --http address)\n");
            return EXIT_USAGE;
        }
        addr = url;
    } else {
        if (url) {
            fprintf(stderr, "error: --url is for --api http; the ZeroMQ API takes --addr\n");
            return EXIT_USAGE;
        }
        if (!addr) addr = getenv("LOOM_ADDR");
        if (!addr || !addr[0]) {
            fprintf(stderr, "error: --addr is required (or set LOOM_ADDR); see loom bench --help\n");
            return EXIT_USAGE;
        }
    }

    /* Probe first, with a short timeout: is anyone there, and what does it serve? */
    loom_err_t err = {0};
    transport_t t;
    bench_model_t model = {.id = "unknown"};
    if (open_transport(http, addr, LOOM_MIN(timeout_s, 10) * 1000, api_key, NULL, &t, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return EXIT_USAGE;
    }
    loom_status_t s = t.model ? t.model(t.self, &model, &err) : LOOM_OK;
    t.close(t.self);
    if (s < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return s == LOOM_ERR_UNAVAILABLE ? EXIT_UNAVAILABLE : 1;
    }
    if (!vocab) vocab = model.vocab_size;
    if (vocab < 4) {
        fprintf(stderr, "error: the server reports no vocabulary size; give --vocab\n");
        return EXIT_USAGE;
    }
    int longest = lengths_hi(prompt_len, prompt_range) + lengths_hi(output_len, output_range);
    if (model.context_length > 0 && longest > model.context_length) {
        fprintf(stderr, "error: prompts and outputs reach %d tokens, over the context length %d of %s\n", longest,
                model.context_length, model.id);
        return EXIT_USAGE;
    }

    bench_cfg_t cfg = {.num_requests = num_requests, .prompt_len = prompt_len, .output_len = output_len,
                       .vocab = vocab, .max_concurrency = max_conc, .prompt_range = prompt_range,
                       .output_range = output_range, .temperature = temperature, .seed = seed,
                       .deadline = loom_now_s() + timeout_s};
    if (open_transport(http, addr, (int)LOOM_MIN((double)timeout_s * 1000, 1e9), api_key, model.id, &t, &err) < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        return EXIT_USAGE;
    }
    printf("loom bench: %s at %s (%s), %d requests per rate, prompt %d..%d tokens, output %d..%d tokens, "
           "vocab %d\n",
           model.id, addr, t.name, num_requests, lengths_lo(prompt_len, prompt_range),
           lengths_hi(prompt_len, prompt_range), lengths_lo(output_len, output_range),
           lengths_hi(output_len, output_range), vocab);
    fflush(stdout);

    rate_result_t *res = loom_xcalloc((size_t)n_rates, sizeof *res);
    rec_t *recs = loom_xcalloc((size_t)num_requests, sizeof *recs);
    handle_ix_t *hix = loom_xmalloc((size_t)num_requests * sizeof *hix);
    int rc = 0, any_failed = 0;
    for (int i = 0; i < n_rates; i++) {
        res[i].rate = rates[i];
        if (loom_now_s() >= cfg.deadline) {
            res[i].skipped = 1;
            continue;
        }
        int32_t *pool = plan_requests(&cfg, rates[i], recs);
        double duration = 0;
        s = run_rate(&t, &cfg, recs, hix, &res[i].peak_in_flight, &duration, &err);
        if (s == LOOM_OK) compute_result(recs, num_requests, duration, &res[i]);
        for (int k = 0; k < num_requests; k++) free(recs[k].chunk_t);
        free(pool);
        if (s < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            rc = 1;
            n_rates = i;
            break;
        }
        any_failed |= res[i].failed > 0;
        print_result(&res[i], &cfg);
    }
    t.close(t.self);
    if (sweep && n_rates > 0) print_sweep(res, n_rates);
    if (json && n_rates > 0 && write_json(json, res, n_rates, sweep, &cfg, t.name, model.id) < 0) rc = 1;
    if (plot && n_rates > 0 && write_plot(plot, res, n_rates, model.id) < 0) rc = 1;
    if (stage_plot && n_rates > 0 && write_stage_plot(stage_plot, res, n_rates, model.id) < 0) rc = 1;
    free(hix);
    free(recs);
    free(res);
    return rc ? rc : any_failed ? 1 : 0;
}

#ifdef LOOM_BENCH_SERVE_MAIN
/* `loom_bench_serve ARGS` runs `loom bench ARGS`. */
int main(int argc, char **argv) {
    loom_log_init("loom-bench");
    char **args = loom_xcalloc((size_t)argc + 2, sizeof *args);
    args[0] = argv[0];
    args[1] = "bench";
    for (int i = 1; i < argc; i++) args[i + 1] = argv[i];
    int rc = loom_cmd_bench(argc + 1, args);
    free(args);
    return rc;
}
#endif
