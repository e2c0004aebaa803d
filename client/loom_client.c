/* Loom's C client: one DEALER socket speaking loom.v1 (api.proto) to a
 * coordinator. Blocking calls are built on the same submit/poll machinery
 * that asynchronous users drive directly.
 *
 * Request lifecycle, per request id:
 *   submitted -> (chunks ...) -> final   the stream ended (any status)
 *   submitted -> expired                 nothing for timeout_ms: UNAVAILABLE
 *   submitted -> lost                    the connection dropped (the server
 *                                        closed it, or missed ZMTP heartbeats
 *                                        for HEARTBEAT_TIMEOUT_MS): UNAVAILABLE
 *   submitted -> refused                 its reply has another protocol version
 * A request sits in `pending` (sorted by id, since ids only grow) from its
 * send until its final reply is received; events that a caller has not taken
 * yet wait in `events` (FIFO). Cancel requests are pending too, but their
 * replies are consumed here and never become events. A reply whose id is not
 * pending (late, after a timeout, or not ours) is dropped at debug level;
 * bytes that are not a Loom reply are dropped with a warning and named in
 * the message of the next timeout. */
#include "client/loom_client.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/log.h"
#include "common/keys.h"
#include "common/util.h"
#include "proto/wire.h"

#define DEFAULT_TIMEOUT_MS 30000
#define HEARTBEAT_IVL_MS 1000     /* ZMTP PINGs on tcp/ipc connections */
#define HEARTBEAT_TIMEOUT_MS 3000 /* no traffic nor PONG this long: the connection is dropped */
#define NEVER UINT64_MAX

typedef enum { KIND_GENERATE, KIND_UNARY, KIND_CANCEL } req_kind_t;

typedef struct pending {
    uint64_t id;
    req_kind_t kind;
    uint64_t last_ns; /* send time or the last reply for it */
} pending_t;

/* A reply for a pending request, or a failure decided here (reply == NULL). */
typedef struct event {
    uint64_t id;
    Loom__V1__Reply *reply;
    loom_status_t status;
    char *msg;
} event_t;

struct loom_client {
    void *zctx;
    int own_ctx;
    void *sock;
    void *monitor; /* PAIR reading the socket's disconnect events (tcp/ipc only; NULL: none) */
    char addr[256];
    char *api_key;
    int timeout_ms;
    uint64_t next_id;

    pending_t *pending; /* sorted by id */
    int n_pending, cap_pending;
    uint64_t next_scan_ns; /* no pending request can expire before this */

    event_t *events; /* FIFO: events[head .. n_events) */
    int head, n_events, cap_events;

    event_t cur; /* the event behind the chunk last returned by poll */
    int n_dropped;
    char last_drop[200];
};

/* ---- pending requests ---- */

static int find_pending(const loom_client_t *c, uint64_t id) {
    int lo = 0, hi = c->n_pending - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (c->pending[mid].id == id) return mid;
        if (c->pending[mid].id < id) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

static void add_pending(loom_client_t *c, uint64_t id, req_kind_t kind) {
    if (c->n_pending == c->cap_pending) {
        c->cap_pending = c->cap_pending ? 2 * c->cap_pending : 16;
        c->pending = loom_xrealloc(c->pending, (size_t)c->cap_pending * sizeof *c->pending);
    }
    uint64_t now = loom_now_ns();
    c->pending[c->n_pending++] = (pending_t){.id = id, .kind = kind, .last_ns = now};
    uint64_t deadline = now + (uint64_t)c->timeout_ms * 1000000u;
    if (deadline < c->next_scan_ns) c->next_scan_ns = deadline;
}

static void remove_pending(loom_client_t *c, int i) {
    memmove(&c->pending[i], &c->pending[i + 1], (size_t)(c->n_pending - i - 1) * sizeof *c->pending);
    c->n_pending--;
}

/* ---- events ---- */

static void free_event(event_t *e) {
    if (e->reply) loom__v1__reply__free_unpacked(e->reply, NULL);
    free(e->msg);
    *e = (event_t){0};
}

static void push_event(loom_client_t *c, event_t e) {
    if (c->head > 0 && c->n_events == c->cap_events) {
        memmove(c->events, c->events + c->head, (size_t)(c->n_events - c->head) * sizeof *c->events);
        c->n_events -= c->head;
        c->head = 0;
    }
    if (c->n_events == c->cap_events) {
        c->cap_events = c->cap_events ? 2 * c->cap_events : 16;
        c->events = loom_xrealloc(c->events, (size_t)c->cap_events * sizeof *c->events);
    }
    c->events[c->n_events++] = e;
}

static void push_failure(loom_client_t *c, uint64_t id, loom_status_t status, const char *msg) {
    push_event(c, (event_t){.id = id, .status = status, .msg = loom_xstrdup(msg)});
}

/* Takes the first event for `want` (0: any) out of the queue. */
static int take_event(loom_client_t *c, uint64_t want, event_t *out) {
    for (int i = c->head; i < c->n_events; i++) {
        if (want && c->events[i].id != want) continue;
        *out = c->events[i];
        if (i == c->head) {
            c->head++;
        } else {
            memmove(&c->events[i], &c->events[i + 1], (size_t)(c->n_events - i - 1) * sizeof *c->events);
            c->n_events--;
        }
        if (c->head == c->n_events) c->head = c->n_events = 0;
        return 1;
    }
    return 0;
}

static int has_event(const loom_client_t *c, uint64_t id) {
    for (int i = c->head; i < c->n_events; i++)
        if (c->events[i].id == id) return 1;
    return 0;
}

/* ---- receiving ---- */

static void note_drop(loom_client_t *c, const char *why) {
    c->n_dropped++;
    snprintf(c->last_drop, sizeof c->last_drop, "%.199s", why);
    LOOM_WARN("client: dropped a reply from %s: %s", c->addr, why);
}

/* Files one received message: an event, a consumed cancel reply, or a drop. */
static void file_reply(loom_client_t *c, const void *data, size_t len) {
    loom_err_t werr = {0};
    Loom__V1__Reply *r = loom_wire_unpack_reply(data, len, &werr);
    if (!r) {
        if (werr.code == LOOM_ERR_PROTOCOL) {
            /* The magic is right but the version is not: blame the request it names. */
            Loom__V1__Reply *raw = loom__v1__reply__unpack(NULL, len, data);
            int i = raw ? find_pending(c, raw->request_id) : -1;
            if (raw) loom__v1__reply__free_unpacked(raw, NULL);
            if (i >= 0) {
                char msg[800];
                snprintf(msg, sizeof msg, "server at %s: %s", c->addr, werr.msg);
                if (c->pending[i].kind != KIND_CANCEL) push_failure(c, c->pending[i].id, LOOM_ERR_PROTOCOL, msg);
                remove_pending(c, i);
                return;
            }
        }
        note_drop(c, werr.msg);
        return;
    }
    int i = find_pending(c, r->request_id);
    if (i < 0 && r->request_id == 0 && r->code != LOOM__V1__STATUS_CODE__OK) {
        /* The server could not read a request well enough to learn its id. */
        char why[300];
        snprintf(why, sizeof why, "%s: %.250s", loom_wire_code_name(r->code), r->message);
        note_drop(c, why);
        loom__v1__reply__free_unpacked(r, NULL);
        return;
    }
    if (i < 0) {
        LOOM_DEBUG("client: dropping a reply for request %llu, which is not in flight",
                   (unsigned long long)r->request_id);
        loom__v1__reply__free_unpacked(r, NULL);
        return;
    }
    pending_t *p = &c->pending[i];
    if (p->kind == KIND_CANCEL) {
        LOOM_DEBUG("client: cancel %llu: %s%s%s", (unsigned long long)p->id, loom_wire_code_name(r->code),
                   r->body_case == LOOM__V1__REPLY__BODY_CANCEL && !r->cancel->found ? " (request not found)" : "",
                   r->message[0] ? r->message : "");
        loom__v1__reply__free_unpacked(r, NULL);
        remove_pending(c, i);
        return;
    }
    int final = p->kind == KIND_UNARY || r->code != LOOM__V1__STATUS_CODE__OK ||
                r->body_case != LOOM__V1__REPLY__BODY_CHUNK || r->chunk->final;
    p->last_ns = loom_now_ns();
    push_event(c, (event_t){.id = r->request_id, .reply = r});
    if (final) remove_pending(c, i);
}

/* The connection dropped: the server's streams on it are gone (it cancels
 * them, or it died), so every request in flight fails now rather than at
 * its timeout. Replies still queued were filed before this. */
static void connection_lost(loom_client_t *c) {
    char msg[400];
    snprintf(msg, sizeof msg, "the connection to %s was lost (the coordinator went away, refused "
                              "this client's CURVE keys, or was silent for %d ms)", c->addr, HEARTBEAT_TIMEOUT_MS);
    for (int i = 0; i < c->n_pending; i++)
        if (c->pending[i].kind != KIND_CANCEL) push_failure(c, c->pending[i].id, LOOM_ERR_UNAVAILABLE, msg);
    c->n_pending = 0;
}

/* Reads the monitor's events (two frames each: event id + value, endpoint). */
static void read_monitor(loom_client_t *c) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        uint16_t ev = 0;
        if (zmq_msg_size(&m) >= 2) memcpy(&ev, zmq_msg_data(&m), 2);
        while (zmq_msg_more(&m)) {
            zmq_msg_close(&m);
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, c->monitor, 0) < 0) break;
        }
        zmq_msg_close(&m);
        if (ev == ZMQ_EVENT_DISCONNECTED && c->n_pending) {
            LOOM_DEBUG("client: the connection to %s dropped with %d request(s) in flight", c->addr, c->n_pending);
            connection_lost(c);
        }
    }
}

/* Waits up to timeout_ms for one message and files it. 1: a message (or a
 * connection event) was handled, 0: nothing arrived, <0: the socket failed. */
static int recv_one(loom_client_t *c, int timeout_ms, loom_err_t *err) {
    zmq_pollitem_t items[2] = {{.socket = c->sock, .events = ZMQ_POLLIN}, {.socket = c->monitor, .events = ZMQ_POLLIN}};
    int n = zmq_poll(items, c->monitor ? 2 : 1, timeout_ms);
    if (n < 0) {
        if (errno == EINTR) return 0;
        return loom_err_set(err, LOOM_ERR_INTERNAL, "INTERNAL: zmq_poll on %s: %s", c->addr, zmq_strerror(errno));
    }
    if (n == 0) return 0;
    if (!(items[0].revents & ZMQ_POLLIN)) { /* only an event: replies first, then the loss */
        read_monitor(c);
        return 1;
    }
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, c->sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&msg);
        if (errno == EAGAIN || errno == EINTR) return 0;
        return loom_err_set(err, LOOM_ERR_INTERNAL, "INTERNAL: receiving from %s: %s", c->addr, zmq_strerror(errno));
    }
    if (zmq_msg_more(&msg)) {
        int parts = 1;
        while (zmq_msg_more(&msg)) {
            zmq_msg_close(&msg);
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, c->sock, 0) < 0) break;
            parts++;
        }
        char why[64];
        snprintf(why, sizeof why, "a reply of %d frames (expected 1)", parts);
        note_drop(c, why);
    } else {
        file_reply(c, zmq_msg_data(&msg), zmq_msg_size(&msg));
    }
    zmq_msg_close(&msg);
    return 1;
}

/* Fails requests that have heard nothing for timeout_ms. */
static void expire(loom_client_t *c) {
    uint64_t now = loom_now_ns();
    if (now < c->next_scan_ns) return;
    uint64_t limit = (uint64_t)c->timeout_ms * 1000000u, next = NEVER;
    for (int i = 0; i < c->n_pending;) {
        pending_t *p = &c->pending[i];
        if (p->last_ns + limit > now) {
            if (p->last_ns + limit < next) next = p->last_ns + limit;
            i++;
            continue;
        }
        if (p->kind == KIND_CANCEL) {
            LOOM_DEBUG("client: no answer to cancel %llu", (unsigned long long)p->id);
        } else {
            char msg[512];
            int n = snprintf(msg, sizeof msg, "no reply from %s in %d ms (is the coordinator running?)", c->addr,
                             c->timeout_ms);
            if (c->n_dropped && n > 0 && (size_t)n < sizeof msg)
                snprintf(msg + n, sizeof msg - (size_t)n, "; %d unreadable replies dropped so far, the last: %s",
                         c->n_dropped, c->last_drop);
            push_failure(c, p->id, LOOM_ERR_UNAVAILABLE, msg);
        }
        remove_pending(c, i);
    }
    c->next_scan_ns = next;
}

/* The next event for `want` (0: any request), waiting up to timeout_ms
 * (< 0: until one comes; pending requests always end in an event). */
static loom_status_t next_event(loom_client_t *c, uint64_t want, int timeout_ms, event_t *ev, int *got,
                                loom_err_t *err) {
    uint64_t deadline = timeout_ms < 0 ? NEVER : loom_now_ns() + (uint64_t)timeout_ms * 1000000u;
    *got = 0;
    for (;;) {
        if (take_event(c, want, ev)) break;
        expire(c);
        if (take_event(c, want, ev)) break;
        if (want && find_pending(c, want) < 0 && !has_event(c, want))
            return loom_err_set(err, LOOM_ERR_INTERNAL, "INTERNAL: request %llu is not in flight",
                                (unsigned long long)want);
        if (!want && c->n_pending == 0 && timeout_ms < 0) return LOOM_OK;
        uint64_t now = loom_now_ns(), until = LOOM_MIN(deadline, c->next_scan_ns);
        uint64_t wait_ns = until > now ? until - now : 0;
        int wait_ms = wait_ns > 3600000000000ull ? 3600000 : (int)((wait_ns + 999999) / 1000000);
        int r = recv_one(c, wait_ms, err);
        if (r < 0) return (loom_status_t)r;
        if (r == 0 && loom_now_ns() >= deadline) return LOOM_OK;
    }
    *got = 1;
    return LOOM_OK;
}

/* ---- sending ---- */

static loom_status_t send_request(loom_client_t *c, Loom__V1__Request *req, req_kind_t kind, uint64_t *id,
                                  loom_err_t *err) {
    req->request_id = c->next_id;
    req->api_key = c->api_key ? c->api_key : "";
    size_t len = 0;
    void *buf = loom_wire_pack_request(req, &len);
    const char *method = loom_wire_method(req->body_case);
    int rc = zmq_send(c->sock, method, strlen(method), ZMQ_SNDMORE | ZMQ_DONTWAIT);
    if (rc >= 0) rc = zmq_send(c->sock, buf, len, ZMQ_DONTWAIT);
    free(buf);
    if (rc < 0) {
        int e = errno;
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "UNAVAILABLE: cannot send to %s: %s", c->addr,
                            e == EAGAIN ? "the send queue is full" : zmq_strerror(e));
    }
    add_pending(c, c->next_id, kind);
    if (id) *id = c->next_id;
    c->next_id++;
    return LOOM_OK;
}

/* ---- replies as chunks ---- */

static loom_finish_t finish_from_wire(Loom__V1__FinishReason f) {
    switch (f) {
    case LOOM__V1__FINISH_REASON__FINISH_STOP: return LOOM_FINISH_STOP;
    case LOOM__V1__FINISH_REASON__FINISH_LENGTH: return LOOM_FINISH_LENGTH;
    case LOOM__V1__FINISH_REASON__FINISH_CANCELLED: return LOOM_FINISH_CANCELLED;
    case LOOM__V1__FINISH_REASON__FINISH_ERROR: return LOOM_FINISH_ERROR;
    default: return LOOM_FINISH_NONE;
    }
}

/* Fills a chunk from a Generate event (the chunk points into the event);
 * *code_name gets the name of the stream's status for error messages. */
static void chunk_from_event(const event_t *e, loom_chunk_t *ch, const char **code_name) {
    *ch = (loom_chunk_t){.request_id = e->id, .text = ""};
    *code_name = "OK";
    const Loom__V1__Reply *r = e->reply;
    if (!r) {
        ch->final = 1;
        ch->finish = LOOM_FINISH_ERROR;
        ch->status = e->status;
        ch->message = e->msg;
        *code_name = loom_status_str(e->status);
        return;
    }
    ch->message = r->message;
    ch->retry_after_ms = (int)LOOM_MIN(r->retry_after_ms, (uint32_t)INT32_MAX);
    const Loom__V1__GenerateChunk *g = r->body_case == LOOM__V1__REPLY__BODY_CHUNK ? r->chunk : NULL;
    if (g) {
        ch->ids = g->ids;
        ch->n_ids = (int)g->n_ids;
        ch->text = g->text;
        ch->text_len = strlen(g->text);
        ch->finish = finish_from_wire(g->finish_reason);
        ch->final = g->final;
        size_t tops = 0;
        for (size_t i = 0; i < g->n_n_top; i++) tops += g->n_top[i];
        if (g->n_logprobs == g->n_ids && g->n_n_top == g->n_ids && g->n_top_ids == tops &&
            g->n_top_logprobs == tops && g->n_ids > 0) { /* a malformed list is dropped, not trusted */
            ch->has_logprobs = 1;
            ch->logprobs = g->logprobs;
            ch->n_top = g->n_top;
            ch->top_ids = g->top_ids;
            ch->top_logprobs = g->top_logprobs;
        }
        size_t ptops = 0;
        for (size_t i = 0; i < g->n_prompt_n_top; i++) ptops += g->prompt_n_top[i];
        if (g->n_prompt_ids > 0 && g->n_prompt_logprobs + 1 == g->n_prompt_ids &&
            g->n_prompt_ranks == g->n_prompt_logprobs && g->n_prompt_n_top == g->n_prompt_logprobs &&
            g->n_prompt_top_ids == ptops && g->n_prompt_top_logprobs == ptops && g->n_prompt_ids <= INT32_MAX) {
            ch->n_prompt_ids = (int)g->n_prompt_ids;
            ch->prompt_ids = g->prompt_ids;
            ch->prompt_logprobs = g->prompt_logprobs;
            ch->prompt_ranks = g->prompt_ranks;
            ch->prompt_n_top = g->prompt_n_top;
            ch->prompt_top_ids = g->prompt_top_ids;
            ch->prompt_top_logprobs = g->prompt_top_logprobs;
        }
        if (g->usage) {
            ch->prompt_tokens = (int)LOOM_MIN(g->usage->prompt_tokens, (uint32_t)INT32_MAX);
            ch->completion_tokens = (int)LOOM_MIN(g->usage->completion_tokens, (uint32_t)INT32_MAX);
            ch->cached_tokens = (int)LOOM_MIN(g->usage->cached_tokens, (uint32_t)INT32_MAX);
            ch->spec_draft_tokens = (int)LOOM_MIN(g->usage->spec_draft_tokens, (uint32_t)INT32_MAX);
            ch->spec_accepted_tokens = (int)LOOM_MIN(g->usage->spec_accepted_tokens, (uint32_t)INT32_MAX);
            ch->target_steps = (int)LOOM_MIN(g->usage->target_steps, (uint32_t)INT32_MAX);
        }
        if (g->kv_transfer_params && g->kv_transfer_params[0]) ch->kv_transfer_params = g->kv_transfer_params;
        if (g->timings) {
            const Loom__V1__Timings *t = g->timings;
            ch->timings = (loom_timings_t){t->queue_ms,      t->tokenize_ms, t->prefill_ms, t->decode_ms,
                                           t->detokenize_ms, t->send_ms,     t->ttft_ms,    t->total_ms};
            ch->has_timings = 1;
        }
    }
    if (r->code != LOOM__V1__STATUS_CODE__OK) {
        ch->final = 1;
        ch->status = loom_wire_status_from_code(r->code);
        if (ch->finish == LOOM_FINISH_NONE)
            ch->finish = r->code == LOOM__V1__STATUS_CODE__CANCELLED ? LOOM_FINISH_CANCELLED : LOOM_FINISH_ERROR;
        *code_name = loom_wire_code_name(r->code);
    } else if (!g) {
        ch->final = 1;
        ch->finish = LOOM_FINISH_ERROR;
        ch->status = LOOM_ERR_PROTOCOL;
        ch->message = "the reply to a Generate request carries no chunk";
        *code_name = loom_status_str(LOOM_ERR_PROTOCOL);
    } else if (ch->final && ch->finish == LOOM_FINISH_CANCELLED) {
        ch->status = LOOM_ERR_CANCELLED;
        *code_name = "CANCELLED";
    } else if (ch->final && ch->finish == LOOM_FINISH_ERROR) {
        ch->status = LOOM_ERR_INTERNAL;
        *code_name = "INTERNAL";
    }
    if (ch->final && ch->status != LOOM_OK && !ch->message[0]) ch->message = "the stream ended with an error";
}

/* ---- public API ---- */

loom_status_t loom_client_connect(const char *addr, const loom_client_options_t *opt, loom_client_t **out,
                                  loom_err_t *err) {
    *out = NULL;
    if (!addr || !addr[0])
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: no server address given");
    loom_client_t *c = loom_xcalloc(1, sizeof *c);
    if (snprintf(c->addr, sizeof c->addr, "%s", addr) >= (int)sizeof c->addr) {
        free(c);
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: server address is too long");
    }
    c->timeout_ms = opt && opt->timeout_ms > 0 ? opt->timeout_ms : DEFAULT_TIMEOUT_MS;
    c->api_key = opt && opt->api_key ? loom_xstrdup(opt->api_key) : NULL;
    c->next_id = 1;
    c->next_scan_ns = NEVER;
    c->zctx = opt ? opt->zmq_context : NULL;
    if (!c->zctx) {
        c->zctx = zmq_ctx_new();
        c->own_ctx = 1;
        if (!c->zctx) goto fail_ctx;
    }
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->sock) goto fail_ctx;
    int zero = 0;
    int64_t max_msg = LOOM_MAX_MSG_BYTES;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(c->sock, ZMQ_MAXMSGSIZE, &max_msg, sizeof max_msg);
    /* No queue limits: a stream must not lose chunks when the caller reads
     * slowly, and a burst of submits must not be refused while connecting. */
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &zero, sizeof zero);
    zmq_setsockopt(c->sock, ZMQ_SNDHWM, &zero, sizeof zero);
    if (strncmp(addr, "inproc://", 9) != 0) {
        int keyed = 0;
        loom_status_t kst = loom_keys_client(c->sock, opt ? opt->curve_server_key : NULL,
                                             opt ? opt->curve_secret : NULL, &keyed, err);
        if (kst < 0) {
            loom_client_close(&c);
            return kst;
        }
    }
    /* A server that dies closes the connection; one that hangs or is cut off
     * stops answering PINGs: either way the monitor reports a disconnect. */
    if (!strncmp(addr, "tcp://", 6) || !strncmp(addr, "ipc://", 6)) {
        int ivl = HEARTBEAT_IVL_MS, hb_timeout = HEARTBEAT_TIMEOUT_MS;
        zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
        zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &hb_timeout, sizeof hb_timeout);
        char mon[64];
        snprintf(mon, sizeof mon, "inproc://loom-client-monitor-%p", (void *)c);
        if (zmq_socket_monitor(c->sock, mon, ZMQ_EVENT_DISCONNECTED) == 0) {
            c->monitor = zmq_socket(c->zctx, ZMQ_PAIR);
            if (c->monitor) {
                zmq_setsockopt(c->monitor, ZMQ_LINGER, &zero, sizeof zero);
                if (zmq_connect(c->monitor, mon) != 0) {
                    zmq_close(c->monitor);
                    c->monitor = NULL;
                }
            }
        }
    }
    if (zmq_connect(c->sock, addr) < 0) {
        loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: cannot connect to '%s': %s", addr,
                     zmq_strerror(errno));
        loom_client_close(&c);
        return LOOM_ERR_INVALID_ARGUMENT;
    }
    *out = c;
    return LOOM_OK;
fail_ctx:
    loom_err_set(err, LOOM_ERR_INTERNAL, "INTERNAL: ZeroMQ: %s", zmq_strerror(errno));
    loom_client_close(&c);
    return LOOM_ERR_INTERNAL;
}

void loom_client_close(loom_client_t **c_p) {
    if (!c_p || !*c_p) return;
    loom_client_t *c = *c_p;
    if (c->sock) zmq_socket_monitor(c->sock, NULL, 0);
    if (c->monitor) zmq_close(c->monitor);
    if (c->sock) zmq_close(c->sock);
    if (c->own_ctx && c->zctx) zmq_ctx_term(c->zctx);
    free_event(&c->cur);
    for (int i = c->head; i < c->n_events; i++) free_event(&c->events[i]);
    free(c->events);
    free(c->pending);
    free(c->api_key);
    free(c);
    *c_p = NULL;
}

loom_status_t loom_client_submit(loom_client_t *c, const loom_gen_params_t *p, uint64_t *request_id,
                                 loom_err_t *err) {
    if (!p || ((!p->prompt || !p->prompt[0]) && p->n_prompt_ids <= 0))
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: a prompt or prompt ids are needed");
    if (p->n_prompt_ids < 0 || (p->n_prompt_ids > 0 && !p->prompt_ids) || p->max_tokens < 0 || p->n_stop < 0 ||
        (p->n_stop > 0 && !p->stop) || p->n_stop_token_ids < 0 || (p->n_stop_token_ids > 0 && !p->stop_token_ids) ||
        p->n_logit_bias < 0 || (p->n_logit_bias > 0 && (!p->logit_bias_ids || !p->logit_bias_values)) ||
        p->n_allowed_token_ids < 0 || (p->n_allowed_token_ids > 0 && !p->allowed_token_ids) || p->n_bad_words < 0 ||
        (p->n_bad_words > 0 && !p->bad_words) || p->min_tokens < 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "INVALID_ARGUMENT: negative counts or missing arrays in the generation parameters");
    for (int i = 0; i < p->n_stop; i++)
        if (!p->stop[i])
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: stop string %d is NULL", i);
    for (int i = 0; i < p->n_bad_words; i++)
        if (!p->bad_words[i])
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT: bad word %d is NULL", i);
    Loom__V1__SamplingParams sp = LOOM__V1__SAMPLING_PARAMS__INIT;
    sp.temperature = p->temperature;
    sp.top_p = p->top_p;
    sp.top_k = p->top_k;
    sp.seed = p->seed;
    sp.has_seed = p->has_seed != 0;
    sp.min_p = p->min_p;
    sp.presence_penalty = p->presence_penalty;
    sp.frequency_penalty = p->frequency_penalty;
    sp.repetition_penalty = p->repetition_penalty;
    Loom__V1__GenerateRequest g = LOOM__V1__GENERATE_REQUEST__INIT;
    g.model = (char *)(p->model ? p->model : "");
    g.prompt = (char *)(p->prompt ? p->prompt : "");
    g.n_prompt_ids = (size_t)p->n_prompt_ids;
    g.prompt_ids = (int32_t *)p->prompt_ids;
    g.max_tokens = (uint32_t)p->max_tokens;
    g.sampling = &sp;
    g.n_stop = (size_t)p->n_stop;
    g.stop = (char **)p->stop;
    g.ignore_eos = p->ignore_eos != 0;
    g.no_speculation = p->no_speculation != 0;
    g.no_cache = p->no_cache != 0;
    g.gateway_tokenize_ns = p->gateway_tokenize_ns;
    g.priority = p->priority;
    g.keep_special = p->keep_special != 0;
    g.n_keep_special_ids = p->n_keep_special_ids > 0 ? (size_t)p->n_keep_special_ids : 0;
    g.keep_special_ids = (int32_t *)p->keep_special_ids;
    g.raw_prompt = p->raw_prompt != 0;
    g.tag = (char *)(p->tag ? p->tag : "");
    g.session = (char *)(p->session ? p->session : "");
    g.kv_transfer_params = (char *)(p->kv_transfer_params ? p->kv_transfer_params : "");
    g.n_stop_token_ids = (size_t)p->n_stop_token_ids;
    g.stop_token_ids = (int32_t *)p->stop_token_ids;
    g.n_logit_bias_ids = g.n_logit_bias_values = (size_t)p->n_logit_bias;
    g.logit_bias_ids = (int32_t *)p->logit_bias_ids;
    g.logit_bias_values = (float *)p->logit_bias_values;
    g.n_allowed_token_ids = (size_t)p->n_allowed_token_ids;
    g.allowed_token_ids = (int32_t *)p->allowed_token_ids;
    g.n_bad_words = (size_t)p->n_bad_words;
    g.bad_words = (char **)p->bad_words;
    g.min_tokens = (uint32_t)p->min_tokens;
    g.include_stop_str_in_output = p->include_stop_str_in_output != 0;
    g.logprobs = p->logprobs != 0;
    g.top_logprobs = p->top_logprobs > 0 ? (uint32_t)p->top_logprobs : 0;
    g.prompt_logprobs = p->prompt_logprobs != 0;
    g.prompt_top_logprobs = p->prompt_top_logprobs > 0 ? (uint32_t)p->prompt_top_logprobs : 0;
    g.guide_kind = p->guide_kind > 0 ? (uint32_t)p->guide_kind : 0;
    g.guide_spec = (char *)(p->guide_spec ? p->guide_spec : "");
    g.guide_after = (char *)(p->guide_after ? p->guide_after : "");
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_GENERATE;
    req.generate = &g;
    return send_request(c, &req, KIND_GENERATE, request_id, err);
}

loom_status_t loom_client_poll(loom_client_t *c, int timeout_ms, loom_chunk_t *chunk, int *got, loom_err_t *err) {
    free_event(&c->cur);
    *got = 0;
    LOOM_CHECK(next_event(c, 0, timeout_ms, &c->cur, got, err));
    if (*got) {
        const char *code_name;
        chunk_from_event(&c->cur, chunk, &code_name);
    }
    return LOOM_OK;
}

loom_status_t loom_client_cancel(loom_client_t *c, uint64_t request_id, loom_err_t *err) {
    int i = find_pending(c, request_id);
    if (i < 0 || c->pending[i].kind != KIND_GENERATE)
        return loom_err_set(err, LOOM_ERR_NOT_FOUND, "NOT_FOUND: request %llu is not in flight on this client",
                            (unsigned long long)request_id);
    Loom__V1__CancelRequest cr = LOOM__V1__CANCEL_REQUEST__INIT;
    cr.target_request_id = request_id;
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_CANCEL;
    req.cancel = &cr;
    return send_request(c, &req, KIND_CANCEL, NULL, err);
}

loom_status_t loom_client_generate(loom_client_t *c, const loom_gen_params_t *p, loom_chunk_fn cb, void *ctx,
                                   loom_err_t *err) {
    uint64_t id;
    LOOM_CHECK(loom_client_submit(c, p, &id, err));
    int cancelled = 0;
    for (;;) {
        event_t e = {0};
        int got = 0;
        loom_status_t s = next_event(c, id, -1, &e, &got, err);
        if (s < 0) return s;
        loom_chunk_t ch;
        const char *code_name;
        chunk_from_event(&e, &ch, &code_name);
        /* After a cancel only the final chunk (usage, finish reason) is passed on. */
        int want_more = 1;
        if (cb && (!cancelled || ch.final)) want_more = !cb(ctx, &ch);
        if (!cancelled && !want_more && !ch.final) {
            cancelled = 1;
            loom_err_t cerr = {0};
            if (loom_client_cancel(c, id, &cerr) < 0 && cerr.code != LOOM_ERR_NOT_FOUND) {
                /* Could not even ask: stop listening; the server's stream ends on its own. */
                int k = find_pending(c, id);
                if (k >= 0) remove_pending(c, k);
                free_event(&e);
                return loom_err_set(err, cerr.code, "%s", cerr.msg);
            }
        }
        if (!ch.final) {
            free_event(&e);
            continue;
        }
        loom_status_t st = ch.status;
        if (cancelled && (st == LOOM_OK || st == LOOM_ERR_CANCELLED))
            st = loom_err_set(err, LOOM_ERR_CANCELLED, "CANCELLED: request %llu was cancelled by the caller",
                              (unsigned long long)id);
        else if (st != LOOM_OK)
            loom_err_set(err, st, "%s: %s", code_name, ch.message);
        free_event(&e);
        return st;
    }
}

/* Sends a unary request and waits for its reply, which must carry `body`. */
static loom_status_t unary(loom_client_t *c, Loom__V1__Request *req, Loom__V1__Reply__BodyCase body,
                           Loom__V1__Reply **out, loom_err_t *err) {
    uint64_t id;
    *out = NULL;
    LOOM_CHECK(send_request(c, req, KIND_UNARY, &id, err));
    event_t e = {0};
    int got = 0;
    LOOM_CHECK(next_event(c, id, -1, &e, &got, err));
    const char *method = loom_wire_method(req->body_case);
    if (!e.reply) {
        loom_status_t s = loom_err_set(err, e.status, "%s: %s", loom_status_str(e.status), e.msg);
        free_event(&e);
        return s;
    }
    Loom__V1__Reply *r = e.reply;
    if (r->code != LOOM__V1__STATUS_CODE__OK) {
        loom_status_t s = loom_err_set(err, loom_wire_status_from_code(r->code), "%s: %s",
                                       loom_wire_code_name(r->code), r->message[0] ? r->message : method);
        free_event(&e);
        return s;
    }
    if (r->body_case != body) {
        free_event(&e);
        return loom_err_set(err, LOOM_ERR_PROTOCOL, "%s: the reply to %s from %s carries the wrong body",
                            loom_status_str(LOOM_ERR_PROTOCOL), method, c->addr);
    }
    *out = r;
    return LOOM_OK;
}

loom_status_t loom_client_health(loom_client_t *c, loom_health_t *h, loom_err_t *err) {
    Loom__V1__HealthRequest hr = LOOM__V1__HEALTH_REQUEST__INIT;
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_HEALTH;
    req.health = &hr;
    Loom__V1__Reply *r;
    LOOM_CHECK(unary(c, &req, LOOM__V1__REPLY__BODY_HEALTH, &r, err));
    const Loom__V1__HealthReply *x = r->health;
    *h = (loom_health_t){.ready = x->ready,
                         .workers_ready = (int)LOOM_MIN(x->workers_ready, (uint32_t)INT32_MAX),
                         .workers_expected = (int)LOOM_MIN(x->workers_expected, (uint32_t)INT32_MAX)};
    snprintf(h->state, sizeof h->state, "%s", x->state);
    snprintf(h->message, sizeof h->message, "%s", x->message);
    loom__v1__reply__free_unpacked(r, NULL);
    return LOOM_OK;
}

loom_status_t loom_client_stats(loom_client_t *c, loom_stats_t *s, loom_err_t *err) {
    Loom__V1__StatsRequest sr = LOOM__V1__STATS_REQUEST__INIT;
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_STATS;
    req.stats = &sr;
    Loom__V1__Reply *r;
    LOOM_CHECK(unary(c, &req, LOOM__V1__REPLY__BODY_STATS, &r, err));
    const Loom__V1__StatsReply *x = r->stats;
#define CLAMP_INT(v) ((int)LOOM_MIN((v), (uint32_t)INT32_MAX))
    *s = (loom_stats_t){
        .running = CLAMP_INT(x->running),
        .waiting = CLAMP_INT(x->waiting),
        .kv_blocks_total = CLAMP_INT(x->kv_blocks_total),
        .kv_blocks_used = CLAMP_INT(x->kv_blocks_used),
        .kv_blocks_free = CLAMP_INT(x->kv_blocks_free),
        .kv_block_size = CLAMP_INT(x->kv_block_size),
        .kv_blocks_cached = x->kv_blocks_cached,
        .prefix_cache_queries = x->prefix_cache_queries,
        .prefix_cache_hits = x->prefix_cache_hits,
        .prefix_cache_hit_rate = x->prefix_cache_hit_rate,
        .gen_tokens_per_s = x->gen_tokens_per_s,
        .requests_finished = x->requests_finished,
        .requests_rejected = x->requests_rejected,
        .preemptions = x->preemptions,
        .prompt_tokens_total = x->prompt_tokens_total,
        .gen_tokens_total = x->gen_tokens_total,
        .steps = x->steps,
        .step_ms_mean = x->step_ms_mean,
    };
#undef CLAMP_INT
    snprintf(s->kv_cache_dtype, sizeof s->kv_cache_dtype, "%s", x->kv_cache_dtype ? x->kv_cache_dtype : "");
    s->kv_block_bytes = x->kv_block_bytes;
    s->preparing = x->preparing > INT32_MAX ? INT32_MAX : (int)x->preparing;
    s->ahead_tokens = x->ahead_tokens;
    s->ahead_dropped = x->ahead_dropped;
    loom__v1__reply__free_unpacked(r, NULL);
    return LOOM_OK;
}

loom_status_t loom_client_list_models(loom_client_t *c, loom_model_info_t *models, int max, int *n,
                                      loom_err_t *err) {
    Loom__V1__ListModelsRequest lr = LOOM__V1__LIST_MODELS_REQUEST__INIT;
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_LIST_MODELS;
    req.list_models = &lr;
    Loom__V1__Reply *r;
    *n = 0;
    LOOM_CHECK(unary(c, &req, LOOM__V1__REPLY__BODY_MODELS, &r, err));
    const Loom__V1__ListModelsReply *x = r->models;
    *n = (int)LOOM_MIN(x->n_models, (size_t)INT32_MAX);
    for (size_t i = 0; i < x->n_models && (int)i < max; i++) {
        const Loom__V1__ModelInfo *m = x->models[i];
        models[i] = (loom_model_info_t){.context_length = (int)LOOM_MIN(m->context_length, (uint32_t)INT32_MAX),
                                        .vocab_size = (int)LOOM_MIN(m->vocab_size, (uint32_t)INT32_MAX),
                                        .tp = (int)LOOM_MIN(m->tp, (uint32_t)INT32_MAX),
                                        .pp = (int)LOOM_MIN(m->pp, (uint32_t)INT32_MAX)};
        snprintf(models[i].id, sizeof models[i].id, "%s", m->id);
        snprintf(models[i].parent, sizeof models[i].parent, "%s", m->parent ? m->parent : "");
        snprintf(models[i].root, sizeof models[i].root, "%s", m->root ? m->root : "");
    }
    loom__v1__reply__free_unpacked(r, NULL);
    return LOOM_OK;
}

static loom_status_t lora_update(loom_client_t *c, Loom__V1__Request *req, char *msg, size_t cap, loom_err_t *err) {
    Loom__V1__Reply *r;
    if (cap) msg[0] = 0;
    LOOM_CHECK(unary(c, req, LOOM__V1__REPLY__BODY_LORA_ADAPTER, &r, err));
    if (cap) snprintf(msg, cap, "%s", r->lora_adapter->message ? r->lora_adapter->message : "");
    loom__v1__reply__free_unpacked(r, NULL);
    return LOOM_OK;
}

loom_status_t loom_client_load_lora_adapter(loom_client_t *c, const char *name, const char *path, char *msg,
                                            size_t cap, loom_err_t *err) {
    Loom__V1__LoadLoraAdapterRequest lr = LOOM__V1__LOAD_LORA_ADAPTER_REQUEST__INIT;
    lr.lora_name = (char *)(name ? name : "");
    lr.lora_path = (char *)(path ? path : "");
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_LOAD_LORA_ADAPTER;
    req.load_lora_adapter = &lr;
    return lora_update(c, &req, msg, cap, err);
}

loom_status_t loom_client_unload_lora_adapter(loom_client_t *c, const char *name, char *msg, size_t cap,
                                              loom_err_t *err) {
    Loom__V1__UnloadLoraAdapterRequest ur = LOOM__V1__UNLOAD_LORA_ADAPTER_REQUEST__INIT;
    ur.lora_name = (char *)(name ? name : "");
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_UNLOAD_LORA_ADAPTER;
    req.unload_lora_adapter = &ur;
    return lora_update(c, &req, msg, cap, err);
}

loom_status_t loom_client_embed(loom_client_t *c, const char *model, const loom_embed_input_t *in, int n,
                                const char *tag, loom_embed_result_t *out, loom_err_t *err) {
    memset(out, 0, sizeof *out);
    if (n < 0) return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "%d embedding inputs", n);
    Loom__V1__EmbedInput *ins = loom_xcalloc((size_t)n + 1, sizeof *ins);
    Loom__V1__EmbedInput **ptrs = loom_xcalloc((size_t)n + 1, sizeof *ptrs);
    for (int i = 0; i < n; i++) {
        loom__v1__embed_input__init(&ins[i]);
        ins[i].text = (char *)(in[i].text ? in[i].text : "");
        ins[i].ids = (int32_t *)in[i].ids;
        ins[i].n_ids = in[i].text ? 0 : (size_t)(in[i].n_ids > 0 ? in[i].n_ids : 0);
        ptrs[i] = &ins[i];
    }
    Loom__V1__EmbedRequest er = LOOM__V1__EMBED_REQUEST__INIT;
    er.model = (char *)(model ? model : "");
    er.tag = (char *)(tag ? tag : "");
    er.inputs = ptrs;
    er.n_inputs = (size_t)n;
    Loom__V1__Request req = LOOM__V1__REQUEST__INIT;
    req.body_case = LOOM__V1__REQUEST__BODY_EMBED;
    req.embed = &er;
    Loom__V1__Reply *r;
    loom_status_t s = unary(c, &req, LOOM__V1__REPLY__BODY_EMBED, &r, err);
    free(ptrs);
    free(ins);
    if (s < 0) return s;
    const Loom__V1__EmbedReply *x = r->embed;
    size_t dim = x->n_data ? x->data[0]->n_values : 0;
    if (x->n_data != (size_t)n || dim == 0) {
        loom__v1__reply__free_unpacked(r, NULL);
        return loom_err_set(err, LOOM_ERR_PROTOCOL, "the Embed reply has %zu vectors for %d inputs", x->n_data, n);
    }
    out->values = loom_xmalloc((size_t)n * dim * sizeof(float));
    for (size_t i = 0; i < x->n_data; i++) {
        if (x->data[i]->n_values != dim) {
            loom__v1__reply__free_unpacked(r, NULL);
            loom_embed_result_free(out);
            return loom_err_set(err, LOOM_ERR_PROTOCOL, "the Embed reply's vectors differ in length");
        }
        memcpy(out->values + i * dim, x->data[i]->values, dim * sizeof(float));
    }
    out->n = n;
    out->dim = (int)dim;
    out->prompt_tokens = (int)LOOM_MIN(x->prompt_tokens, (uint32_t)INT32_MAX);
    snprintf(out->pooling, sizeof out->pooling, "%s", x->pooling ? x->pooling : "");
    loom__v1__reply__free_unpacked(r, NULL);
    return LOOM_OK;
}

void loom_embed_result_free(loom_embed_result_t *r) {
    if (!r) return;
    free(r->values);
    memset(r, 0, sizeof *r);
}
